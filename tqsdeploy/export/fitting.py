"""Fitting an allocation to its target as written: the knapsack prices each slot alone, the file holds stretches
(runs of a unit's slots at one tier) each with its own scales and nodes.

`Fitter` solves the knapsack again with the budget shrunk by what the stretches wrote beyond their prices,
bisects an overshooting shrink back up, and solves over whole units when no shrink fits.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from tiers import Tier
from tqsdeploy.errors import InfeasibleError
from tqsdeploy.export.allocate import Allocation, Choice, Knapsack
from tqsdeploy.export.job import ExportJob
from tqsdeploy.export.sizing import Sizing

REFITS = 16
"""Most times an allocation is solved again with its budget shrunk; past that, every slot goes to its cheapest tier."""
TIGHTENS = 8
"""Most solves that bisect an overshooting shrink back up."""
TIGHT_ENOUGH = 0.002
"""Bisection stops once the shrink is known to within this share of the slots' budget."""


class Fitter:
    """Makes a knapsack's allocation meet its target as the file writes it, for one tier set."""

    def __init__(self, job: ExportJob, sizing: Sizing, tiers: list[Tier]):
        self.job, self.sizing, self.tiers = job, sizing, tiers

    def fitted(self, problem: Knapsack, choices: list[Choice]) -> Allocation:
        """The allocation `solve` makes for `target`, priced as written, solved again with the slots' budget shrunk
        by what its stretches wrote beyond their prices until the file meets `target` (the additive prices cannot
        see how many stretches a split unit is cut into). An overshooting shrink is bisected back up; when no shrink
        fits (or the split allocation breaks the memory bound as written), the knapsack is solved over whole units;
        only past that, every slot at its cheapest tier."""
        target = problem.target
        allocation = self._fit(lambda reserve: problem.solve(choices, reserve), target)
        holds = allocation is not None and self._holds(allocation, problem)
        if not holds and len(whole := self._whole_units(choices)) < len(choices):
            whole_units = self._fit(lambda reserve: self._spread(problem.solve(whole, reserve), target), target)
            if allocation is None or (whole_units is not None and self._holds(whole_units, problem)):
                allocation = whole_units
        if allocation is not None:
            return allocation
        costs = self.sizing.costs(self.tiers)
        cheapest = {s.name: min(costs[s.name], key=costs[s.name].get) for s in self.job.cut.slots}
        return self.sizing.allocation(
            cheapest, target, "cheapest (the allocations missed C)", self.job.settings.objective, self.tiers
        )

    def _holds(self, allocation: Allocation, problem: Knapsack) -> bool:
        """Whether `allocation` keeps within the problem's memory bound as written (a unit split over tiers may
        fold to float where its slots were priced in a kernel); always, without one. A split allocation that does
        not is solved again over whole units, whose prices are exact."""
        cap = problem.memory
        return cap is None or self.sizing.written_resident(allocation.tiers) <= cap.slot_bytes

    def _fit(self, solve: Callable[[int], Allocation], target: float) -> Allocation | None:
        """`fitted`'s shrink-then-bisect on one knapsack; None when no try within `REFITS` fits."""
        budget, excess, fits_not = self.sizing.budget(self.tiers), 0, None
        allowed = max(budget.slot_bits(target), self.sizing.floor_bits(self.tiers))

        def attempt(excess: int) -> tuple[Allocation, float]:
            solved = solve(excess)
            allocation = replace(solved, size=budget, cost_bits=self.sizing.written_costs(solved.tiers))
            return allocation, sum(allocation.cost_bits.values()) - allowed

        for _ in range(REFITS):
            try:
                allocation, over = attempt(excess)
            except InfeasibleError:
                return None
            if over <= 0:
                return allocation if fits_not is None else _tightened(attempt, allocation, fits_not, excess, allowed)
            fits_not, excess = excess, excess + math.ceil(over)
        return None

    def _whole_units(self, choices: list[Choice]) -> list[Choice]:
        """`choices` merged per unit: a unit's tiers are those every slot of it offers, at the slots' summed cost and
        loss (units whose slots share no tier stay split)."""
        unit_of = {slot.name: slot.unit for slot in self.job.cut.slots}
        grouped: dict[str, list[Choice]] = {}
        for choice in choices:
            grouped.setdefault(unit_of.get(choice.unit, choice.unit), []).append(choice)
        merged = []
        for unit, parts in grouped.items():
            shared = [t for t in parts[0].cost if all(t in p.cost for p in parts[1:])]
            if len(parts) == 1 or not shared:
                merged.extend(parts)
                continue
            merged.append(
                Choice(
                    unit,
                    sum(p.params for p in parts),
                    max(p.gamma for p in parts),
                    all(p.dead for p in parts),
                    {t: sum(p.cost[t] for p in parts) for t in shared},
                    {t: sum(p.loss[t] for p in parts) for t in shared},
                    {t: sum(p.resident[t] for p in parts) for t in shared} if parts[0].resident else {},
                )
            )
        return merged

    def _spread(self, allocation: Allocation, target: float) -> Allocation:
        """A whole-unit allocation as the slots' tiers."""
        tiers = {
            slot.name: allocation.tiers.get(slot.unit, allocation.tiers.get(slot.name)) for slot in self.job.cut.slots
        }
        spread = self.sizing.allocation(
            tiers,
            target,
            f"{allocation.solver} (whole units: the split allocations missed C)",
            allocation.objective,
            self.tiers,
        )
        return replace(spread, predicted_loss=allocation.predicted_loss)


def _tightened(attempt, fitting: Allocation, fits_not: int, fits: int, allowed: float) -> Allocation:
    """The fitting allocation of the least shrink found by bisecting between a shrink that wrote too much
    (`fits_not`) and one that fits: more budget, lower priced loss."""
    for _ in range(TIGHTENS):
        if fits - fits_not <= max(1.0, TIGHT_ENOUGH * allowed):
            break
        middle = (fits_not + fits) // 2
        try:
            allocation, over = attempt(middle)
        except InfeasibleError:
            fits_not = middle
            continue
        if over <= 0:
            fitting, fits = allocation, middle
        else:
            fits_not = middle
    return fitting
