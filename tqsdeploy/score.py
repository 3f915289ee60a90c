"""`score`: the TQS sensitivity sweep end to end, and the run folder it fills.

A run folder is self-sufficient: besides the scores it keeps the resolved
rollout spec and the contexts, so later steps (export, eval) need nothing
else. It is also the resume point: `run.json` carries a fingerprint of
everything that determines the results, and `sweep.jsonl` the finished tasks.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl

import graph_ops
from runtimes import OrtRuntime, Session
from tqsdeploy import __version__
from tqsdeploy.contexts import Contexts, load_contexts
from tqsdeploy.errors import InputError
from tqsdeploy.rollout import RolloutSpec, detect
from tqsdeploy.scoring import ScoreSettings, score_frame, spearman
from tqsdeploy.sweep import EarlyStop, ResultLog, SweepJob, SweepRunner, TaskResult, plan_tasks, run_local, run_parallel, run_ray
from tqsdeploy.units import Unit, UnitSelection, check_finite, select_units

DEFAULT_STEPS = 8
RUN_FILES = ("run.json", "sweep.jsonl", "measured.jsonl", "scores.parquet", "scores.csv", "rollout.toml", "contexts.npz")


@dataclass(frozen=True)
class ContextOptions:
    """How to read contexts that are not an .npz of ready windows."""

    windows: int = 8
    zscore: bool = False
    random: bool = False
    seed: int = 0
    max_batch_windows: int = 64


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
class RebuildFactory:
    """Opens a session of the original model with some weights replaced (constants).

    Picklable: it carries the serialized model and the runtime settings.
    """

    model: bytes
    runtime: OrtRuntime

    def __call__(self, weights: dict[str, np.ndarray]):
        import onnx

        if not hasattr(self, "_proto"):
            self._proto = onnx.load_model_from_string(self.model)
        proto = graph_ops.replace_weights(self._proto, weights) if weights else self._proto
        return self.runtime.open(graph_ops.model_bytes(proto))


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

    def open_runner(self) -> SweepRunner:
        session, self.session = self.session, None
        return self.job.open(session)


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


def resolve_spec(spec: RolloutSpec | str | Path | None, steps: int | None, inputs, outputs) -> RolloutSpec:
    """A given spec (file or object, `steps` overriding its steps) or a detected one."""
    if spec is None:
        resolved = detect(inputs, outputs, steps or DEFAULT_STEPS)
    else:
        resolved = spec if isinstance(spec, RolloutSpec) else RolloutSpec.from_toml(spec)
        if steps:
            resolved = resolved.with_steps(steps)
    resolved.check(inputs, outputs)
    return resolved


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
) -> Prepared:
    """Load and check everything a sweep needs; fails fast on bad input."""
    runtime.check()
    loaded = graph_ops.load_model(model)
    units = select_units(graph_ops.find_weight_tensors(loaded.proto), selection)
    names = [n for u in units for n in u.tensor_names]
    session_proto = graph_ops.make_weights_overridable(loaded.proto, names)
    source: bytes | Path
    rebuild = None
    if graph_ops.io.stored_bytes(session_proto) < graph_ops.io.PROTOBUF_LIMIT:
        source = graph_ops.model_bytes(session_proto)
        rebuild = RebuildFactory(graph_ops.model_bytes(graph_ops.io.runtime_compatible(copy.deepcopy(loaded.proto))), runtime)
    else:  # over 2 GiB: hand the runtime a file with external data; feeding is the only sane strategy
        source = graph_ops.save_model(session_proto, Path(loaded.path.parent, f".{loaded.stem}.tqs-session.onnx"), external_data=True)
    factory = partial(runtime.open, source)
    try:
        probe_session = factory()
    except Exception as exc:
        raise InputError(f"ONNX Runtime cannot load {loaded.path}: {str(exc).splitlines()[0]}") from None
    inputs = [s for s in probe_session.inputs if s.name not in probe_session.weights]
    resolved = resolve_spec(spec, steps, inputs, probe_session.outputs)
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
        )
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
        strategy=strategy,
    )
    return Prepared(model=loaded, units=units, spec=resolved, contexts=ctx, job=job, session=probe_session)


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
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def default_run_dir(model: str | Path) -> Path:
    return Path("tqs-runs") / Path(model).stem


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str))
    temporary.replace(path)


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
) -> ScoreTable:
    """Run the TQS sweep on an ONNX model and return the ranked score table.

    `resume=None` continues a matching interrupted run in `out` and refuses to
    overwrite a different one; `True` requires a match; `False` starts afresh.
    `on_start(total, done)` and `on_result(result)` report progress.
    `workers` > 1 runs the sweep in that many processes (one session each);
    with `ray_address` ('local', 'auto' or a cluster address) on that many Ray actors.
    """
    started = time.perf_counter()
    if workers > 1 and isinstance(runtime, OrtRuntime) and runtime.threads is None:
        runtime = dataclasses.replace(runtime, threads=max(1, (os.cpu_count() or 1) // workers))
    prepared = prepare(
        model, contexts, spec, steps, selection=selection, settings=settings, runtime=runtime, context_options=context_options, strategy=strategy
    )
    run_dir = Path(out) if out else default_run_dir(model)
    fingerprint = _fingerprint(prepared, settings, runtime)
    meta_path = run_dir / "run.json"
    existing = json.loads(meta_path.read_text()) if meta_path.exists() else None
    matches = existing is not None and existing.get("fingerprint") == fingerprint
    if existing is not None and not matches and resume is not False:
        raise InputError(
            f"{run_dir} holds a score run with a different model, contexts or settings",
            hint="pass --fresh to replace it, or --out DIR for a new run",
        )
    if resume is True and not matches:
        raise InputError(f"nothing to resume in {run_dir}")
    if resume is False or not matches:
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)

    log = ResultLog(run_dir / "sweep.jsonl")
    done = log.load() if matches else {}
    if done and existing.get("strategy"):
        prepared.job.strategy = existing["strategy"]  # finish the way it started
    tasks = plan_tasks(prepared.units, settings.quant_probe, settings.gauss_draws)
    pending = [t for t in tasks if t.key not in done]
    (run_dir / "rollout.toml").write_text(prepared.spec.to_toml())
    prepared.contexts.save(run_dir / "contexts.npz")
    meta = {
        "status": "running",
        "fingerprint": fingerprint,
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
        "warnings": list(prepared.contexts.warnings),
    }
    _write_json(meta_path, meta)

    nominal_started = time.perf_counter()
    runner = prepared.open_runner()
    nominal_seconds = time.perf_counter() - nominal_started
    meta["strategy"] = runner.strategy
    _write_json(meta_path, meta)
    if on_start:
        on_start(len(tasks), len(tasks) - len(pending))
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
        run_local(prepared.job, pending, log, on_result=record, runner=runner)
        runner.close()
    sweep_seconds = time.perf_counter() - sweep_started

    frame = score_frame(prepared.units, done, runner.nominal.norm_sq, settings, prepared.spec.steps)
    frame.write_parquet(run_dir / "scores.parquet")
    frame.write_csv(run_dir / "scores.csv")
    alive = frame.filter(~pl.col("dead"))
    meta.update(
        {
            "status": "complete",
            "nominal_norm_sq": runner.nominal.norm_sq,
            "batched_windows": runner.nominal.batched,
            "dead_units": int(frame["dead"].sum()),
            "spearman_quant_gauss": spearman(alive["gamma_quant"], alive["gamma_gauss"]) if settings.quant_probe and settings.gauss_draws else None,
            "timings_s": {
                "prepare_and_nominal": round(nominal_started - started + nominal_seconds, 4),
                "sweep": round(sweep_seconds, 4),
                "resumed_tasks": len(tasks) - len(pending),
                "total": round(time.perf_counter() - started, 4),
            },
        }
    )
    _write_json(meta_path, meta)
    return ScoreTable(frame=frame, run_dir=run_dir, meta=meta)
