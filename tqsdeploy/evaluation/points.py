"""A frontier point (one exported or attempted model) and its rows in frontier.parquet.

One row per (split, output, variable) an evaluation reports, each carrying the point's identity, size and times,
so the report can filter the table without joining it to anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Candidate:
    family: str
    """'baseline' or 'tqs'."""
    method: str
    setting: str
    target: float | None
    path: Path | None
    """The exported model; None where nothing was written (a failed or infeasible point)."""
    compression: float | None
    file_bytes: int | None
    timings: dict[str, float]
    status: str = "ok"
    details: dict = field(default_factory=dict)


def _scaled(ref: dict, end: int) -> float | None:
    """An end of the drift's 95% bootstrap interval: the MAE interval in drift units (% of mean |reference|)."""
    if not ref.get("mae") or not ref.get("mae_ci95"):
        return ref.get("drift_pct") if ref else None
    return ref["mae_ci95"][end] * ref["drift_pct"] / ref["mae"]


def _identity(candidate: Candidate, split: str) -> dict:
    return {
        "family": candidate.family,
        "method": candidate.method,
        "setting": candidate.setting,
        "target_C": candidate.target,
        "achieved_C": candidate.compression,
        "file_bytes": candidate.file_bytes,
        "split": split,
        "status": candidate.status,
        "shipped": candidate.details.get("shipped"),  # TQS-PTQ: its mixed allocation or a uniform model it fell back to
        **{f"{k}_s": v for k, v in candidate.timings.items()},
    }


def _measured(metrics: dict) -> dict:
    """One output's (or variable's) numbers from an `evaluate` report."""
    ref, truth = metrics.get("vs_reference", {}), metrics.get("vs_truth") or {}
    interval = truth.get("degradation_ci95") or [None, None]
    return {
        "mae_ref": ref.get("mae"),
        "rmse_ref": ref.get("rmse"),
        "drift_pct": ref.get("drift_pct"),
        "drift_lo": _scaled(ref, 0),
        "drift_hi": _scaled(ref, 1),
        "mae_truth": truth.get("mae"),
        "rmse_truth": truth.get("rmse"),
        "ref_mae_truth": truth.get("reference_mae"),
        "degradation_pct": metrics.get("degradation_pct"),
        "degradation_lo": interval[0],
        "degradation_hi": interval[1],
        "mae_by_step": json.dumps(truth.get("mae_by_step") or ref.get("mae_by_step")),
        "ref_mae_by_step": json.dumps(truth.get("reference_mae_by_step")),
        "drift_by_step": json.dumps(ref.get("mae_by_step")),
    }


def rows(candidate: Candidate, split: str, report: dict | None) -> list[dict]:
    """The point's rows on `split`: one per output and variable of `report`, or one without numbers (None: not
    evaluated)."""
    base = _identity(candidate, split)
    if report is None:
        return [{**base, "output": None, "variable": None}]
    timed = (report.get("latency") or {}).get("batches")
    if timed:  # frontier --latency: the first batch size, candidate beside the reference
        first = timed[0]
        base |= {
            "latency_ms": first["candidate"]["median_ms"],
            "reference_latency_ms": first["reference"]["median_ms"],
            "slowdown": first["slowdown"],
        }
    found = []
    for output, metrics in report["outputs"].items():
        for variable, m in [("all", metrics)] + list(metrics.get("variables", {}).items()):
            found.append({**base, "output": output, "variable": variable, **_measured(m)})
    return found


def mark_budget(frame_rows: list[dict], split: str, budget: tuple[float, str] | None) -> dict | None:
    """Set every row's `meets_budget` (None without a budget): whether its point's worst output drifts at most
    budget[0] percent from the original on `split`, judging budget[1] ('upper': the upper end of the 95% interval
    over windows, as `export --max-drift` does; 'point': the estimate). Returns the most compressed point within it
    (None when none is)."""
    if budget is None:
        for row in frame_rows:
            row["meets_budget"] = None
        return None
    limit, on = budget
    worst: dict[tuple, float] = {}
    for row in frame_rows:
        if row["split"] != split or row.get("variable") != "all":
            continue
        value = row.get("drift_hi" if on == "upper" else "drift_pct")
        usable = row["status"] == "ok" and value is not None
        key = (row["method"], row["setting"])
        worst[key] = max(worst.get(key, 0.0), value if usable else float("inf"))
    meets = {key: value <= limit for key, value in worst.items()}
    for row in frame_rows:
        row["meets_budget"] = meets.get((row["method"], row["setting"]), False)
    passing = [r for r in frame_rows if r["split"] == split and r.get("variable") == "all" and r["meets_budget"]]
    if not passing:
        return {"max_drift_pct": limit, "judged": on, "split": split, "point": None}
    best = max(passing, key=lambda r: (r["achieved_C"] or 0.0, -worst[(r["method"], r["setting"])]))
    return {
        "max_drift_pct": limit,
        "judged": on,
        "split": split,
        "point": {k: best[k] for k in ("method", "setting", "achieved_C", "drift_pct", "drift_lo", "drift_hi")},
    }
