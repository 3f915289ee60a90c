"""`export`'s candidate building: the models considered for one target, each measured, best first.

The mixed allocation (refined against interactions between slots, then calibrated as itself) and the uniform
allocations at the finest tier that fits, rounded by every method. `CandidateBuilding` is a part of `Planner`:
it prices and measures with the planner's `allocate`, `uniform`, `encodings` and `measure`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tiers import TIERS, Encoded, Rounding, Tier
from tqsdeploy.allocate import Allocation, Choice, allocate
from tqsdeploy.quantization import TierRoundings, can_still_win, comparison_methods
from tqsdeploy.sweep import Drift, Lanes, SweepRunner

AUTO_METHODS = ("qep", "gptaq", "gptq")
"""What `--rounding auto` chooses from on a calibratable tier (listed first wins a tie)."""


def _rank(candidate: "Candidate") -> tuple[float, float]:
    return candidate.drift.worst_pct, candidate.drift.relative_rms


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

    def refine(self, allocation: Allocation, rounds: int | None = None) -> tuple[Allocation, Drift]:
        """Re-price every live slot one tier up and one down in the context of the whole
        allocation (joint rollouts), re-solve, keep the result only if its joint drift drops."""
        rounds = self.settings.refine if rounds is None else rounds
        started = time.perf_counter()
        order = [t.name for t in self.tiers]
        costs = self.costs()
        best, best_drift = allocation, self.measure_tiers(allocation.tiers, keep=True)
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
            step = self.fitted(lambda fixed_bits: allocate(choices, self.tiers, best.target, self.budget.basis_bits, fixed_bits, objective="measured", fp32_fraction=0.0,
                                                           solver=self.settings.allocator), best.target)
            if step.tiers == best.tiers:
                break
            drift = self.measure_tiers(step.tiers, keep=True)
            if sum(drift.div_sq) >= base:
                break
            step.solver, step.objective = best.solver + "+refine", best.objective
            best, best_drift = step, drift
        self._base_floats.clear()  # a float copy of the weights
        self.timings["refine"] += time.perf_counter() - started
        return best, best_drift

    def candidates(self, target: float, on_result=None, final: bool = False) -> list[Candidate]:
        """Every model considered for `target`, each with its measured drift, best first.
        `final`: no other target follows, so a large model's price list is not kept for one."""
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
        if self.rounding.needs_stats and any(TIERS[t].calibratable for t in allocation.tiers.values()):
            encodings = self.encodings(allocation, calibrated=True)
            found.append(Candidate(label + ", calibrated as allocated", allocation, encodings, self.measure(encodings), calibrated=True))
            del encodings
            self._keep_best(found)
        uniform_started = time.perf_counter()
        if fitting:
            for method in comparison_methods(self.rounding, fitting[0]):
                best = min(found, key=_rank).drift.worst_pct
                if not can_still_win(method, lambda rival: self.uniform_candidate(fitting[0], Rounding(rival), target).drift.worst_pct, best):
                    continue
                uniform = self.uniform_candidate(fitting[0], Rounding(method), target)
                uniform.allocation.solver = uniform.label
                found.append(uniform)
                self._keep_best(found)
        self.timings["compare"] += time.perf_counter() - started
        self.timings["uniform_comparison"] = self.timings.get("uniform_comparison", 0.0) + time.perf_counter() - uniform_started
        return sorted(found, key=_rank)

    def uniform_candidate(self, tier: Tier, rounding: Rounding, target: float | None) -> Candidate:
        """Every slot at `tier`, codes chosen by `rounding` (to nearest on a tier that takes no calibration),
        measured: the one way a uniform baseline is built, for the fallback, `export --uniform` and `frontier`.
        Measured once per export: `choose_roundings` measured these models already, the comparison reuses it."""
        allocation = self.uniform(tier.name)
        allocation.target = target
        encodings = self.encoder.uniform(tier, rounding)
        label = f"uniform {tier.name} {rounding.method if tier.calibratable else 'rtn'}"
        key = (tier.name, rounding if tier.calibratable else Rounding())
        if key not in self._uniform_drifts:
            self._uniform_drifts[key] = self.measure(encodings)
        return Candidate(label, allocation, encodings, self._uniform_drifts[key], (tier.name, rounding))

    def choose_roundings(self) -> TierRoundings:
        """`--rounding auto`: per calibratable tier of the set, the method (`AUTO_METHODS`) whose uniform model at
        that tier drifts least on the scoring contexts. The best method differs per grid and per model (on a real
        model GPTAQ drifted least at 8 bits and QEP at 4), and a uniform model is where a method's codes at a
        tier meet the rollout as they will in the mixed one. Every tier is chosen before pricing, so a slot's
        price, the mixed model and its calibration as itself all use the same codes; the uniform models measured
        here are among the candidates the export compares."""
        started = time.perf_counter()
        chosen = []
        for tier in self.tiers:
            if not tier.calibratable:
                continue
            measured = {method: self.uniform_candidate(tier, Rounding(method), None) for method in AUTO_METHODS}
            best = min(measured, key=lambda method: _rank(measured[method]))
            self.rounding_choice[tier.name] = {method: candidate.drift.worst_pct for method, candidate in measured.items()}
            chosen.append((tier.name, Rounding(best)))
            if self.one_session:  # a byte per weight each: keep only what the export goes on to read
                for method in measured:
                    if method != best:
                        self.encoder.forget(tier, Rounding(method))
        self.timings["rounding"] += time.perf_counter() - started
        return TierRoundings(tuple(chosen))

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
        order = [t.name for t in self.tiers]
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
