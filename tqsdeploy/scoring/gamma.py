"""From task results to TQS scores.

gamma(T) = (1/T) ln( mean_s ||dY_s,1:T||^2 / (||d theta||_F^2 + eps) ), where
||dY_s,1:T||^2 sums the squared divergence of every trajectory output over
steps 1..T. For the Gaussian probe the mean runs over windows and draws.

Dead rule: a unit is dead when, for every probe that ran, the RMS trajectory
divergence relative to the RMS nominal trajectory is at most `dead_rtol`
(default 1e-6, a few float32 ulps: below what float32 arithmetic resolves).
Dead units get the sentinel score ln(1e-30) = -69.08 (the floor the paper
reports on TimesFM) and rank below every live unit. A perturbation that drives
the rollout to NaN/Inf scores +inf and ranks first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import polars as pl

from tqsdeploy.sweep import TaskResult
from tqsdeploy.units import Unit

SENTINEL_GAMMA = math.log(1e-30)
"""Score given to dead units."""


@dataclass(frozen=True)
class ScoreSettings:
    """Probe and scoring parameters; part of a run's identity."""

    probe_bits: int = 6
    gauss_draws: int = 4
    quant_probe: bool = True
    seed: int = 0
    eps: float = 1e-12
    dead_rtol: float = 1e-6
    horizons: tuple[int, ...] | None = None
    early_stop: bool = False
    early_stop_tol: float = 0.01
    early_stop_window: int = 3

    def __post_init__(self) -> None:
        """Settings outside these ranges give a wrong table, not an error, so they are refused here:
        a 1-bit symmetric probe has no grid, one of 17 bits or more sits below float32's resolution
        (every unit 'dead'), and a non-finite or non-positive ε makes every γ NaN or the floor."""
        from tqsdeploy.errors import InputError

        problems = []
        if not 2 <= self.probe_bits <= 16:
            problems.append(f"--probe-bits must be 2 to 16, not {self.probe_bits}")
        if self.gauss_draws < 0:
            problems.append(f"--probes must be 0 or more, not {self.gauss_draws}")
        if not self.quant_probe and self.gauss_draws == 0:
            problems.append("no probe left: the quantization probe is off and --probes is 0")
        if self.seed < 0:
            problems.append(f"--seed must be 0 or more, not {self.seed}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            problems.append(f"--eps must be a positive finite number, not {self.eps}")
        if not (math.isfinite(self.dead_rtol) and self.dead_rtol >= 0):
            problems.append(f"--dead-rtol must be a finite number >= 0, not {self.dead_rtol}")
        if self.horizons is not None and any(h < 1 for h in self.horizons):
            problems.append(f"--horizons are steps from 1, not {','.join(map(str, self.horizons))}")
        if not (math.isfinite(self.early_stop_tol) and self.early_stop_tol > 0):
            problems.append(f"--early-stop-tol must be a positive finite number, not {self.early_stop_tol}")
        if self.early_stop_window < 1:
            problems.append(f"--early-stop-window must be 1 or more, not {self.early_stop_window}")
        if problems:
            raise InputError("; ".join(problems))

    def check_horizons(self, steps: int) -> None:
        """Horizons past the rollout's T would be dropped from the table without a word."""
        from tqsdeploy.errors import InputError

        beyond = [h for h in self.horizons or () if h > steps]
        if beyond:
            raise InputError(
                f"--horizons {','.join(map(str, beyond))} lie beyond the rollout's {steps} steps",
                hint="lower them or raise --steps",
            )

    def schedule(self, steps: int) -> tuple[int, ...]:
        """Horizons at which gamma is reported: given, or 1, 2, 4, ... up to T (T included)."""
        if self.horizons:
            return tuple(sorted({h for h in self.horizons if 1 <= h <= steps} | {steps}))
        powers = {2**k for k in range(0, int(math.log2(steps)) + 1)}
        return tuple(sorted(powers | {steps}))


def horizon_ratios(results: Sequence[TaskResult], eps: float) -> np.ndarray:
    """Per step t: mean over draws of ||dY_1:t||^2 / (||d theta||^2 + eps)."""
    steps = min(r.steps for r in results)
    curves = [np.cumsum(np.asarray(r.div_sq[:steps], dtype=np.float64)) / (r.delta_sq + eps) for r in results]
    return np.mean(curves, axis=0)


def gamma_at(ratio: float, t: int) -> float:
    if math.isnan(ratio):
        return math.nan
    if ratio == math.inf:
        return math.inf
    return math.log(ratio) / t if ratio > 0 else SENTINEL_GAMMA


def _relative_divergence(results: Sequence[TaskResult], nominal_sq: Sequence[float]) -> float:
    steps = min(r.steps for r in results)
    divergence = float(np.mean([np.sum(r.div_sq[:steps]) for r in results]))
    reference = float(np.sum(nominal_sq[:steps]))
    return math.sqrt(divergence / reference) if reference > 0 else math.sqrt(divergence)


def _probe_summary(results: Sequence[TaskResult], nominal_sq, settings: ScoreSettings, schedule) -> dict:
    if not results:
        return {}
    nonfinite = any(r.nonfinite for r in results)
    ratios = horizon_ratios(results, settings.eps)
    steps = len(ratios)
    return {
        "gamma": math.inf if nonfinite else gamma_at(ratios[-1], steps),
        "horizons": {
            h: (math.inf if nonfinite else gamma_at(ratios[h - 1], h)) if h <= steps else None for h in schedule
        },
        "a_max": math.inf if nonfinite else max(math.sqrt(ratios[h - 1]) for h in schedule if h <= steps),
        "rel_div": math.inf if nonfinite else _relative_divergence(results, nominal_sq),
        "nonfinite": nonfinite,
        "steps": steps,
        "norm": math.sqrt(float(np.mean([r.delta_sq for r in results]))),
        "draw_gammas": [gamma_at(horizon_ratios([r], settings.eps)[-1], steps) for r in results],
    }


def score_frame(
    units: Sequence[Unit],
    results: dict[str, TaskResult],
    nominal_sq: Sequence[float],
    settings: ScoreSettings,
    steps: int,
    rows_read: dict | None = None,
) -> pl.DataFrame:
    """One row per unit with every score column, ranked (rank 1 = most sensitive).

    `rows_read` (Gather tables' rows the contexts read) fills `touched_rows`:
    the rows the probes perturbed; empty for units perturbed whole."""
    schedule = settings.schedule(steps)
    by_unit: dict[str, dict[str, list[TaskResult]]] = {}
    for result in results.values():
        by_unit.setdefault(result.unit, {}).setdefault(result.probe, []).append(result)
    rows_read = rows_read or {}
    rows = [_unit_row(unit, by_unit.get(unit.name, {}), nominal_sq, settings, schedule, rows_read) for unit in units]
    frame = pl.DataFrame(rows, infer_schema_length=None)
    if frame.height == 0:
        return frame
    frame = frame.sort(["dead", "gamma", "params"], descending=[False, True, True])
    return frame.with_columns(pl.Series("rank", np.arange(1, frame.height + 1))).select(
        ["rank", *[c for c in frame.columns if c != "rank"]]
    )


def _unit_row(
    unit: Unit,
    probes: dict[str, list[TaskResult]],
    nominal_sq: Sequence[float],
    settings: ScoreSettings,
    schedule: Sequence[int],
    rows_read: dict,
) -> dict:
    """One unit's row of the score table, from its probes' results."""
    described = {
        "unit": unit.name,
        "label": unit.label,
        "tensors": ";".join(unit.tensor_names),
        "op_types": ";".join(unit.op_types),
        "nodes": ";".join(unit.nodes),
        "shape": unit.shape,
        "params": unit.params,
    }
    # A weight exactly representable at the probe's bits has a zero residual: the quant probe then says nothing,
    # and the Gaussian probe (which falls back to the expected rounding-noise norm) carries the score.
    quant = _probe_summary([r for r in probes.get("quant", []) if r.delta_sq > 0], nominal_sq, settings, schedule)
    gauss = _probe_summary(sorted(probes.get("gauss", []), key=lambda r: r.draw), nominal_sq, settings, schedule)
    primary = quant or gauss
    if not primary:
        return {**described, "gamma": math.nan, "dead": False, "nonfinite": False}
    summaries = [s for s in (quant, gauss) if s]
    dead = all(s["rel_div"] <= settings.dead_rtol for s in summaries)
    row = {
        **described,
        "gamma": SENTINEL_GAMMA if dead else primary["gamma"],
        "gamma_quant": quant.get("gamma"),
        "gamma_gauss": gauss.get("gamma"),
        "gamma_gauss_std": float(np.std(gauss["draw_gammas"])) if gauss else None,
    }
    for h in schedule:
        value = primary["horizons"][h]
        row[f"gamma_T{h}"] = SENTINEL_GAMMA if dead and value is not None else value
    touched = any(n in rows_read for n in unit.tensor_names)
    row.update(
        {
            "a_max": primary["a_max"],
            "rel_divergence": primary["rel_div"],
            "probe_norm": primary["norm"],
            "steps": primary["steps"],
            "dead": dead,
            "nonfinite": any(s["nonfinite"] for s in summaries),
            "seconds": sum(r.seconds for group in probes.values() for r in group),
            "touched_rows": sum(len(rows_read[n]) for n in unit.tensor_names if n in rows_read) if touched else None,
        }
    )
    return row


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None below 3 points."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size < 3:
        return None

    def ranks(v):
        order = np.argsort(v, kind="mergesort")
        r = np.empty(v.size)
        r[order] = np.arange(v.size)
        for value in np.unique(v):
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])
