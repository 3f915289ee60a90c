"""`export --max-drift PCT` without --C: the most compressed model whose drift on the validation windows stays
within PCT.

One planner serves every target tried, so the tier prices, the encoded passes and the candidates' drifts are
measured once and reused (`Planner.choose`); each target's chosen candidate is written to a scratch file and
evaluated on the validation windows (`validation.Validation`). The search tries a few targets on a geometric grid
from the largest reachable compression down until one meets the budget, then bisects (in log C) between it and the
grid point above it; only the most compressed target that met the budget is written, once, where asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqsdeploy.errors import InputError
from tqsdeploy.export.planner import Planner
from tqsdeploy.export.validation import ValidationDrift
from tqsdeploy.export.writing import Outcome

GRID = 4
"""Grid points from the largest reachable C down: C_max^(k/GRID) for k = GRID..1 (C_max 16: 16, 8, 4, 2)."""
BISECTIONS = 5
"""Bisections of the bracket the grid finds (each a target between one that met the budget and one that did not):
a grid step of C_max^(1/4) (about 1.9x at C_max 13) narrowed to about 2% of C. Three stopped lorenz96 at 3.93x where
a `--C 4` export met 1% (docs/design-notes/export.md)."""
CLOSE = 1.02
"""A bracket narrower than this ratio of C is not bisected further: the allocations either side barely differ."""


@dataclass(frozen=True)
class Trial:
    """One target tried: what the export chose there and how it drifts on the validation windows."""

    target: float
    compression: float
    """What the chosen candidate's allocation reaches (stored tensor bits, the original's over its own)."""
    shipped: str
    drift: ValidationDrift
    scoring_drift_pct: float | None
    meets: bool

    def record(self) -> dict:
        return {
            "target_C": self.target,
            "compression": self.compression,
            "shipped": self.shipped,
            **self.drift.record(),
            "scoring_drift_pct": self.scoring_drift_pct,
            "meets_budget": self.meets,
        }


@dataclass
class BudgetSearch:
    """What a search tried and chose (`chosen` None: no target met the budget, nothing was written)."""

    budget_pct: float
    on: str
    trials: list[Trial] = field(default_factory=list)
    chosen: Trial | None = None
    outcome: Outcome | None = None

    def record(self, planner: Planner) -> dict:
        """The allocation JSON's `budget`: the bound, how it is judged, every target tried."""
        validation = planner.validation
        return {
            "max_drift_pct": self.budget_pct,
            "judged": self.on,
            "windows": str(validation.options.windows),
            "windows_count": validation.windows,
            "search": f"targets C_max^(k/{GRID}) for k = {GRID}..1 from the largest reachable C down until one meets "
            f"the budget, then up to {BISECTIONS} bisections in log C; the most compressed target that met it "
            "is written",
            "largest_reachable_C": planner.max_compression(),
            "chosen_C": self.chosen.target if self.chosen else None,
            "tried": [t.record() for t in self.trials],
        }


def _largest(planner: Planner) -> float:
    """The largest reachable C, nudged below where rounding makes it a hair out of reach."""
    top = planner.max_compression()
    while not planner.reachable(top) and top > 1:
        top *= 1 - 1e-6
    return top


def search(
    planner: Planner,
    budget_pct: float,
    path: Path | str,
    on_trial: Callable[[Trial], None] = lambda trial: None,
) -> BudgetSearch:
    """The most compressed model within `budget_pct` on the planner's validation windows, written to `path` with its
    allocation record (its `budget` says what was tried); nothing written when no target tried meets it."""
    validation = planner.validation
    if validation is None:
        raise InputError(
            "export --max-drift without --C judges the drift on validation windows, and none were given",
            hint="pass --validate FILE (windows the score never saw, e.g. held-out.npz), or --C to bound one model",
        )
    if not (math.isfinite(budget_pct) and budget_pct >= 0):
        raise InputError(f"--max-drift takes a finite percentage of at least 0, not {budget_pct:g}")
    found = BudgetSearch(budget_pct, validation.on)

    def trial(target: float) -> Trial:
        compared = planner.choose(target)
        chosen = compared[0]
        drift = validation.known(chosen)
        scoring = chosen.drift.worst_pct if chosen.drift is not None else None
        made = Trial(
            target, chosen.allocation.compression, chosen.label, drift, scoring, drift.judged(found.on) <= budget_pct
        )
        found.trials.append(made)
        on_trial(made)
        return made

    top = _largest(planner)
    grid = [top ** (k / GRID) for k in range(GRID, 0, -1)]
    low, high = 1.0, None  # low: met the budget (1: the original, never tried); high: did not
    for target in grid:
        if trial(target).meets:
            low = target
            break
        high = target
    for _ in range(BISECTIONS if high is not None else 0):
        if high / low < CLOSE:
            break
        middle = math.sqrt(low * high)
        if trial(middle).meets:
            low = middle
        else:
            high = middle
    passing = [t for t in found.trials if t.meets]
    if not passing:
        return found
    found.chosen = max(passing, key=lambda t: (t.compression, t.target))
    found.outcome = planner.export(found.chosen.target, path, final=True, record={"budget": found.record(planner)})
    return found
