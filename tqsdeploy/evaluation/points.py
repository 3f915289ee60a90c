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
