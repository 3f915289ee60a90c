"""Preparing a sweep: a model loaded and checked, its units chosen, its sessions' sources made, its rollout
resolved and its contexts read; what `score` sweeps, and what a later stage runs again (`ScoreRun.prepare`).
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

import graph_ops
from graph_ops.qdq import at_opset, default_opset
from runtimes import Runtime, Session
from runtimes.derived import derived_feed, fed_as_fast
from runtimes.factories import RebuildFactory, StreamedCuts, open_fed
from tqsdeploy.errors import InputError
from tqsdeploy.rollout import CheckedSpec, resolve_spec
from tqsdeploy.rollout.contexts import ContextOptions, Contexts, load_contexts
from tqsdeploy.scoring.request import ScoreRequest
from tqsdeploy.sweep import EarlyStop, Nominal, SweepJob, SweepRunner, sweep_lanes, usable_cores
from tqsdeploy.units import Unit, check_finite, gather_rows, index_rows, select_units, selection_notes

__all__ = ["ContextOptions", "Prepared", "SessionOptions", "prepare"]  # ContextOptions: where frontier imports it from


@dataclass(frozen=True)
class SessionOptions:
    """How `prepare` makes a sweep's sessions: a score's defaults differ from export's, which runs candidate
    sessions beside this one.

    Models whose session copy would pass protobuf's 2 GiB are handed to the runtime as a file with external
    data, written once into `workdir` (the run folder: reused by a resumed score and by export, removed with the
    run) or a temporary folder. With `stream`, a model that keeps its weights in external-data files is never
    copied: the session file holds only the graph (its tensors still point into the model's own data files),
    and the sweep reads each unit's weights from those files when it gets to the unit. The units are then
    overridable initializers the runtime loads once (`runtime_keeps_weights`: a run feeds only what it perturbs,
    as a score does), or plain inputs fed from the files on every run, so the runtime holds no copy of them."""

    workdir: Path | None = None
    stream: bool = False
    runtime_keeps_weights: bool = True
    opset: Callable[[onnx.ModelProto, list[Unit]], int] | None = None
    """The opset the sessions run the model at, from the model and its units (export: the opset it writes at);
    it is converted as the writer converts it (`graph_ops.qdq.at_opset`), the model loaded kept as it is."""


@dataclass
class Prepared:
    """A model made ready for a sweep: units, session factory, rollout, contexts."""

    model: graph_ops.LoadedModel
    units: list[Unit]
    spec: CheckedSpec
    contexts: Contexts
    job: SweepJob
    session: Session | None = None
    """The session opened to check the model, handed to the first runner so it is not built twice."""
    session_file: Path | None = None
    """The runtime's copy of a model too large to pass as bytes (external data beside it)."""
    data_dir: Path | None = None
    """Set when the model was loaded without its external data: the folder its data files are in."""
    workers: int = 1
    """Worker processes (or Ray actors) the sweep runs on (`SweepSettings.processes`)."""
    lanes: int = 1
    """Tasks the sweep runs at once in this process (`sweep.run_lanes`); the sessions' threads are split for them."""
    threads: int | None = None
    """ONNX Runtime intra-op threads per session (None: its default, every core)."""
    fed_as: str = "weights as stored"
    """What the fed session is a graph of (`derived_feed`), for run.json."""
    held_out: Contexts | None = None
    """The windows `ScoreRequest.validation` held out of the contexts (neither swept nor calibrated on)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the unit selection (`units.selection_notes`)."""
    opset: int = 0
    """The default-domain opset its sessions run the model at (`SessionOptions.opset`; the model's own unless
    raised)."""

    def open_runner(self, nominal: "Nominal | None" = None) -> SweepRunner:
        """A runner of the sweep; `nominal`: the rollout an earlier runner of this job made (not made again)."""
        session, self.session = self.session, None
        return SweepRunner(self.job, session, nominal)


@dataclass
class _Sources:
    """Where a sweep's sessions come from: the overridable session's factory and what it opens, the factories
    of rebuilt and cut sessions when the model is in memory, and the weights when they stay in the model's files."""

    factory: Callable[[], Session]
    source: bytes | Path
    rebuild: RebuildFactory | None = None
    cuts: object | None = None
    weights: graph_ops.FileWeights | None = None
    fed_as: str = "weights as stored"
    keeps_kernels: bool = False


def prepare(request: ScoreRequest, sessions: SessionOptions = SessionOptions()) -> Prepared:
    """Load and check everything the sweep of `request` needs, its sessions made as `sessions` says; fails fast
    on bad input. The rollout spec is checked here, once (`resolve_spec`): the job's runners trust it."""
    request.runtime.check()
    # a large single file comes as a skeleton
    loaded = graph_ops.load_model(request.model, load_external=not sessions.stream)
    streamed = sessions.stream and graph_ops.io.has_external_data(loaded.proto)
    data_dir = loaded.path.parent.resolve() if streamed else None
    runtime, workers, lanes = _sized(request, loaded)
    units, notes = _units(loaded, request)
    names = [n for u in units for n in u.tensor_names]
    sources, opset = _sources(loaded, units, runtime, sessions, data_dir)
    probe_session, build_seconds = _open_probe(sources.factory, loaded)
    inputs = [s for s in probe_session.inputs if s.name not in probe_session.weights]
    spec = resolve_spec(request.spec, request.steps, inputs, probe_session.outputs)
    settings = request.settings
    settings.check_horizons(spec.steps)
    contexts, held_out = _held_out(_contexts(request, inputs, loaded), request.validation, request.held_out)
    weights = sources.weights if streamed else graph_ops.read_weights(loaded.proto, names)
    check_finite(weights)
    job = SweepJob(
        session_factory=sources.factory,
        contexts=contexts,
        spec=spec,
        units={u.name: u for u in units},
        weights=weights,
        probe_bits=settings.probe_bits,
        seed=settings.seed,
        eps=settings.eps,
        max_batch_windows=request.context_options.max_batch_windows,
        early_stop=EarlyStop(settings.early_stop_tol, settings.early_stop_window) if settings.early_stop else None,
        rebuild_factory=sources.rebuild,
        cut_factory=sources.cuts,
        session_build_s=build_seconds,
        lanes=lanes,
        strategy=request.sweep.strategy,
        rows=gather_rows(loaded.proto, units, contexts.arrays, spec.fed_inputs),
        unit_factory=sources.rebuild.overridable if sources.rebuild is not None else None,
        fed_keeps_kernels=sources.keeps_kernels,
        tasks_per_unit=int(settings.quant_probe) + settings.gauss_draws,
        quant_probe=settings.quant_probe,
    )
    return Prepared(
        model=loaded,
        units=units,
        spec=spec,
        contexts=contexts,
        job=job,
        session=probe_session,
        session_file=sources.source if isinstance(sources.source, Path) else None,
        data_dir=data_dir,
        workers=workers,
        lanes=lanes,
        threads=runtime.threads,
        fed_as=sources.fed_as,
        held_out=held_out,
        notes=notes,
        opset=opset,
    )


def _sized(request: ScoreRequest, loaded: graph_ops.LoadedModel) -> tuple[Runtime, int, int]:
    """The sweep sized to this machine and model: the runtime as the model needs it, the worker processes, and
    the lanes (one per worker; else `sweep_lanes`, and native TensorRT has no threads: one lane). The cores
    are split between workers or lanes when the runtime leaves threads to ONNX Runtime."""
    runtime, cores = request.runtime, usable_cores()
    workers = request.sweep.processes(cores)
    if workers > 1 and runtime.threads is None:
        runtime = runtime.with_threads(max(1, cores // workers))  # N workers x threads <= cores
    runtime = runtime.for_model(loaded.proto)
    spread = workers > 1 or request.sweep.ray_address is not None  # each worker runs one task at a time
    lanes = sweep_lanes(1 if spread else request.sweep.lanes, runtime.provider, runtime.threads, loaded.file_bytes)
    if lanes > 1 and runtime.threads is None:
        runtime = runtime.with_threads(max(1, cores // lanes))
    return runtime, workers, lanes


def _units(loaded: graph_ops.LoadedModel, request: ScoreRequest) -> tuple[list[Unit], list[str]]:
    """The units the request selects, and what the user should know about the selection."""
    tensors = graph_ops.find_weight_tensors(loaded.proto)
    unfed = graph_ops.layout.unfed_float_tensors(loaded.proto.graph)
    units = select_units(tensors, request.selection, unfed)
    return units, selection_notes(loaded, tensors, units, request.selection, unfed)


def _sources(
    loaded: graph_ops.LoadedModel, units: list[Unit], runtime: Runtime, sessions: SessionOptions, data_dir: Path | None
) -> tuple[_Sources, int]:
    """The sessions' sources for a model with these units overridable, and the opset they run it at: read from
    the model's files (`data_dir`), made in memory, or, past protobuf's 2 GiB, a file with external data."""
    names = [n for u in units for n in u.tensor_names]
    own = default_opset(loaded.proto)
    opset = max(own, sessions.opset(loaded.proto, units)) if sessions.opset is not None else own
    proto = at_opset(graph_ops.lift_constants(loaded.proto, names), opset)  # GraphError: the CLI's one-line exit 2
    declarations = {n: graph_ops.input_declarations(proto, [n]) for n in names}
    if data_dir is not None:  # feeding is the only strategy that needs no weights in memory
        return _streamed(proto, declarations, names, loaded, runtime, sessions, data_dir), opset
    if graph_ops.io.stored_bytes(proto) < graph_ops.io.PROTOBUF_LIMIT:
        return _in_memory(proto, declarations, units, names, runtime), opset
    # over 2 GiB: hand the runtime a file with external data; feeding is the only sane strategy
    proto.MergeFromString(b"".join(declarations.values()))
    source = _session_file(loaded, names, sessions.workdir, opset if opset != own else None)
    if not source.exists():
        graph_ops.save_model(proto, source, external_data=True)
    return _Sources(partial(runtime.open, source), source), opset


def _streamed(
    proto: onnx.ModelProto,
    declarations: dict[str, bytes],
    names: list[str],
    loaded: graph_ops.LoadedModel,
    runtime: Runtime,
    sessions: SessionOptions,
    data_dir: Path,
) -> _Sources:
    """Sessions of a graph whose tensors stay references into the model's files; cuts are read from them too."""
    cuts = StreamedCuts(graph_ops.model_bytes(proto), runtime, data_dir)
    if sessions.runtime_keeps_weights:  # the units declared inputs too
        proto.MergeFromString(b"".join(declarations.values()))
        graph = proto
    else:  # the units plain inputs
        unit_names = set(names)
        graph = graph_ops.io.weights_as_inputs(proto, lambda t: t.name not in unit_names)
    source = _graph_file(graph, sessions.workdir, "overridable" if sessions.runtime_keeps_weights else "fed")
    weights = graph_ops.FileWeights(loaded.proto, names, data_dir)
    if sessions.runtime_keeps_weights:
        factory = partial(runtime.open, source, external_data_dir=data_dir)
    else:
        factory = partial(open_fed, runtime, source, data_dir, weights)
    return _Sources(factory, source, cuts=cuts, weights=weights)


def _in_memory(
    proto: onnx.ModelProto, declarations: dict[str, bytes], units: list[Unit], names: list[str], runtime: Runtime
) -> _Sources:
    """Sessions made from the model's bytes, serialised once: the fed one a derived graph when that runs faster."""
    rebuild = RebuildFactory(graph_ops.model_bytes(proto), runtime, declarations)
    derived, fed_as = derived_feed(rebuild, units, names)
    factory = derived or partial(rebuild.overridable, tuple(names))
    if derived is not None:
        keeps = derived.made()[1].keeps_kernels
    else:
        keeps = all(fed_as_fast(t) for u in units for t in u.tensors)
    return _Sources(factory, rebuild.model, rebuild=rebuild, cuts=rebuild, fed_as=fed_as, keeps_kernels=keeps)


def _open_probe(factory: Callable[[], Session], loaded: graph_ops.LoadedModel) -> tuple[Session, float]:
    """The first session, which checks the model loads, and the seconds it took to build."""
    try:
        started = time.perf_counter()
        session = factory()
        return session, time.perf_counter() - started
    except Exception as exc:
        raise InputError(f"ONNX Runtime cannot load {loaded.path}: {str(exc).splitlines()[0]}") from None


def _contexts(request: ScoreRequest, inputs: list, loaded: graph_ops.LoadedModel) -> Contexts:
    """The request's contexts for these inputs (random ones drawn within the rows of the tables they index)."""
    if isinstance(request.contexts, Contexts):
        return request.contexts
    options = request.context_options
    path = Path(request.contexts) if request.contexts is not None else None
    return load_contexts(path, inputs, options, rows=index_rows(loaded.proto) if options.random else None)


def _held_out(contexts: Contexts, count: int, indices: tuple[int, ...] = ()) -> tuple[Contexts, Contexts | None]:
    """(the windows scored, those held out for validation: the last `count`, or the windows at `indices`); None held
    out for neither."""
    if not count and not indices:
        return contexts, None
    if count and indices:
        raise InputError("hold out windows by count (--validation) or by index, not both")
    if indices:
        chosen = sorted(set(indices))
        if (
            len(chosen) != len(indices)
            or chosen[0] < 0
            or chosen[-1] >= contexts.count
            or len(chosen) >= contexts.count
        ):
            raise InputError(
                f"held-out windows {list(indices)} are not distinct windows of the {contexts.count} context windows "
                "leaving some to score"
            )
        rest = [i for i in range(contexts.count) if i not in set(chosen)]
        return _part(contexts, np.array(rest)), _part(contexts, np.array(chosen))
    if not 0 < count < contexts.count:
        raise InputError(
            f"--validation {count} holds out {'every window' if count >= contexts.count else 'a negative count'} of "
            f"the {contexts.count} context windows: none would be left to score",
            hint="hold out fewer windows, or pass more contexts",
        )
    return _part(contexts, slice(None, -count)), _part(contexts, slice(-count, None))


def _part(contexts: Contexts, rows) -> Contexts:
    """The windows at `rows` (a slice or an index array), with what is kept of each."""
    csv = contexts.csv
    if csv and "starts" in csv:
        csv = {**csv, "starts": _rows_of(csv["starts"], rows)}
    following = contexts.following[rows] if contexts.following is not None else None
    arrays = {name: array[rows] for name, array in contexts.arrays.items()}
    return replace(contexts, arrays=arrays, csv=csv, following=following, warnings=list(contexts.warnings))


def _rows_of(values, rows):
    """`values[rows]` for a list as for an array (a CSV's start rows are kept as a list for run.json)."""
    if isinstance(values, list):
        return [values[i] for i in rows] if not isinstance(rows, slice) else values[rows]
    return values[rows]


def _session_file(
    loaded: graph_ops.LoadedModel, names: list[str], workdir: Path | None, opset: int | None = None
) -> Path:
    """Where the runtime's full copy of this model (with these units overridable; at `opset` when raised) lives: the
    run folder, or a temporary one; named by the model's digest, so a resumed score and export reuse it."""
    key = hashlib.sha256(
        (loaded.sha256 + "\x1f".join(sorted(names)) + (f"\x1fopset {opset}" if opset else "")).encode()
    ).hexdigest()[:12]
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
