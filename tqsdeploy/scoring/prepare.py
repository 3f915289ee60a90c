"""Preparing a sweep: a model loaded and checked, its units chosen, its sessions' sources made, its rollout
resolved and its contexts read; what `score` sweeps, and what a later stage runs again (`ScoreRun.prepare`).
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import onnx

import graph_ops
from runtimes import DEFAULT_RUNTIME, Runtime, Session
from runtimes.derived import derived_feed, fed_as_fast
from graph_ops.qdq import at_opset, default_opset
from runtimes.factories import RebuildFactory, StreamedCuts, open_fed
from tqsdeploy.rollout.contexts import Contexts, load_contexts
from tqsdeploy.errors import InputError
from tqsdeploy.rollout import RolloutSpec, resolve_spec
from tqsdeploy.scoring.gamma import ScoreSettings
from tqsdeploy.sweep import EarlyStop, Nominal, SweepJob, SweepRunner, sweep_lanes, usable_cores
from tqsdeploy.units import Unit, UnitSelection, check_finite, gather_rows, index_rows, select_units, selection_notes


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
    opset: int = 0
    """The default-domain opset its sessions run the model at (`prepare`'s `opset`; the model's own unless raised)."""

    def open_runner(self, nominal: "Nominal | None" = None) -> SweepRunner:
        """A runner of the sweep; `nominal`: the rollout an earlier runner of this job made (not made again)."""
        session, self.session = self.session, None
        return SweepRunner(self.job, session, nominal)


def prepare(
    model: str | Path,
    contexts: str | Path | Contexts | None,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    *,
    selection: UnitSelection = UnitSelection(),
    settings: ScoreSettings = ScoreSettings(),
    runtime: Runtime = DEFAULT_RUNTIME,
    context_options: ContextOptions = ContextOptions(),
    strategy: str = "auto",
    workdir: Path | None = None,
    stream: bool = False,
    runtime_keeps_weights: bool = True,
    lanes: int | None = 1,
    opset: Callable[[onnx.ModelProto, list[Unit]], int] | None = None,
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
    `opset`: the opset the sessions run the model at, from the model and its units (export: the opset it writes
    at); it is converted as the writer converts it (`graph_ops.qdq.at_opset`), the model loaded kept as it is.
    """
    runtime.check()
    loaded = graph_ops.load_model(model, load_external=not stream)  # large single files come as a skeleton
    runtime = runtime.for_model(loaded.proto)
    data_dir = loaded.path.parent.resolve() if stream and graph_ops.io.has_external_data(loaded.proto) else None
    streamed = data_dir is not None
    lanes = sweep_lanes(lanes, runtime.provider, runtime.threads, loaded.file_bytes)  # native TensorRT has no threads: one lane
    if lanes > 1 and runtime.threads is None:
        runtime = runtime.with_threads(max(1, usable_cores() // lanes))
    tensors, unfed = graph_ops.find_weight_tensors(loaded.proto), graph_ops.layout.unfed_float_tensors(loaded.proto.graph)
    units = select_units(tensors, selection, unfed)
    notes = selection_notes(loaded, tensors, units, selection, unfed)
    names = [n for u in units for n in u.tensor_names]
    own = default_opset(loaded.proto)
    raised = max(own, opset(loaded.proto, units)) if opset is not None else own
    session_proto = at_opset(graph_ops.lift_constants(loaded.proto, names), raised)  # GraphError: the CLI's one-line exit 2
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
        source = _session_file(loaded, names, workdir, raised if raised != own else None)
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
        session_file=source if isinstance(source, Path) else None, data_dir=data_dir, lanes=lanes, threads=runtime.threads, fed_as=fed_as,
        notes=notes, opset=raised,
    )



def _session_file(loaded: graph_ops.LoadedModel, names: list[str], workdir: Path | None, opset: int | None = None) -> Path:
    """Where the runtime's full copy of this model (with these units overridable; at `opset` when raised) lives: the
    run folder, or a temporary one; named by the model's digest, so a resumed score and export reuse it."""
    key = hashlib.sha256((loaded.sha256 + "\x1f".join(sorted(names)) + (f"\x1fopset {opset}" if opset else "")).encode()).hexdigest()[:12]
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
