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

import math
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
from tqsdeploy.evaluation.ledger import PROGRESS, Ledger, digest, stamp
from tqsdeploy.evaluation.plan import FrontierSteps, StepPlan, expect_points, expect_start, model_shape
from tqsdeploy.evaluation.points import Candidate, mark_budget, rows
from tqsdeploy.evaluation.report import build_report
from tqsdeploy.export import CacheOptions, ExportSettings, Planner
from tqsdeploy.files import write_json, write_table
from tqsdeploy.scoring.gamma import ScoreSettings
from tqsdeploy.scoring.prepare import ContextOptions
from tqsdeploy.scoring.runs import ScoreRun
from tqsdeploy.scoring.score import score
from tqsdeploy.size import reachable_label
from tqsdeploy.units import UnitSelection

MATCH_DIGITS = 6
"""A TQS target at a grid point is the baseline's compression cut at this decimal: the same size within a few bits,
so the export may still ship that uniform model where nothing it builds drifts less
(docs/design-notes/evaluation.md)."""

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


@dataclass(frozen=True)
class FrontierRequest:
    """One frontier: the model and its contexts, the folder it writes, and how it runs (what `frontier` parses)."""

    model: Path
    contexts: Path
    out_dir: Path
    spec: Path | None = None
    steps: int | None = None
    truth: Path | None = None
    eval_contexts: Path | None = None
    """Held-out contexts: evaluated first, and what the report leads with."""
    eval_truth: Path | None = None
    settings: FrontierSettings = FrontierSettings()
    score_settings: ScoreSettings = ScoreSettings()
    runtime: Runtime = DEFAULT_RUNTIME
    force: bool = False
    """Write into a folder of other files (`_check_folder`)."""
    buckets: tuple[tuple[str, str], ...] = ()
    """The report's role buckets as (role, regex on unit names); none: from the graph structure."""
    budget: tuple[float, str] | None = None
    """`--budget PCT`: (percent, 'upper' or 'point'): mark the points whose drift on the first split (held-out when
    given) stays within it, and the most compressed of them (`points.mark_budget`); not part of the ledger's key."""


@dataclass(frozen=True)
class FrontierResult:
    frame: pl.DataFrame
    """frontier.parquet's rows."""
    report: Path
    page: Path
    """report.md and report.html."""


def _quiet(message: str) -> None:
    pass


def run_frontier(
    request: FrontierRequest,
    *,
    log: Callable[[str], None] = _quiet,
    notice: Callable[[str], None] = _quiet,
    progress=None,
) -> FrontierResult:
    """Build every candidate, evaluate it, write frontier.parquet/csv/json, then the report.

    `progress` (a `tqsdeploy.progress.Progress`) counts the steps: the score, each baseline, export and evaluation;
    `notice` says that earlier work in the folder was for something else and is done again."""
    request = replace(request, model=Path(request.model), out_dir=Path(request.out_dir))
    settings, out_dir = request.settings, request.out_dir
    _check_folder(out_dir, request.force)
    splits, checks = _splits(request)
    (out_dir / "models").mkdir(parents=True, exist_ok=True)
    (out_dir / PROGRESS).touch()  # first of all: it marks the folder as this frontier's, however early interrupted
    steps = FrontierSteps(log, progress, StepPlan(rollout_s=checks[-1] / 3, check_s=sum(checks) / len(checks)))
    shape = model_shape(request.model, settings.min_params, settings.export.split_fraction)
    names = [name for name, _, _ in splits]
    expect_start(steps, settings, request.score_settings, shape, names)
    steps.begin("score", "scoring (resumes a matching run)")
    table = _score(request)
    sweep_s = table.timings_s["sweep"]
    ledger = _ledger(request, table, splits, notice)
    exports = _Exports(request)
    try:
        candidates = _baselines(request, exports, ledger, steps)
        exports.open_variants()
        targets = _targets(settings, [c for c in candidates if c.family == "baseline"])
        guessed = [(None, f"C?@W{bits}") for bits in settings.bits]
        expect_points(steps, settings, shape, targets, names, guessed)
        steps.show()
        candidates += _tqs_points(request, exports, targets, sweep_s, ledger, steps)
        exports.finished()
    finally:
        exports.close()
    frame_rows, modes = _evaluations(request, candidates, splits, table.spec_file, ledger, steps)
    steps.begin("write", "writing")
    frame = _write(request, candidates, frame_rows, splits, modes)
    report, page = build_report(out_dir, request.model, dict(request.buckets) or None)
    steps.done()
    if steps.kept:  # said once: off a terminal the steps' own lines are few
        notice(f"{steps.kept} of {steps.started} steps kept from an earlier run ({PROGRESS}): only the others ran")
    return FrontierResult(frame, report, page)


def _splits(request: FrontierRequest) -> tuple[list[tuple[str, Path, Path | None]], list[float]]:
    """(name, contexts, truth) of every split, held-out first; each checked by evaluating the reference against
    itself, so contexts, truth and spec fail before any work; and the seconds each check took (what the ETA
    starts from)."""
    if request.eval_truth is not None and request.eval_contexts is None:
        raise InputError("--eval-truth is the truth of --eval-contexts, which is missing")
    held_out = [("held-out", request.eval_contexts, request.eval_truth)] if request.eval_contexts else []
    splits = held_out + [("scoring", request.contexts, request.truth)]
    untimed = replace(request.settings.evaluation, latency=None)
    seconds = []
    for _, contexts, truth in splits:
        started = time.perf_counter()
        evaluate(
            request.model,
            request.model,
            contexts,
            spec=request.spec,
            steps=request.steps,
            truth=truth,
            settings=untimed,
        )
        seconds.append(time.perf_counter() - started)
    return splits, seconds


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
        raise InputError(
            f"{out_dir} is not a frontier's folder and not empty (it holds {shown})",
            hint="choose a new or empty folder with --out, or pass --force to write over files of the same names",
        )


def _score(request: FrontierRequest) -> ScoreRun:
    """The frontier's score run in its folder: resumed when it matches, else made again (it is this frontier's)."""
    evaluation = request.settings.evaluation
    options = ContextOptions(columns=evaluation.columns, windows=evaluation.windows, zscore=evaluation.zscore)
    arguments = dict(
        spec=request.spec,
        steps=request.steps,
        out=request.out_dir / "score",
        settings=request.score_settings,
        selection=UnitSelection(min_params=request.settings.min_params),
        runtime=request.runtime,
        context_options=options,
    )
    try:
        return score(request.model, request.contexts, **arguments)
    except InputError:  # the folder's run is for other settings; it belongs to this frontier, so replace it
        return score(request.model, request.contexts, resume=False, **arguments)


def _ledger(request: FrontierRequest, table: ScoreRun, splits, notice: Callable[[str], None]) -> Ledger:
    """The folder's ledger, keyed by everything the work depends on; `notice` says what changed since earlier work
    (which is then done again)."""
    identity = {
        "score": table.fingerprint,
        "model": table.model.sha256,
        "settings": asdict(request.settings),
        "runtime": repr(request.runtime),
        "splits": [(name, digest(c), digest(t)) for name, c, t in splits],
        "code": checkpoints.code_hash(),
    }
    ledger = Ledger(request.out_dir / PROGRESS, identity)
    if ledger.changed:
        words = {
            "score": "score run",
            "model": "model",
            "settings": "settings",
            "runtime": "runtime",
            "splits": "contexts or truth",
            "code": "tqsdeploy code",
        }
        changed = ", ".join(words.get(k, k) for k in ledger.changed)
        notice(f"the earlier work in {request.out_dir} was for another {changed}: it is done again")
    return ledger


class _Exports:
    """Every call the frontier makes to the export planner, so that a change of its API changes this class alone:
    one `Planner` per TQS-PTQ line, the first also exporting the uniform baselines (they share its calibration and
    caches)."""

    def __init__(self, request: FrontierRequest):
        self.request = request
        self.lines = [(TQS_LABEL, self._planner(request.settings.export))]

    def _planner(self, settings: ExportSettings) -> Planner:
        request = self.request
        return Planner(request.out_dir / "score", request.model, settings, request.runtime, cache=CacheOptions())

    def open_variants(self) -> None:
        self.lines += [(label, self._planner(variant)) for label, variant in self.request.settings.variants]

    def baseline(self, method: str, bits: int, tier: str, path: Path) -> tuple[Candidate, list]:
        """A uniform model at `bits` (tier `tier`) rounded by `method`, and the files it wrote."""
        started = time.perf_counter()
        outcome = self.lines[0][1].export(None, path, uniform_tier=tier, rounding=method)
        timings = {"sweep": 0.0, "export": time.perf_counter() - started}
        candidate = Candidate(
            "baseline",
            LABELS[method],
            f"W{bits}",
            None,
            path,
            outcome.compression,
            outcome.file_bytes,
            timings,
            details={"drift_pct": outcome.drift_pct},
        )
        return candidate, outcome.files

    def unreachable(self, line: int, target: float) -> str | None:
        """Why line `line` cannot reach `target`, or None where it can."""
        planner = self.lines[line][1]
        if planner.reachable(target):
            return None
        return f"infeasible: largest reachable C is {reachable_label(planner.max_compression())}"

    def point(self, line: int, target: float, setting: str, path: Path, sweep_s: float) -> tuple[Candidate, list]:
        """Line `line`'s model at `target`, and the files it wrote."""
        label, planner = self.lines[line]
        started = time.perf_counter()
        outcome = planner.export(target, path)
        timings = {"sweep": sweep_s, "export": time.perf_counter() - started}  # the first also prices every slot once
        details = {
            "shipped": outcome.shipped,
            "drift_pct": outcome.drift_pct,
            "compared": outcome.compared,
            "tiers": dict(zip(outcome.table["slot"], outcome.table["tier"])),
        }
        candidate = Candidate(
            "tqs", label, setting, target, path, outcome.compression, outcome.file_bytes, timings, details=details
        )
        return candidate, outcome.files

    def finished(self) -> None:
        for _, planner in self.lines:  # every export is written; the run's cache stays for a later frontier or export
            planner.finished()

    def close(self) -> None:
        for _, planner in self.lines:
            planner.close()


def _kept(ledger: Ledger, key: str) -> Candidate | None:
    """A candidate an earlier run exported, if its files are still the ones it wrote."""
    fields = ledger.export(key)
    if fields is None:
        return None
    fields["path"] = Path(fields["path"]) if fields["path"] else None
    return Candidate(**fields)


def _record(ledger: Ledger, key: str, candidate: Candidate, files) -> None:
    ledger.put_export(key, asdict(candidate) | {"path": str(candidate.path) if candidate.path else None}, files)


def _baselines(request: FrontierRequest, exports: _Exports, ledger: Ledger, steps: FrontierSteps) -> list[Candidate]:
    """Every uniform baseline: each bit width by each rounding method (a failed one is a row that says why)."""
    candidates = []
    for bits in request.settings.bits:
        tier = tier_for_bits(bits, request.settings.symmetric_baselines)
        for method in request.settings.baselines:
            name = f"{LABELS[method]} W{bits}"
            if (kept := _kept(ledger, f"export {name}")) is not None:
                steps.begin(f"export {name}", f"baseline {name}: kept from an earlier run", kept=True)
                candidates.append(kept)
                continue
            steps.begin(f"export {name}", f"baseline {name}")
            path = request.out_dir / "models" / f"{request.model.stem}.{method}-w{bits}.onnx"
            try:
                candidate, files = exports.baseline(method, bits, tier.name, path)
            except TqsError as exc:
                failed = Candidate("baseline", LABELS[method], f"W{bits}", None, None, None, None, {}, f"failed: {exc}")
                candidates.append(failed)
                continue
            candidates.append(candidate)
            _record(ledger, f"export {name}", candidate, files)
    return candidates


def _targets(settings: FrontierSettings, baselines: list[Candidate]) -> list[tuple[float, str]]:
    """Requested compressions plus one just below every baseline's (a matched point)."""
    targets = [(float(t), f"C{t:g}") for t in settings.targets]
    for candidate in baselines:
        if candidate.compression:
            matched = math.floor(candidate.compression * 10**MATCH_DIGITS) / 10**MATCH_DIGITS
            if matched < 1:  # a baseline no smaller than the original (a tiny model's scales and nodes): no match
                continue
            if not any(abs(math.log(matched / t)) < 0.005 for t, _ in targets):
                targets.append((matched, f"C{matched:.3g}@{candidate.setting}"))
    return sorted(targets)


def _tqs_points(
    request: FrontierRequest, exports: _Exports, targets, sweep_s: float, ledger: Ledger, steps: FrontierSteps
) -> list[Candidate]:
    """Every TQS-PTQ line at every target (an unreachable one is a row that says so)."""
    candidates = []
    for line, (label, _) in enumerate(exports.lines):
        for target, setting in targets:
            key = f"export {label} {setting}"
            if (why := exports.unreachable(line, target)) is not None:
                candidates.append(Candidate("tqs", label, setting, target, None, None, None, {}, why))
                steps.drop(key)
                continue
            if (kept := _kept(ledger, key)) is not None:
                steps.begin(key, f"{key}: kept from an earlier run", kept=True)
                candidates.append(kept)
                continue
            steps.begin(key, key)
            path = request.out_dir / "models" / f"{request.model.stem}.{label.replace(' ', '_')}.{setting}.onnx"
            candidate, files = exports.point(line, target, setting, path, sweep_s)
            candidates.append(candidate)
            _record(ledger, key, candidate, files)
    return candidates


def _evaluations(
    request: FrontierRequest, candidates: list[Candidate], splits, spec: Path, ledger: Ledger, steps: FrontierSteps
) -> tuple[list[dict], dict[str, None]]:
    """Every exported candidate evaluated on every split: the table's rows, and how ONNX Runtime ran the
    candidates, as eval says it (the models' layouts decide it, so it is read off the reports)."""
    frame_rows: list[dict] = []
    modes: dict[str, None] = {}
    references: dict = {}
    for candidate in candidates:
        for split in splits:
            if candidate.path is None:
                steps.drop(f"eval {candidate.method} {candidate.setting} {split[0]}")
                frame_rows.extend(rows(candidate, split[0], None))
                continue
            try:
                report, seconds = _evaluated(
                    request, candidate, split, split is splits[0], spec, ledger, steps, references
                )
            except TqsError as exc:
                candidate.status = f"eval failed: {exc}"
                frame_rows.extend(rows(candidate, split[0], None))
                continue
            candidate.timings["eval"] = candidate.timings.get("eval", 0.0) + seconds
            modes[report["runtime"]["mode"]] = None
            if any(not math.isfinite(o.get("degradation_pct", 0.0)) for o in report["outputs"].values()):
                candidate.status = "non-finite outputs"
            frame_rows.extend(rows(candidate, split[0], report))
    return frame_rows, modes


def _evaluated(
    request: FrontierRequest,
    candidate: Candidate,
    split,
    first: bool,
    spec: Path,
    ledger: Ledger,
    steps: FrontierSteps,
    references: dict,
) -> tuple[dict, float]:
    """A candidate's report on one split and the seconds it took, from the ledger where this file was evaluated
    before; a failed evaluation raises its error (again, when the ledger holds it). `references`: the original's
    trajectories, rolled out once per split for every candidate."""
    name, contexts, truth = split
    key = f"eval {candidate.method} {candidate.setting} {name}"
    kept = ledger.evaluation(key, candidate.path)
    message = f"eval {candidate.method} {candidate.setting} on {name}" + (": kept from an earlier run" if kept else "")
    steps.begin(key, message, kept=kept is not None)
    if kept is not None:
        if kept["report"] is None:
            raise TqsError(kept["error"])
        return kept["report"], kept["seconds"]
    started = time.perf_counter()
    settings = request.settings.evaluation  # latency timed once, on the first split
    settings = settings if first else replace(settings, latency=None)
    try:
        report = evaluate(
            candidate.path, request.model, contexts, spec=spec, truth=truth, settings=settings, references=references
        )
    except TqsError as exc:
        seconds = time.perf_counter() - started
        ledger.put(key, {"report": None, "error": str(exc), "seconds": seconds, "stamp": stamp(candidate.path)})
        raise
    seconds = time.perf_counter() - started
    ledger.put(key, {"report": report, "seconds": seconds, "stamp": stamp(candidate.path)})
    return report, seconds


def _write(
    request: FrontierRequest, candidates: list[Candidate], frame_rows: list[dict], splits, modes: dict[str, None]
) -> pl.DataFrame:
    """frontier.parquet, frontier.csv and frontier.json; each row gets its candidate's times, known only now."""
    for row in frame_rows:
        match = next(c for c in candidates if c.method == row["method"] and c.setting == row["setting"])
        row["eval_s"] = match.timings.get("eval")
        for key in ("sweep", "export"):
            row.setdefault(f"{key}_s", match.timings.get(key))
    budget = mark_budget(frame_rows, splits[0][0], request.budget)
    frame = pl.DataFrame(frame_rows, infer_schema_length=None)
    out_dir, settings = request.out_dir, request.settings
    write_table(frame, out_dir / "frontier.parquet")
    write_table(frame, out_dir / "frontier.csv")
    exact = "exact dequantization" if settings.evaluation.exact else "default session options"
    write_json(
        out_dir / "frontier.json",
        {
            "model": str(request.model),
            "score_run": str(out_dir / "score"),
            "tqs_settings": asdict(settings.export),
            "splits": [s for s, _, _ in splits],
            "candidates": [
                {k: v for k, v in asdict(c).items() if k != "path"} | {"path": str(c.path) if c.path else None}
                for c in candidates
            ],
            "runtime": "; ".join(modes) or "ONNX Runtime " + exact,
            "budget": budget,
        },
    )
    return frame
