"""`score`: the TQS sensitivity sweep end to end, and the run folder it fills.

A run folder is self-sufficient: besides the scores it keeps the resolved
rollout spec and the contexts, so later steps (export, eval) need nothing
else. It is also the resume point: `run.json` carries a fingerprint of
everything that determines the results, and `sweep.jsonl` the finished tasks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import tempfile
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import polars as pl

import graph_ops
from runtimes import OrtRuntime, Session
from runtimes.derived import FED_OPTIMIZED, derived_feed, fed_as_fast  # noqa: F401  (FED_OPTIMIZED: the CLI's summary reads it here)
from runtimes.factories import RebuildFactory, StreamedCuts, open_fed
from tqsdeploy import __version__
from tqsdeploy.contexts import Contexts, load_contexts
from tqsdeploy.errors import InputError
from tqsdeploy.files import claim_run_folder, write_json, write_npz, write_table, write_text
from tqsdeploy.rollout import RolloutSpec, resolve_spec
from tqsdeploy.scoring import ScoreSettings, score_frame, spearman
from tqsdeploy.sweep import EarlyStop, Nominal, ResultLog, SweepJob, SweepRunner, TaskResult, plan_tasks, run_local, run_parallel, run_ray, sweep_lanes, usable_cores
from tqsdeploy.units import Unit, UnitSelection, check_finite, gather_rows, index_rows, select_units, selection_notes

RUN_FILES = ("run.json", "sweep.jsonl", "measured.jsonl", "scores.parquet", "scores.csv", "rollout.toml", "contexts.npz")


@dataclass(frozen=True)
class ContextOptions:
    """How to read contexts that are not an .npz of ready windows."""

    windows: int = 8
    zscore: bool = False
    random: bool = False
    seed: int = 0
    max_batch_windows: int = 64
    columns: tuple[str, ...] | None = None
    """CSV columns (series) to use; default every numeric column."""
    dims: tuple[tuple[str, int], ...] = ()
    """Sizes of named dynamic axes for random contexts, e.g. (("seq", 128),)."""


@dataclass
class ScoreTable:
    """The scores of one run, ranked, with the run's metadata."""

    frame: pl.DataFrame
    run_dir: Path
    meta: dict = field(default_factory=dict)

    def top(self, k: int = 5) -> pl.DataFrame:
        return self.frame.head(k)

    def bottom(self, k: int = 5) -> pl.DataFrame:
        return self.frame.tail(k)

    @property
    def complete(self) -> bool:
        return self.meta.get("status") == "complete"

    @classmethod
    def load(cls, run_dir: str | Path) -> "ScoreTable":
        run_dir = Path(run_dir)
        meta_path, scores = run_dir / "run.json", run_dir / "scores.parquet"
        if not meta_path.exists() or not scores.exists():
            raise InputError(f"{run_dir} is not a finished score run (no run.json / scores.parquet)")
        return cls(frame=pl.read_parquet(scores), run_dir=run_dir, meta=json.loads(meta_path.read_text()))


@dataclass
class Prepared:
    """A model made ready for a sweep: units, session factory, rollout, contexts."""

    model: graph_ops.LoadedModel
    units: list[Unit]
    spec: RolloutSpec
    contexts: Contexts
    job: SweepJob
    session: Session | None = None
    """The session opened to check the model, handed to the first runner so it is not built twice."""
    session_file: Path | None = None
    """The runtime's copy of a model too large to pass as bytes (external data beside it)."""
    data_dir: Path | None = None
    """Set when the model was loaded without its external data: the folder its data files are in."""
    lanes: int = 1
    """Tasks the sweep runs at once in this process (`sweep.run_lanes`); the sessions' threads are split for them."""
    threads: int | None = None
    """ONNX Runtime intra-op threads per session (None: its default, every core)."""
    fed_as: str = "weights as stored"
    """What the fed session is a graph of (`derived_feed`), for run.json."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the unit selection (`units.selection_notes`)."""

    def open_runner(self, nominal: "Nominal | None" = None) -> SweepRunner:
        """A runner of the sweep; `nominal`: the rollout an earlier runner of this job made (not made again)."""
        session, self.session = self.session, None
        return SweepRunner(self.job, session, nominal)


def _versions() -> dict:
    import onnx
    import onnxruntime

    return {
        "tqsdeploy": __version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "polars": pl.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }



def prepare(
    model: str | Path,
    contexts: str | Path | Contexts | None,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    *,
    selection: UnitSelection = UnitSelection(),
    settings: ScoreSettings = ScoreSettings(),
    runtime: OrtRuntime = OrtRuntime(),
    context_options: ContextOptions = ContextOptions(),
    strategy: str = "auto",
    workdir: Path | None = None,
    stream: bool = False,
    runtime_keeps_weights: bool = True,
    lanes: int | None = 1,
) -> Prepared:
    """Load and check everything a sweep needs; fails fast on bad input.

    Models whose session copy would pass protobuf's 2 GiB are handed to the
    runtime as a file with external data, written once into `workdir` (the run
    folder: reused by a resumed score and by export, removed with the run) or a
    temporary folder. With `stream`, a model that keeps its weights in
    external-data files is never copied: the session file holds only the graph
    (its tensors still point into the model's own data files, which the runtime
    reads), and the sweep reads each unit's weights from those files when it
    gets to the unit. The units are then overridable initializers the runtime
    loads once (`runtime_keeps_weights`: a run feeds only what it perturbs, as a
    score does), or plain inputs fed from the files on every run, so the runtime
    holds no copy of them (export, which runs candidate sessions beside this one).
    `lanes`: tasks run at once (`sweep.sweep_lanes`; None: as many as pay), the
    cores split between them when `runtime` leaves threads to ONNX Runtime.
    """
    runtime.check()
    loaded = graph_ops.load_model(model, load_external=not stream)  # large single files come as a skeleton
    runtime = runtime.for_model(loaded.proto)
    data_dir = loaded.path.parent.resolve() if stream and graph_ops.io.has_external_data(loaded.proto) else None
    streamed = data_dir is not None
    lanes = sweep_lanes(lanes, runtime.provider, getattr(runtime, "threads", None), loaded.file_bytes)  # native TensorRT has no threads: one lane
    if lanes > 1 and isinstance(runtime, OrtRuntime) and runtime.threads is None:
        runtime = dataclasses.replace(runtime, threads=max(1, usable_cores() // lanes))
    tensors, unfed = graph_ops.find_weight_tensors(loaded.proto), graph_ops.layout.unfed_float_tensors(loaded.proto.graph)
    units = select_units(tensors, selection, unfed)
    notes = selection_notes(loaded, tensors, units, selection, unfed)
    names = [n for u in units for n in u.tensor_names]
    session_proto = graph_ops.lift_constants(loaded.proto, names)
    declarations = {n: graph_ops.input_declarations(session_proto, [n]) for n in names}
    source: bytes | Path
    rebuild = cuts = None
    fed_as, keeps_kernels = "weights as stored", False
    if streamed:  # feeding is the only strategy that needs no weights in memory
        cuts = StreamedCuts(graph_ops.model_bytes(session_proto), runtime, data_dir)  # and cuts, read from the files too
        if runtime_keeps_weights:  # the graph only: tensors stay references into the model's files; the units declared inputs too
            session_proto.MergeFromString(b"".join(declarations.values()))
            graph = session_proto
        else:  # the units plain inputs
            unit_names = set(names)
            graph = graph_ops.io.weights_as_inputs(session_proto, lambda t: t.name not in unit_names)
        source = _graph_file(graph, workdir, "overridable" if runtime_keeps_weights else "fed")
        weights = graph_ops.FileWeights(loaded.proto, names, data_dir)
        factory = partial(runtime.open, source, external_data_dir=data_dir) if runtime_keeps_weights else partial(open_fed, runtime, source, data_dir, weights)
    elif graph_ops.io.stored_bytes(session_proto) < graph_ops.io.PROTOBUF_LIMIT:
        rebuild = cuts = RebuildFactory(graph_ops.model_bytes(session_proto), runtime, declarations)  # the one serialisation
        derived, fed_as = derived_feed(rebuild, units, names)
        factory = derived or partial(rebuild.overridable, tuple(names))
        keeps_kernels = derived.made()[1].keeps_kernels if derived is not None else all(fed_as_fast(t) for u in units for t in u.tensors)
        source = rebuild.model
    else:  # over 2 GiB: hand the runtime a file with external data; feeding is the only sane strategy
        session_proto.MergeFromString(b"".join(declarations.values()))
        source = _session_file(loaded, names, workdir)
        if not source.exists():
            graph_ops.save_model(session_proto, source, external_data=True)
        factory = partial(runtime.open, source)
    del session_proto
    try:
        build_started = time.perf_counter()
        probe_session = factory()
        build_seconds = time.perf_counter() - build_started
    except Exception as exc:
        raise InputError(f"ONNX Runtime cannot load {loaded.path}: {str(exc).splitlines()[0]}") from None
    inputs = [s for s in probe_session.inputs if s.name not in probe_session.weights]
    resolved = resolve_spec(spec, steps, inputs, probe_session.outputs)
    settings.check_horizons(resolved.steps)
    if isinstance(contexts, Contexts):
        ctx = contexts
    else:
        ctx = load_contexts(
            Path(contexts) if contexts is not None else None,
            inputs,
            windows=context_options.windows,
            zscore=context_options.zscore,
            random=context_options.random,
            seed=context_options.seed,
            columns=context_options.columns,
            dims=dict(context_options.dims),
            rows=index_rows(loaded.proto) if context_options.random else None,
        )
    if not streamed:
        weights = graph_ops.read_weights(loaded.proto, names)
    check_finite(weights)
    job = SweepJob(
        session_factory=factory,
        contexts=ctx,
        spec=resolved,
        units={u.name: u for u in units},
        weights=weights,
        probe_bits=settings.probe_bits,
        seed=settings.seed,
        eps=settings.eps,
        max_batch_windows=context_options.max_batch_windows,
        early_stop=EarlyStop(settings.early_stop_tol, settings.early_stop_window) if settings.early_stop else None,
        rebuild_factory=rebuild,
        cut_factory=cuts,
        session_build_s=build_seconds,
        lanes=lanes,
        strategy=strategy,
        rows=gather_rows(loaded.proto, units, ctx.arrays, resolved.fed_inputs),
        unit_factory=rebuild.overridable if rebuild is not None else None,
        fed_keeps_kernels=keeps_kernels,
        tasks_per_unit=int(settings.quant_probe) + settings.gauss_draws,
        quant_probe=settings.quant_probe,
    )
    return Prepared(
        model=loaded, units=units, spec=resolved, contexts=ctx, job=job, session=probe_session,
        session_file=source if isinstance(source, Path) else None, data_dir=data_dir, lanes=lanes, threads=getattr(runtime, "threads", None), fed_as=fed_as,
        notes=notes,
    )



def _session_file(loaded: graph_ops.LoadedModel, names: list[str], workdir: Path | None) -> Path:
    """Where the runtime's full copy of this model (with these units overridable) lives: the run folder, or a
    temporary one; named by the model's digest, so a resumed score and export reuse it."""
    key = hashlib.sha256((loaded.sha256 + "\x1f".join(sorted(names))).encode()).hexdigest()[:12]
    return _session_folder(workdir) / f"session-{key}.onnx"


def _graph_file(graph: onnx.ModelProto, workdir: Path | None, kind: str) -> Path:
    """A graph-only session file (its tensors references into the model's data files), named by its own
    bytes: written when missing, and found again without waiting for the model's digest."""
    data = graph.SerializeToString()
    path = _session_folder(workdir) / f"{kind}-{hashlib.sha256(data).hexdigest()[:12]}.onnx"
    if not path.exists():
        graph_ops.save_model(graph, path, external_data=False)
    return path


def _session_folder(workdir: Path | None) -> Path:
    return Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="tqs-session-"))


def _fingerprint(prepared: Prepared, settings: ScoreSettings, runtime: OrtRuntime) -> str:
    spec = prepared.spec.to_dict()
    spec.pop("origin")
    identity = {
        "model": prepared.model.sha256,
        "spec": spec,
        "contexts": prepared.contexts.sha256,
        "settings": asdict(settings),
        "units": [u.tensor_names for u in prepared.units],
        "provider": runtime.provider,
    }
    if getattr(runtime, "tf32", False):  # TF32 moves γ by up to nats/step on a GPU: never resumed into an exact run
        identity["tf32"] = True
    if prepared.job.rows:
        identity["gather_rows"] = {name: rows.tolist() for name, rows in sorted(prepared.job.rows.items())}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


GENERIC_STEMS = ("model",)
"""File names exporters give every model; default output names add the folder's name to them."""


def model_label(model: str | Path) -> str:
    """The name default outputs use: the file's stem, prefixed by its folder's name when the stem is
    generic, so examples/a/model.onnx and examples/b/model.onnx get different runs and exports."""
    path = Path(model)
    if path.stem.lower() in GENERIC_STEMS:
        folder = path.resolve().parent.name
        return f"{folder}_{path.stem}" if folder else path.stem
    return path.stem


def default_run_dir(model: str | Path) -> Path:
    return Path("tqs-runs") / model_label(model)


def score(
    model: str | Path,
    contexts: str | Path | Contexts | None = None,
    *,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    out: str | Path | None = None,
    selection: UnitSelection = UnitSelection(),
    settings: ScoreSettings = ScoreSettings(),
    runtime: OrtRuntime = OrtRuntime(),
    context_options: ContextOptions = ContextOptions(),
    resume: bool | None = None,
    strategy: str = "auto",
    workers: int = 1,
    ray_address: str | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_result: Callable[[TaskResult], None] | None = None,
    lanes: int | None = None,
    on_estimate: Callable[[float], None] | None = None,
) -> ScoreTable:
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
    cores = usable_cores()
    if ray_address is None:
        workers = min(workers, cores)  # more local processes than cores only adds contention
    if workers > 1 or ray_address is not None:
        if lanes not in (None, 1):
            raise InputError("--lanes runs tasks side by side in this process; with --workers or --ray each worker runs one at a time", hint="pass one of them")
        lanes = 1
    if workers > 1 and isinstance(runtime, OrtRuntime) and runtime.threads is None:
        runtime = dataclasses.replace(runtime, threads=max(1, cores // workers))  # N workers x threads <= cores
    run_dir = Path(out) if out else default_run_dir(model)
    with claim_run_folder(run_dir):
        return _score(run_dir, model, contexts, spec, steps, selection, settings, runtime, context_options, resume, strategy, workers, ray_address, on_start, on_result, started, lanes,
                      on_estimate)


def _score(run_dir, model, contexts, spec, steps, selection, settings, runtime, context_options, resume, strategy, workers, ray_address, on_start, on_result, started, lanes,
           on_estimate) -> ScoreTable:
    """`score` inside its claimed run folder."""
    prepared = prepare(
        model, contexts, spec, steps, selection=selection, settings=settings, runtime=runtime, context_options=context_options, strategy=strategy,
        workdir=run_dir, stream=True, lanes=lanes,
    )
    meta_path = run_dir / "run.json"
    existing = json.loads(meta_path.read_text()) if meta_path.exists() else None
    # Only a folder that may be resumed needs the fingerprint before the sweep opens; a fresh run works it
    # out after `open_runner`, so the model's digest (a background thread) runs beside the session builds.
    fingerprint = _fingerprint(prepared, settings, runtime) if existing is not None and resume is not False else None
    matches = fingerprint is not None and existing.get("fingerprint") == fingerprint
    if existing is not None and not matches and resume is not False:
        unfinished = " (an unfinished one: interrupted, or it failed)" if existing.get("status") != "complete" else ""
        raise InputError(
            f"{run_dir} holds a score run{unfinished} with a different model, contexts or settings",
            hint="pass --fresh to replace it, or --out DIR for a new run",
        )
    if resume is True and not matches:
        raise InputError(f"nothing to resume in {run_dir}")
    if resume is False or not matches:
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        in_use = {prepared.session_file.name} if prepared.session_file else set()
        for pattern in ("session-*.onnx*", "overridable-*.onnx", "fed-*.onnx", "graph-*.onnx", "weights-*.onnx*"):  # graph-*, weights-*: what older versions made
            for stale in run_dir.glob(pattern):
                if not any(stale.name.startswith(name) for name in in_use):
                    stale.unlink()

    log = ResultLog(run_dir / "sweep.jsonl")
    done = log.load() if matches else {}
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
        "status": "running",
        "fingerprint": fingerprint or _fingerprint(prepared, settings, runtime),
        "model": {"path": str(prepared.model.path.resolve()), "sha256": prepared.model.sha256, "bytes": prepared.model.file_bytes},
        "rollout": prepared.spec.to_dict(),
        "contexts": prepared.contexts.describe(),
        "probe": asdict(settings),
        "selection": asdict(selection),
        "provider": runtime.provider,
        "units": len(prepared.units),
        "params": sum(u.params for u in prepared.units),
        "tasks": len(tasks),
        "versions": _versions(),
        "warnings": [*prepared.notes, *prepared.contexts.warnings],
    }
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
    record = lambda r: (done.__setitem__(r.key, r), on_result and on_result(r))  # noqa: E731
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
    return ScoreTable(frame=frame, run_dir=run_dir, meta=meta)
