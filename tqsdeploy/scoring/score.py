"""`score`: the TQS sensitivity sweep end to end, into the run folder it fills (`tqsdeploy.scoring.runs`).

The steps: `prepare` makes the sweep ready (model, units, sessions, rollout,
contexts); an interrupted run with the same fingerprint is resumed, any other
run in the folder is refused or replaced (`replacement`); the sweep runs locally,
on worker processes or on Ray; the scores and run.json are written as they finish.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import polars as pl

from tqsdeploy.errors import InputError
from tqsdeploy.files import claim_run_folder, write_json, write_npz, write_table, write_text
from tqsdeploy.scoring.gamma import ScoreSettings, score_frame, spearman
from tqsdeploy.scoring.prepare import Prepared, SessionOptions, prepare
from tqsdeploy.scoring.replacement import Replacement, holds_nothing
from tqsdeploy.scoring.request import ScoreProgress, ScoreRequest
from tqsdeploy.scoring.runs import RUN_FORMAT, ScoreRun, current_versions, default_run_dir, read_record, run_fingerprint
from tqsdeploy.sweep import (
    ResultLog,
    SweepRunner,
    SweepSettings,
    Task,
    TaskResult,
    plan_tasks,
    run_local,
    run_parallel,
    run_ray,
    stale_units,
    usable_cores,
)
from tqsdeploy.sweep.executors import check_ray_address
from tqsdeploy.sweep.settings import check_strategy

__all__ = ["ScoreProgress", "ScoreRequest", "ScoreSettings", "run_score", "score"]

SWEEP_KEYWORDS = ("strategy", "workers", "ray_address", "lanes")
"""`score`'s keywords that are `SweepSettings` fields."""
PROGRESS_KEYWORDS = ("on_start", "on_result", "on_estimate")
"""`score`'s keywords that are `ScoreProgress` fields."""
SESSION_PATTERNS = ("session-*.onnx*", "overridable-*.onnx", "fed-*.onnx", "graph-*.onnx", "weights-*.onnx*")
"""Session files a run folder may hold (graph-*, weights-*: what older versions made)."""


def score(
    model: str | Path, contexts=None, *, spec=None, steps: int | None = None, out: str | Path | None = None, **options
) -> ScoreRun:
    """Run the TQS sweep on an ONNX model and return the ranked score table: the keyword form of a `ScoreRequest`.

    The other keywords are the request's (`settings`, `selection`, `context_options`, `runtime`, `resume`), its
    `SweepSettings`' (`strategy`, `workers`, `ray_address`, `lanes`) and `ScoreProgress`' (`on_start`,
    `on_result`, `on_estimate`); see those classes for what each means.
    """
    sweep = SweepSettings(**{key: options.pop(key) for key in SWEEP_KEYWORDS if key in options})
    progress = ScoreProgress(**{key: options.pop(key) for key in PROGRESS_KEYWORDS if key in options})
    return run_score(ScoreRequest(model, contexts, spec, steps, out, sweep=sweep, **options), progress)


def run_score(request: ScoreRequest, progress: ScoreProgress = ScoreProgress()) -> ScoreRun:
    """Run the score `request` asks for in its run folder, claimed while it runs; what the CLI's `score` calls."""
    started = time.perf_counter()
    _check_machine(request.sweep)
    run_dir = Path(request.out) if request.out else default_run_dir(request.model)
    with claim_run_folder(run_dir):
        prepared = prepare(request, SessionOptions(workdir=run_dir, stream=True))
        return _score(run_dir, request, prepared, progress, started)


def _check_machine(sweep: SweepSettings) -> None:
    """What the sweep asks of the machine, checked before the model loads and the nominal rollout runs."""
    if sweep.ray_address is not None:
        check_ray_address(None if sweep.ray_address == "local" else sweep.ray_address)
    if (sweep.processes(usable_cores()) > 1 or sweep.ray_address is not None) and sweep.lanes not in (None, 1):
        raise InputError(
            "--lanes runs tasks side by side in this process; with --workers or --ray each worker runs one at a time",
            hint="pass one of them",
        )


@dataclass
class _Folder:
    """What the run folder holds for this score: its record, this run's fingerprint when it was needed to decide,
    whether the record is this run's (to resume), and whether the score starts afresh."""

    existing: dict | None
    fingerprint: str | None
    matches: bool
    fresh: bool


@dataclass
class _Tasks:
    """The sweep's tasks: all of them, those left to run, the results kept from an interrupted run (and the units
    measured again because an older version probed them otherwise), and the log results are appended to."""

    log: ResultLog
    done: dict[str, TaskResult]
    remeasured: set[str]
    planned: list[Task]
    pending: list[Task]


def _score(
    run_dir: Path, request: ScoreRequest, prepared: Prepared, progress: ScoreProgress, started: float
) -> ScoreRun:
    """`run_score` inside its claimed run folder, its sweep prepared."""
    folder = _read_folder(run_dir, prepared, request)
    if folder.fresh:
        _remove_stale_sessions(run_dir, prepared)
    with Replacement(run_dir, folder.fresh) as replacing:
        tasks = _plan(run_dir, prepared, request.settings, folder)
        write_text(run_dir / "rollout.toml", prepared.spec.to_toml())
        write_npz(run_dir / "contexts.npz", prepared.contexts.arrays)
        if prepared.held_out is not None:
            write_npz(run_dir / "validation.npz", prepared.held_out.arrays)
        else:
            (run_dir / "validation.npz").unlink(missing_ok=True)  # an earlier score's held-out windows: not this one's
        runner = prepared.open_runner()
        prepared_s = time.perf_counter() - started  # with the nominal rollout when it ran alone
        nominal_on_lane = not runner.nominal_made  # made by the sweep's first lane, beside the first tasks
        meta = _record(prepared, request, runner, tasks, folder.fingerprint)
        if runner.cut_plan is not None:  # a cut's units one after another (stable: probes keep their order)
            position = {name: i for i, name in enumerate(runner.unit_order)}
            tasks.pending.sort(key=lambda t: position[t.unit])
        write_json(run_dir / "run.json", meta)
        _announce(progress, runner, tasks, prepared, request.sweep)

        def record(result: TaskResult) -> None:
            replacing.recorded()
            tasks.done[result.key] = result
            if progress.on_result:
                progress.on_result(result)

        sweep_started = time.perf_counter()
        meta.update(_run_tasks(prepared, runner, tasks, request.sweep.ray_address, record))
        sweep_seconds = time.perf_counter() - sweep_started
        if runner.fallbacks:
            meta["batch_fallbacks"] = runner.fallbacks  # units 'batch' ran probe by probe, and why
        frame = score_frame(
            prepared.units, tasks.done, runner.nominal.norm_sq, request.settings, prepared.spec.steps, prepared.job.rows
        )
        write_table(frame, run_dir / "scores.parquet")
        write_table(frame, run_dir / "scores.csv")
        meta.update(_outcome(frame, runner, request.settings))
        meta["timings_s"] = {
            "prepare": round(prepared_s, 4),
            "nominal_on_a_lane": nominal_on_lane,
            "sweep": round(sweep_seconds, 4),
            "resumed_tasks": len(tasks.planned) - len(tasks.pending),
            "total": round(time.perf_counter() - started, 4),
        }
        write_json(run_dir / "run.json", meta)
    return ScoreRun(frame=frame, run_dir=run_dir, meta=meta)


def _read_folder(run_dir: Path, prepared: Prepared, request: ScoreRequest) -> _Folder:
    """Decide between resuming the folder's run and replacing it, refusing what `request.resume` forbids."""
    Replacement.recover(run_dir)
    existing, resume = read_record(run_dir), request.resume
    # Only a folder that may be resumed needs the fingerprint before the sweep opens; a fresh run works it
    # out after `open_runner`, so the model's digest (a background thread) runs beside the session builds.
    needed = existing is not None and resume is not False
    fingerprint = run_fingerprint(prepared, request.settings, request.runtime) if needed else None
    matches = fingerprint is not None and existing.get("fingerprint") == fingerprint
    if existing is not None and not matches and resume is None and holds_nothing(run_dir, existing):
        resume = False  # a run that failed or stopped before its first result: nothing to keep, nothing to refuse for
    if existing is not None and not matches and resume is not False:
        unfinished = " (an unfinished one: interrupted, or it failed)" if existing.get("status") != "complete" else ""
        raise InputError(
            f"{run_dir} holds a score run{unfinished} with a different model, contexts or settings",
            hint="pass --fresh to replace it, or --out DIR for a new run",
        )
    if resume is True and not matches:
        raise InputError(f"nothing to resume in {run_dir}")
    return _Folder(existing, fingerprint, matches, fresh=resume is False or not matches)


def _remove_stale_sessions(run_dir: Path, prepared: Prepared) -> None:
    """A fresh run's folder keeps only the session file this sweep opens."""
    in_use = {prepared.session_file.name} if prepared.session_file else set()
    for pattern in SESSION_PATTERNS:
        for stale in run_dir.glob(pattern):
            if not any(stale.name.startswith(name) for name in in_use):
                stale.unlink()


def _plan(run_dir: Path, prepared: Prepared, settings: ScoreSettings, folder: _Folder) -> _Tasks:
    """The sweep's tasks, less those a resumed run finished (as this version probes them)."""
    log = ResultLog(run_dir / "sweep.jsonl")
    done = log.load() if folder.matches else {}
    remeasured = stale_units(prepared.job, done) if done else set()
    done = {key: r for key, r in done.items() if r.unit not in remeasured}
    if done and folder.existing.get("strategy"):
        check_strategy(folder.existing["strategy"])
        prepared.job.strategy = folder.existing["strategy"]  # finish the way it started
    planned = plan_tasks(prepared.units, settings.quant_probe, settings.gauss_draws)
    return _Tasks(log, done, remeasured, planned, [t for t in planned if t.key not in done])


def _record(
    prepared: Prepared, request: ScoreRequest, runner: SweepRunner, tasks: _Tasks, fingerprint: str | None
) -> dict:
    """run.json as the sweep starts: what is scored, how, and what the user should know."""
    meta = {
        "format": RUN_FORMAT,
        "status": "running",
        "fingerprint": fingerprint or run_fingerprint(prepared, request.settings, request.runtime),
        "model": {
            "path": str(prepared.model.path.resolve()),
            "sha256": prepared.model.sha256,
            "bytes": prepared.model.file_bytes,
        },
        "rollout": prepared.spec.to_dict(),
        "contexts": prepared.contexts.describe(),
        "validation": _held_out_record(prepared, request),
        "probe": asdict(request.settings),
        "selection": asdict(request.selection),
        "provider": request.runtime.provider,
        "units": len(prepared.units),
        "params": sum(u.params for u in prepared.units),
        "tasks": len(tasks.planned),
        "versions": current_versions(),
        "warnings": [*prepared.notes, *prepared.contexts.warnings],
    }
    if tasks.remeasured:
        remeasured = sorted(tasks.remeasured)
        meta["warnings"].append(
            f"{len(remeasured)} unit(s) finished in this folder were probed with other perturbations than this "
            f"version makes (an older tqsdeploy?): measured again "
            f"({', '.join(remeasured[:3])}{', ...' if len(remeasured) > 3 else ''})"
        )
    meta["strategy"] = runner.strategy
    meta["fed_session"] = prepared.fed_as
    if prepared.job.strategy not in ("auto", runner.strategy):
        meta["warnings"].append(
            f"strategy '{prepared.job.strategy}' ran as 'feed': it rebuilds the model in memory, and this one is "
            "swept from its file (weights in external data, or a file of 64 MiB or more), where only 'feed' and "
            "'prefix' run"
        )
    if runner.timings:
        meta["strategy_estimates_s"] = runner.timings
    if runner.cut_plan is not None:
        meta["prefix_cuts"] = [list(group) for group in runner.cut_plan.groups]  # units sharing one cut session
    return meta


def _held_out_record(prepared: Prepared, request: ScoreRequest) -> dict | None:
    """What run.json says of the held-out windows: their description, file, and (held out by index) which."""
    if prepared.held_out is None:
        return None
    record = prepared.held_out.describe() | {"file": "validation.npz"}
    return record | ({"held_out_windows": sorted(request.held_out)} if request.held_out else {})


def _announce(
    progress: ScoreProgress, runner: SweepRunner, tasks: _Tasks, prepared: Prepared, sweep: SweepSettings
) -> None:
    """Tell the caller how many tasks there are, and how long auto's timing says the sweep will take (when it
    timed the sweep on these lanes)."""
    if progress.on_start:
        progress.on_start(len(tasks.planned), len(tasks.planned) - len(tasks.pending))
    estimate = runner.timings.get(runner.strategy)
    if progress.on_estimate and estimate and tasks.pending and sweep.ray_address is None and prepared.workers == 1:
        # the share first: a whole sweep pending hands on the estimate exactly
        progress.on_estimate(estimate * (len(tasks.pending) / len(tasks.planned)))


def _run_tasks(prepared: Prepared, runner: SweepRunner, tasks: _Tasks, ray_address: str | None, record) -> dict:
    """Run the pending tasks on Ray, on worker processes or in this process; what run.json records of how."""
    pending = tasks.pending
    if ray_address is not None and pending:
        workers = max(1, min(prepared.workers, len(pending)))
        runner.close()
        address = None if ray_address == "local" else ray_address
        run_ray(prepared.job, pending, tasks.log, workers, runner.strategy, address, on_result=record)
        return {"workers": f"ray:{workers}"}
    if prepared.workers > 1 and len(pending) > 1:
        workers = min(prepared.workers, len(pending))
        runner.close()
        run_parallel(prepared.job, pending, tasks.log, workers, runner.strategy, on_result=record)
        return {"workers": workers}
    lanes = run_local(prepared.job, pending, tasks.log, on_result=record, runner=runner, lanes=prepared.lanes)
    runner.close()
    return {"workers": 1, "lanes": lanes, "threads_per_lane": prepared.threads}


def _outcome(frame: pl.DataFrame, runner: SweepRunner, settings: ScoreSettings) -> dict:
    """run.json's summary of a finished sweep (the timings apart)."""
    alive = frame.filter(~pl.col("dead"))
    both = settings.quant_probe and settings.gauss_draws
    return {
        "status": "complete",
        "nominal_norm_sq": runner.nominal.norm_sq,
        "batched_windows": runner.nominal.batched,
        "dead_units": int(frame["dead"].sum()),
        "spearman_quant_gauss": spearman(alive["gamma_quant"], alive["gamma_gauss"]) if both else None,
    }
