"""Which roundings an export or a baseline builds and compares: a method per tier, the grids each takes, and
the rules that skip a uniform model that cannot win.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from tiers import GRIDS, METHODS, Rounding, Tier
from tqsdeploy.errors import InputError


@dataclass(frozen=True)
class TierRoundings:
    """A rounding method per tier (`export --rounding auto`): the best rounding differs per grid (on a real
    model GPTAQ drifted least at 8 bits and QEP at 4, where GPTQ drifted 9x more), so each tier's codes
    come from the method chosen for it; `default` serves the tiers not named."""

    by_tier: tuple[tuple[str, Rounding], ...]
    default: Rounding = Rounding("qep")
    label: str = "auto"

    def at(self, tier: str) -> Rounding:
        return dict(self.by_tier).get(tier, self.default)

    @property
    def method(self) -> str:
        return self.label

    @property
    def needs_stats(self) -> bool:
        return self.default.needs_stats or any(r.needs_stats for _, r in self.by_tier)

    @property
    def needs_cross(self) -> bool:
        return self.default.needs_cross or any(r.needs_cross for _, r in self.by_tier)


AnyRounding = Rounding | TierRoundings


def rounding_at(rounding: AnyRounding, tier: str) -> Rounding:
    """The one method that rounds `tier`'s codes."""
    return rounding.at(tier) if isinstance(rounding, TierRoundings) else rounding


def comparison_methods(rounding: AnyRounding, tier: Tier) -> tuple[str, ...]:
    """Rounding methods whose uniform encodings at `tier` an export with `rounding` compares against: every
    one but those its own dominates (`Method.dominates`: each would cost a calibration pass to lose; auto dominates
    none, it measured them to choose); RTN alone where the tier takes no calibration, and for an RTN export, which
    asked for none (export's thin-statistics note offers it as the way out: comparing calibrated uniform models
    would run the passes it avoids and could ship their codes)."""
    if not tier.calibratable or rounding.method == "rtn":
        return ("rtn",)
    dominated = METHODS[rounding.method].dominates if rounding.method in METHODS else ()
    return tuple(m for m in METHODS if m not in dominated)


def can_still_win(
    method: str, rival_drift: Callable[[str], float], best_drift: float, compared: Sequence[str] = METHODS
) -> bool:
    """Whether `method`'s uniform model is worth its pass (`Method.outrun_by`): `rival_drift(m)` measures the uniform
    model of method m at the same grid, asked only when m is among the `compared` methods (the export measures
    it anyway: an RTN export compares no calibrated model, so nothing rules its RTN out); `best_drift` is the
    best candidate's so far. A rival that failed (NaN) rules nothing out."""
    outrun_by = METHODS[method].outrun_by
    if outrun_by is None or outrun_by[0] not in compared:
        return True
    rival, factor = outrun_by
    return not rival_drift(rival) > factor * best_drift


GRID_CHOICES = ("auto", *GRIDS)
"""`--grids`: 'auto' measures a calibrated method's uniform model on each of `tiers.GRIDS` at every clip-searched
tier and keeps the one that drifts less on the data at hand (`grid_options`, `least_drift`); or one of them."""


GRIDS_HELP = (
    "Grids of the 4-bit and 2-bit tiers: per-channel (each channel on the clip-searched or the min-max grid, whichever "
    "its solve rounds better; rtn: the clip search alone), min-max, or auto (default): for a calibrated rounding "
    "both measured, "
    "the one whose uniform model drifts less kept per tier; for rtn per-channel."
)


def check_grids(grids: str) -> str:
    if grids not in GRID_CHOICES:
        raise InputError(f"unknown --grids '{grids}'; choose one of {', '.join(GRID_CHOICES)}")
    return grids


def grid_options(tier: Tier, method: str, grids: str) -> list[Rounding]:
    """The roundings of `method` a uniform model at `tier` is built with to choose its grid by measurement: one per
    grid of `tiers.GRIDS` with `grids` 'auto', where the method calibrates and the tier's grid is clip-searched (the
    only place the two differ); else the one rounding asked for."""
    if grids == "auto" and Rounding(method).needs_stats and tier.calibratable and tier.quantized and tier.grid.search:
        return [Rounding(method, grids=g) for g in GRIDS]
    return [plain_rounding(method, grids)]


def plain_rounding(method: str, grids: str) -> Rounding:
    """`method` on `grids`, where nothing is measured: 'auto' takes the first of `tiers.GRIDS` (on a tier that
    is not clip-searched both are the same grid)."""
    return Rounding(method, grids=GRIDS[0] if grids == "auto" else grids)


def drift_order(drift) -> tuple[float, float]:
    """How measured models are ordered, best first: worst output drift, then relative RMS drift."""
    return drift.worst_pct, drift.relative_rms


def least_drift(measured: Mapping[Rounding, object]) -> Rounding:
    """The rounding whose measured drift (`tqsdeploy.rollout.engine.Drift`) is least (`drift_order`; listed first
    wins a tie):
    how `export` and `baseline` choose a uniform model's grid, on the scoring contexts and the calibration windows."""
    return min(measured, key=lambda rounding: drift_order(measured[rounding]))
