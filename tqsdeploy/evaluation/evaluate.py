"""`eval` and `gate`: roll out a candidate next to its reference and measure.

What is evaluated is what the runtime runs: by default ONNX Runtime with its
full optimisations, which fuse integer DequantizeLinear->MatMul into
MatMulNBits with int8 activations (accuracy_level 4); `exact` switches that to
exact dequantization. The report says which mode ran and how many MatMulNBits
nodes the optimised graph holds.

Degradation: with ground truth, the paper's (MAE_q - MAE_ref) / MAE_ref against
the truth; without it, the candidate's MAE against the reference relative to
the reference's mean absolute value ("drift"). Both in percent.

Embeddings are read as vectors, not values: for an output that looks like one
(`looks_like_embedding`) or when asked, the report adds the cosine similarity of
each candidate vector to its reference vector and how often a vector's nearest
neighbour among the others stays the same (`tqsdeploy.evaluation.metrics`).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

import graph_ops
import graph_ops.native
import graph_ops.qdq
from runtimes import Session, for_provider, release_freed_memory
from tqsdeploy.errors import InputError
from tqsdeploy.evaluation.eval_report import write_report
from tqsdeploy.evaluation.latency import LatencySettings
from tqsdeploy.evaluation.latency import measure as measure_latency
from tqsdeploy.evaluation.metrics import looks_like_embedding, metrics, side_metrics, vector_metrics
from tqsdeploy.evaluation.runtime_forms import (
    CHECKED_FOLDING_BYTES,
    dequantizes,
    forms,
    oldest_onnxruntime,
    reads_codes,
    runtime_mode,
)
from tqsdeploy.rollout import RolloutSpec, resolve_spec
from tqsdeploy.rollout.contexts import (
    ContextOptions,
    Contexts,
    continuation_rows,
    load_contexts,
    npz_arrays,
    truth_from_csv,
)
from tqsdeploy.rollout.engine import RolloutEngine
from tqsdeploy.size import compression


@dataclass(frozen=True)
class EvalSettings:
    exact: bool = False
    provider: str = "cpu"
    variable_axis: int | None = None
    """Axis of each per-step output whose entries are reported as separate variables."""
    bootstrap: int = 1000
    """Resamples of the 95% BCa intervals over context windows (scipy.stats.bootstrap)."""
    seed: int = 0
    max_batch_windows: int = 64
    windows: int = 8
    """Windows cut from a CSV of contexts (they leave room for the truth after them)."""
    zscore: bool = False
    columns: tuple[str, ...] | None = None
    """CSV columns (series) to use; default every numeric column."""
    cosine: bool | None = None
    """Cosine and nearest-neighbour metrics: None for the outputs that look like embeddings, True for
    every trajectory output (its last axis the vector), False for none."""
    latency: LatencySettings | None = None
    """Time candidate and reference (`tqsdeploy.evaluation.latency`); None: not measured (the CLI measures by
    default)."""
    memory: bool = False
    """Measure each model's resident memory in a fresh process (`runtimes.memory`): peak and steady growth of a
    session created and called on the contexts' first batch (the CLI measures it with the latency)."""


@dataclass(frozen=True)
class EvalRequest:
    """One evaluation, as `eval` and `gate` ask for it: the two models, the contexts and truth, and how to run them."""

    candidate: Path
    reference: Path
    contexts: Path
    spec: Path | None = None
    steps: int | None = None
    truth: Path | None = None
    settings: EvalSettings = EvalSettings()


def evaluate_request(request: EvalRequest) -> dict:
    return evaluate(
        request.candidate,
        request.reference,
        request.contexts,
        spec=request.spec,
        steps=request.steps,
        truth=request.truth,
        settings=request.settings,
    )


def run_eval(
    request: EvalRequest, prefix: Path, warn: Callable[[list[str]], None] = lambda warnings: None
) -> tuple[dict, Path, Path]:
    """`eval`: the report, told its warnings (`warn`) before it is written to PREFIX.json and PREFIX.md."""
    report = evaluate_request(request)
    warn(report.get("warnings", []))
    json_path, md_path = write_report(report, prefix)
    return report, json_path, md_path


def trajectories(session: Session, contexts: Contexts, spec: RolloutSpec, max_batch: int) -> dict[str, np.ndarray]:
    """Every trajectory output as (windows, steps, *per-window shape), by the one rollout engine."""
    return RolloutEngine(session, contexts, spec, max_batch).trajectories()


def _load(path: Path) -> "graph_ops.LoadedModel":
    return graph_ops.load_model(path, load_external=False)  # sizes need shapes only; the runtime reads the weights


def _open(loaded: "graph_ops.LoadedModel", settings: EvalSettings, optimized: str | None = None) -> Session:
    folds = loaded.file_bytes < CHECKED_FOLDING_BYTES and reads_codes(loaded.proto)
    if not dequantizes(loaded.proto) and not folds:
        optimized = None  # nothing to fuse or fold: no need for ONNX Runtime to write out a whole copy of the model
    runtime = for_provider(settings.provider, exact_qdq=settings.exact, optimized_model_path=optimized)
    runtime = runtime.for_model(loaded.proto)
    source = graph_ops.io.runnable_path(loaded)  # the file itself: no serialised copy, any size
    if source is None:  # an IR the runtime refuses: a clamped copy (bytes, or a temporary file past 2 GiB)
        source = graph_ops.io.session_source(graph_ops.io.runtime_compatible(graph_ops.load_model(loaded.path).proto))
    return runtime.open(source, external_data_dir=None if isinstance(source, bytes) else source.parent)


def _closed(session: Session) -> None:
    """Close a session and hand its memory back before the next one opens: eval holds one model's
    session at a time, so its peak is one model, not two."""
    session.close()
    release_freed_memory()


def _signature(proto) -> tuple[dict, dict]:
    """Inputs (weights aside) and outputs, each with its element type and dims ('?' where
    symbolic; None where the graph declares no shape)."""
    initializers = {t.name for t in proto.graph.initializer}

    def describe(value):
        tensor = value.type.tensor_type
        dims = (
            [d.dim_value if d.HasField("dim_value") else "?" for d in tensor.shape.dim]
            if tensor.HasField("shape")
            else None
        )
        return dims, onnx.TensorProto.DataType.Name(tensor.elem_type).lower()

    return (
        {v.name: describe(v) for v in proto.graph.input if v.name not in initializers},
        {v.name: describe(v) for v in proto.graph.output},
    )


def _fits(a: tuple, b: tuple) -> bool:
    """Same element type, and shapes that can agree (an unknown shape or dim agrees with any)."""
    (dims_a, type_a), (dims_b, type_b) = a, b
    if type_a != type_b:
        return False
    if dims_a is None or dims_b is None:
        return True
    return len(dims_a) == len(dims_b) and all(x == y or "?" in (x, y) for x, y in zip(dims_a, dims_b))


def _check_same_signature(candidate, reference) -> None:
    """Read off the graphs, before either model runs (one may declare shapes the other leaves open)."""
    cand, ref = _signature(candidate), _signature(reference)
    for kind, c, r in zip(("input", "output"), cand, ref):  # name the first difference, not two dicts
        for name in [*c, *(k for k in r if k not in c)]:
            if name not in r or name not in c:
                which, other = ("candidate", "reference") if name in c else ("reference", "candidate")
                raise InputError(
                    f"candidate and reference differ: the {which} has {kind} '{name}', the {other} does not "
                    f"(its {kind}s: {', '.join(r if name in c else c) or 'none'})"
                )
            if not _fits(c[name], r[name]):
                raise InputError(
                    f"candidate and reference differ: {kind} '{name}' is {_shown(c[name])} in the candidate, "
                    f"{_shown(r[name])} in the reference"
                )


def _shown(described) -> str:
    """'[?, 40] float' from a `_signature` entry."""
    dims, dtype = described
    return ("[" + ", ".join(map(str, dims)) + "]" if dims is not None else "[no declared shape]") + f" {dtype}"


def load_truth(path: Path, spec: RolloutSpec, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    stored = npz_arrays(
        path,
        "truth file",
        "expected one array per trajectory output shaped (windows, steps, *output) (numpy.savez); "
        "with CSV contexts, leave --truth out to use the rows after each window",
    )
    truth = {}
    for name in spec.trajectory:
        if name not in stored:
            raise InputError(f"truth file {path} has no array for trajectory output '{name}'")
        array = stored[name]
        want = shapes[name]
        if array.ndim == len(want) - 1 and len(want) > 2 and want[2] == 1 and array.shape[2:] == want[3:]:
            array = array[:, :, None]  # windows without their batch axis of one, as contexts may be given
        if (
            array.ndim != len(want)
            or array.shape[0] != want[0]
            or array.shape[2:] != want[2:]
            or array.shape[1] < want[1]
        ):
            expected = ", ".join(
                [str(want[0]), f"{want[1]} or more", *map(str, want[2:])]
            )  # longer truths are cut to the rollout
            raise InputError(
                f"truth '{name}' has shape {list(array.shape)}; expected [{expected}] (windows, steps, *output)"
            )
        truth[name] = array[:, : want[1]].astype(np.float64)
        if not np.all(np.isfinite(truth[name])):
            raise InputError(f"truth '{name}' in {path} contains NaN or Inf")
    return truth


@dataclass
class _Rollouts:
    """Both models rolled out from the same contexts, and what the report says about how."""

    spec: RolloutSpec
    """The resolved spec: its trajectory outputs are the ones measured (and gated)."""
    contexts: Contexts
    inputs: list
    batched: bool
    """Whether the engine ran several windows per call (latency times calls the same way)."""
    mode: dict
    following: int
    """Rows after each CSV window used as the truth (0: none)."""
    side: tuple[str, ...]
    """Outputs outside the trajectory, rolled out alongside and reported apart."""
    candidate: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]


def _roll_out(
    candidate: "graph_ops.LoadedModel",
    reference: "graph_ops.LoadedModel",
    contexts: str | Path,
    spec: RolloutSpec | str | Path | None,
    steps: int | None,
    truth,
    settings: EvalSettings,
    references: dict | None = None,
) -> _Rollouts:
    """The candidate's trajectories, then the reference's (from `references` when an earlier call rolled it out on
    the same windows and settings), one session open at a time."""
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "optimized.onnx")
        session = _open(candidate, settings, optimized)
        mode = runtime_mode(settings, optimized, candidate.proto)
    inputs = [s for s in session.inputs if s.name not in session.weights]
    resolved = resolve_spec(spec, steps, inputs, session.outputs)
    csv = Path(contexts).suffix.lower() == ".csv"
    following = continuation_rows(resolved, session.outputs, inputs) if csv and not truth else 0
    options = ContextOptions(
        windows=settings.windows, zscore=settings.zscore, seed=settings.seed, columns=settings.columns
    )
    ctx = load_contexts(Path(contexts), inputs, options, following=following)
    side = tuple(o.name for o in session.outputs if o.name not in resolved.trajectory)
    followed = replace(resolved, trajectory=resolved.trajectory + side)  # side outputs ride along, measured apart
    engine = RolloutEngine(session, ctx, followed, settings.max_batch_windows)
    cand = engine.trajectories()
    _closed(session)
    key = (reference.sha256, str(contexts), repr(followed), following, repr(replace(settings, latency=None)))
    ref = dict(references[key]) if references is not None and key in references else None
    if ref is None:
        session = _open(reference, settings)
        ref = trajectories(session, ctx, followed, settings.max_batch_windows)
        _closed(session)
        if references is not None:
            references[key] = dict(ref)
    return _Rollouts(resolved, ctx, inputs, engine.batched, mode, following, side, cand, ref)


def _check_reference(run: _Rollouts, reference: Path, variable_axis: int | None) -> None:
    """A reference that cannot be compared against is an input error, not a failed gate; so is a variable axis
    the outputs do not have."""
    for name, values in run.reference.items():
        if not np.all(np.isfinite(values)):
            raise InputError(
                f"the reference model {reference} produces NaN or Inf on these contexts "
                f"(output '{name}'); there is nothing to compare against"
            )
    if variable_axis is not None:
        per_step = min(v.ndim for v in run.reference.values()) - 2  # (windows, steps, *output)
        if not -per_step <= variable_axis < per_step:
            raise InputError(
                f"--variable-axis {variable_axis} is not an axis of the per-step outputs (they have {per_step})"
            )


def _truths(truth, contexts: str | Path, run: _Rollouts) -> tuple[dict[str, np.ndarray], str | None]:
    """The truth of every trajectory output (none without a truth file or CSV rows after the windows), and where
    it came from in words."""
    shapes = {k: v.shape for k, v in run.reference.items()}
    if truth:
        return load_truth(Path(truth), run.spec, shapes), str(truth)
    if run.following:
        truths = truth_from_csv(run.contexts, run.spec, run.inputs, shapes)
        return truths, f"the {run.following} rows after each window of {contexts}"
    return {}, None


def _output(
    name: str,
    candidate: np.ndarray,
    reference: np.ndarray,
    truth: np.ndarray | None,
    vectors: bool,
    settings: EvalSettings,
) -> dict:
    """One trajectory output's entry: its metrics (per variable too, when asked), its cosines when read as
    vectors; a non-finite candidate has an infinite degradation."""
    if not np.all(np.isfinite(candidate)):
        entry = {"nonfinite": True, "degradation_pct": math.inf, "degradation_basis": "non-finite output"}
        if vectors:  # no similarity to speak of: a --min-cosine bound fails
            entry["cosine"] = {
                "vectors": int(candidate.size // candidate.shape[-1]),
                "dim": int(candidate.shape[-1]),
                "mean": math.nan,
                "min": math.nan,
            }
        return entry
    entry = metrics(candidate, reference, truth, settings.bootstrap, settings.seed)
    if vectors:
        entry["cosine"] = vector_metrics(candidate, reference)
    if settings.variable_axis is not None:
        axis = 2 + settings.variable_axis % (candidate.ndim - 2)
        entry["variables"] = {
            str(i): metrics(
                np.take(candidate, [i], axis),
                np.take(reference, [i], axis),
                np.take(truth, [i], axis) if truth is not None else None,
                settings.bootstrap,
                settings.seed,
            )
            for i in range(candidate.shape[axis])
        }
    return entry


def evaluate(
    candidate: str | Path,
    reference: str | Path,
    contexts: str | Path,
    *,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    truth: str | Path | None = None,
    settings: EvalSettings = EvalSettings(),
    references: dict | None = None,
) -> dict:
    """Metrics of `candidate` against `reference` (and the truth), as plain data. `references`: the reference's
    trajectories kept between calls that share it (the frontier's), rolled out once per windows and settings."""
    candidate, reference = Path(candidate), Path(reference)
    cand_model, ref_model = _load(candidate), _load(reference)
    _check_same_signature(cand_model.proto, ref_model.proto)
    run = _roll_out(cand_model, ref_model, contexts, spec, steps, truth, settings, references)
    side_outputs = {
        name: side_metrics(run.candidate.pop(name), run.reference.pop(name), settings.bootstrap, settings.seed)
        for name in run.side
        if name in run.candidate and name in run.reference
    }
    _check_reference(run, reference, settings.variable_axis)
    truths, truth_source = _truths(truth, contexts, run)
    declared = {name: dims for name, (dims, _) in _signature(ref_model.proto)[1].items()}
    outputs = {}
    for name in run.spec.trajectory:
        vectors = settings.cosine or (settings.cosine is None and looks_like_embedding(name, declared.get(name)))
        outputs[name] = _output(name, run.candidate[name], run.reference[name], truths.get(name), vectors, settings)
    latency = _latency(run, cand_model, ref_model, settings) if settings.latency is not None else None
    memory = _memory(run, candidate, reference, settings) if settings.memory else None
    ref_bits, cand_bits = graph_ops.weight_bits(ref_model.proto), graph_ops.weight_bits(cand_model.proto)
    ctx = run.contexts
    return {
        "candidate": str(candidate),
        "reference": str(reference),
        "contexts": str(contexts),
        "truth": truth_source,
        "windows": ctx.count,
        "series": list(ctx.csv["columns"]) if ctx.csv and ctx.csv["layout"] == "univariate" else None,
        "warnings": list(ctx.warnings),
        "steps": run.spec.steps,
        "runtime": run.mode,
        "candidate_file_bytes": cand_model.file_bytes,
        "reference_file_bytes": ref_model.file_bytes,
        "compression": compression(ref_bits, cand_bits),
        "reference_weight_bits": ref_bits,
        "candidate_weight_bits": cand_bits,
        "outputs": outputs,
        "side_outputs": side_outputs,
        "degradation_pct": max(o["degradation_pct"] for o in outputs.values()),
        "latency": latency,
        "memory": memory,
        "forms": forms(cand_model.proto),
        "oldest_onnxruntime": oldest_onnxruntime(cand_model.proto),
    }


def _memory(run: _Rollouts, candidate: Path, reference: Path, settings: EvalSettings) -> dict | None:
    """Each model's resident memory in a fresh process on the contexts' first batch (`runtimes.memory`); None
    where it cannot be read (not Linux)."""
    from runtimes.memory import measure_each
    from tqsdeploy.evaluation.latency import batch_feeds

    feeds = batch_feeds(run.contexts, run.inputs, run.batched, min(run.contexts.count, settings.max_batch_windows))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "feeds.npz"
        np.savez(path, **feeds)
        found = dict(zip(("candidate", "reference"), measure_each([candidate, reference], path, settings.provider)))
    if any(value is None for value in found.values()):
        return None
    reference_peak = max(found["reference"].peak_bytes, 1)
    return {
        **{
            label: {"peak_bytes": value.peak_bytes, "steady_bytes": value.steady_bytes}
            for label, value in found.items()
        },
        "peak_ratio": found["candidate"].peak_bytes / reference_peak,
        "basis": "resident-set growth of a fresh process from just before the session is created to after 3 calls",
    }


def _latency(run: _Rollouts, cand_model, ref_model, settings: EvalSettings) -> dict:
    """Candidate and reference timed on the eval's contexts, at the eval's batch."""
    batch = min(run.contexts.count, settings.max_batch_windows)
    return measure_latency(
        lambda: _open(cand_model, settings),
        lambda: _open(ref_model, settings),
        run.contexts,
        run.inputs,
        run.batched,
        batch,
        settings.latency,
    )
