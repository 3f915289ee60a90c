"""`export`'s fitting of an allocation to its target as written: the knapsack prices each slot alone, the file
holds stretches (runs of slots at one tier) each with its own scales and nodes.

`Fitting` is a part of `Planner`: it solves the planner's knapsack again with the budget shrunk by what the
stretches wrote beyond their prices, bisects an overshooting shrink back up, and solves over whole units when no
shrink fits.
"""

from __future__ import annotations

import math
from typing import Callable

from tqsdeploy.export.allocate import Allocation, Choice
from tqsdeploy.errors import InfeasibleError

REFITS = 16
"""Most times an allocation is solved again with its budget shrunk by what its stretches write beyond their
prices (`Planner.fitted`); past that, every slot goes to its cheapest tier (exactly priced, and reachable)."""
TIGHTENS = 8
"""Most solves that bisect an overshooting shrink back up (`Planner.fitted`)."""
TIGHT_ENOUGH = 0.002
"""Bisection stops once the shrink is known to within this share of the slots' budget."""


class Fitting:
    """The planner's allocation fitting (see the module docstring)."""

    def fitted(self, solve: Callable[[list[Choice], int], Allocation], choices: list[Choice], target: float) -> Allocation:
        """The allocation `solve(choices, fixed_bits)` makes for `target`, priced as written (`written_costs`),
        solved again with the slots' budget shrunk by what its stretches wrote beyond their prices until the file
        meets `target`: the knapsack's additive prices cannot see how many stretches a split unit is cut into, and
        an allocation they fit could write a file below C. A shrink can overshoot (the next solve cuts fewer
        stretches than the one it corrects), so the budget is then bisected back up to the largest that still fits.
        When no shrink fits (each re-solve cut more stretches), the knapsack is solved over whole units (one
        stretch each, so priced nearly as written); only past that, every slot at its cheapest tier. The int1
        candidate of a small MLP once went straight to all-int1: 16.7x and 15% drift for an 11.4x target."""
        allocation = self._fit(lambda fixed_bits: solve(choices, fixed_bits), target)
        if allocation is None and len(whole := self._whole_units(choices)) < len(choices):
            allocation = self._fit(lambda fixed_bits: self._spread(solve(whole, fixed_bits), target), target)
        if allocation is not None:
            return allocation
        costs = self.costs()
        return self._allocation({s.name: min(costs[s.name], key=costs[s.name].get) for s in self.slots}, target, "cheapest (the allocations missed C)", self.settings.objective)

    def _fit(self, solve: Callable[[int], Allocation], target: float) -> Allocation | None:
        """`fitted`'s shrink-then-bisect on one knapsack; None when no try within `REFITS` fits."""
        budget, excess, fits_not = self.budget, 0, None
        allowed = max(budget.slot_bits(target), self.floor_bits())

        def attempt(excess: int) -> tuple[Allocation, float]:
            allocation = solve(budget.fixed_bits + excess)
            allocation.size, allocation.cost_bits = budget, self.written_costs(allocation.tiers)
            return allocation, sum(allocation.cost_bits.values()) - allowed

        for _ in range(REFITS):
            try:
                allocation, over = attempt(excess)
            except InfeasibleError:
                return None
            if over <= 0:
                return allocation if fits_not is None else self._tightened(attempt, allocation, fits_not, excess, allowed)
            fits_not, excess = excess, excess + math.ceil(over)
        return None

    def _whole_units(self, choices: list[Choice]) -> list[Choice]:
        """`choices` merged per unit: a unit's tiers are those every slot of it offers, at the slots' summed cost
        and loss (units whose slots share no tier stay split)."""
        unit_of = {slot.name: slot.unit for slot in self.slots}
        grouped: dict[str, list[Choice]] = {}
        for choice in choices:
            grouped.setdefault(unit_of.get(choice.unit, choice.unit), []).append(choice)
        merged = []
        for unit, parts in grouped.items():
            shared = [t for t in parts[0].cost if all(t in p.cost for p in parts[1:])]
            if len(parts) == 1 or not shared:
                merged.extend(parts)
                continue
            merged.append(Choice(unit, sum(p.params for p in parts), max(p.gamma for p in parts), all(p.dead for p in parts),
                                 {t: sum(p.cost[t] for p in parts) for t in shared}, {t: sum(p.loss[t] for p in parts) for t in shared}))
        return merged

    def _spread(self, allocation: Allocation, target: float) -> Allocation:
        """A whole-unit allocation as the slots' tiers."""
        tiers = {slot.name: allocation.tiers.get(slot.unit, allocation.tiers.get(slot.name)) for slot in self.slots}
        spread = self._allocation(tiers, target, f"{allocation.solver} (whole units: the split allocations missed C)", allocation.objective)
        spread.predicted_loss = allocation.predicted_loss
        return spread

    @staticmethod
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
