"""Refinement of an allocation against interactions: single-slot prices do not add up when units interact.

Each round re-prices moving every live slot one tier up and one down with all other slots at their allocated
tiers (joint rollouts) and re-solves; the new allocation is kept only if its joint drift drops and, where the
mixed model ships calibrated as itself, that calibrated model's drift drops too (what ships is calibrated).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from tiers import TIERS
from tqsdeploy.encoding.choices import drift_order
from tqsdeploy.export.allocate import Allocation, Choice, Knapsack
from tqsdeploy.export.candidates import MixedModels
from tqsdeploy.export.fitting import Fitter
from tqsdeploy.export.job import ExportJob
from tqsdeploy.export.measuring import Measuring
from tqsdeploy.export.roundings import Roundings
from tqsdeploy.export.sizing import Sizing
from tqsdeploy.sweep import Drift, Lanes, SweepRunner


class Refiner:
    """Rounds of joint re-pricing (`ExportSettings.refine`)."""

    def __init__(self, job: ExportJob, sizing: Sizing, measuring: Measuring, mixed: MixedModels, roundings: Roundings):
        self.job, self.sizing, self.measuring, self.mixed, self.roundings = job, sizing, measuring, mixed, roundings
        self.fitter = Fitter(job, sizing, job.tiers)

    def refine(self, allocation: Allocation, rounds: int | None = None) -> tuple[Allocation, Drift]:
        """The best allocation found from `allocation` in at most `rounds` rounds, and its joint drift as priced."""
        rounds = self.job.settings.refine if rounds is None else rounds
        started = time.perf_counter()
        rounding = self.roundings.rounding
        best, best_drift = allocation, self.measuring.measure_tiers(allocation.tiers, rounding, keep=True)
        judged = rounds > 0 and self.mixed.calibrates(allocation, rounding)
        best_calibrated = self.mixed.calibrated_drift(best, rounding) if judged else None
        for _ in range(rounds):
            base = sum(best_drift.div_sq)
            step = self._round(best, base)
            if step.tiers == best.tiers:
                break
            drift = self.measuring.measure_tiers(step.tiers, rounding, keep=True)
            if sum(drift.div_sq) >= base:
                break
            if judged:
                calibrated = self.mixed.calibrated_drift(step, rounding)
                if drift_order(calibrated) >= drift_order(best_calibrated):
                    self.mixed.release_calibrated(step)
                    break
                self.mixed.release_calibrated(best)
                best_calibrated = calibrated
            best, best_drift = replace(step, solver=best.solver + "+refine", objective=best.objective), drift
        self.measuring.forget_base()  # a float copy of the weights
        self.job.timings["refine"] += time.perf_counter() - started
        return best, best_drift

    def _round(self, best: Allocation, base: float) -> Allocation:
        """One round: every live slot one tier up and one down in the context of `best`, priced jointly, re-solved."""
        order = [t.name for t in self.job.tiers]
        costs = self.sizing.costs(self.job.tiers)
        held = self.sizing.residents(self.job.tiers) if self.job.memory is not None else {}
        trials = [
            (slot.name, order[other])
            for slot in self.job.cut.slots
            if slot.unit not in self.job.scored.dead
            for other in (order.index(best.tiers[slot.name]) - 1, order.index(best.tiers[slot.name]) + 1)
            if 0 <= other < len(order)
        ]
        for tier in {tier for _, tier in trials} | set(best.tiers.values()):
            if TIERS[tier].calibratable:  # each tier's pass before the lanes start: they only read encodings
                self.job.encoder.uniform(TIERS[tier], self.roundings.at(tier))
        rounding = self.roundings.rounding

        def trial(lane: SweepRunner, item, tiers=best.tiers, base=base):
            for name, tier in item:
                drift = self.measuring.measure_tiers({**tiers, name: tier}, rounding, lane)
                yield (name, tier), sum(drift.div_sq) - base if math.isfinite(drift.relative_rms) else math.inf

        with (
            self.job.encoder.profile.section("measurement_rollouts"),
            Lanes(self.measuring.lanes, [[t] for t in trials], trial) as results,
        ):
            losses = dict(results)  # every trial changes the whole model: one each
        choices = []
        for slot in self.job.cut.slots:
            options = {best.tiers[slot.name]: 0.0} | {
                tier: losses[(name, tier)] for name, tier in trials if name == slot.name
            }
            resident = {t: held[slot.name][t] for t in options} if held else {}
            choices.append(
                Choice(slot.name, slot.params, 0.0, False, {t: costs[slot.name][t] for t in options}, options, resident)
            )
        problem = Knapsack(
            self.job.tiers,
            best.target,
            self.sizing.budget(self.job.tiers),
            solver=self.job.settings.allocator,
            memory=self.job.knapsack_memory(),
        )
        return self.fitter.fitted(problem, choices)
