"""Measurements of whole candidates: the joint drift of a model with every unit at its encoding.

Candidates roll out on one runner (or side by side on its lanes), as float weights fed to its session, or for
a model past `FED_FLOATS_BYTES` as a session of its codes. An allocation as priced is measured once per export,
its weights dequantized once per distinct tensor.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np

import graph_ops
from graph_ops.fed_codes import fed_codes_model
from graph_ops.qdq import at_opset
from runtimes import WithDefaults, release_freed_memory
from tiers import Encoded
from tqsdeploy.encoding import checkpoints, run_cache
from tqsdeploy.encoding.choices import AnyRounding
from tqsdeploy.encoding.sessions import open_graph, original_nominal
from tqsdeploy.export.job import ExportJob
from tqsdeploy.sweep import Drift, SweepRunner


class Measuring:
    """Rolls candidates out against the original on the scoring contexts; owns the measuring sessions."""

    def __init__(self, job: ExportJob):
        self.scored, self.encoder, self.cut = job.scored, job.encoder, job.cut
        self.settings, self.cache = job.settings, job.cache
        self._identity: str | None = None
        """What every drift depends on besides the codes (`ScoredModel.measure_identity`), made on first use."""
        self._runner: SweepRunner | None = None
        self._lanes: list[SweepRunner] = []
        self._nominal = None
        """The original's rollout the first runner made: reopening a runner must not read every weight again."""
        self._fed_graph = None
        """The model with its unit weights as plain inputs (no weight data): what large candidates run on."""
        self._fed_session = None
        """A one-session model's session with every unit overridable, for joint candidates fed as floats."""
        self._base_floats: dict[str, tuple[tuple, np.ndarray | None]] = {}
        """Per unit tensor: its channel runs in the allocation a refinement round starts from, and its float values."""
        self._joint_drifts: dict[tuple[tuple[str, str], ...], Drift] = {}
        """Allocations (as priced) already measured, by their tiers: each distinct one is rolled out once."""

    @property
    def runner(self) -> SweepRunner:
        if self._runner is None:
            scored = self.scored
            if scored.one_session:
                self.encoder.release_calibrator()
            if (
                self._nominal is None and scored.opset > scored.model_opset
            ):  # drift from the original as it runs, not as converted
                prepared = scored.prepared
                rollout = (prepared.contexts, prepared.spec, prepared.job.max_batch_windows)
                self._nominal = original_nominal(
                    scored.model.proto,
                    scored.layouts,
                    scored.weights,
                    rollout,
                    scored.runtime,
                    scored.run_dir,
                    prepared.data_dir,
                )
            self._runner = scored.prepared.open_runner(self._nominal)  # reopened: the original is not rolled out again
            self._nominal = self._runner.nominal
        return self._runner

    @property
    def lanes(self) -> list[SweepRunner]:
        """The runners that roll out independent candidates side by side: the measuring runner and its lanes (one
        for a model whose candidates run as sessions of their codes)."""
        if not self._lanes:
            count = self.scored.prepared.lanes if self.scored.feeds_floats else 1
            self._lanes = [self.runner] + [self.runner.lane() for _ in range(count - 1)]
        return self._lanes

    def cut_lanes(self) -> list[SweepRunner]:
        """Runners that price a slot the way the score swept its units: each rollout runs only the part of the graph
        downstream of the slot's unit, fed the original's activations at the cut. The caller closes them."""
        prepared = self.scored.prepared
        lanes = [SweepRunner(replace(prepared.job, strategy="prefix"))]
        try:
            lanes += [lanes[0].lane() for _ in range(prepared.lanes - 1)]
        except BaseException:
            lanes[0].close()
            raise
        return lanes

    def release_runner(self) -> None:
        """Close the measuring sessions for a calibration pass; they open again the way they ran."""
        if self._fed_session is not None:
            self._fed_session.close()
            self._fed_session = None
        if self._runner is not None:
            for lane in self._lanes[1:]:
                lane.close()
            self._lanes = []
            self.scored.prepared.job.strategy = self._runner.strategy
            self._runner.close()
            self._runner = None
            release_freed_memory()

    @staticmethod
    def weights_of(encodings: dict[str, Encoded]) -> dict[str, np.ndarray]:
        return {name: e.dequantize() for name, e in encodings.items() if e.form != "raw"}

    def measure(self, encodings: dict[str, Encoded], runner: SweepRunner | None = None) -> Drift:
        """Joint drift of the model with these encodings on the scoring contexts (on `runner`, one of the `lanes`,
        when given; else kept in the run's cache under the digest of the codes). A one-session model's candidate
        runs on a session that rebuilds each quantized weight from its codes just before it is used: a byte per
        weight fed instead of a float copy, the same values computed."""
        name = self._cache_key("measure", encodings) if runner is None else None
        if (kept := self._kept(name)) is not None:
            return kept
        with self.encoder.profile.section("measurement_rollouts"):
            drift = self._measure(encodings, runner)
        self._keep(name, drift)
        return drift

    def _cache_key(self, how: str, encodings: dict[str, Encoded]) -> str | None:
        """The run-cache key of the drift of `encodings` measured `how` (None without a cache): the digest of every
        code fed, and what else the rollout depends on (`ScoredModel.measure_identity`)."""
        if self.cache is None:
            return None
        if self._identity is None:
            self._identity = self.scored.measure_identity(self.settings)
        weights = self.scored.weights
        parts = [checkpoints.digest(n, encodings[n], weights.get(n)).hex() for n in sorted(encodings)]
        return run_cache.key(self._identity, how, *sorted(encodings), *parts)

    def _kept(self, name: str | None) -> Drift | None:
        value = self.cache.value("drift", name) if name is not None else None
        return Drift(**value) if value is not None else None

    def _keep(self, name: str | None, drift: Drift) -> None:
        if name is not None:
            self.cache.keep("drift", name, f"drift {drift.worst_pct:.4g}%", asdict(drift))

    def _measure(self, encodings: dict[str, Encoded], runner: SweepRunner | None) -> Drift:
        scored = self.scored
        runner = runner or self.runner  # opening it rolls out the original, reading every weight
        graph_ops.release_pages(scored.weights)  # the originals of what is fed are not read by this run
        self.encoder.release_kept()  # nor the kept passes' codes, but for those this run feeds
        if not scored.one_session:
            return runner.drift(self.weights_of(encodings))
        if self._fed_graph is None:
            self._fed_graph = at_opset(
                graph_ops.weights_as_graph_inputs(scored.model.proto, list(scored.layouts)), scored.opset
            )  # as the file is written
        proto, feeds = fed_codes_model(self._fed_graph, encodings)
        source = graph_ops.io.session_source(proto, scored.run_dir)
        del proto
        session = WithDefaults(
            open_graph(scored.runtime, source, scored.prepared.data_dir, "the quantized candidate"),
            feeds,
            scored.weights,
        )
        try:
            return runner.drift({}, session=session)
        finally:
            session.close()

    def measure_tiers(
        self, tiers: dict[str, str], rounding: AnyRounding, runner: SweepRunner | None = None, keep: bool = False
    ) -> Drift:
        """Joint drift of the allocation `tiers` as priced (`Encoder.assemble`), measured once per distinct allocation
        (the export's rounding is fixed once chosen). `keep`: its float weights become the base later allocations
        differ from; a model past `FED_FLOATS_BYTES` runs a session of its codes, as `measure` does."""
        key = tuple(sorted(tiers.items()))
        if key in self._joint_drifts:
            return self._joint_drifts[key]
        name = None
        if runner is None and not keep and self.cache is not None:  # a separate path: fed floats to a shared session
            fed = self.scored.one_session and self.scored.feeds_floats
            name = self._cache_key(
                "as priced" if fed else "measure", self.encoder.assemble(self.cut.slots, tiers, rounding)
            )
        if (kept := self._kept(name)) is not None:
            self._joint_drifts[key] = kept
            return kept
        with self.encoder.profile.section("measurement_rollouts"):
            if not self.scored.feeds_floats:
                drift = self._measure(self.encoder.assemble(self.cut.slots, tiers, rounding), runner)
            else:
                weights = self.joint_weights(tiers, rounding, keep)
                runner = runner or self.runner
                graph_ops.release_pages(self.scored.weights)
                drift = runner.drift(self.fed(weights), session=self.fed_session if self.scored.one_session else None)
        self._joint_drifts[key] = drift
        self._keep(name, drift)
        return drift

    def joint_weights(self, tiers: dict[str, str], rounding: AnyRounding, keep: bool = False) -> dict[str, np.ndarray]:
        """The float weights of the allocation `tiers` as priced (the tensors not stored as themselves). A tensor whose
        channel runs are those of the base (the last allocation asked with `keep`) is not dequantized again."""
        weights = {}
        for name in self.scored.layouts:
            runs = tuple(self.encoder.runs(name, self.cut.slots, tiers))
            cached = self._base_floats.get(name)
            if cached is not None and cached[0] == runs:
                values = cached[1]
            else:
                values = self._patched(name, runs, cached, rounding) if cached is not None else None
                if values is None:
                    encoded = self.encoder.joined(name, runs, rounding)
                    values = None if encoded.form == "raw" else encoded.dequantize()
                if keep:
                    self._base_floats[name] = (runs, values)
            if values is not None:
                weights[name] = values
        return weights

    def _patched(self, name: str, runs: tuple, base: tuple, rounding: AnyRounding) -> np.ndarray | None:
        """Tensor `name` at channel `runs` as the base's float values with the channels whose tier differs dequantized
        anew (a channel's values are its tier's whatever its neighbours' tiers). None when the base has no float
        values or either side is not split into channel runs."""
        base_runs, base_values = base
        if base_values is None or runs[0][0] is None:
            return None
        layout = self.encoder.layouts[name]
        covered = {}
        for rows, tier in base_runs:
            for start, stop in [rows] if rows is not None else [(0, layout.channels)]:
                covered[(start, stop)] = tier
        values = None
        for rows, tier in runs:
            if any(a <= rows[0] and rows[1] <= b and t == tier for (a, b), t in covered.items()):
                continue
            if values is None:
                values = np.array(base_values, copy=True)
            part = self.encoder.channels(name, self.encoder.tensor(name, tier, rounding), rows).dequantize()
            index = [slice(None)] * values.ndim
            index[layout.channel_axis] = slice(*rows)
            values[tuple(index)] = part
        return values if values is not None else base_values

    def forget_base(self) -> None:
        """Drop the base float copy of the weights (`joint_weights` with `keep`)."""
        self._base_floats.clear()

    def fed(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What a measuring run feeds for `weights`: with resident weights every unit weight (the rest as they are)."""
        return {**self.scored.weights, **weights} if self.scored.resident else weights

    @property
    def fed_session(self):
        """A one-session model's session with every unit weight overridable (the originals as defaults)."""
        if self._fed_session is None:
            self._fed_session = self.scored.prepared.job.session_factory()
        return self._fed_session
