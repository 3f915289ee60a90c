"""TQS-PTQ: pick one precision tier per slot under a compression target.

Algorithm 1 of the paper: budget B = basis bits / C (`tqsdeploy.size`); dead slots go to the cheapest tier; the
most sensitive go to FP32 until the FP32 share of the slots' FP32 size reaches `fp32_fraction`; the rest is a
multiple-choice knapsack (pulp with HiGHS, falling back to PuLP 3's bundled CBC) or the paper's greedy promotion.
The loss each choice minimises comes from an objective (`tqsdeploy.export.objectives`).
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import sys
from dataclasses import dataclass, field

from tiers import Tier
from tqsdeploy.errors import InputError
from tqsdeploy.export.objectives import OBJECTIVES
from tqsdeploy.size import SizeBudget

ALLOCATORS = ("mckp", "greedy")
"""mckp: the exact multiple-choice knapsack (HiGHS, then CBC; greedy when both fail); greedy: the paper's promotion."""


def check_allocator(solver: str) -> str:
    if solver not in ALLOCATORS:
        raise InputError(f"unknown allocator '{solver}'; choose one of {', '.join(ALLOCATORS)}")
    return solver


@dataclass(frozen=True)
class Choice:
    """One unit's options: cost and loss per tier name."""

    unit: str
    params: int
    gamma: float
    dead: bool
    cost: dict[str, int]
    loss: dict[str, float]


@dataclass(frozen=True)
class Allocation:
    """A tier per unit and the size accounting behind it."""

    tiers: dict[str, str]
    cost_bits: dict[str, int]
    size: SizeBudget
    """What C divides and what stays outside the slots (`tqsdeploy.size`)."""
    target: float | None
    solver: str
    objective: str
    predicted_loss: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total_bits(self) -> int:
        return self.size.fixed_bits + sum(self.cost_bits.values())

    @property
    def compression(self) -> float:
        return self.size.compression(sum(self.cost_bits.values()))

    def tier_of(self, unit: str) -> str:
        return self.tiers[unit]


def unit_cost_floor(choices: list[Choice]) -> int:
    return sum(min(c.cost.values()) for c in choices)


def max_compression(choices: list[Choice], budget: SizeBudget) -> float:
    """The largest C `choices` reach on `budget` (every choice at its cheapest tier)."""
    return budget.compression(unit_cost_floor(choices))


@contextlib.contextmanager
def _native_stdout_silenced():
    """File descriptor 1 on /dev/null: HiGHS prints its banner from C++ whatever `msg` says, which would land in
    the middle of a command's tables or its --json output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as sink:
            os.dup2(sink.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _milp_solvers(pulp) -> list[tuple[str, object]]:
    """(label, factory) of each exact solver this PuLP can run, best first. HiGHS comes with highspy, a
    dependency; CBC is bundled with PuLP 3 only (PuLP 4, the release on Python >= 3.12, runs it where a cbc
    binary is installed)."""
    solvers = []
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        solvers.append(
            (
                "mckp-highs",
                lambda: pulp.HiGHS(
                    msg=False,
                    timeLimit=120,
                    gapRel=1e-9,
                    gapAbs=0,
                    mip_feasibility_tolerance=1e-9,
                    dual_feasibility_tolerance=1e-10,
                    primal_feasibility_tolerance=1e-10,
                ),
            )
        )
    if hasattr(pulp, "PULP_CBC_CMD"):
        solvers.append(("mckp-cbc", lambda: pulp.PULP_CBC_CMD(msg=False, timeLimit=120, gapRel=1e-9, gapAbs=0)))
    elif pulp.COIN_CMD(msg=False).available():  # PuLP 4 with a cbc binary (pip install pulp[cbc])
        solvers.append(("mckp-cbc", lambda: pulp.COIN_CMD(msg=False, timeLimit=120, gapRel=1e-9, gapAbs=0)))
    return solvers


def _solve_status(pulp, result) -> str:
    """The status name of what LpProblem.solve returned: PuLP 3 returns a status code (named in
    pulp.LpStatus), PuLP 4 an LpSolveStats whose .status is the LpSolveStatus enum."""
    status = getattr(result, "status", result)
    return status.name if isinstance(status, enum.Enum) else pulp.LpStatus[status]


def _loss_scale(choices: list[Choice]) -> float:
    """What the losses are divided by in the solver: their geometric mean (nonzero, finite). Measured prices span ten
    orders of magnitude; divided by the largest, the small ones would fall below the solver's tolerances
    (docs/design-notes/export.md, "The solver's loss scale")."""
    logs = [math.log(abs(v)) for c in choices for v in c.loss.values() if math.isfinite(v) and v != 0]
    return math.exp(sum(logs) / len(logs)) if logs else 1.0


def _solve_mckp(choices: list[Choice], budget: int) -> tuple[dict[str, str], str]:
    """Exact multiple-choice knapsack with pulp: HiGHS first, then CBC where PuLP bundles it."""
    import pulp

    if not choices:
        return {}, "none"
    scale = _loss_scale(choices)
    problem = pulp.LpProblem("tqs_ptq", pulp.LpMinimize)
    variables = {}
    for i, choice in enumerate(choices):
        for j, tier in enumerate(choice.cost):
            variables[choice.unit, tier] = problem.add_variable(f"x_{i}_{j}", cat="Binary")
        problem += pulp.lpSum(variables[choice.unit, t] for t in choice.cost) == 1
    problem += (
        pulp.lpSum(choice.cost[t] * variables[choice.unit, t] for choice in choices for t in choice.cost) <= budget
    )
    cap = 1e3 * max(
        (abs(v) / scale for c in choices for v in c.loss.values() if math.isfinite(v)), default=1.0
    )  # a non-finite rollout: never worth it
    problem += pulp.lpSum(
        min(choice.loss[t] / scale, cap) * variables[choice.unit, t] for choice in choices for t in choice.cost
    )
    for label, make in _milp_solvers(pulp):
        try:
            with _native_stdout_silenced():
                result = problem.solve(make())
        except pulp.PulpSolverError:
            continue
        if _solve_status(pulp, result) == "Optimal":
            chosen = {}
            for choice in choices:
                chosen[choice.unit] = max(choice.cost, key=lambda t: variables[choice.unit, t].value() or 0.0)
            return chosen, label
    return {}, "failed"


def _greedy(choices: list[Choice], tiers: list[Tier], budget: int) -> dict[str, str]:
    """The paper's greedy: in decreasing gamma, give each unit the most precise
    tier that still leaves room for every later unit at its cheapest tier."""
    ordered = sorted(choices, key=lambda c: -c.gamma if math.isfinite(c.gamma) else -math.inf)
    remaining_floor = unit_cost_floor(ordered)
    spent, chosen = 0, {}
    for choice in ordered:
        floor = min(choice.cost.values())
        remaining_floor -= floor
        for tier in tiers:
            if tier.name in choice.cost and spent + choice.cost[tier.name] + remaining_floor <= budget:
                chosen[choice.unit] = tier.name
                break
        else:
            chosen[choice.unit] = min(choice.cost, key=choice.cost.get)
        spent += choice.cost[chosen[choice.unit]]
    return chosen


def _monotone_repair(choices: list[Choice], chosen: dict[str, str], bits: dict[str, int]) -> dict[str, str]:
    """Among units with identical costs, hand the more precise tiers to the more
    sensitive units. Cost is unchanged and, under the paper objective, the loss
    cannot rise; it removes ties a solver's tolerance may leave."""
    groups: dict[tuple, list[Choice]] = {}
    for choice in choices:
        groups.setdefault(tuple(sorted(choice.cost.items())), []).append(choice)
    repaired = dict(chosen)
    for members in groups.values():
        if len(members) < 2:
            continue
        assigned = sorted((chosen[c.unit] for c in members), key=lambda t: -bits[t])
        for choice, tier in zip(sorted(members, key=lambda c: -c.gamma), assigned):
            repaired[choice.unit] = tier
    return repaired


@dataclass(frozen=True)
class Knapsack:
    """One allocation problem: a tier per choice from `tiers`, meeting C `target` on `budget`."""

    tiers: list[Tier]
    target: float
    budget: SizeBudget
    objective: str = "measured"
    fp32_fraction: float = 0.0
    solver: str = "mckp"

    def solve(self, choices: list[Choice], reserve: int = 0) -> Allocation:
        """`allocate` with `reserve` more bits held outside the choices (what the file writes beyond their prices)."""
        return allocate(
            choices,
            self.tiers,
            self.target,
            self.budget.reserving(reserve),
            objective=self.objective,
            fp32_fraction=self.fp32_fraction,
            solver=self.solver,
        )


def allocate(
    choices: list[Choice],
    tiers: list[Tier],
    target: float,
    budget: SizeBudget,
    *,
    objective: str = "measured",
    fp32_fraction: float = 0.10,
    solver: str = "mckp",
) -> Allocation:
    """Algorithm 1 with the chosen objective and solver: one tier per choice so that the slots fit `budget` at C
    `target`; the allocation's size is `budget` and its costs the choices' own."""
    check_allocator(solver)
    floor = unit_cost_floor(choices)
    budget.check(target, floor, [t.name for t in tiers])
    slot_bits = max(
        budget.slot_bits(target), floor
    )  # a target within the size owner's tolerance of the largest C is that C
    chosen = {c.unit: min(c.cost, key=c.cost.get) for c in choices if c.dead}
    if tiers[0].name == "fp32" and fp32_fraction > 0:
        chosen |= _most_sensitive_at_fp32(choices, chosen, fp32_fraction, slot_bits)
    rest = [c for c in choices if c.unit not in chosen]
    remaining = slot_bits - sum(c.cost[chosen[c.unit]] for c in choices if c.unit in chosen)
    label = solver
    if solver == "mckp":
        solved, label = _solve_mckp(rest, int(remaining))
        if label == "failed":
            solved, label = _greedy(rest, tiers, remaining), "greedy (MCKP solver failed)"
    else:
        solved = _greedy(rest, tiers, remaining)
    chosen.update(solved)
    if objective in OBJECTIVES and OBJECTIVES[objective].ranks_ties:
        chosen = _monotone_repair(choices, chosen, {t.name: t.bits for t in tiers})
    by_unit = {c.unit: c for c in choices}
    return Allocation(
        tiers=chosen,
        cost_bits={u: by_unit[u].cost[t] for u, t in chosen.items()},
        size=budget,
        target=target,
        solver=label,
        objective=objective,
        predicted_loss=float(sum(by_unit[u].loss[t] for u, t in chosen.items())),
    )


def _most_sensitive_at_fp32(
    choices: list[Choice], chosen: dict[str, str], fp32_fraction: float, slot_bits: float
) -> dict[str, str]:
    """The live choices at FP32, most sensitive first, while the FP32 share and the budget allow."""
    fp32_budget = fp32_fraction * sum(32 * c.params for c in choices)
    live = sorted((c for c in choices if c.unit not in chosen), key=lambda c: -c.gamma)
    placed = sum(c.cost[chosen[c.unit]] for c in choices if c.unit in chosen)
    live_floor = unit_cost_floor(live)
    spent_fp32, found = 0, {}
    for choice in live:
        cost, cheapest = choice.cost["fp32"], min(choice.cost.values())
        if spent_fp32 + cost > fp32_budget or placed + cost + live_floor - cheapest > slot_bits:
            break
        found[choice.unit] = "fp32"
        spent_fp32 += cost
        placed += cost
        live_floor -= cheapest
    return found
