"""The comparison an export makes for one target: the mixed allocation (refined, then calibrated as itself; near
the lowest tier's size also one allocated with the tier below it) against the uniform models at the finest tier
that fits, rounded by every method that can still win, each measured on the scoring contexts; best first.
"""

from __future__ import annotations

import time
from typing import Callable

from tiers import TIERS, Tier, precision_order
from tqsdeploy.encoding.choices import can_still_win, comparison_methods
from tqsdeploy.export.candidates import (
    AS_PRICED,
    CALIBRATED,
    Candidate,
    MixedModels,
    UniformModels,
    mixed_with,
    preferred,
    rank,
    relabelled,
)
from tqsdeploy.export.job import ExportJob
from tqsdeploy.export.measuring import Measuring
from tqsdeploy.export.pricing import TierPricing
from tqsdeploy.export.refine import Refiner
from tqsdeploy.export.roundings import Roundings
from tqsdeploy.export.sizing import Sizing

BELOW_LOWEST = "int1"
"""The tier a default export also allocates with near the lowest tier's uniform size: a bit per weight below INT2."""
NEAR_LOWEST = 0.95
"""A target at or past this share of the lowest tier's uniform compression leaves the mixed model no room but to
equal that uniform model, so the export also allocates with `BELOW_LOWEST` added: a few slots at one bit pay
for others at four."""
SLACK_PROMOTIONS = 4
"""How many channel groups the bits between a target and the best uniform model meeting it must be able to promote
one tier up; where groups of the setting's share are too large for that, units are cut finer (`slack_split`)."""
MIN_SPLIT = 0.002
"""The finest share `slack_split` cuts to: each halving doubles the slots to price."""


class Comparison:
    """Every model considered for a target, measured, best first (`candidates`)."""

    def __init__(
        self,
        job: ExportJob,
        sizing: Sizing,
        pricing: TierPricing,
        roundings: Roundings,
        uniforms: UniformModels,
        mixed: MixedModels,
        measuring: Measuring,
        extended: Callable[[list[Tier]], TierPricing],
    ):
        """`extended(tiers)`: a fresh pricing of another tier set, sharing the price list (for `BELOW_LOWEST`)."""
        self.job, self.sizing, self.pricing, self.roundings = job, sizing, pricing, roundings
        self.uniforms, self.mixed, self.measuring, self.extended = uniforms, mixed, measuring, extended
        self.refiner = Refiner(job, sizing, measuring, mixed, roundings)

    def use_split(self, fraction: float) -> None:
        """Cut the units into slots at `fraction`; what was priced stays cached by slot name."""
        self.job.cut.use(fraction)
        self.pricing.reset()

    def candidates(self, target: float, on_result=None, final: bool = False) -> list[Candidate]:
        """Every model considered for `target`, each with its measured drift, best first. `final`: no other target
        follows, so a large model's price list is not kept for one."""
        settings, timings, encoder = self.job.settings, self.job.timings, self.job.encoder
        fraction = settings.split_fraction
        if fraction > 0:
            fraction = min(fraction, self.slack_split(target))
        if fraction != self.job.cut.fraction:
            self.use_split(fraction)
        allocation = self.pricing.allocate(target, on_result)
        drift = None
        if settings.refine:
            allocation, drift = self.refiner.refine(allocation)
        rounding = self.roundings.rounding
        mixed = self.mixed.encodings(allocation, rounding)
        budget = self.sizing.budget(self.job.tiers)
        fitting = (
            [
                t
                for t in self.job.tiers
                if budget.fits(sum(self.uniform(t.name).cost_bits.values()), target) and self._holds(t.name)
            ]
            if settings.fallback
            else []
        )
        if self.job.scored.one_session:  # the mixed model holds what it uses; the rest of the price list can be rebuilt
            encoder.forget_uniform(keep=fitting[0].name if fitting else None, calibrated=final)
        found = [
            Candidate(
                AS_PRICED,
                allocation,
                mixed,
                drift if drift is not None else self.measuring.measure_tiers(allocation.tiers, rounding),
                rounding=rounding.method,
            )
        ]
        del mixed
        started = time.perf_counter()
        if self.mixed.calibrates(allocation, rounding):
            if self.job.scored.one_session:  # not held through the pass: remade from the run's cache if it wins
                found[0].encodings = {}
                found[0].remake = lambda: self.mixed.encodings(allocation, rounding)
            found.append(self.mixed.calibrated_candidate(CALIBRATED, allocation, rounding))
            self._keep_best(found)
        below = self.below_lowest(target)
        if below is not None:
            candidate = self._with_tier_below(below, target)
            if candidate is not None:
                found.append(candidate)
                self._keep_best(found)
        uniform_started = time.perf_counter()
        if fitting:
            self._add_uniform(found, fitting[0], target)
        timings["compare"] += time.perf_counter() - started
        timings["uniform_comparison"] = timings.get("uniform_comparison", 0.0) + time.perf_counter() - uniform_started
        ordered = preferred(found, self.roundings.rounding.method)
        best = ordered[0]
        if not best.encodings and best.remake is not None:
            best.encodings = best.remake()
        return ordered

    def _holds(self, tier: str) -> bool:
        """Whether the uniform model at `tier` keeps within `--max-memory` (always, without it)."""
        cap = self.job.knapsack_memory()
        uniform = {slot.name: tier for slot in self.job.cut.slots}
        return cap is None or self.sizing.resident_of(uniform) <= cap.slot_bytes

    def _add_uniform(self, found: list[Candidate], tier: Tier, target: float) -> None:
        """The uniform models at `tier`, one per method that can still beat the best so far (`can_still_win`)."""
        compared = comparison_methods(self.roundings.rounding, tier)
        for method in compared:
            best = min(found, key=rank).drift.worst_pct
            # measured by `--rounding auto` with its codes still held: free to compare
            kept = self.roundings.measured_already(tier, method) and not self.job.scored.one_session
            if not kept and not can_still_win(
                method, lambda other: self._uniform_drift(tier, other, target), best, compared
            ):
                continue
            uniform = self.uniforms.candidate(tier, self.roundings.measured_rounding(tier, method), target)
            found.append(relabelled(uniform, uniform.label))
            self._keep_best(found)

    def _uniform_drift(self, tier: Tier, method: str, target: float) -> float:
        return self.uniforms.candidate(tier, self.roundings.measured_rounding(tier, method), target).drift.worst_pct

    def uniform(self, tier: str):
        """Every slot at `tier` (an allocation, priced as written)."""
        return self.sizing.uniform(tier, self.job.tiers)

    def below_lowest(self, target: float) -> Tier | None:
        """`BELOW_LOWEST` where a default export's target is near its lowest tier's uniform size (`NEAR_LOWEST`);
        None with --tiers given, a target runtime without it, or a target that leaves room above the lowest tier."""
        below = TIERS[BELOW_LOWEST]
        settings = self.job.settings
        if (
            settings.tiers
            or settings.runtime not in below.runtimes
            or any(t.bits <= below.bits for t in self.job.tiers)
        ):
            return None
        lowest = min(self.job.tiers, key=lambda t: t.bits)
        if not (
            lowest.calibratable and self.mixed.calibrates(self.uniform(lowest.name), self.roundings.rounding)
        ) or not self.near_lowest(target):
            return None
        return below

    def slack_split(self, target: float) -> float:
        """The channel-group share at which the bits `target` leaves beyond the best uniform model meeting it buy
        `SLACK_PROMOTIONS` groups promoted one tier up (at least `MIN_SPLIT`; 1 where no tier, or every tier, meets
        it)."""
        ordered = sorted(self.job.tiers, key=precision_order)
        bits = [sum(self.uniform(t.name).cost_bits.values()) for t in ordered]
        budget = self.sizing.budget(self.job.tiers)
        fitting = [b for b in bits if budget.fits(b, target)]
        above = [b for b in bits if fitting and b > fitting[0]]
        if not above:
            return 1.0
        return max(MIN_SPLIT, (budget.slot_bits(target) - fitting[0]) / (min(above) - fitting[0]) / SLACK_PROMOTIONS)

    def near_lowest(self, target: float) -> bool:
        """`target` is at or past `NEAR_LOWEST` of the lowest tier's uniform compression."""
        lowest = min(self.job.tiers, key=lambda t: t.bits)
        return target >= NEAR_LOWEST * self.uniform(lowest.name).compression

    def _with_tier_below(self, below: Tier, target: float) -> Candidate | None:
        """The mixed model allocated with `below` added to the tiers (its slots priced once, in the run's cache),
        calibrated as itself; None when the allocation does not use it (it is then the mixed one)."""
        allocation = self.extended(sorted([*self.job.tiers, below], key=precision_order)).allocate(target)
        if below.name not in allocation.tiers.values():
            return None
        return self.mixed.calibrated_candidate(mixed_with(below.name), allocation, self.roundings.rounding)

    def _keep_best(self, found: list[Candidate]) -> None:
        """Only the best candidate is ever written: for a large model, drop the others' codes as soon as they are
        beaten (up to a byte per weight each) before the next calibration pass runs."""
        if not self.job.scored.one_session:
            return
        best = preferred(found, self.roundings.rounding.method)[0]
        for candidate in found:
            if candidate is not best and candidate.encodings:
                candidate.encodings = {}
                if candidate.cached and (
                    candidate.cached[1] != self.roundings.at(candidate.cached[0]) or not candidate.cached[1].needs_stats
                ):
                    self.job.encoder.forget(*candidate.cached)  # cheap to make again, or not this export's own rounding
                if candidate.calibrated:
                    self.job.encoder.forget_mixed()

    def overshoot(self, chosen: Candidate, target: float) -> str:
        """Why the shipped model is more than 5% smaller than asked."""
        achieved = f"achieved {chosen.allocation.compression:.3g}x, more than 5% above the target {target:g}x"
        tiers = [*self.job.tiers, *(TIERS[n] for n in chosen.allocation.tiers.values())]
        order = [t.name for t in sorted({t.name: t for t in tiers}.values(), key=precision_order)]
        if chosen.allocation.solver.startswith("uniform"):
            tier = chosen.label.split()[1]
            finer = order[order.index(tier) - 1] if order.index(tier) > 0 else None
            if finer is None:
                return f"{achieved}: {chosen.label} is the finest tier in the set"
            return (
                f"{achieved}: the next finer uniform tier ({finer}) reaches only "
                f"{self.uniform(finer).compression:.3g}x, "
                f"and {chosen.label} drifted least of the candidates"
            )
        spare = self.sizing.budget(self.job.tiers).slot_bits(target) - sum(chosen.allocation.cost_bits.values())
        slots = {s.name: s for s in self.job.cut.slots}
        steps = [
            self.sizing.cost(slots[name], order[order.index(tier) - 1]) - self.sizing.cost(slots[name], tier)
            for name, tier in chosen.allocation.tiers.items()
            if order.index(tier) > 0
        ]
        cheapest = min(steps, default=None)
        if cheapest is None:
            return f"{achieved}: every slot is already at the finest tier"
        if cheapest > spare:
            return (
                f"{achieved}: no finer tier fits: the cheapest one-tier promotion costs {cheapest / 8:,.0f} bytes and "
                f"{max(spare, 0) / 8:,.0f} bytes of budget are left"
            )
        return f"{achieved}: the promotions that fit the budget did not lower the measured loss"
