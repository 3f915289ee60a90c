"""`export`'s measurements of whole candidates: the joint drift of a model with every unit at its encoding.

`Measuring` is a part of `Planner`: it rolls candidates out on the planner's runner (or lanes), as float weights
fed to its session, or for a large model (`export.FED_FLOATS_BYTES`) as a session of its codes. An allocation
as priced (`measure_tiers`) is measured once per export, its weights dequantized once per distinct tensor.
"""

from __future__ import annotations

import numpy as np

import graph_ops
from graph_ops.qdq import at_opset, fed_codes_model
from runtimes import WithDefaults
from tiers import Encoded
from tqsdeploy.encoding.calibrator import open_graph
from tqsdeploy.sweep import Drift, SweepRunner


class Measuring:
    """The planner's candidate measurements (see the module docstring)."""

    def weights_of(self, encodings: dict[str, Encoded]) -> dict[str, np.ndarray]:
        return {name: e.dequantize() for name, e in encodings.items() if e.form != "raw"}

    def measure(self, encodings: dict[str, Encoded], runner: SweepRunner | None = None) -> Drift:
        """Joint drift of the model with these encodings on the scoring contexts (on `runner`, one of the
        `lanes`, when given). A large model's candidate runs on a session that rebuilds each quantized weight
        from its codes just before it is used (`graph_ops.qdq.fed_codes_model`): a byte per weight fed
        instead of a float copy of the whole model, the same values computed."""
        with self.encoder.profile.section("measurement_rollouts"):
            return self._measure(encodings, runner)

    def _measure(self, encodings: dict[str, Encoded], runner: SweepRunner | None) -> Drift:
        runner = runner or self.runner  # opening it rolls out the original, reading every weight
        graph_ops.release_pages(self.weights)  # the originals of what is fed are not read by this run
        if not self.one_session:
            return runner.drift(self.weights_of(encodings))
        if self._fed_graph is None:
            self._fed_graph = at_opset(graph_ops.weights_as_graph_inputs(self.model.proto, list(self.layouts)), self.opset)  # as the file is written
        proto, feeds = fed_codes_model(self._fed_graph, encodings)
        source = graph_ops.io.session_source(proto, self.run_dir)
        del proto
        session = WithDefaults(open_graph(self.runtime, source, self.prepared.data_dir, "the quantized candidate"), feeds, self.weights)
        try:
            return runner.drift({}, session=session)
        finally:
            session.close()

    def measure_tiers(self, tiers: dict[str, str], runner: SweepRunner | None = None, keep: bool = False) -> Drift:
        """Joint drift of the allocation `tiers` as priced (`assemble`), measured once per distinct allocation.
        Its float weights come from `joint_weights` (`keep`: held as the base later allocations differ from);
        a large model's (`FED_FLOATS_BYTES`) from a session of its codes, as `measure` runs them."""
        key = tuple(sorted(tiers.items()))
        if key in self._joint_drifts:
            return self._joint_drifts[key]
        with self.encoder.profile.section("measurement_rollouts"):
            if not self.feeds_floats:
                drift = self._measure(self.encoder.assemble(self.slots, tiers, self.rounding), runner)
            else:
                weights = self.joint_weights(tiers, keep)
                runner = runner or self.runner
                graph_ops.release_pages(self.weights)
                drift = runner.drift(self.fed(weights), session=self.fed_session if self.one_session else None)
        self._joint_drifts[key] = drift
        return drift

    def joint_weights(self, tiers: dict[str, str], keep: bool = False) -> dict[str, np.ndarray]:
        """The float weights of the allocation `tiers` as priced (the tensors not stored as themselves): what
        `measure` feeds for `assemble`'s encodings, the same values. A tensor whose channel runs are those of
        the base (the last allocation asked with `keep`) is not dequantized again: refinement's trials each
        move one slot, and dequantizing every tensor per trial cost the 22M BERT 0.1 s a trial."""
        weights = {}
        for name in self.layouts:
            runs = tuple(self.encoder.runs(name, self.slots, tiers))
            cached = self._base_floats.get(name)
            if cached is not None and cached[0] == runs:
                values = cached[1]
            else:
                values = self._patched(name, runs, cached) if cached is not None else None
                if values is None:
                    encoded = self.encoder.joined(name, runs, self.rounding)
                    values = None if encoded.form == "raw" else encoded.dequantize()
                if keep:
                    self._base_floats[name] = (runs, values)
            if values is not None:
                weights[name] = values
        return weights

    def _patched(self, name: str, runs: tuple, base: tuple) -> np.ndarray | None:
        """Tensor `name` at channel `runs` as the base's float values with the channels whose tier differs
        dequantized anew (a channel's values are its tier's whatever its neighbours' tiers): a trial moving
        one channel group of the 22M BERT's 30522-row embedding dequantized all of it, 90 ms a trial. None
        when the base has no float values or either side is not split into channel runs."""
        base_runs, base_values = base
        if base_values is None or runs[0][0] is None:
            return None
        covered = {}
        for rows, tier in base_runs:
            for start, stop in [rows] if rows is not None else [(0, self.encoder.layouts[name].channels)]:
                covered[(start, stop)] = tier
        values = None
        axis = self.encoder.layouts[name].channel_axis
        for rows, tier in runs:
            if any(a <= rows[0] and rows[1] <= b and t == tier for (a, b), t in covered.items()):
                continue
            if values is None:
                values = np.array(base_values, copy=True)
            part = self.encoder.channels(name, self.encoder.tensor(name, tier, self.rounding), rows).dequantize()
            index = [slice(None)] * values.ndim
            index[axis] = slice(*rows)
            values[tuple(index)] = part
        return values if values is not None else base_values

    def fed(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What a measuring run feeds for `weights`: with `resident` weights every unit weight (the rest as they are)."""
        return {**self.weights, **weights} if self.resident else weights

    @property
    def fed_session(self):
        """A one-session model's session with every unit weight overridable (the originals as defaults)."""
        if self._fed_session is None:
            self._fed_session = self.prepared.job.session_factory()
        return self._fed_session
