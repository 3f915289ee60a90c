"""The one quantization path: every (weight, tier, rounding) encoded once, for everyone.

Export's pricing, its joint measurements, the uniform baselines it compares
with, the `baseline` command and the file writer all read `Encoder`, so what
is measured is what is written:

- `uniform(tier, rounding)`: every unit's tensors at one tier. Compensating
  roundings (GPTQ, GPTAQ, QEP) calibrate sequentially with every earlier wave
  at that tier, which is exactly the uniform baseline of that method.
- `slot(...)`: one slot (a unit, or a group of a unit's output channels) at a
  tier, cut from the uniform encoding of that tier: what a slot's price is
  measured on.
- `assemble(assignment, rounding)`: a mixed allocation from those cached
  encodings, and `calibrated(assignment, rounding)` the same allocation
  calibrated sequentially as itself (every earlier wave at its own tier).

Encodings come back compact (`Encoded.compact`: INT4/INT2 codes packed as on
disk, which is how they are cached); `dequantize` reads them as they are and the
file writer unpacks them, so only code that reads `values` itself calls `expand`.

Slots let the allocator spend a budget finely: a unit holding a large share
of the weights is split into groups of output channels, each priced and
assigned on its own and written as its own DequantizeLinear joined by Concat.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

import graph_ops
from graph_ops.layout import WeightLayout
from tiers import TIERS, Encoded, Hessian, Layout, Rounding, Tier, encode, split
from tiers.hessian import output_error
from tqsdeploy.encoding.choices import AnyRounding, least_drift, rounding_at
from tqsdeploy.encoding.logs import CalibrationLog, EncoderLog
from tqsdeploy.encoding.profiling import Profile
from tqsdeploy.encoding.slots import Slot
from tqsdeploy.encoding.spill import Spill
from tqsdeploy.units import Unit

UNCACHED_FORMS = ("raw", "cast")
"""Stored forms made again when asked for, not kept: the weight itself, or a cast of it, costs a
read (of a file, for a streamed model) and holding them would keep up to 1.5 copies of the model."""


def _assignment_key(assignment: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """An allocation's slot -> tier map as a key of the calibrated-encodings cache (`Encoder.calibrated`)."""
    return tuple(sorted(assignment.items()))


def _grid(tier: Tier) -> str:
    """What a tier's codes depend on, in words that are the same in every process (a frozenset's
    repr is not: string hashes are salted per process)."""
    return f"{tier.name}: {tier.family} {tier.bits} bits, {'symmetric' if tier.symmetric else 'asymmetric'}"


def _described(how: tuple) -> str:
    """A weight's channel runs with their tiers (by `_grid`) and roundings, in words the same in every process."""
    return "; ".join(f"{rows} {_grid(TIERS[tier])} {rounding!r}" for rows, tier, rounding in how)


@dataclass(frozen=True)
class EncodingProgress:
    """What an encoder reports as it goes (progress bars); both optional."""

    on_pass: Callable[[str, int, int, int], None] | None = None
    """A pass begins: its label, how many weights it has, how many of them are done already (taken from a cached
    pass or read from the run's cache) and how many of those an earlier process left (an earlier or interrupted
    export's)."""
    on_weight: Callable[[str], None] | None = None
    """A weight of a pass is encoded."""


class Encoder:
    """Encodings of a model's units, cached per (tier, rounding) and per allocation."""

    def __init__(
        self,
        units: Sequence[Unit],
        layouts: Mapping[str, WeightLayout],
        weights: Mapping[str, np.ndarray],
        group_size: int | None = None,
        calibrator: Callable[[], object] | None = None,
        track_errors: bool = False,
        checkpoints: tuple[object, str] | None = None,
        progress: EncodingProgress = EncodingProgress(),
    ):
        """`checkpoints`: (the run's cache, `run_cache.RunCache`; what the encodings depend on besides the pass):
        passes save each finished weight there and read back what an earlier or interrupted export saved
        (`tqsdeploy.encoding.checkpoints`)."""
        self.units = {u.name: u for u in units}
        self.graph_layouts = dict(layouts)
        self.layouts = {n: Layout(w.shape, w.perm, w.row_groups) for n, w in layouts.items()}
        self.weights = weights
        self.group_size = group_size
        self._make_calibrator = calibrator
        self.track_errors = track_errors
        self._calibrator = None
        self._uniform: dict[tuple[str, Rounding], dict[str, Encoded]] = {}
        self._single: dict[tuple[str, str], Encoded] = {}
        self._mixed: dict[tuple, dict[str, Encoded]] = {}
        self._mixed_made: dict[tuple, tuple] = {}
        """(slots, assignment, rounding) of each `_mixed` entry: how it encoded each weight (`_same`)."""
        self.checkpoints = checkpoints
        """(the run's cache, what every encoding depends on besides the pass), or None: no cache."""
        self.log = EncoderLog()
        self.profile = Profile()
        """Where the time goes (`tqsdeploy.encoding.profiling`): the encoder times its solves, its calibrator the "
        "rest."""
        self.on_pass = progress.on_pass
        self.on_weight = progress.on_weight
        self.before_calibration: Callable[[], None] | None = None
        """Called before a calibration pass (to free memory the pass does not need)."""
        self.spill: Spill | None = None
        """Where a large model's uniform passes are kept, mapped from files (`tqsdeploy.encoding.spill`); None: in
        memory."""
        for name, layout in self.graph_layouts.items():
            if layout.rtn_reason:
                self.log.rtn_only[name] = layout.rtn_reason

    @property
    def calibrator(self):
        if self._calibrator is None:
            if self._make_calibrator is None:
                raise ValueError("this encoder has no calibration data; only round-to-nearest is available")
            self._calibrator = self._make_calibrator()
            self._calibrator.profile = self.profile
        return self._calibrator

    def _encode(self, name: str, tier: Tier, rounding: Rounding, stats: list[Hessian] | None) -> Encoded:
        with self.profile.section("solver"):
            encoded = encode(self.weights[name], self.layouts[name], tier, rounding, stats, self.group_size)
            if self.track_errors and stats is not None and tier.calibratable:
                self._errors(name, tier, encoded, stats)
        graph_ops.release_pages(
            self.weights, [name]
        )  # read once per encoding: a pass would otherwise end with the whole model resident
        return encoded

    def _errors(self, name: str, tier: Tier, encoded: Encoded, stats: list[Hessian]) -> None:
        """Layer reconstruction error of `encoded` and of round to nearest, on the statistics' samples."""
        layout = self.layouts[name]
        original = layout.to_wt(np.asarray(self.weights[name], np.float64))
        nearest = encode(self.weights[name], layout, tier, Rounding(), None, self.group_size)
        rows = original.shape[0] // len(stats)
        for target, quantized in ((self.log.errors, encoded), (self.log.rtn_errors, nearest)):
            values = layout.to_wt(quantized.dequantize().astype(np.float64))
            blocks = [slice(g * rows, (g + 1) * rows) for g in range(len(stats))]
            target[name] = float(
                np.sqrt(sum(output_error(original[b], values[b], s) ** 2 for b, s in zip(blocks, stats)))
            )

    def _pass(
        self,
        encode_one: Callable[[str, list[Hessian] | None], Encoded],
        rounding: AnyRounding,
        label: str,
        signature: Callable[[str], tuple],
    ) -> dict[str, Encoded]:
        """Encode every unit tensor: directly, or sequentially on calibration statistics, each weight read from the
        run's cache where an earlier pass encoded it the same way on the same inputs and written there otherwise
        (`checkpoints`). What a pass returns is kept compact (sub-byte codes packed as on disk) from the first
        weight on. `signature(name)`: how this pass encodes the weight (its channel runs with their tiers and
        roundings): a weight that a cached pass in memory encoded the same way, on statistics from weights all
        encoded the same way, is taken from it (`_same`)."""
        self.log.passes.append(label)
        calibrated = rounding.needs_stats and any(layout.calibratable for layout in self.graph_layouts.values())
        saved = self._stored(signature, calibrated, rounding.needs_cross)
        groups = self.calibrator.groups if calibrated else [list(self.layouts)]
        found = saved.resume(groups) if saved is not None else {}
        reused = saved.reused if saved is not None else 0
        self.log.reused += reused
        taken = self._same(signature) if calibrated else {}
        if self.on_pass is not None:  # taken from a cached pass or read from the cache: done before the pass begins
            self.on_pass(label, len(self.layouts), len(found) + len(taken.keys() - found.keys()), reused)
        report = self.on_weight
        reporting = threading.Lock()  # a wave's weights are encoded in threads side by side

        def encode_kept(name, stats):
            encoded = encode_one(name, stats).compact()
            self.release_kept()  # what a mixed weight took from the kept passes is copied into its own codes
            if report is not None:
                with reporting:
                    report(name)
            return encoded

        if not calibrated:
            started = time.perf_counter()
            result = {}
            for name in self.layouts:
                result[name] = found[name][0] if name in found else encode_kept(name, None)
                if saved is not None and name not in found:
                    saved.save(name, result[name])
            self.log.encode_s += time.perf_counter() - started
            return result
        log = CalibrationLog()
        if self.before_calibration is not None and len(found) < len(
            self.layouts
        ):  # a pass read whole from the cache opens nothing
            self.before_calibration()
        result = self.calibrator.run(encode_kept, rounding.needs_cross, log, saved, found, taken)
        if saved is not None:
            saved.cache.settle()  # the cap holds between passes, not only when the export ends
        self.log.calibration_s += log.seconds
        for name, width in log.thin.items():  # with what the note says: the rows it saw against its input width
            self.log.thin[name] = (log.rows.get(name, 0), width)
        return result

    def _stored(self, signature: Callable[[str], tuple], calibrated: bool, cross: bool):
        """The pass's entries in the run's cache (`checkpoints.PassCheckpoints`), or None without a cache."""
        if self.checkpoints is None:
            return None
        from tqsdeploy.encoding.checkpoints import PassCheckpoints

        cache, base = self.checkpoints
        kind = ("calibrated" + (" with cross terms" if cross else "")) if calibrated else "direct"
        return PassCheckpoints(
            cache,
            f"{base}\ngroup size {self.group_size}",
            self.weights,
            lambda name: f"{kind}: {_described(signature(name))}",
            self.calibrator.depends_on if calibrated else lambda name: frozenset(),
        )

    def _signatures(self) -> list[tuple[Callable[[str], tuple], dict[str, Encoded]]]:
        """The cached calibrated passes, each as (how it encoded a weight, its encodings): the channel runs of
        the weight with each run's tier and rounding (a uniform pass: one run)."""
        found: list[tuple[Callable[[str], tuple], dict[str, Encoded]]] = []
        for (tier, rounding), result in self._uniform.items():
            found.append((lambda name, tier=tier, rounding=rounding: ((None, tier, rounding),), result))
        for key, result in self._mixed.items():
            slots, assignment, rounding = self._mixed_made[key]
            found.append((self._mixed_signature(slots, assignment, rounding), result))
        return found

    def _mixed_signature(self, slots, assignment, rounding) -> Callable[[str], tuple]:
        """How a mixed pass encodes each weight: its channel runs, each with its tier and that tier's rounding."""
        return lambda name: tuple(
            (rows, tier, rounding_at(rounding, tier) if TIERS[tier].calibratable else Rounding())
            for rows, tier in self.runs(name, slots, assignment)
        )

    def _same(self, signature: Callable[[str], tuple]) -> dict[str, Encoded]:
        """The encodings cached passes made that a pass encoding each weight as `signature` says would make
        again, bit for bit: the weight encoded the same way there, and every weight its statistics depend on
        (`Calibrator.upstream`) too (a refinement round that changes the last layers re-solves only those; the
        runtime sees the same graphs, `tqsdeploy.encoding.calibrator`)."""
        sources = self._signatures()
        if not sources:
            return {}
        upstream = self.calibrator.upstream
        wanted = {name: signature(name) for name in self.layouts}
        taken: dict[str, Encoded] = {}
        for how, result in sources:
            differ = {name for name in self.layouts if name not in result or how(name) != wanted[name]}
            for name in self.layouts:
                if name not in taken and name not in differ and not upstream(name) & differ:
                    taken[name] = result[name]
        return taken

    def uniform(self, tier: Tier | str, rounding: Rounding) -> dict[str, Encoded]:
        """Every unit tensor at `tier`, codes chosen by `rounding` (its uniform baseline)."""
        tier = TIERS[tier] if isinstance(tier, str) else tier
        if not tier.calibratable:  # float and fp8 tiers: nothing to compensate, each tensor on its own
            return {name: self.tensor(name, tier, rounding) for name in self.layouts}
        key = (tier.name, rounding)
        if key not in self._uniform:
            self._uniform[key] = self._pass(
                lambda name, stats: self._encode(name, tier, rounding, stats),
                rounding,
                f"uniform {tier.name} {rounding.label}",
                lambda name: ((None, tier.name, rounding),),
            )
            if self.spill is not None:
                self._uniform[key] = self.spill.keep(self._uniform[key], self.weights)
        return self._uniform[key]

    def release_kept(self) -> None:
        """Hand back the pages of the kept passes read so far (`spill`; nothing to do without one)."""
        if self.spill is not None:
            self.spill.release()

    def least_drifting(
        self, tier: Tier, options: Sequence[Rounding], measure: Callable[[Rounding], object], forget: bool = True
    ) -> tuple[Rounding, dict]:
        """(the rounding of `options` whose uniform model at `tier` drifts least by `measure`, each one's drift),
        measured
        in the order given (`least_drift`); with `forget` the others' encodings are dropped (a byte per weight each):
        how
        `export` picks a tier's grid and method and `baseline` its grid, whatever each measures on."""
        measured = {rounding: measure(rounding) for rounding in options}
        chosen = least_drift(measured)
        if forget:
            for rounding in options:
                if rounding != chosen:
                    self.forget(tier, rounding)
        return chosen, measured

    def forget(self, tier: Tier | str, rounding: Rounding) -> None:
        """Drop the cached uniform encodings of (tier, rounding): 1 byte per weight."""
        self._uniform.pop((tier if isinstance(tier, str) else tier.name, rounding), None)

    def forget_mixed(self, assignment: Mapping[str, str] | None = None) -> None:
        """Drop the mixed allocations calibrated as themselves, or only `assignment`'s (remade by a calibration pass "
        "if asked again)."""
        if assignment is None:
            self._mixed.clear()
        else:
            dropped = _assignment_key(assignment)
            for key in [k for k in self._mixed if k[0] == dropped]:
                del self._mixed[key]

    def forget_uniform(self, keep: str | None = None, calibrated: bool = False) -> None:
        """Drop the cached uniform encodings of every tier but `keep`: those that need no calibration
        to make again (round to nearest, float and fp8 tiers: a grid search each), and with
        `calibrated` the calibrated ones too (a calibration pass each to make again). Up to a byte per
        weight per tier and rounding."""
        for key in [k for k in self._uniform if k[0] != keep and (calibrated or not k[1].needs_stats)]:
            del self._uniform[key]
        self._single.clear()

    def release_calibrator(self) -> None:
        """Close the calibration session (a copy of the model) until the next pass opens it again."""
        if self._calibrator is not None:
            self._calibrator.release()

    def tensor(self, name: str, tier: Tier | str, rounding: AnyRounding) -> Encoded:
        """One unit tensor's entry of `uniform(tier, rounding)`; a tier that needs no calibration
        encodes just this tensor (kept unless its form is the weight itself or a cast of it)."""
        tier = TIERS[tier] if isinstance(tier, str) else tier
        if tier.calibratable:
            return self.uniform(tier, rounding_at(rounding, tier.name))[name]
        if (tier.name, name) in self._single:
            return self._single[(tier.name, name)]
        encoded = self._encode(name, tier, Rounding(), None).compact()
        if encoded.form not in UNCACHED_FORMS:
            self._single[(tier.name, name)] = encoded
        return encoded

    def channels(self, name: str, encoded: Encoded, rows: tuple[int, int] | None) -> Encoded:
        """Output channels rows[0]..rows[1] of tensor `name`'s encoding (all of it when rows is None),
        packed if the encoding was."""
        if rows is None:
            return encoded
        expanded = encoded.expand()
        taken = expanded.take_channels(rows[0], rows[1], self.layouts[name].channel_axis)
        return taken if expanded is encoded else taken.compact()

    def stored_forms(self, unit: str, tier: Tier | str) -> dict[str, Encoded]:
        """The unit's tensors at `tier` as the file stores them, codes on the unsearched grid and not
        kept: their sizes are those of every rounding method's, at a fraction of the work."""
        tier = TIERS[tier] if isinstance(tier, str) else tier
        with self.profile.section("solver"):
            forms = {
                name: encode(
                    self.weights[name], self.layouts[name], tier, Rounding(), None, self.group_size, search=False
                )
                for name in self.units[unit].tensor_names
            }
        graph_ops.release_pages(self.weights, list(forms))
        return forms

    def slot(self, slot: Slot, tier: Tier | str, rounding: AnyRounding) -> dict[str, Encoded]:
        """The slot's own encodings at `tier` (its channel group only, for a split unit)."""
        return {
            name: self.channels(name, self.tensor(name, tier, rounding), slot.rows)
            for name in self.units[slot.unit].tensor_names
        }

    def slot_weights(self, slot: Slot, tier: Tier | str, rounding: AnyRounding) -> dict[str, np.ndarray]:
        """Full tensors of the slot's unit with only the slot at `tier` (the rest at full precision)."""
        weights = {}
        for name, encoded in self.slot(slot, tier, rounding).items():
            values = encoded.dequantize()
            if slot.rows is not None:
                full = np.array(self.weights[name], copy=True)
                index = [slice(None)] * full.ndim
                index[self.layouts[name].channel_axis] = slice(*slot.rows)
                full[tuple(index)] = values
                values = full
            weights[name] = values
        return weights

    def runs(
        self, name: str, slots: Sequence[Slot], assignment: Mapping[str, str]
    ) -> list[tuple[tuple[int, int] | None, str]]:
        """Consecutive channel ranges of one tensor that share a tier: what the tensor's entry of an
        allocation depends on (two allocations with the same runs store it the same)."""
        ordered = sorted(
            (s for s in slots if name in self.units[s.unit].tensor_names), key=lambda s: (s.rows or (0, 0))[0]
        )
        runs: list[tuple[tuple[int, int] | None, str]] = []
        for s in ordered:
            tier = assignment[s.name]
            if s.rows is None:
                return [(None, tier)]
            if runs and runs[-1][1] == tier:
                runs[-1] = ((runs[-1][0][0], s.rows[1]), tier)
            else:
                runs.append((s.rows, tier))
        if len(runs) == 1:
            return [(None, runs[0][1])]
        return runs

    def _join(self, name: str, runs, pick: Callable[[str], Encoded]) -> Encoded:
        if len(runs) == 1 and runs[0][0] is None:
            return pick(runs[0][1])
        expanded: dict[str, Encoded] = {}  # each tier's codes unpacked once for all its channel runs
        parts = []
        for rows, tier in runs:
            if tier not in expanded:
                expanded[tier] = pick(tier).expand()
            parts.append(self.channels(name, expanded[tier], rows))
        return split(parts, self.layouts[name]).compact()

    def stored_joined(self, unit: str, name: str, runs) -> Encoded:
        """Tensor `name` of unit `unit` with channel `runs` at their tiers, in the stored forms (`stored_forms`):
        the form the file writes for a unit split over tiers, to price it as written."""
        return self._join(name, runs, lambda tier: self.stored_forms(unit, tier)[name])

    def joined(self, name: str, runs, rounding: AnyRounding) -> Encoded:
        """Tensor `name` of a mixed allocation whose channel `runs` (`runs`) take the uniform encodings."""
        return self._join(name, runs, lambda tier: self.tensor(name, tier, rounding))

    def assemble(
        self, slots: Sequence[Slot], assignment: Mapping[str, str], rounding: AnyRounding
    ) -> dict[str, Encoded]:
        """A mixed allocation from the uniform encodings (each slot as it was priced)."""
        assembled = {}
        for name in self.layouts:
            assembled[name] = self.joined(name, self.runs(name, slots, assignment), rounding)
            self.release_kept()  # a weight cut from several tiers' passes holds copies of what it took
        return assembled

    def calibrated(
        self, slots: Sequence[Slot], assignment: Mapping[str, str], rounding: AnyRounding
    ) -> dict[str, Encoded]:
        """A mixed allocation calibrated as itself: every earlier wave at its own tier."""
        if not rounding.needs_stats:
            return self.assemble(slots, assignment, rounding)
        key = (_assignment_key(assignment), rounding)
        if key not in self._mixed:

            def encode_one(name: str, stats) -> Encoded:
                runs = self.runs(name, slots, assignment)
                cache: dict[str, Encoded] = {}

                def pick(tier: str) -> Encoded:
                    if tier not in cache:
                        cache[tier] = self._encode(
                            name,
                            TIERS[tier],
                            rounding_at(rounding, tier) if TIERS[tier].calibratable else Rounding(),
                            stats,
                        )
                    return cache[tier]

                return self._join(name, runs, pick)

            made = (list(slots), dict(assignment), rounding)
            self._mixed[key] = self._pass(
                encode_one, rounding, f"mixed {rounding.method}", self._mixed_signature(*made)
            )
            self._mixed_made[key] = made
        return self._mixed[key]

    def close(self) -> None:
        if self._calibrator is not None:
            self._calibrator.close()
        if self.spill is not None:
            self._uniform.clear()
            self.spill.close()
