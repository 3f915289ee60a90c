"""`frontier`: TQS-PTQ and the calibration-based baselines on one chart.

One score run; one export per (objective, C); one uniform model per
(baseline method, bits); every candidate evaluated with `evaluate` on the
same contexts (and on held-out contexts when given, so an allocation that
overfits the scoring contexts shows). Results land in `frontier.parquet`,
one row per (candidate, split, output, variable), with wall time split into
sweep / calibration / apply / eval.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl

from runtimes import OrtRuntime
from tqsdeploy.baselines import quantize_baseline, write_baseline
from tqsdeploy.errors import InputError, TqsError
from tqsdeploy.evaluate import EvalSettings, evaluate
from tqsdeploy.export import ExportSettings, Planner
from tqsdeploy.score import ScoreTable, score
from tqsdeploy.scoring import ScoreSettings
from tqsdeploy.units import UnitSelection

MATCH_SLACK = 0.01
"""TQS targets at a grid point sit this fraction below the baseline's compression."""

LABELS = {"paper": "TQS-PTQ (paper)", "response": "TQS-PTQ (response)", "measured": "TQS-PTQ (measured)", "rtn": "RTN", "gptq": "GPTQ", "gptaq": "GPTAQ", "qep": "QEP"}


@dataclass(frozen=True)
class FrontierSettings:
    targets: tuple[float, ...] = (2, 4, 8, 12, 16, 24, 32)
    objectives: tuple[str, ...] = ("paper", "response", "measured")
    baselines: tuple[str, ...] = ("rtn", "gptq", "gptaq", "qep")
    bits: tuple[int, ...] = (2, 3, 4, 8)
    export: ExportSettings = field(default_factory=ExportSettings)
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    baseline_group_size: int = -1
    min_params: int = 1024
    """Smallest tensor quantized, by TQS-PTQ and the baselines alike."""


@dataclass
class Candidate:
    family: str
    method: str
    setting: str
    target: float | None
    path: Path | None
    compression: float | None
    file_bytes: int | None
    timings: dict[str, float]
    status: str = "ok"
    details: dict = field(default_factory=dict)


def _rows(candidate: Candidate, split: str, report: dict | None) -> list[dict]:
    base = {
        "family": candidate.family,
        "method": LABELS.get(candidate.method, candidate.method),
        "setting": candidate.setting,
        "target_C": candidate.target,
        "achieved_C": candidate.compression,
        "file_bytes": candidate.file_bytes,
        "split": split,
        "status": candidate.status,
        **{f"{k}_s": v for k, v in candidate.timings.items()},
    }
    if report is None:
        return [{**base, "output": None, "variable": None}]
    rows = []
    for output, metrics in report["outputs"].items():
        entries = [("all", metrics)] + list(metrics.get("variables", {}).items())
        for variable, m in entries:
            ref, truth = m.get("vs_reference", {}), m.get("vs_truth") or {}
            rows.append(
                {
                    **base,
                    "output": output,
                    "variable": variable,
                    "mae_ref": ref.get("mae"),
                    "rmse_ref": ref.get("rmse"),
                    "drift_pct": ref.get("drift_pct"),
                    "mae_truth": truth.get("mae"),
                    "rmse_truth": truth.get("rmse"),
                    "ref_mae_truth": truth.get("reference_mae"),
                    "degradation_pct": m.get("degradation_pct"),
                    "mae_by_step": json.dumps(truth.get("mae_by_step") or ref.get("mae_by_step")),
                }
            )
    return rows


def run_frontier(
    model: str | Path,
    contexts: str | Path,
    out_dir: str | Path,
    *,
    spec: str | Path | None = None,
    steps: int | None = None,
    truth: str | Path | None = None,
    calib: str | Path | None = None,
    eval_contexts: str | Path | None = None,
    eval_truth: str | Path | None = None,
    settings: FrontierSettings = FrontierSettings(),
    score_settings: ScoreSettings = ScoreSettings(),
    runtime: OrtRuntime = OrtRuntime(),
    log: Callable[[str], None] = lambda message: None,
) -> pl.DataFrame:
    """Build every candidate, evaluate it, and write frontier.parquet/csv."""
    model, out_dir = Path(model), Path(out_dir)
    models_dir = out_dir / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    log("scoring (resumes a matching run)")
    selection = UnitSelection(min_params=settings.min_params)
    arguments = dict(spec=spec, steps=steps, out=out_dir / "score", settings=score_settings, selection=selection, runtime=runtime)
    try:
        table: ScoreTable = score(model, contexts, **arguments)  # resumes a matching run
    except InputError:  # the folder's run is for other settings; it belongs to this frontier, so replace it
        table = score(model, contexts, resume=False, **arguments)
    spec_path = out_dir / "score" / "rollout.toml"
    sweep_s = table.meta["timings_s"]["sweep"]
    candidates: list[Candidate] = []

    for method in settings.baselines:
        for bits in settings.bits:
            log(f"baseline {method} W{bits}")
            path = models_dir / f"{model.stem}.{method}-w{bits}.onnx"
            try:
                result = quantize_baseline(
                    model, method, bits, calib or contexts, group_size=settings.baseline_group_size, min_params=settings.min_params, runtime=runtime
                )
                summary = write_baseline(model, result, path)
            except TqsError as exc:
                candidates.append(Candidate("baseline", method, f"W{bits}", None, None, None, None, {}, f"failed: {exc}"))
                continue
            timings = {"sweep": 0.0, "calibration": summary["timings_s"]["calibration"], "apply": summary["timings_s"]["apply"] + summary["timings_s"]["write"]}
            candidates.append(Candidate("baseline", method, f"W{bits}", None, path, summary["achieved_compression"], summary["file_bytes"], timings, details={"notes": summary["notes"]}))

    # TQS-PTQ also runs at each baseline grid point's compression (1% below it,
    # so that a uniform allocation of the same tier still fits), so matched
    # comparisons compare equal sizes rather than the nearest requested C.
    targets = [(t, f"C{t:g}") for t in settings.targets]
    for candidate in [c for c in candidates if c.compression]:
        matched = round(candidate.compression * (1 - MATCH_SLACK), 3)
        if not any(abs(math.log(matched / t)) < 0.01 for t, _ in targets):
            targets.append((matched, f"C{matched:.3g}@{candidate.setting}"))
    targets.sort()
    for objective in settings.objectives:
        planner = Planner(out_dir / "score", model, ExportSettings(**{**asdict(settings.export), "objective": objective}), runtime)
        best = planner.max_compression()
        measured_started = time.perf_counter()
        if objective == "measured":
            planner.measured()
        calibration_s = time.perf_counter() - measured_started
        for target, setting in targets:
            if target > best:
                candidates.append(Candidate("tqs", objective, setting, target, None, None, None, {}, f"infeasible: largest reachable C is {best:.3g}"))
                continue
            log(f"export {objective} {setting}")
            started = time.perf_counter()
            path = models_dir / f"{model.stem}.{objective}.{setting}.onnx"
            outcome = planner.export(target, path)
            timings = {"sweep": sweep_s, "calibration": calibration_s, "apply": time.perf_counter() - started}
            details = {"tiers": dict(zip(outcome.table["unit"], outcome.table["tier"])), "fell_back_to": outcome.fell_back_to, "drift": outcome.drift}
            candidates.append(Candidate("tqs", objective, setting, target, path, outcome.allocation.compression, outcome.file_bytes, timings, details=details))
        planner.close()

    splits = [("scoring", contexts, truth)] + ([("held-out", eval_contexts, eval_truth)] if eval_contexts else [])
    rows: list[dict] = []
    for candidate in candidates:
        for split, split_contexts, split_truth in splits:
            if candidate.path is None:
                rows.extend(_rows(candidate, split, None))
                continue
            log(f"eval {candidate.method} {candidate.setting} on {split}")
            started = time.perf_counter()
            try:
                report = evaluate(candidate.path, model, split_contexts, spec=spec_path, truth=split_truth, settings=settings.evaluation)
            except TqsError as exc:
                candidate.status = f"eval failed: {exc}"
                rows.extend(_rows(candidate, split, None))
                continue
            candidate.timings["eval"] = candidate.timings.get("eval", 0.0) + time.perf_counter() - started
            if any(not math.isfinite(o.get("degradation_pct", 0.0)) for o in report["outputs"].values()):
                candidate.status = "non-finite outputs"
            rows.extend(_rows(candidate, split, report))
    for row in rows:  # eval time is known only once every split ran
        match = next(c for c in candidates if LABELS.get(c.method, c.method) == row["method"] and c.setting == row["setting"])
        row["eval_s"] = match.timings.get("eval")
        for key in ("sweep", "calibration", "apply"):
            row.setdefault(f"{key}_s", match.timings.get(key))
    frame = pl.DataFrame(rows, infer_schema_length=None)
    frame.write_parquet(out_dir / "frontier.parquet")
    frame.write_csv(out_dir / "frontier.csv")
    (out_dir / "frontier.json").write_text(
        json.dumps(
            {
                "model": str(model),
                "score_run": str(out_dir / "score"),
                "candidates": [{k: v for k, v in asdict(c).items() if k != "path"} | {"path": str(c.path) if c.path else None} for c in candidates],
                "runtime": "ONNX Runtime " + ("exact dequantization" if settings.evaluation.exact else "default optimisations (MatMulNBits, accuracy_level 4)"),
            },
            indent=2,
            default=str,
        )
    )
    return frame
