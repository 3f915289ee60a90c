"""`score`: the TQS sensitivity sweep end to end, into the run folder it fills (`tqsdeploy.scoring.runs`).

The steps: `prepare` makes the sweep ready (model, units, sessions, rollout,
contexts); an interrupted run with the same fingerprint is resumed, any other
run in the folder is refused or replaced; the sweep runs locally, on worker
processes or on Ray; the scores and run.json are written as they finish.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import polars as pl

from runtimes import DEFAULT_RUNTIME, Runtime
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.errors import InputError
from tqsdeploy.files import REPLACED, claim_run_folder, write_json, write_npz, write_table, write_text
from tqsdeploy.scoring.prepare import ContextOptions, prepare
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.scoring.runs import RUN_FILES, RUN_FORMAT, ScoreRun, current_versions, default_run_dir, read_record, run_fingerprint
from tqsdeploy.scoring.gamma import ScoreSettings, score_frame, spearman
from tqsdeploy.sweep.executors import check_ray_address
from tqsdeploy.sweep.strategies import strategy_names
from tqsdeploy.sweep import ResultLog, TaskResult, plan_tasks, run_local, run_parallel, run_ray, stale_units, usable_cores
from tqsdeploy.units import UnitSelection


def score(
    model: str | Path,
    contexts: str | Path | Contexts | None = None,
    *,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    out: str | Path | None = None,
    selection: UnitSelection = UnitSelection(),
    settings: ScoreSettings = ScoreSettings(),
    runtime: Runtime = DEFAULT_RUNTIME,
    context_options: ContextOptions = ContextOptions(),
    resume: bool | None = None,
    strategy: str = "auto",
    workers: int = 1,
    ray_address: str | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_result: Callable[[TaskResult], None] | None = None,
    lanes: int | None = None,
    on_estimate: Callable[[float], None] | None = None,
) -> ScoreRun:
    """Run the TQS sweep on an ONNX model and return the ranked score table.

    `resume=None` continues a matching interrupted run in `out` and refuses to
    overwrite a different one; `True` requires a match; `False` starts afresh.
    `on_start(total, done)` and `on_result(result)` report progress; `on_estimate(seconds)`, the sweep's
    estimated time when `auto` timed it, before any task ends (so a slow first rollout still shows an ETA).
    `workers` > 1 runs the sweep in that many processes (one session each);
    with `ray_address` ('local', 'auto' or a cluster address) on that many Ray actors.
    `lanes` runs that many tasks at once in this process (None: `sweep.sweep_lanes` decides).
    """
    started = time.perf_counter()
    if strategy not in strategy_names():  # now: a finished run in the folder would otherwise take its own and never read this one
        raise InputError(f"unknown strategy '{strategy}'; choose one of {', '.join(strategy_names())}")
    if ray_address is not None:
        check_ray_address(None if ray_address == "local" else ray_address)  # before the model loads and the nominal rollout runs
    cores = usable_cores()
    if ray_address is None:
        workers = min(workers, cores)  # more local processes than cores only adds contention
    if workers > 1 or ray_address is not None:
        if lanes not in (None, 1):
            raise InputError("--lanes runs tasks side by side in this process; with --workers or --ray each worker runs one at a time", hint="pass one of them")
        lanes = 1
    if workers > 1 and runtime.threads is None:
        runtime = runtime.with_threads(max(1, cores // workers))  # N workers x threads <= cores
    run_dir = Path(out) if out else default_run_dir(model)
    with claim_run_folder(run_dir):
        return _score(run_dir, model, contexts, spec, steps, selection, settings, runtime, context_options, resume, strategy, workers, ray_address, on_start, on_result, started, lanes,
                      on_estimate)


def _score(run_dir, model, contexts, spec, steps, selection, settings, runtime, context_options, resume, strategy, workers, ray_address, on_start, on_result, started, lanes,
           on_estimate) -> ScoreRun:
    """`score` inside its claimed run folder."""
    prepared = prepare(
        model, contexts, spec, steps, selection=selection, settings=settings, runtime=runtime, context_options=context_options, strategy=strategy,
        workdir=run_dir, stream=True, lanes=lanes,
    )
    meta_path = run_dir / "run.json"
    _Replacement.recover(run_dir)
    existing = read_record(run_dir)
    # Only a folder that may be resumed needs the fingerprint before the sweep opens; a fresh run works it
    # out after `open_runner`, so the model's digest (a background thread) runs beside the session builds.
    fingerprint = run_fingerprint(prepared, settings, runtime) if existing is not None and resume is not False else None
    matches = fingerprint is not None and existing.get("fingerprint") == fingerprint
    if existing is not None and not matches and resume is None and _holds_nothing(run_dir, existing):
        resume = False  # a run that failed or stopped before its first result: nothing to keep, nothing to refuse for
    if existing is not None and not matches and resume is not False:
        unfinished = " (an unfinished one: interrupted, or it failed)" if existing.get("status") != "complete" else ""
        raise InputError(
            f"{run_dir} holds a score run{unfinished} with a different model, contexts or settings",
            hint="pass --fresh to replace it, or --out DIR for a new run",
        )
    if resume is True and not matches:
        raise InputError(f"nothing to resume in {run_dir}")
    fresh = resume is False or not matches
    if fresh:
        in_use = {prepared.session_file.name} if prepared.session_file else set()
        for pattern in ("session-*.onnx*", "overridable-*.onnx", "fed-*.onnx", "graph-*.onnx", "weights-*.onnx*"):  # graph-*, weights-*: what older versions made
            for stale in run_dir.glob(pattern):
                if not any(stale.name.startswith(name) for name in in_use):
                    stale.unlink()

    with _Replacement(run_dir, fresh) as replacing:
        log = ResultLog(run_dir / "sweep.jsonl")
        done = log.load() if matches else {}
        remeasured = stale_units(prepared.job, done) if done else set()
        done = {key: r for key, r in done.items() if r.unit not in remeasured}
        if done and existing.get("strategy"):
            prepared.job.strategy = existing["strategy"]  # finish the way it started
        tasks = plan_tasks(prepared.units, settings.quant_probe, settings.gauss_draws)
        pending = [t for t in tasks if t.key not in done]
        write_text(run_dir / "rollout.toml", prepared.spec.to_toml())
        write_npz(run_dir / "contexts.npz", prepared.contexts.arrays)

        runner = prepared.open_runner()
        prepared_s = time.perf_counter() - started  # with the nominal rollout when it ran alone
        nominal_on_lane = not runner.nominal_made  # made by the sweep's first lane, beside the first tasks
        meta = {
            "format": RUN_FORMAT,
            "status": "running",
            "fingerprint": fingerprint or run_fingerprint(prepared, settings, runtime),
            "model": {"path": str(prepared.model.path.resolve()), "sha256": prepared.model.sha256, "bytes": prepared.model.file_bytes},
            "rollout": prepared.spec.to_dict(),
            "contexts": prepared.contexts.describe(),
            "probe": asdict(settings),
            "selection": asdict(selection),
            "provider": runtime.provider,
            "units": len(prepared.units),
            "params": sum(u.params for u in prepared.units),
            "tasks": len(tasks),
            "versions": current_versions(),
            "warnings": [*prepared.notes, *prepared.contexts.warnings],
        }
        if remeasured:
            meta["warnings"].append(
                f"{len(remeasured)} unit(s) finished in this folder were probed with other perturbations than this version makes "
                f"(an older tqsdeploy?): measured again ({', '.join(sorted(remeasured)[:3])}{', ...' if len(remeasured) > 3 else ''})"
            )
        meta["strategy"] = runner.strategy
        meta["fed_session"] = prepared.fed_as
        if prepared.job.strategy not in ("auto", runner.strategy):
            meta["warnings"].append(
                f"strategy '{prepared.job.strategy}' ran as 'feed': it rebuilds the model in memory, and this one is swept from its "
                "file (weights in external data, or a file of 64 MiB or more), where only 'feed' and 'prefix' run"
            )
        if runner.timings:
            meta["strategy_estimates_s"] = runner.timings
        if runner.cut_plan is not None:
            meta["prefix_cuts"] = [list(group) for group in runner.cut_plan.groups]  # units sharing one cut session
            position = {name: i for i, name in enumerate(runner.unit_order)}
            pending.sort(key=lambda t: position[t.unit])  # a cut's units one after another (stable: probes keep their order)
        write_json(meta_path, meta)
        if on_start:
            on_start(len(tasks), len(tasks) - len(pending))
        estimate = runner.timings.get(runner.strategy)
        if on_estimate and estimate and pending and ray_address is None and workers == 1:  # auto timed the sweep on these lanes
            on_estimate(estimate * (len(pending) / len(tasks)))  # the share first: a whole sweep pending hands on the estimate exactly
        sweep_started = time.perf_counter()
        record = lambda r: (replacing.recorded(), done.__setitem__(r.key, r), on_result and on_result(r))  # noqa: E731
        meta["workers"] = 1
        if ray_address is not None and pending:
            meta["workers"] = f"ray:{max(1, min(workers, len(pending)))}"
            runner.close()
            address = None if ray_address == "local" else ray_address
            run_ray(prepared.job, pending, log, max(1, min(workers, len(pending))), runner.strategy, address, on_result=record)
        elif workers > 1 and len(pending) > 1:
            meta["workers"] = min(workers, len(pending))
            runner.close()
            run_parallel(prepared.job, pending, log, min(workers, len(pending)), runner.strategy, on_result=record)
        else:
            meta["lanes"] = run_local(prepared.job, pending, log, on_result=record, runner=runner, lanes=prepared.lanes)
            meta["threads_per_lane"] = prepared.threads
            runner.close()
        sweep_seconds = time.perf_counter() - sweep_started
        if runner.fallbacks:
            meta["batch_fallbacks"] = runner.fallbacks  # units 'batch' ran probe by probe, and why

        frame = score_frame(prepared.units, done, runner.nominal.norm_sq, settings, prepared.spec.steps, prepared.job.rows)
        write_table(frame, run_dir / "scores.parquet")
        write_table(frame, run_dir / "scores.csv")
        alive = frame.filter(~pl.col("dead"))
        meta.update(
            {
                "status": "complete",
                "nominal_norm_sq": runner.nominal.norm_sq,
                "batched_windows": runner.nominal.batched,
                "dead_units": int(frame["dead"].sum()),
                "spearman_quant_gauss": spearman(alive["gamma_quant"], alive["gamma_gauss"]) if settings.quant_probe and settings.gauss_draws else None,
                "timings_s": {
                    "prepare": round(prepared_s, 4),
                    "nominal_on_a_lane": nominal_on_lane,
                    "sweep": round(sweep_seconds, 4),
                    "resumed_tasks": len(tasks) - len(pending),
                    "total": round(time.perf_counter() - started, 4),
                },
            }
        )
        write_json(meta_path, meta)
    return ScoreRun(frame=frame, run_dir=run_dir, meta=meta)


def _holds_nothing(run_dir: Path, existing: dict) -> bool:
    """An unfinished run without one finished task (it failed or was stopped before its first result)."""
    return existing.get("status") != "complete" and not ResultLog(run_dir / "sweep.jsonl").load()


class _Replacement:
    """A new run in a folder, taking the place of whatever run it held only once it has a result.

    On entry the previous run's files (`RUN_FILES`) move into `.replaced/`; a run that fails or is stopped
    before its first task result (a nominal rollout that gives NaN, a model that fails on the contexts,
    Ctrl-C) removes what it wrote and moves them back, so `--fresh` never costs a finished run for nothing
    and the corrected command finds the folder as it was. The first result discards them."""

    def __init__(self, run_dir: Path, fresh: bool):
        self.run_dir, self.fresh, self.aside = run_dir, fresh, run_dir / REPLACED
        self.settled = not fresh

    @staticmethod
    def recover(run_dir: Path) -> None:
        """After a process killed while it replaced a run (kill -9: no `__exit__`): the run set aside comes back
        unless the new one got a result."""
        shutil.rmtree(run_dir / f"{REPLACED}.tmp", ignore_errors=True)  # killed before the set was whole: the run is still in place
        aside = run_dir / REPLACED
        if not aside.is_dir():
            return
        replacing, new = _Replacement(run_dir, True), read_record(run_dir)
        if new is not None and not _holds_nothing(run_dir, new):
            replacing.recorded()
        else:
            replacing.restore()

    def __enter__(self) -> "_Replacement":
        if self.fresh:  # linked into a folder renamed whole, then unlinked: a kill at any point leaves one whole copy of the run
            gathering = self.run_dir / f"{REPLACED}.tmp"
            gathering.mkdir()
            present = [name for name in RUN_FILES if (self.run_dir / name).exists()]
            for name in present:
                try:
                    os.link(self.run_dir / name, gathering / name)
                except OSError:  # a file system without hard links
                    shutil.copy2(self.run_dir / name, gathering / name)
            gathering.rename(self.aside)
            for name in present:
                (self.run_dir / name).unlink()
            try:
                write_json(self.run_dir / "run.json", {"format": RUN_FORMAT, "status": "starting"})  # a run folder from now on, whatever kills this
            except BaseException:  # a full disk here: no `__exit__` follows, so the run set aside comes back now
                self.restore()
                raise
        return self

    def recorded(self) -> None:
        """A result of the new run is in: the previous run is gone for good."""
        if not self.settled:
            self.settled = True
            shutil.rmtree(self.aside, ignore_errors=True)

    def __exit__(self, kind, value, traceback) -> None:
        if self.settled:
            return
        if kind is None:
            self.recorded()
        else:
            self.restore()

    def restore(self) -> None:
        """The new run's files go, the set-aside run's come back."""
        self.settled = True
        for name in RUN_FILES:
            (self.run_dir / name).unlink(missing_ok=True)
        for kept in self.aside.iterdir():
            kept.replace(self.run_dir / kept.name)
        self.aside.rmdir()
