"""`export`'s candidate building: the models considered for one target, each measured, best first.

The mixed allocation (refined against interactions between slots, then calibrated as itself) and the uniform
allocations at the finest tier that fits, rounded by every method. `CandidateBuilding` is a part of `Planner`:
it prices and measures with the planner's `allocate`, `uniform`, `encodings` and `measure`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tiers import TIERS, Encoded, Rounding, Tier, auto_methods, precision_order
from tqsdeploy.export.allocate import Allocation, Choice, allocate
from tqsdeploy.encoding.encoder import TierRoundings, can_still_win, comparison_methods, drift_order, grid_options, plain_rounding
from tqsdeploy.sweep import Drift, Lanes, SweepRunner

BELOW_LOWEST = "int1"
"""The tier a default export also allocates with when its target is near the lowest tier's uniform size
(`NEAR_LOWEST`): the sign tier, a bit per weight below INT2."""
NEAR_LOWEST = 0.95
"""A target at or past this share of the lowest tier's uniform compression leaves the mixed model no room
but to equal that uniform model (at the W2 size every slot but 1% of the bits sits at INT2), so the export
also allocates with `BELOW_LOWEST` added: a few slots at one bit pay for others at four. Measured on held-out
windows at the W2 size: etth1 5.65 -> 4.47% (uniform INT2 QEP 5.65%); on lorenz96 the mixed model with int1
drifted more (29.9%) than the one without (12.8%), and the scoring contexts chose the latter."""

SLACK_PROMOTIONS = 4
"""How many channel groups the bits between a target and the best uniform model that meets it must be able to
promote to the next tier up; where groups of the setting's share (0.02) are too large for that, units are cut
finer (`slack_split`). A target 1% past a uniform size leaves 1% of the bits: promoting a 2% group from INT8 to
FP16 costs twice that, so the allocation could only be the uniform model (pangu_lorenz96 at the W8 size shipped
uniform INT8). Held-out at the frontier's 21 W8/W4/W2 points against a fixed 0.02 share (0.005 near INT2): 18
moved, 14 down (pangu W8 0.4946 -> 0.4835, best uniform 0.4903; lorenz96 W4 3.046 -> 2.457; era5_emulator W8
0.001724 -> 0.00162), 4 up and still below the best uniform (tied mixer W4 1.989 -> 2.115, lorenz96 W8 0.160 ->
0.185); `benchmarks/results/versions-vs-tqs.md`."""
MIN_SPLIT = 0.002
"""The finest share `slack_split` cuts to: each halving doubles the slots to price. The cut costs a rollout per
finer slot and tier: a 22M-parameter BERT at the W8 size went from 76 to 269 slots, `--C 3.91` from 37.5 to 60.7 s,
for 0.2453 -> 0.2444% scoring drift (it has many small units that fit the slack already). Not cutting where 16 or
more slots at the setting's share fit the slack was tried and dropped: it lost where the finer cut had gained (tied
mixer W2 10.07 -> 11.23%, era5_downscale W8 and W4 +3% held-out)."""

AUTO_METHODS = auto_methods()
"""What `--rounding auto` chooses from on a calibratable tier (listed first wins a tie)."""


def _rank(candidate: "Candidate") -> tuple[float, float]:
    return _order(candidate.drift)


def _drift_key(tier: Tier, rounding: Rounding) -> tuple[str, Rounding]:
    """A uniform model's key among the measured ones: a tier that takes no calibration is rounded to nearest by any method."""
    return tier.name, rounding if tier.calibratable else Rounding()


_order = drift_order
"""How candidates are ordered: worst output drift, then relative RMS drift."""


@dataclass
class Candidate:
    """One model export considered for a target: its encodings, size and measured drift."""

    label: str
    allocation: Allocation
    encodings: dict[str, Encoded]
    drift: Drift | None = None
    cached: tuple[str, Rounding] | None = None
    """For a uniform baseline: the encoder's (tier, rounding) cache its encodings are."""
    calibrated: bool = False
    """The mixed allocation calibrated as itself (its encodings are the encoder's mixed cache)."""

    def record(self) -> dict:
        return {
            "label": self.label,
            "compression": round(self.allocation.compression, 6),
            "drift_pct": None if self.drift is None else self.drift.worst_pct,
            "relative_rms": None if self.drift is None else self.drift.relative_rms,
        }


class CandidateBuilding:
    """The planner's comparison of candidates (see the module docstring)."""

    def calibrates(self, allocation: Allocation) -> bool:
        """The mixed model ships calibrated as itself (a calibration pass on its own tiers), not as priced."""
        return self.rounding.needs_stats and any(TIERS[t].calibratable for t in allocation.tiers.values())

    def calibrated_drift(self, allocation: Allocation) -> Drift:
        """Drift of `allocation` calibrated as itself (a calibration pass), measured once per allocation."""
        key = tuple(sorted(allocation.tiers.items()))
        if key not in self._calibrated_drifts:
            self._calibrated_drifts[key] = self.measure(self.encodings(allocation, calibrated=True))
        return self._calibrated_drifts[key]

    def refine(self, allocation: Allocation, rounds: int | None = None) -> tuple[Allocation, Drift]:
        """Re-price every live slot one tier up and one down in the context of the whole
        allocation (joint rollouts), re-solve, keep the result only if its joint drift drops and,
        where the mixed model ships calibrated as itself, only if that calibrated model's drift drops too.

        The trials are priced encodings (a calibration pass per trial is out of reach), but what ships is
        the allocation calibrated as itself, and the two disagree: on the examples 6 of 9 rounds that lowered the
        priced drift raised the calibrated one (lorenz96 at the W2 size: priced 34.4 -> 22.7%, calibrated
        13.8 -> 22.7%, held-out 12.8 -> 21.8%; etth1 at C 4: held-out 0.207 -> 0.231%). So each accepted round costs one calibration
        pass of its result, and refinement stops at the first round whose calibrated model is no better."""
        rounds = self.settings.refine if rounds is None else rounds
        started = time.perf_counter()
        order = [t.name for t in self.tiers]
        costs = self.costs()
        best, best_drift = allocation, self.measure_tiers(allocation.tiers, keep=True)
        judged = rounds > 0 and self.calibrates(allocation)
        best_calibrated = self.calibrated_drift(best) if judged else None
        for _ in range(rounds):
            base = sum(best_drift.div_sq)
            trials = [
                (slot.name, order[other])
                for slot in self.slots if slot.unit not in self.dead
                for other in (order.index(best.tiers[slot.name]) - 1, order.index(best.tiers[slot.name]) + 1) if 0 <= other < len(order)
            ]

            for tier in {tier for _, tier in trials} | set(best.tiers.values()):
                if TIERS[tier].calibratable:  # each tier's pass before the lanes start: they only read encodings
                    self.encoder.uniform(TIERS[tier], self.rounding_at(tier))

            def trial(lane: SweepRunner, item, tiers=best.tiers, base=base):
                for name, tier in item:
                    drift = self.measure_tiers({**tiers, name: tier}, lane)
                    yield (name, tier), sum(drift.div_sq) - base if math.isfinite(drift.relative_rms) else math.inf

            with self.encoder.profile.section("measurement_rollouts"), Lanes(self.lanes, [[t] for t in trials], trial) as results:  # every trial changes the whole model: one each
                losses = dict(results)
            choices = []
            for slot in self.slots:
                options = {best.tiers[slot.name]: 0.0} | {tier: losses[(name, tier)] for name, tier in trials if name == slot.name}
                choices.append(Choice(slot.name, slot.params, 0.0, False, {t: costs[slot.name][t] for t in options}, options))
            step = self.fitted(lambda options, fixed_bits: allocate(options, self.tiers, best.target, self.budget.basis_bits, fixed_bits, objective="measured",
                                                                    fp32_fraction=0.0, solver=self.settings.allocator), choices, best.target)
            if step.tiers == best.tiers:
                break
            drift = self.measure_tiers(step.tiers, keep=True)
            if sum(drift.div_sq) >= base:
                break
            if judged:
                calibrated = self.calibrated_drift(step)
                if _order(calibrated) >= _order(best_calibrated):
                    self._release_calibrated(step)
                    break
                self._release_calibrated(best)
                best_calibrated = calibrated
            step.solver, step.objective = best.solver + "+refine", best.objective
            best, best_drift = step, drift
        self._base_floats.clear()  # a float copy of the weights
        self.timings["refine"] += time.perf_counter() - started
        return best, best_drift

    def _release_calibrated(self, allocation: Allocation) -> None:
        """A large model keeps only the calibrated codes it may still ship (up to a byte per weight each)."""
        if self.one_session:
            self.encoder.forget_mixed(allocation.tiers)

    def candidates(self, target: float, on_result=None, final: bool = False) -> list[Candidate]:
        """Every model considered for `target`, each with its measured drift, best first.
        `final`: no other target follows, so a large model's price list is not kept for one."""
        fraction = self.settings.split_fraction
        if fraction > 0:
            fraction = min(fraction, self.slack_split(target))
        if fraction != self.split_fraction:
            self.use_split(fraction)
        allocation = self.allocate(target, on_result)
        drift = None
        if self.settings.refine:
            allocation, drift = self.refine(allocation)
        label = f"TQS-PTQ {self.settings.objective}/{self.rounding.method}"
        mixed = self.encodings(allocation)
        fitting = [t for t in self.tiers if self.budget.fits(sum(self.uniform(t.name).cost_bits.values()), target)] if self.settings.fallback else []
        if self.one_session:  # the mixed model holds what it uses; the rest of the price list can be rebuilt (the fallback's tier is next)
            self.encoder.forget_uniform(keep=fitting[0].name if fitting else None, calibrated=final)
        found = [Candidate(label, allocation, mixed, drift if drift is not None else self.measure_tiers(allocation.tiers))]
        del mixed
        started = time.perf_counter()
        if self.calibrates(allocation):
            found.append(Candidate(label + ", calibrated as allocated", allocation, self.encodings(allocation, calibrated=True), self.calibrated_drift(allocation), calibrated=True))
            self._keep_best(found)
        below = self.below_lowest(target)
        if below is not None:
            candidate = self._with_tier_below(below, target, label)
            if candidate is not None:
                found.append(candidate)
                self._keep_best(found)
        uniform_started = time.perf_counter()
        if fitting:
            compared = comparison_methods(self.rounding, fitting[0])
            for method in compared:
                best = min(found, key=_rank).drift.worst_pct
                # measured by `--rounding auto` with its codes still held: free to compare
                kept = self._measured_already(fitting[0], method) and not self.one_session
                if not kept and not can_still_win(method, lambda rival: self.uniform_candidate(fitting[0], self.measured_rounding(fitting[0], rival), target).drift.worst_pct,
                                                  best, compared):
                    continue
                uniform = self.uniform_candidate(fitting[0], self.measured_rounding(fitting[0], method), target)
                uniform.allocation.solver = uniform.label
                found.append(uniform)
                self._keep_best(found)
        self.timings["compare"] += time.perf_counter() - started
        self.timings["uniform_comparison"] = self.timings.get("uniform_comparison", 0.0) + time.perf_counter() - uniform_started
        return sorted(found, key=_rank)

    def below_lowest(self, target: float) -> Tier | None:
        """`BELOW_LOWEST` where a default export's target is near its lowest tier's uniform size (`NEAR_LOWEST`);
        None with --tiers given, a target runtime without it, or a target that leaves room above the lowest tier."""
        below = TIERS[BELOW_LOWEST]
        if self.settings.tiers or self.settings.runtime not in below.runtimes or any(t.bits <= below.bits for t in self.tiers):
            return None
        lowest = min(self.tiers, key=lambda t: t.bits)
        if not (lowest.calibratable and self.calibrates(self.uniform(lowest.name))) or not self.near_lowest(target):
            return None
        return below

    def slack_split(self, target: float) -> float:
        """The channel-group share at which the bits `target` leaves beyond the best uniform model meeting it
        buy `SLACK_PROMOTIONS` groups promoted to the next tier up (at least `MIN_SPLIT`; 1 where no tier, or
        every tier, meets it). Tier costs are per unit, so the uniform models cost the same at any share."""
        ordered = sorted(self.tiers, key=precision_order)
        bits = [sum(self.uniform(t.name).cost_bits.values()) for t in ordered]
        fitting = [b for b in bits if self.budget.fits(b, target)]
        above = [b for b in bits if fitting and b > fitting[0]]
        if not above:
            return 1.0
        return max(MIN_SPLIT, (self.budget.slot_bits(target) - fitting[0]) / (min(above) - fitting[0]) / SLACK_PROMOTIONS)

    def near_lowest(self, target: float) -> bool:
        """`target` is at or past `NEAR_LOWEST` of the lowest tier's uniform compression."""
        lowest = min(self.tiers, key=lambda t: t.bits)
        return target >= NEAR_LOWEST * self.uniform(lowest.name).compression

    def _with_tier_below(self, below: Tier, target: float, label: str) -> Candidate | None:
        """The mixed model allocated with `below` added to the tiers (its slots priced once, in the run's
        cache), calibrated as itself; None when the allocation does not use it (it is then the mixed one)."""
        saved = self.tiers, self._choices, self._unpriced
        self.tiers = sorted([*self.tiers, below], key=precision_order)
        self._choices = {}
        try:
            allocation = self.allocate(target)
        finally:
            self.tiers, self._choices, self._unpriced = saved
        if below.name not in allocation.tiers.values():
            return None
        return Candidate(f"{label}, with {below.name}, calibrated as allocated", allocation, self.encodings(allocation, calibrated=True), self.calibrated_drift(allocation),
                         calibrated=True)

    def uniform_candidate(self, tier: Tier, rounding: Rounding, target: float | None) -> Candidate:
        """Every slot at `tier`, codes chosen by `rounding` (to nearest on a tier that takes no calibration),
        measured: the one way a uniform baseline is built, for the fallback, `export --uniform` and `frontier`.
        Measured once per export: `choose_roundings` measured these models already, the comparison reuses it."""
        allocation = self.uniform(tier.name)
        allocation.target = target
        encodings = self.encoder.uniform(tier, rounding)
        label = f"uniform {tier.name} {rounding.label if tier.calibratable else 'rtn'}"
        key = _drift_key(tier, rounding)
        if key not in self._uniform_drifts:
            self._uniform_drifts[key] = self.measure(encodings)
        return Candidate(label, allocation, encodings, self._uniform_drifts[key], (tier.name, rounding))

    def measured_rounding(self, tier: Tier, method: str) -> Rounding:
        """`method`'s rounding at `tier` on the grids the export asks for (`ExportSettings.grids`). With 'auto',
        where the grids differ (`grid_options`), both grids' uniform models are measured on the scoring contexts and
        the one that drifts less is kept, once per export: the better grid differs per model and tier (`tiers.GRIDS`),
        and a uniform model is where a grid's codes meet the rollout as they will in the mixed one."""
        options = grid_options(tier, method, self.settings.grids)
        if len(options) == 1:
            return options[0]
        key = (tier.name, method)
        if key not in self._grid_choice:
            self._grid_choice[key] = self._least_drifting(tier, options)
        return self._grid_choice[key]

    def _least_drifting(self, tier: Tier, options: list[Rounding]) -> Rounding:
        """The rounding of `options` whose uniform model at `tier` drifts least on the scoring contexts, every one
        recorded (`rounding_choice`); a large model keeps only the chosen one's codes (a byte per weight each)."""
        chosen, measured = self.encoder.least_drifting(tier, options, lambda rounding: self.uniform_candidate(tier, rounding, None).drift, forget=self.one_session)
        self.rounding_choice.setdefault(tier.name, {}).update({rounding.label: drift.worst_pct for rounding, drift in measured.items()})
        return chosen

    def _measured_already(self, tier: Tier, method: str) -> bool:
        """Whether `method`'s uniform model at `tier` (on its measured grids) was measured: free to compare."""
        options = grid_options(tier, method, self.settings.grids)
        rounding = options[0] if len(options) == 1 else self._grid_choice.get((tier.name, method))
        return rounding is not None and _drift_key(tier, rounding) in self._uniform_drifts

    def choose_roundings(self) -> TierRoundings:
        """Per calibratable tier of the set, the rounding whose uniform model at that tier drifts least on the
        scoring contexts: with `--rounding auto` among the methods (`AUTO_METHODS`), and with `--grids auto` among
        the grids each method takes there (`measured_rounding`). The best method differs per grid and per model
        (on a real model GPTAQ drifted least at 8 bits and QEP at 4), and so does the best grid. Every tier is
        chosen before pricing, so a slot's price, the mixed model and its calibration as itself all use the same
        codes; the uniform models measured here are among the candidates the export compares."""
        started = time.perf_counter()
        asked = self.settings.rounding
        methods = AUTO_METHODS if asked == "auto" else (asked,)
        chosen = []
        for tier in self.tiers:
            if not tier.calibratable or (asked != "auto" and len(grid_options(tier, asked, self.settings.grids)) == 1):
                continue  # one rounding to take: nothing to measure
            chosen.append((tier.name, self._least_drifting(tier, [self.measured_rounding(tier, method) for method in methods])))
        self.timings["rounding"] += time.perf_counter() - started
        default = plain_rounding("qep" if asked == "auto" else asked, self.settings.grids)
        return TierRoundings(tuple(chosen), default, asked)

    def _keep_best(self, found: list[Candidate]) -> None:
        """Only the best candidate is ever written: for a large model, drop the others' codes as soon as
        they are beaten (up to a byte per weight each) before the next calibration pass runs."""
        if not self.one_session:
            return
        best = min(found, key=_rank)
        for candidate in found:
            if candidate is not best and candidate.encodings:
                candidate.encodings = {}
                if candidate.cached and (candidate.cached[1] != self.rounding_at(candidate.cached[0]) or not candidate.cached[1].needs_stats):
                    self.encoder.forget(*candidate.cached)  # cheap to make again, or not this export's own rounding
                if candidate.calibrated:
                    self.encoder.forget_mixed()

    def _overshoot(self, chosen: Candidate, target: float) -> str:
        """Why the shipped model is more than 5% smaller than asked."""
        achieved = f"achieved {chosen.allocation.compression:.3g}x, more than 5% above the target {target:g}x"
        order = [t.name for t in sorted({t.name: t for t in [*self.tiers, *(TIERS[n] for n in chosen.allocation.tiers.values())]}.values(), key=precision_order)]
        if chosen.allocation.solver.startswith("uniform"):
            tier = chosen.label.split()[1]
            finer = order[order.index(tier) - 1] if order.index(tier) > 0 else None
            if finer is None:
                return f"{achieved}: {chosen.label} is the finest tier in the set"
            return f"{achieved}: the next finer uniform tier ({finer}) reaches only {self.uniform(finer).compression:.3g}x, and {chosen.label} drifted least of the candidates"
        spare = self.budget.slot_bits(target) - sum(chosen.allocation.cost_bits.values())
        slots = {s.name: s for s in self.slots}
        steps = [self.cost(slots[name], order[order.index(tier) - 1]) - self.cost(slots[name], tier)
                 for name, tier in chosen.allocation.tiers.items() if order.index(tier) > 0]
        cheapest = min(steps, default=None)
        if cheapest is None:
            return f"{achieved}: every slot is already at the finest tier"
        if cheapest > spare:
            return f"{achieved}: no finer tier fits: the cheapest one-tier promotion costs {cheapest / 8:,.0f} bytes and {max(spare, 0) / 8:,.0f} bytes of budget are left"
        return f"{achieved}: the promotions that fit the budget did not lower the measured loss"
