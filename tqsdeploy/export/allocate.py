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
from dataclasses import dataclass, field, replace

from tiers import Tier
from tqsdeploy.errors import BoundUnmet, InputError
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
    resident: dict[str, int] = field(default_factory=dict)
    """Bytes held in a session after load per tier (`Sizing.resident`); read only under a memory bound."""


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


def _solve_mckp(choices: list[Choice], budget: int, memory: int | None = None) -> tuple[dict[str, str], str]:
    """Exact multiple-choice knapsack with pulp: HiGHS first, then CBC where PuLP bundles it; `memory`: a second
    constraint, the choices' resident bytes at most this (None: none)."""
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
    if memory is not None:
        held = pulp.lpSum(c.resident[t] * variables[c.unit, t] for c in choices for t in c.cost)
        problem += held <= memory, "resident_bytes"
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


def _solve(
    choices: list[Choice], tiers: list[Tier], solver: str, budget: int, memory: int | None = None
) -> tuple[dict[str, str], str]:
    """A tier per choice within `budget` bits (and `memory` resident bytes) by `solver`, and how it was solved."""
    if solver == "mckp":
        solved, label = _solve_mckp(choices, budget, memory)
        if label != "failed":
            return solved, label
        return _greedy(choices, tiers, budget, memory), "greedy (MCKP solver failed)"
    return _greedy(choices, tiers, budget, memory), solver


def _greedy(choices: list[Choice], tiers: list[Tier], budget: int, memory: int | None = None) -> dict[str, str]:
    """The paper's greedy: in decreasing gamma, give each unit the most precise
    tier that still leaves room for every later unit at its cheapest tier (in bits, and in resident bytes
    under a `memory` bound)."""
    ordered = sorted(choices, key=lambda c: -c.gamma if math.isfinite(c.gamma) else -math.inf)
    remaining_floor = unit_cost_floor(ordered)
    held_floor = sum(min(c.resident.values()) for c in ordered) if memory is not None else 0
    spent, held, chosen = 0, 0, {}
    for choice in ordered:
        remaining_floor -= min(choice.cost.values())
        held_floor -= min(choice.resident.values()) if memory is not None else 0

        def fits(tier: str) -> bool:
            if memory is not None and held + choice.resident[tier] + held_floor > memory:
                return False
            return spent + choice.cost[tier] + remaining_floor <= budget

        chosen[choice.unit] = next(
            (t.name for t in tiers if t.name in choice.cost and fits(t.name)), min(choice.cost, key=choice.cost.get)
        )
        spent += choice.cost[chosen[choice.unit]]
        held += choice.resident[chosen[choice.unit]] if memory is not None else 0
    return chosen


def _monotone_repair(
    choices: list[Choice], chosen: dict[str, str], bits: dict[str, int], memory: bool = False
) -> dict[str, str]:
    """Among units with identical costs (and, under a `memory` bound, identical resident bytes), hand the more
    precise tiers to the more sensitive units. Cost is unchanged and, under the paper objective, the loss
    cannot rise; it removes ties a solver's tolerance may leave."""
    groups: dict[tuple, list[Choice]] = {}
    for choice in choices:
        key = tuple(sorted(choice.cost.items())) + (tuple(sorted(choice.resident.items())) if memory else ())
        groups.setdefault(key, []).append(choice)
    repaired = dict(chosen)
    for members in groups.values():
        if len(members) < 2:
            continue
        assigned = sorted((chosen[c.unit] for c in members), key=lambda t: -bits[t])
        for choice, tier in zip(sorted(members, key=lambda c: -c.gamma), assigned):
            repaired[choice.unit] = tier
    return repaired


@dataclass(frozen=True)
class MemoryCap:
    """`export --max-memory` as the knapsack reads it: the resident bytes the slots may hold, and what the message
    of a bound out of reach adds to theirs (the tensors outside the slots, the session's own memory)."""

    slot_bytes: int
    outside_bytes: int
    asked: str
    """The bound in the user's words, and what it covers: "--max-memory 40MB (session peak)"."""

    def unmet(self, least_slot_bytes: int, target: float | None) -> BoundUnmet:
        at = f" at C {target:g}" if target is not None else ""
        return BoundUnmet(
            f"{self.asked} cannot be met{at}: the smallest reachable resident size{at} is "
            f"{(least_slot_bytes + self.outside_bytes) / 1e6:.4g} MB "
            f"({least_slot_bytes + self.outside_bytes:,} bytes)"
        )


def held_bytes(choices: list[Choice], chosen: dict[str, str]) -> int:
    """The resident bytes of `choices` at the tiers `chosen` gives them."""
    return sum(c.resident[chosen[c.unit]] for c in choices if c.unit in chosen)


def _least_held(choices: list[Choice], budget: int) -> int:
    """The fewest resident bytes `choices` reach within `budget` bits (a knapsack whose loss is the bytes)."""
    bytes_as_loss = [replace(c, loss={t: float(v) for t, v in c.resident.items()}) for c in choices]
    solved, label = _solve_mckp(bytes_as_loss, budget)
    if label == "failed":
        return sum(min(c.resident.values()) for c in choices)
    return held_bytes(choices, solved)


@dataclass(frozen=True)
class Knapsack:
    """One allocation problem: a tier per choice from `tiers`, meeting C `target` on `budget`."""

    tiers: list[Tier]
    target: float
    budget: SizeBudget
    objective: str = "measured"
    fp32_fraction: float = 0.0
    solver: str = "mckp"
    memory: MemoryCap | None = None
    """A bound on the slots' resident bytes (`export --max-memory`); None: bits alone."""

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
            memory=self.memory,
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
    memory: MemoryCap | None = None,
) -> Allocation:
    """Algorithm 1 with the chosen objective and solver: one tier per choice so that the slots fit `budget` at C
    `target` (and, under `memory`, its resident bytes); the allocation's size is `budget` and its costs the choices'
    own. The memory bound is added only when the allocation without it breaks it: a loose bound changes nothing."""
    check_allocator(solver)
    floor = unit_cost_floor(choices)
    budget.check(target, floor, [t.name for t in tiers])
    slot_bits = max(
        budget.slot_bits(target), floor
    )  # a target within the size owner's tolerance of the largest C is that C
    chosen = {c.unit: min(c.cost, key=c.cost.get) for c in choices if c.dead}
    if tiers[0].name == "fp32" and fp32_fraction > 0:
        cap = memory.slot_bytes if memory is not None else None
        chosen |= _most_sensitive_at_fp32(choices, chosen, fp32_fraction, slot_bits, cap)
    rest = [c for c in choices if c.unit not in chosen]
    remaining = slot_bits - sum(c.cost[chosen[c.unit]] for c in choices if c.unit in chosen)
    ranks_ties = objective in OBJECTIVES and OBJECTIVES[objective].ranks_ties
    bits = {t.name: t.bits for t in tiers}

    def repaired(solved: dict[str, str], by_memory: bool = False) -> dict[str, str]:
        found = chosen | solved
        return _monotone_repair(choices, found, bits, by_memory) if ranks_ties else found

    solved, label = _solve(rest, tiers, solver, int(remaining))
    found = repaired(solved)
    if memory is not None and held_bytes(choices, found) > memory.slot_bytes:
        placed = held_bytes(choices, chosen)
        solved, label = _solve(rest, tiers, solver, int(remaining), memory.slot_bytes - placed)
        found = repaired(solved, by_memory=True)
        if held_bytes(choices, found) > memory.slot_bytes:
            raise memory.unmet(placed + _least_held(rest, int(remaining)), target)
    chosen = found
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
    choices: list[Choice],
    chosen: dict[str, str],
    fp32_fraction: float,
    slot_bits: float,
    memory: int | None = None,
) -> dict[str, str]:
    """The live choices at FP32, most sensitive first, while the FP32 share and the budget allow (and the `memory`
    bound on the slots' resident bytes)."""
    fp32_budget = fp32_fraction * sum(32 * c.params for c in choices)
    live = sorted((c for c in choices if c.unit not in chosen), key=lambda c: -c.gamma)
    placed = sum(c.cost[chosen[c.unit]] for c in choices if c.unit in chosen)
    live_floor = unit_cost_floor(live)
    held = held_bytes(choices, chosen) + sum(min(c.resident.values()) for c in live) if memory is not None else 0
    spent_fp32, found = 0, {}
    for choice in live:
        cost, cheapest = choice.cost["fp32"], min(choice.cost.values())
        if spent_fp32 + cost > fp32_budget or placed + cost + live_floor - cheapest > slot_bits:
            break
        if memory is not None:
            more = choice.resident["fp32"] - min(choice.resident.values())
            if held + more > memory:
                break
            held += more
        found[choice.unit] = "fp32"
        spent_fp32 += cost
        placed += cost
        live_floor -= cheapest
    return found
