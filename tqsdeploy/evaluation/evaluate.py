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
neighbour among the others stays the same (`_vector_metrics`).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

import graph_ops
import graph_ops.qdq
from runtimes import Session, for_provider, release_freed_memory
from tqsdeploy.rollout.contexts import ContextOptions, Contexts, continuation_rows, load_contexts, npz_arrays, truth_from_csv
from tqsdeploy.errors import InputError
from tqsdeploy.files import json_text, write_texts
from tqsdeploy.progress import counted
from tqsdeploy.rollout.engine import RolloutEngine
from tqsdeploy.evaluation.latency import LatencySettings, measure as measure_latency
from tqsdeploy.rollout import RolloutSpec, resolve_spec
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
    """Time candidate and reference (`tqsdeploy.evaluation.latency`); None: not measured (the CLI measures by default)."""


EMBEDDING_NAME = re.compile(r"embed|pool|sentence|hidden_state", re.IGNORECASE)
"""Output names that say their values are vectors: embedding(s), pooled/pooler_output, sentence_embedding,
last_hidden_state."""
NEIGHBOUR_VECTORS = 4096
"""Nearest neighbours are compared among at most this many vectors (the first ones): N² similarities."""


def looks_like_embedding(name: str, dims: list | None) -> bool:
    """An output read as vectors by default: named like an embedding (`EMBEDDING_NAME`) and shaped
    [batch, dim] or [batch, tokens, dim] with a fixed dim above 1."""
    return bool(EMBEDDING_NAME.search(name)) and dims is not None and len(dims) in (2, 3) and isinstance(dims[-1], int) and dims[-1] > 1


def _vector_metrics(candidate: np.ndarray, reference: np.ndarray) -> dict:
    """Cosine similarity of every candidate vector (the last axis) to its reference vector, and for the
    first `NEIGHBOUR_VECTORS` vectors whether each one's nearest neighbour (by cosine, itself excluded)
    is the same vector in both models."""
    dim = reference.shape[-1]
    c, r = (np.asarray(a, np.float64).reshape(-1, dim) for a in (candidate, reference))
    unit_c, unit_r = (a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-300) for a in (c, r))
    cosine = np.sum(unit_c * unit_r, axis=1)
    result = {"vectors": int(cosine.size), "dim": int(dim), "mean": float(cosine.mean()), "min": float(cosine.min())}
    count = min(len(c), NEIGHBOUR_VECTORS)
    if count >= 3:  # with two vectors each is the other's neighbour whatever the models do
        same = sum(int(np.sum(_nearest(unit_c[:count], start) == _nearest(unit_r[:count], start))) for start in range(0, count, 512))
        result.update({"same_neighbour": same, "neighbour_vectors": count})
    return result


def _nearest(unit: np.ndarray, start: int, rows: int = 512) -> np.ndarray:
    """Index of each of rows start..start+rows' nearest other vector among `unit` (unit-norm rows)."""
    similarity = unit[start:start + rows] @ unit.T
    similarity[np.arange(similarity.shape[0]), np.arange(start, start + similarity.shape[0])] = -np.inf
    return np.argmax(similarity, axis=1)


def trajectories(session: Session, contexts: Contexts, spec: RolloutSpec, max_batch: int) -> dict[str, np.ndarray]:
    """Every trajectory output as (windows, steps, *per-window shape), by the one rollout engine."""
    return RolloutEngine(session, contexts, spec, max_batch).trajectories()


def _load(path: Path) -> "graph_ops.LoadedModel":
    return graph_ops.load_model(path, load_external=False)  # sizes need shapes only; the runtime reads the weights


CHECKED_FOLDING_BYTES = 256 << 20
"""Largest file whose dequantized layout eval has ONNX Runtime write out folded (float-size) to check that no
dequantization runs per call; past it the check would write gigabytes."""


def _reads_codes(proto) -> bool:
    """Whether any node reads stored codes (integer or FP8 initializers): DequantizeLinear, or the
    'dequantized' layout's Casts."""
    return bool(graph_ops.qdq.per_call_dequantization(proto))


def _open(loaded: "graph_ops.LoadedModel", settings: EvalSettings, optimized: str | None = None) -> Session:
    dequantizes = any(n.op_type == "DequantizeLinear" for n in loaded.proto.graph.node)
    if not dequantizes and not (loaded.file_bytes < CHECKED_FOLDING_BYTES and _reads_codes(loaded.proto)):
        optimized = None  # nothing to fuse or fold: no need for ONNX Runtime to write out a whole copy of the model
    runtime = for_provider(settings.provider, exact_qdq=settings.exact, optimized_model_path=optimized).for_model(loaded.proto)
    source = graph_ops.io.runnable_path(loaded)  # the file itself: no serialised copy, any size
    if source is None:  # an IR the runtime refuses: a clamped copy (bytes, or a temporary file past 2 GiB)
        source = graph_ops.io.session_source(graph_ops.io.runtime_compatible(graph_ops.load_model(loaded.path).proto))
    return runtime.open(source, external_data_dir=None if isinstance(source, bytes) else source.parent)


def _closed(session: Session) -> None:
    """Close a session and hand its memory back before the next one opens: eval holds one model's
    session at a time, so its peak is one model, not two."""
    session.close()
    release_freed_memory()


def _runtime_mode(settings: EvalSettings, optimized_path: str, proto) -> dict:
    fused, per_call = 0, None
    if os.path.exists(optimized_path):
        optimized = graph_ops.wire.skeleton(optimized_path)  # node types only: the weights stay in the file
        fused = sum(1 for n in optimized.graph.node if n.op_type == "MatMulNBits")
        per_call = graph_ops.qdq.per_call_dequantization(optimized)
    dequantizes = any(n.op_type == "DequantizeLinear" for n in proto.graph.node)
    if not dequantizes and not _reads_codes(proto):  # the original, or an fp16 copy: nothing to fuse or fold
        mode = f"ONNX Runtime default on {settings.provider}: float weights (no stored codes, nothing to fuse or fold); float kernels"
    elif not dequantizes:
        checked = "its optimized graph reads no codes" if per_call == {} else ("not checked: a large file" if per_call is None else f"yet its optimized graph still reads codes: {per_call}")
        mode = (f"ONNX Runtime default on {settings.provider}: weights stored dequantized-at-load, folded into float initializers when the session is created "
                f"({checked}); float kernels, exact")
    elif settings.exact:
        mode = "exact dequantization (session.qdq_matmulnbits_accuracy_level=0)"
    elif settings.provider == "cpu" and fused == 0 and per_call is not None:  # say, Conv kernels: no MatMul to fuse with
        mode = "ONNX Runtime default on cpu: DequantizeLinear runs on every call (no MatMul it fuses with into MatMulNBits); float kernels, exact"
    elif settings.provider == "cpu":
        mode = "ONNX Runtime default: DequantizeLinear->MatMul fused into MatMulNBits with accuracy_level 4 (int8 activations)"
    else:  # the CUDA kernel: the demo export drifted 0.076% there on an H100, 0.117% with the CPU's int8 activations
        mode = f"ONNX Runtime default on {settings.provider}: DequantizeLinear->MatMul fused into MatMulNBits, run by the GPU kernel (float activations; accuracy_level is the CPU kernel's setting)"
    return {"provider": settings.provider, "mode": mode, "matmulnbits_nodes": fused, "exact": settings.exact, "per_call_dequantization": per_call}


def _bootstrap(samples: tuple[np.ndarray, ...], statistic, rounds: int, seed: int) -> list[float]:
    """95% BCa interval of `statistic(*samples, axis)` over context windows resampled together
    (scipy.stats.bootstrap: BCa corrects the bias and skew a percentile interval shows over few
    windows); the percentile interval where BCa is undefined (say, identical windows)."""
    import warnings

    from scipy import stats

    value = float(statistic(*samples, axis=-1))
    if samples[0].shape[0] < 2 or rounds <= 0:
        return [value, value]
    for method in ("BCa", "percentile"):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = stats.bootstrap(samples, statistic, n_resamples=rounds, paired=True, vectorized=True, method=method, rng=np.random.default_rng(seed))
        low, high = result.confidence_interval
        if np.isfinite(low) and np.isfinite(high):
            return [float(low), float(high)]
    return [value, value]


def _mean(sample: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(sample, axis=axis)


def _degradation(candidate: np.ndarray, reference: np.ndarray, axis: int = -1) -> np.ndarray:
    """(MAE_candidate - MAE_reference) / MAE_reference in percent, from per-window MAEs."""
    mae_c, mae_r = np.mean(candidate, axis=axis), np.mean(reference, axis=axis)
    return (mae_c - mae_r) / np.maximum(mae_r, 1e-30) * 100


def _growth_rate(per_step: np.ndarray) -> float | None:
    """Slope of ln(error) over steps: the error-growth rate per step."""
    keep = per_step > 0
    if keep.sum() < 2:
        return None
    steps = np.arange(1, per_step.size + 1)[keep]
    return float(np.polyfit(steps, np.log(per_step[keep]), 1)[0])


def _metrics(candidate: np.ndarray, reference: np.ndarray, truth: np.ndarray | None, settings: EvalSettings) -> dict:
    """All metrics for one output (or one variable), arrays shaped (windows, steps, ...)."""
    n, t = candidate.shape[:2]
    diff = np.abs(candidate - reference).reshape(n, t, -1)
    mae_window = diff.mean(axis=(1, 2))
    ref_scale = float(np.abs(reference).mean()) or 1e-30
    result = {
        "vs_reference": {
            "mae": float(diff.mean()),
            "rmse": float(np.sqrt(np.square(diff).mean())),
            "mae_ci95": _bootstrap((mae_window,), _mean, settings.bootstrap, settings.seed),
            "drift_pct": float(diff.mean() / ref_scale * 100),
            "mae_by_step": diff.mean(axis=(0, 2)).tolist(),
            "mae_by_window": mae_window.tolist(),
            "growth_rate": _growth_rate(diff.mean(axis=(0, 2))),
        }
    }
    if truth is not None:
        cand_err = np.abs(candidate - truth).reshape(n, t, -1)
        ref_err = np.abs(reference - truth).reshape(n, t, -1)
        mae_c, mae_r = float(cand_err.mean()), float(ref_err.mean())
        windows = (cand_err.mean(axis=(1, 2)), ref_err.mean(axis=(1, 2)))
        result["vs_truth"] = {
            "mae": mae_c,
            "rmse": float(np.sqrt(np.square(candidate - truth).mean())),
            "reference_mae": mae_r,
            "reference_rmse": float(np.sqrt(np.square(reference - truth).mean())),
            "degradation_pct": (mae_c - mae_r) / max(mae_r, 1e-30) * 100,
            "degradation_ci95": _bootstrap(windows, _degradation, settings.bootstrap, settings.seed),
            "mae_by_step": cand_err.mean(axis=(0, 2)).tolist(),
            "reference_mae_by_step": ref_err.mean(axis=(0, 2)).tolist(),
            "mae_by_window": windows[0].tolist(),
            "reference_mae_by_window": windows[1].tolist(),
            "growth_rate": _growth_rate(cand_err.mean(axis=(0, 2))),
        }
    result["degradation_pct"] = result["vs_truth"]["degradation_pct"] if truth is not None else result["vs_reference"]["drift_pct"]
    result["degradation_basis"] = "truth" if truth is not None else "reference drift"
    return result


def _side_metrics(candidate: np.ndarray, reference: np.ndarray, settings: EvalSettings) -> dict:
    """How far an output outside the trajectory moved (reported, never gated): the score follows only the
    trajectory, so units feeding nothing else score dead and drop to the lowest tier, and an output such as
    a quantile head can drift far while the forecast does not."""
    if not (np.all(np.isfinite(candidate)) and np.all(np.isfinite(reference))):
        return {"nonfinite": True}
    return _metrics(candidate, reference, None, settings)


def _signature(proto) -> tuple[dict, dict]:
    """Inputs (weights aside) and outputs, each with its element type and dims ('?' where
    symbolic; None where the graph declares no shape)."""
    initializers = {t.name for t in proto.graph.initializer}

    def describe(value):
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else "?" for d in tensor.shape.dim] if tensor.HasField("shape") else None
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
                raise InputError(f"candidate and reference differ: the {which} has {kind} '{name}', the {other} does not "
                                 f"(its {kind}s: {', '.join(r if name in c else c) or 'none'})")
            if not _fits(c[name], r[name]):
                raise InputError(f"candidate and reference differ: {kind} '{name}' is {_shown(c[name])} in the candidate, {_shown(r[name])} in the reference")


def _shown(described) -> str:
    """'[?, 40] float' from a `_signature` entry."""
    dims, dtype = described
    return ("[" + ", ".join(map(str, dims)) + "]" if dims is not None else "[no declared shape]") + f" {dtype}"


def load_truth(path: Path, spec: RolloutSpec, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    stored = npz_arrays(path, "truth file", "expected one array per trajectory output shaped (windows, steps, *output) (numpy.savez); "
                                           "with CSV contexts, leave --truth out to use the rows after each window")
    truth = {}
    for name in spec.trajectory:
        if name not in stored:
            raise InputError(f"truth file {path} has no array for trajectory output '{name}'")
        array = stored[name]
        want = shapes[name]
        if array.ndim == len(want) - 1 and len(want) > 2 and want[2] == 1 and array.shape[2:] == want[3:]:
            array = array[:, :, None]  # windows without their batch axis of one, as contexts may be given
        if array.ndim != len(want) or array.shape[0] != want[0] or array.shape[2:] != want[2:] or array.shape[1] < want[1]:
            expected = ", ".join([str(want[0]), f"{want[1]} or more", *map(str, want[2:])])  # longer truths are cut to the rollout
            raise InputError(f"truth '{name}' has shape {list(array.shape)}; expected [{expected}] (windows, steps, *output)")
        truth[name] = array[:, : want[1]].astype(np.float64)
        if not np.all(np.isfinite(truth[name])):
            raise InputError(f"truth '{name}' in {path} contains NaN or Inf")
    return truth


def evaluate(
    candidate: str | Path,
    reference: str | Path,
    contexts: str | Path,
    *,
    spec: RolloutSpec | str | Path | None = None,
    steps: int | None = None,
    truth: str | Path | None = None,
    settings: EvalSettings = EvalSettings(),
) -> dict:
    """Metrics of `candidate` against `reference` (and the truth), as plain data."""
    candidate, reference = Path(candidate), Path(reference)
    cand_model, ref_model = _load(candidate), _load(reference)
    _check_same_signature(cand_model.proto, ref_model.proto)
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "optimized.onnx")
        session = _open(cand_model, settings, optimized)
        mode = _runtime_mode(settings, optimized, cand_model.proto)
    inputs = [s for s in session.inputs if s.name not in session.weights]
    resolved = resolve_spec(spec, steps, inputs, session.outputs)
    csv = Path(contexts).suffix.lower() == ".csv"
    following = continuation_rows(resolved, session.outputs, inputs) if csv and not truth else 0
    options = ContextOptions(windows=settings.windows, zscore=settings.zscore, seed=settings.seed, columns=settings.columns)
    ctx = load_contexts(Path(contexts), inputs, options, following=following)
    side = tuple(o.name for o in session.outputs if o.name not in resolved.trajectory)
    followed = replace(resolved, trajectory=resolved.trajectory + side)  # side outputs ride along, measured apart
    engine = RolloutEngine(session, ctx, followed, settings.max_batch_windows)
    cand = engine.trajectories()
    _closed(session)
    session = _open(ref_model, settings)
    ref = trajectories(session, ctx, followed, settings.max_batch_windows)
    _closed(session)
    side_outputs = {name: _side_metrics(cand.pop(name), ref.pop(name), settings) for name in side if name in cand and name in ref}
    for name, values in ref.items():  # a reference that cannot be compared against is an input error, not a failed gate
        if not np.all(np.isfinite(values)):
            raise InputError(f"the reference model {reference} produces NaN or Inf on these contexts (output '{name}'); there is nothing to compare against")
    if settings.variable_axis is not None:
        per_step = min(v.ndim for v in ref.values()) - 2  # (windows, steps, *output)
        if not -per_step <= settings.variable_axis < per_step:
            raise InputError(f"--variable-axis {settings.variable_axis} is not an axis of the per-step outputs (they have {per_step})")
    shapes = {k: v.shape for k, v in ref.items()}
    truth_source = str(truth) if truth else None
    if truth:
        truths = load_truth(Path(truth), resolved, shapes)
    elif following:
        truths = truth_from_csv(ctx, resolved, inputs, shapes)
        truth_source = f"the {following} rows after each window of {contexts}"
    else:
        truths = {}
    outputs = {}
    declared = {name: dims for name, (dims, _) in _signature(ref_model.proto)[1].items()}
    for name in resolved.trajectory:
        vectors = settings.cosine or (settings.cosine is None and looks_like_embedding(name, declared.get(name)))
        if not np.all(np.isfinite(cand[name])):
            outputs[name] = {"nonfinite": True, "degradation_pct": math.inf, "degradation_basis": "non-finite output"}
            if vectors:  # no similarity to speak of: a --min-cosine bound fails
                outputs[name]["cosine"] = {"vectors": int(cand[name].size // cand[name].shape[-1]), "dim": int(cand[name].shape[-1]), "mean": math.nan, "min": math.nan}
            continue
        entry = _metrics(cand[name], ref[name], truths.get(name), settings)
        if vectors:
            entry["cosine"] = _vector_metrics(cand[name], ref[name])
        if settings.variable_axis is not None:
            axis = 2 + settings.variable_axis % (cand[name].ndim - 2)
            entry["variables"] = {
                str(i): _metrics(np.take(cand[name], [i], axis), np.take(ref[name], [i], axis), np.take(truths[name], [i], axis) if name in truths else None, settings)
                for i in range(cand[name].shape[axis])
            }
        outputs[name] = entry
    latency = None
    if settings.latency is not None:
        latency = measure_latency(lambda: _open(cand_model, settings), lambda: _open(ref_model, settings), ctx, inputs, engine.batched,
                                  min(ctx.count, settings.max_batch_windows), settings.latency)
    ref_bits, cand_bits = graph_ops.weight_bits(ref_model.proto), graph_ops.weight_bits(cand_model.proto)
    return {
        "candidate": str(candidate),
        "reference": str(reference),
        "contexts": str(contexts),
        "truth": truth_source,
        "windows": ctx.count,
        "series": list(ctx.csv["columns"]) if ctx.csv and ctx.csv["layout"] == "univariate" else None,
        "warnings": list(ctx.warnings),
        "steps": resolved.steps,
        "runtime": mode,
        "candidate_file_bytes": cand_model.file_bytes,
        "reference_file_bytes": ref_model.file_bytes,
        "compression": compression(ref_bits, cand_bits),
        "reference_weight_bits": ref_bits,
        "candidate_weight_bits": cand_bits,
        "outputs": outputs,
        "side_outputs": side_outputs,
        "degradation_pct": max(o["degradation_pct"] for o in outputs.values()),
        "latency": latency,
    }


def _series(columns: list[str] | None) -> str:
    """' × 2 series each (CSV columns HUFL, OT)' where a univariate model read several CSV columns: every metric
    averages over them, which '8 context windows' alone once hid."""
    return f" × {len(columns)} series each (CSV columns {', '.join(columns)})" if columns and len(columns) > 1 else ""


def markdown(report: dict) -> str:
    lines = [
        f"### Evaluation of `{Path(report['candidate']).name}` against `{Path(report['reference']).name}`",
        "",
        f"{counted(report['windows'], 'context window')}{_series(report.get('series'))} × {counted(report['steps'], 'step')}; compression {report['compression']:.2f}×; "
        f"{report['candidate_file_bytes'] / 1e6:.3f} MB vs {report['reference_file_bytes'] / 1e6:.3f} MB.",
        f"Runtime: {report['runtime']['provider']}, {report['runtime']['mode']}; MatMulNBits nodes: {report['runtime']['matmulnbits_nodes']}.",
        f"Truth: {report['truth']}." if report.get("truth") else "No truth: degradation is the drift from the reference.",
        "",
        "| output | MAE vs ref | RMSE vs ref | MAE 95% CI | drift % | growth/step | MAE vs truth | ref MAE vs truth | degradation % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, o in report["outputs"].items():
        if o.get("nonfinite"):
            lines.append(f"| {name} | non-finite | | | | | | | inf |")
            continue
        r, t = o["vs_reference"], o.get("vs_truth")
        growth = f"{r['growth_rate']:.4f}" if r["growth_rate"] is not None else "-"
        truth_cells = f"{t['mae']:.5g} | {t['reference_mae']:.5g} | {t['degradation_pct']:.3f} [{t['degradation_ci95'][0]:.3f}, {t['degradation_ci95'][1]:.3f}]" if t else "- | - | " + f"{o['degradation_pct']:.3f} (drift)"
        lines.append(
            f"| {name} | {r['mae']:.5g} | {r['rmse']:.5g} | [{r['mae_ci95'][0]:.4g}, {r['mae_ci95'][1]:.4g}] | {r['drift_pct']:.3f} | {growth} | {truth_cells} |"
        )
    side = report.get("side_outputs") or {}
    if side:
        moved = ", ".join(f"{name} {'non-finite' if o.get('nonfinite') else format(o['vs_reference']['drift_pct'], '.3f') + '%'}" for name, o in side.items())
        lines += ["", f"Outputs outside the trajectory (drift from the reference; not scored, not gated: units feeding only them score dead "
                      f"and go to the lowest tier; list them in the rollout spec's `trajectory` to protect them): {moved}."]
    vectors = {name: o["cosine"] for name, o in report["outputs"].items() if "cosine" in o}
    if vectors:
        lines += ["", "| output (vectors) | cosine mean | cosine min | same nearest neighbour |", "|---|---|---|---|"]
        for name, v in vectors.items():
            same = f"{v['same_neighbour']}/{v['neighbour_vectors']}" if "same_neighbour" in v else "- (fewer than 3 vectors)"
            lines.append(f"| {name} ({v['vectors']} × {v['dim']}) | {v['mean']:.6f} | {v['min']:.6f} | {same} |")
    if report.get("latency"):
        from tqsdeploy.evaluation.latency import markdown as latency_lines

        lines += latency_lines(report["latency"], f"{report['runtime']['provider']}, {report['runtime']['mode']}")
    return "\n".join(lines) + "\n"


def write_report(report: dict, prefix: Path) -> tuple[Path, Path]:
    """PREFIX.json and PREFIX.md; a prefix named like either file (--report r.json) is taken as that file's
    prefix, not written as r.json.json and r.json.md."""
    prefix = Path(prefix)
    if prefix.suffix.lower() in (".json", ".md"):
        prefix = prefix.with_suffix("")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = Path(f"{prefix}.json"), Path(f"{prefix}.md")
    write_texts({json_path: json_text(report), md_path: markdown(report)})
    return json_path, md_path
