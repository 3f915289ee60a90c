"""`frontier`: TQS-PTQ and the uniform baselines on one chart, at matched sizes.

One score run and one `Planner`; the baselines are uniform allocations
exported by that planner with each rounding method (so they share its
calibration and its caches); TQS-PTQ runs at the requested compressions and
just below every baseline's compression (matched points); every candidate is
evaluated with `evaluate` on the scoring contexts and, when given, on held-out
contexts, which is what the report leads with. Results land in
`frontier.parquet`, one row per (candidate, split, output, variable), with wall
time split into the score sweep (shared by every TQS-PTQ point), the export
(pricing, calibration, refinement, comparison and writing; TQS-PTQ prices
every slot once, in its first export) and the evaluation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import polars as pl

from runtimes import DEFAULT_RUNTIME, Runtime
from tiers import METHOD_LABELS, METHODS, tier_for_bits
from tqsdeploy.encoding import checkpoints
from tqsdeploy.errors import InputError, TqsError
from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate
from tqsdeploy.export import ExportSettings, Planner
from tqsdeploy.files import write_json, write_table, write_text
from tqsdeploy.scoring.prepare import ContextOptions
from tqsdeploy.scoring.runs import ScoreRun
from tqsdeploy.scoring.score import score
from tqsdeploy.scoring.gamma import ScoreSettings
from tqsdeploy.size import reachable_label
from tqsdeploy.units import UnitSelection

MATCH_DIGITS = 6
"""A TQS target at a grid point is the baseline's compression cut at this decimal: the same size within a few bits,
so the export may still ship that uniform model where nothing it builds drifts less (it once sat 1% below the
baseline's C, i.e. 1% larger; rounded up at the third decimal instead, the uniform model was out of reach by a hair
and TQS-PTQ lost at four of 21 held-out points, three of them with a model that drifted more than that uniform one on
the scoring contexts too)."""

LABELS = METHOD_LABELS
TQS_LABEL = "TQS-PTQ"


@dataclass(frozen=True)
class FrontierSettings:
    targets: tuple[float, ...] = (2, 4, 8, 12, 16)
    baselines: tuple[str, ...] = tuple(METHODS)
    bits: tuple[int, ...] = (2, 4, 8)
    export: ExportSettings = field(default_factory=ExportSettings)
    """TQS-PTQ's settings (the defaults unless asked otherwise)."""
    variants: tuple[tuple[str, ExportSettings], ...] = ()
    """Extra TQS-PTQ lines: (label, settings), e.g. another objective or rounding."""
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    min_params: int = 1024
    """Smallest tensor quantized, by TQS-PTQ and the baselines alike."""
    symmetric_baselines: bool = False


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


def _scaled(ref: dict, end: int) -> float | None:
    """An end of the drift's 95% bootstrap interval: the MAE interval in drift units (% of mean |reference|)."""
    if not ref.get("mae") or not ref.get("mae_ci95"):
        return ref.get("drift_pct") if ref else None
    return ref["mae_ci95"][end] * ref["drift_pct"] / ref["mae"]


def _rows(candidate: Candidate, split: str, report: dict | None) -> list[dict]:
    base = {
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
    if report is None:
        return [{**base, "output": None, "variable": None}]
    timed = (report.get("latency") or {}).get("batches")
    if timed:  # frontier --latency: the first batch size, candidate beside the reference
        base |= {"latency_ms": timed[0]["candidate"]["median_ms"], "reference_latency_ms": timed[0]["reference"]["median_ms"], "slowdown": timed[0]["slowdown"]}
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
                    "drift_lo": _scaled(ref, 0),
                    "drift_hi": _scaled(ref, 1),
                    "mae_truth": truth.get("mae"),
                    "rmse_truth": truth.get("rmse"),
                    "ref_mae_truth": truth.get("reference_mae"),
                    "degradation_pct": m.get("degradation_pct"),
                    "degradation_lo": (truth.get("degradation_ci95") or [None, None])[0],
                    "degradation_hi": (truth.get("degradation_ci95") or [None, None])[1],
                    "mae_by_step": json.dumps(truth.get("mae_by_step") or ref.get("mae_by_step")),
                    "ref_mae_by_step": json.dumps(truth.get("reference_mae_by_step")),
                    "drift_by_step": json.dumps(ref.get("mae_by_step")),
                }
            )
    return rows


def _targets(settings: FrontierSettings, baselines: list[Candidate]) -> list[tuple[float, str]]:
    """Requested compressions plus one just below every baseline's (a matched point)."""
    targets = [(float(t), f"C{t:g}") for t in settings.targets]
    for candidate in baselines:
        if candidate.compression:
            matched = math.floor(candidate.compression * 10**MATCH_DIGITS) / 10**MATCH_DIGITS
            if matched < 1:  # a baseline no smaller than the original (a tiny model's scales and nodes): nothing to match
                continue
            if not any(abs(math.log(matched / t)) < 0.005 for t, _ in targets):
                targets.append((matched, f"C{matched:.3g}@{candidate.setting}"))
    return sorted(targets)


PROGRESS = "frontier-progress.jsonl"
"""In the frontier's folder: each finished export and evaluation, so a rerun after an interruption redoes none."""


class _Progress:
    """The frontier's finished work under an identity of everything it depends on (model, score run, settings,
    contexts, runtime, code): entries of another identity are ignored, an export whose files changed since is
    made again, and a half-written last line (a kill) is dropped."""

    def __init__(self, path: Path, identity: dict):
        self.path = path
        self.identity = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
        self.parts = {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16] for k, v in identity.items()}
        self.entries: dict[str, dict] = {}
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            lines = []
        earlier, kept = None, 0
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                break
            if not isinstance(entry, dict):
                continue
            if "parts" in entry:  # a header: what the work after it was done for
                earlier = entry["parts"] if entry.get("identity") != self.identity else earlier
                kept += entry.get("identity") == self.identity
            elif entry.get("identity") == self.identity:
                self.entries[entry["key"]] = entry["value"]
                kept += 1
        self.changed = sorted(k for k in self.parts if earlier.get(k) != self.parts[k]) if earlier is not None else []
        """What differs from the earlier work found in the ledger (score, model, settings, runtime, splits, code)."""
        self._headed = bool(lines) and kept == len(lines) and kept > len(self.entries)
        if lines and not self._headed:  # another identity's entries (or a torn line): only this one's stay, under its header
            write_text(path, "".join(json.dumps(e, default=str) + "\n" for e in [self._header(), *({"identity": self.identity, "key": k, "value": v} for k, v in self.entries.items())]))
            self._headed = True

    def _header(self) -> dict:
        return {"identity": self.identity, "parts": self.parts}

    def put(self, key: str, value: dict) -> None:
        self.entries[key] = value
        with open(self.path, "a", encoding="utf-8") as handle:
            if not self._headed:
                handle.write(json.dumps(self._header()) + "\n")
                self._headed = True
            handle.write(json.dumps({"identity": self.identity, "key": key, "value": value}, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def candidate(self, key: str) -> Candidate | None:
        """A finished export's candidate, if its files are still the ones it wrote."""
        value = self.entries.get(key)
        if value is None or any(_stamp(Path(f)) != stamp for f, stamp in value["files"].items()):
            return None
        fields = dict(value["candidate"])
        fields["path"] = Path(fields["path"]) if fields["path"] else None
        return Candidate(**fields)

    def put_candidate(self, key: str, candidate: Candidate, files) -> None:
        fields = asdict(candidate) | {"path": str(candidate.path) if candidate.path else None}
        self.put(key, {"candidate": fields, "files": {str(f): _stamp(Path(f)) for f in files}})


def _check_folder(out_dir: Path, force: bool) -> None:
    """The frontier writes report.md, frontier.csv, plots and more under fixed names: a folder of the user's own
    files is refused (as score refuses one) unless --force; a folder an earlier frontier wrote (its ledger is
    there) is taken up again, which is how an interrupted frontier resumes."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"frontier folder {out_dir} is a file")
    if force or not out_dir.is_dir() or (out_dir / PROGRESS).exists():
        return
    foreign = sorted(p.name for p in out_dir.iterdir())
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise InputError(f"{out_dir} is not a frontier's folder and not empty (it holds {shown})",
                         hint="choose a new or empty folder with --out, or pass --force to write over files of the same names")


def _stamp(path: Path) -> list[int] | None:
    """What tells a file from one written since: its size and modification time."""
    try:
        status = path.stat()
    except OSError:
        return None
    return [status.st_size, status.st_mtime_ns]


def _digest(path: str | Path | None) -> str | None:
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_frontier(
    model: str | Path,
    contexts: str | Path,
    out_dir: str | Path,
    *,
    spec: str | Path | None = None,
    steps: int | None = None,
    truth: str | Path | None = None,
    eval_contexts: str | Path | None = None,
    eval_truth: str | Path | None = None,
    settings: FrontierSettings = FrontierSettings(),
    score_settings: ScoreSettings = ScoreSettings(),
    runtime: Runtime = DEFAULT_RUNTIME,
    log: Callable[[str], None] = lambda message: None,
    notice: Callable[[str], None] = lambda message: None,
    progress=None,
    force: bool = False,
) -> pl.DataFrame:
    """Build every candidate, evaluate it, and write frontier.parquet/csv/json.

    `progress` (a `tqsdeploy.progress.Progress`) counts the steps: the score, each baseline, export and evaluation.
    `force` writes into a folder of other files (`_check_folder`)."""
    model, out_dir = Path(model), Path(out_dir)
    _check_folder(out_dir, force)
    if eval_truth is not None and eval_contexts is None:
        raise InputError("--eval-truth is the truth of --eval-contexts, which is missing")
    splits = ([("held-out", eval_contexts, eval_truth)] if eval_contexts else []) + [("scoring", contexts, truth)]
    for _, split_contexts, split_truth in splits:  # the reference against itself: contexts, truth and spec are checked before any work
        evaluate(model, model, split_contexts, spec=spec, steps=steps, truth=split_truth, settings=replace(settings.evaluation, latency=None))
    models_dir = out_dir / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PROGRESS).touch()  # first of all: it marks the folder as this frontier's, however early it is interrupted
    lines_count = 1 + len(settings.variants)
    baselines_count = len(settings.bits) * len(settings.baselines)

    def planned(exports: int) -> int:
        return 1 + baselines_count + exports + (baselines_count + exports) * len(splits)

    started_steps = [0]

    def begin(message: str) -> None:
        """Log a step and count the one before it as done."""
        log(message)
        if progress is not None:
            if started_steps[0]:
                progress.advance(detail=message)
            else:
                progress.detail = message
            started_steps[0] += 1

    if progress is not None:
        progress.start(planned(len(settings.targets) * lines_count))
    begin("scoring (resumes a matching run)")
    selection = UnitSelection(min_params=settings.min_params)
    arguments = dict(spec=spec, steps=steps, out=out_dir / "score", settings=score_settings, selection=selection, runtime=runtime,
                     context_options=ContextOptions(columns=settings.evaluation.columns, windows=settings.evaluation.windows, zscore=settings.evaluation.zscore))
    try:
        table: ScoreRun = score(model, contexts, **arguments)
    except InputError:  # the folder's run is for other settings; it belongs to this frontier, so replace it
        table = score(model, contexts, resume=False, **arguments)
    spec_path = table.spec_file
    sweep_s = table.timings_s["sweep"]
    candidates: list[Candidate] = []
    done = _Progress(out_dir / PROGRESS, {"score": table.fingerprint, "model": table.model.sha256, "settings": asdict(settings), "runtime": repr(runtime),
                                          "splits": [(name, _digest(c), _digest(t)) for name, c, t in splits], "code": checkpoints.code_hash()})

    if done.changed:
        words = {"score": "score run", "model": "model", "settings": "settings", "runtime": "runtime", "splits": "contexts or truth", "code": "tqsdeploy code"}
        notice(f"the earlier work in {out_dir} was for another {', '.join(words.get(k, k) for k in done.changed)}: it is done again")
    planner = Planner(out_dir / "score", model, settings.export, runtime, resumable=True)
    for bits in settings.bits:
        tier = tier_for_bits(bits, settings.symmetric_baselines)
        for method in settings.baselines:
            key = f"export {LABELS[method]} W{bits}"
            if (kept := done.candidate(key)) is not None:
                begin(f"baseline {LABELS[method]} W{bits}: kept from an earlier run")
                candidates.append(kept)
                continue
            begin(f"baseline {LABELS[method]} W{bits}")
            started = time.perf_counter()
            path = models_dir / f"{model.stem}.{method}-w{bits}.onnx"
            try:
                outcome = planner.export(None, path, uniform_tier=tier.name, rounding=method)
            except TqsError as exc:
                candidates.append(Candidate("baseline", LABELS[method], f"W{bits}", None, None, None, None, {}, f"failed: {exc}"))
                continue
            timings = {"sweep": 0.0, "export": time.perf_counter() - started}
            candidates.append(Candidate("baseline", LABELS[method], f"W{bits}", None, path, outcome.compression, outcome.file_bytes, timings, details={"drift_pct": outcome.drift_pct}))
            done.put_candidate(key, candidates[-1], outcome.files)

    lines = [(TQS_LABEL, planner)] + [(label, Planner(out_dir / "score", model, variant, runtime, resumable=True)) for label, variant in settings.variants]
    targets = _targets(settings, [c for c in candidates if c.family == "baseline"])
    if progress is not None:
        progress.start(planned(len(targets) * lines_count), progress.done)
    for label, line in lines:
        for target, setting in targets:
            if not line.reachable(target):
                candidates.append(Candidate("tqs", label, setting, target, None, None, None, {}, f"infeasible: largest reachable C is {reachable_label(line.max_compression())}"))
                continue
            key = f"export {label} {setting}"
            if (kept := done.candidate(key)) is not None:
                begin(f"export {label} {setting}: kept from an earlier run")
                candidates.append(kept)
                continue
            begin(f"export {label} {setting}")
            started = time.perf_counter()
            path = models_dir / f"{model.stem}.{label.replace(' ', '_')}.{setting}.onnx"
            outcome = line.export(target, path)
            timings = {"sweep": sweep_s, "export": time.perf_counter() - started}  # the first export also prices every slot once
            details = {"shipped": outcome.shipped, "drift_pct": outcome.drift_pct, "compared": outcome.compared, "tiers": dict(zip(outcome.table["slot"], outcome.table["tier"]))}
            candidates.append(Candidate("tqs", label, setting, target, path, outcome.compression, outcome.file_bytes, timings, details=details))
            done.put_candidate(key, candidates[-1], outcome.files)
    planner.discard_checkpoints()  # every export is written: no calibration pass is left to resume
    for _, line in lines:
        line.close()

    if progress is not None:  # failed and infeasible candidates are not evaluated
        progress.start(progress.done + 1 + sum(c.path is not None for c in candidates) * len(splits), progress.done)
    rows: list[dict] = []
    modes: dict[str, None] = {}
    """How ONNX Runtime ran the candidates, as eval says it (a fixed 'MatMulNBits, accuracy_level 4' once stood
    here for models it folded to float weights at load, Conv models included)."""
    for candidate in candidates:
        for split, split_contexts, split_truth in splits:
            if candidate.path is None:
                rows.extend(_rows(candidate, split, None))
                continue
            key = f"eval {candidate.method} {candidate.setting} {split}"
            kept = done.entries.get(key)
            kept = kept if kept is not None and kept.get("stamp") == _stamp(candidate.path) else None  # the file it evaluated, not one made since
            begin(f"eval {candidate.method} {candidate.setting} on {split}" + (": kept from an earlier run" if kept else ""))
            started = time.perf_counter()
            try:
                if kept is not None:
                    report, seconds = kept["report"], kept["seconds"]
                    if report is None:
                        raise TqsError(kept["error"])
                else:
                    timing = settings.evaluation if split == splits[0][0] else replace(settings.evaluation, latency=None)  # timed once, on the first split
                    report = evaluate(candidate.path, model, split_contexts, spec=spec_path, truth=split_truth, settings=timing)
                    seconds = time.perf_counter() - started
                    done.put(key, {"report": report, "seconds": seconds, "stamp": _stamp(candidate.path)})
            except TqsError as exc:
                if kept is None:
                    done.put(key, {"report": None, "error": str(exc), "seconds": time.perf_counter() - started, "stamp": _stamp(candidate.path)})
                candidate.status = f"eval failed: {exc}"
                rows.extend(_rows(candidate, split, None))
                continue
            candidate.timings["eval"] = candidate.timings.get("eval", 0.0) + seconds
            modes[report["runtime"]["mode"]] = None
            if any(not math.isfinite(o.get("degradation_pct", 0.0)) for o in report["outputs"].values()):
                candidate.status = "non-finite outputs"
            rows.extend(_rows(candidate, split, report))
    if progress is not None:
        progress.advance(detail="writing")
    for row in rows:  # eval time is known only once every split ran
        match = next(c for c in candidates if c.method == row["method"] and c.setting == row["setting"])
        row["eval_s"] = match.timings.get("eval")
        for key in ("sweep", "export"):
            row.setdefault(f"{key}_s", match.timings.get(key))
    frame = pl.DataFrame(rows, infer_schema_length=None)
    write_table(frame, out_dir / "frontier.parquet")
    write_table(frame, out_dir / "frontier.csv")
    write_json(
        out_dir / "frontier.json",
        {
            "model": str(model),
            "score_run": str(out_dir / "score"),
            "tqs_settings": asdict(settings.export),
            "splits": [s for s, _, _ in splits],
            "candidates": [{k: v for k, v in asdict(c).items() if k != "path"} | {"path": str(c.path) if c.path else None} for c in candidates],
            "runtime": "; ".join(modes) or "ONNX Runtime " + ("exact dequantization" if settings.evaluation.exact else "default session options"),
        },
    )
    return frame
