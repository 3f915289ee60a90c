"""Baseline weight quantizers on an ONNX model: RTN, GPTQ, GPTAQ and QEP.

These are the reference points a TQS allocation is compared against. The
math lives in `tiers.gptq`, the graph reading in `graph_ops.calibration`;
this module runs the sequential calibration of the spec (§5 of
/work/shared/specs/baselines.md) with one ONNX Runtime session: weights are
overridable feeds and every layer input is an extra output, so the same
session gives full-precision activations (original weights) and
quantized-prefix activations (current weights). Weights whose inputs cannot be
rebuilt get RTN under every method, so all four quantize the same tensors.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter

import numpy as np

import graph_ops
from graph_ops.calibration import WeightBinding, expose_tensors, layer_inputs, waves, weight_bindings
from runtimes.ort import OrtRuntime
from tiers import gptq as solvers
from tiers.encoded import Encoded
from tqsdeploy.contexts import Contexts, load_npz
from tqsdeploy.errors import InputError, TqsError
from tqsdeploy.units import UnitSelection, select_units

METHODS = ("rtn", "gptq", "gptaq", "qep")
DEFAULT_ALPHA = {"gptaq": 0.25, "qep": 0.5}
"""GPTAQ's hard-coded α and the QEP CLI's perccorr."""


class BaselineError(TqsError):
    """A baseline method failed on one tensor (non-finite result, singular Hessian)."""


@dataclass
class BaselineResult:
    """Quantized weights of one baseline run, in the model's stored layout."""

    method: str
    bits: int
    encoded: dict[str, Encoded]
    """Codes and DequantizeLinear parameters per initializer; `.dequantize()` == `weights[name]`."""
    weights: dict[str, np.ndarray]
    """Fake-quantized weights, stored layout and dtype, ready for replace_weights or feeds."""
    timings: dict[str, float]
    """Seconds per stage: load, calibration (runs + statistics), apply (the method's math), total."""
    errors: dict[str, float] = field(default_factory=dict)
    """‖X̂W - X̂Q‖_F per calibrated weight, X̂ being the inputs of its wave."""
    rtn_errors: dict[str, float] = field(default_factory=dict)
    """The same error for plain RTN on the same X̂, for comparison."""
    waves: list[list[str]] = field(default_factory=list)
    rtn_only: dict[str, str] = field(default_factory=dict)
    """Weights quantized with RTN whatever the method, and why."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    """Per-run choices shared by every weight."""

    method: str
    bits: int
    scheme: str | None
    group_size: int
    mse: bool
    percdamp: float
    block_size: int
    act_order: bool
    static_groups: bool
    alpha: float
    percdampqep: float
    qep_base: str
    qep_skip: re.Pattern | None


def quantize_baseline(
    model_path: str | Path,
    method: str,
    bits: int,
    calib: Contexts | str | Path | None = None,
    *,
    group_size: int = -1,
    symmetric: bool = False,
    sym_style: str = "gptq",
    mse: bool = False,
    percdamp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    alpha: float | None = None,
    percdampqep: float = 1.0,
    qep_base: str = "gptq",
    qep_skip: str | None = None,
    min_params: int = 1024,
    names: list[str] | None = None,
    max_batch_windows: int = 32,
    runtime: OrtRuntime = OrtRuntime(),
) -> BaselineResult:
    """Quantize a model's weights with one baseline method.

    Defaults follow the official code: asymmetric min-max per channel,
    percdamp 0.01, block 128, α = 0.25 (GPTAQ) / 0.5 with percdampqep 1.0
    (QEP on top of GPTQ). `sym_style` picks GPTQ ('gptq') or QuaRot
    ('quarot') symmetric grids; 1 bit is the declared sign(w)·mean|w|
    extension. `qep_skip` is a regex of weights QEP does not correct (the
    official script skips mlp.down_proj). RTN needs no calibration; the
    others take windows in the contexts format (`load_npz`), run
    teacher-forced in one pass.
    """
    started = perf_counter()
    plan = _plan(method, bits, group_size, symmetric, sym_style, mse, percdamp, block_size, act_order, static_groups, alpha, percdampqep, qep_base, qep_skip)
    runtime.check()
    loaded = graph_ops.load_model(model_path)
    chosen = list(names) if names else _selected(loaded.proto, min_params)
    proto = graph_ops.make_weights_overridable(loaded.proto, chosen)
    bindings = weight_bindings(proto, chosen)
    original = graph_ops.read_weights(proto, chosen)
    stages = waves(proto, bindings) if plan.method != "rtn" else []
    if stages and calib is None:
        raise InputError(f"{method} needs calibration windows", hint="pass a contexts .npz (or use method 'rtn')")
    result = BaselineResult(method, bits, {}, {}, {"load": perf_counter() - started, "calibration": 0.0, "apply": 0.0}, waves=stages)
    _note_settings(plan, result)
    for name, binding in bindings.items():
        if plan.method == "rtn" or not binding.calibratable:
            if binding.rtn_reason and plan.method != "rtn":
                result.rtn_only[name] = binding.rtn_reason
            tick = perf_counter()
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # _store reports non-finite results
                _store(result, binding, original[name], [_rtn(plan, binding.to_wt(original[name]), _group(plan, binding, result))], name, "rtn")
            result.timings["apply"] += perf_counter() - tick
    if stages:
        source = _session_source(expose_tensors(proto, _layer_tensors(proto, bindings)), loaded)
        _sequential(source, proto, bindings, stages, original, calib, plan, max_batch_windows, runtime, result)
    result.timings["total"] = perf_counter() - started
    return result


def _selected(proto, min_params: int) -> list[str]:
    """The tensors every other command quantizes: float weight operands of at least min_params."""
    units = select_units(graph_ops.find_weight_tensors(proto), UnitSelection(min_params=min_params))
    return [n for u in units for n in u.tensor_names]


def _plan(method, bits, group_size, symmetric, sym_style, mse, percdamp, block_size, act_order, static_groups, alpha, percdampqep, qep_base, qep_skip) -> _Plan:
    if method not in METHODS:
        raise InputError(f"unknown baseline method '{method}'; choose one of {', '.join(METHODS)}")
    if qep_base not in ("gptq", "rtn"):
        raise InputError(f"QEP runs on 'gptq' or 'rtn', not '{qep_base}'")
    if sym_style not in ("gptq", "quarot"):
        raise InputError(f"symmetric style must be 'gptq' or 'quarot', not '{sym_style}'")
    scheme = None if bits == 1 else ({"gptq": "sym", "quarot": "quarot"}[sym_style] if symmetric else "asym")
    try:
        solvers.quant_spec(bits, scheme, group_size, mse)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if block_size < 1:
        raise InputError(f"block size must be positive, not {block_size}")
    try:
        skip = re.compile(qep_skip) if qep_skip else None
    except re.error as exc:
        raise InputError(f"qep_skip '{qep_skip}' is not a valid regular expression: {exc}") from None
    return _Plan(
        method, bits, scheme, group_size, mse, percdamp, block_size, act_order, static_groups or (act_order and group_size > 0),
        DEFAULT_ALPHA.get(method, 0.0) if alpha is None else alpha, percdampqep, qep_base, skip,
    )


def _note_settings(plan: _Plan, result: BaselineResult) -> None:
    if plan.bits == 1:
        result.notes.append("1 bit uses the declared sign(w)·mean|w| extension (codes ±1: store them as INT2 for DequantizeLinear)")
    if plan.act_order and plan.group_size > 0 and plan.method != "rtn" and not (plan.method == "qep" and plan.qep_base == "rtn"):
        result.notes.append("act_order with groups: static groups forced so each DequantizeLinear block stays contiguous")


def _group(plan: _Plan, binding: WeightBinding, result: BaselineResult) -> int:
    """The group size this weight can use: group-wise needs a plain 2-D matrix."""
    if plan.group_size <= 0:
        return -1
    if binding.perm is None or len(binding.shape) != 2 or binding.row_groups != 1:
        result.notes.append(f"'{binding.name}' {list(binding.shape)}: group-wise needs a 2-D weight, quantized per channel instead")
        return -1
    return plan.group_size


def _rtn(plan: _Plan, wt: np.ndarray, group_size: int) -> solvers.Quantized:
    return solvers.rtn(wt, plan.bits, group_size, plan.scheme, plan.mse)


def _layer_tensors(proto, bindings: dict[str, WeightBinding]) -> list[str]:
    """Every layer input the waves read that the graph does not already take as an input."""
    graph_inputs = {v.name for v in proto.graph.input}
    return sorted({u.x for b in bindings.values() if b.calibratable for u in b.uses} - graph_inputs)


def _session_source(proto, loaded: graph_ops.LoadedModel) -> bytes | Path:
    """Serialised model, or a side-car file with external data above protobuf's 2 GiB."""
    if graph_ops.io.stored_bytes(proto) < graph_ops.io.PROTOBUF_LIMIT:
        return graph_ops.model_bytes(proto)
    return graph_ops.save_model(proto, Path(loaded.path.parent, f".{loaded.stem}.tqs-baseline.onnx"), external_data=True)


def _sequential(source, proto, bindings, stages, original, calib, plan: _Plan, max_windows: int, runtime: OrtRuntime, result: BaselineResult) -> None:
    """Spec §5: per wave, collect statistics on the quantized prefix, then quantize the wave."""
    graph_inputs = {v.name for v in proto.graph.input}
    try:
        session = runtime.open(source)
    except Exception as exc:
        raise InputError(f"ONNX Runtime cannot load the calibration graph: {str(exc).splitlines()[0]}") from None
    inputs = [s for s in session.inputs if s.name not in session.weights]
    contexts = calib if isinstance(calib, Contexts) else load_npz(Path(calib), inputs)
    batch = all(s.rank > 0 and s.is_dynamic(0) for s in inputs)
    cross = plan.method in ("gptaq", "qep")
    thin = set()
    for stage in stages:
        tick = perf_counter()
        uses = {u.key: (u, bindings[name].row_groups) for name in stage for u in bindings[name].uses}
        stats = {key: None for key in uses}
        fetch = sorted({u.x for u, _ in uses.values()} - graph_inputs)
        changed = {n: result.weights[n] for n in result.weights}
        for _, feeds in contexts.chunks(inputs, batch, max_windows):
            quantized = _run(session, feeds, changed, fetch)
            full = _run(session, feeds, {}, fetch) if cross and changed else quantized
            for key, (use, groups) in uses.items():
                xs = layer_inputs(use, quantized[use.x], groups)
                xf = layer_inputs(use, full[use.x], groups) if cross else [None] * groups
                if stats[key] is None:
                    stats[key] = [solvers.Hessian(x.shape[1], cross) for x in xs]
                for part, x, x_fp in zip(stats[key], xs, xf):
                    part.add(x, x_fp)
        result.timings["calibration"] += perf_counter() - tick
        tick = perf_counter()
        for name in stage:
            binding = bindings[name]
            merged = [solvers.Hessian.merge([stats[u.key][g] for u in binding.uses]) for g in range(binding.row_groups)]
            if any(m.count < 2 * m.H.shape[0] for m in merged):
                thin.add(name)
            _quantize_weight(binding, original[name], merged, plan, result)
        result.timings["apply"] += perf_counter() - tick
    if thin:
        result.notes.append(
            f"{len(thin)} weight(s) saw fewer calibration rows than 2x their input width, so their Hessians are "
            f"rank-deficient (damping hides it): {', '.join(sorted(thin))}"
        )


def _run(session, feeds, weights, fetch) -> dict[str, np.ndarray]:
    values = dict(feeds)
    if fetch:
        values.update(session.run({**feeds, **weights}, fetch))
    for name in fetch:
        if np.issubdtype(values[name].dtype, np.floating) and not np.all(np.isfinite(values[name])):
            raise BaselineError(f"layer input '{name}' is not finite on the calibration windows")
    return values


def _quantize_weight(binding: WeightBinding, stored: np.ndarray, stats: list[solvers.Hessian], plan: _Plan, result: BaselineResult) -> None:
    """Run the plan's method on each row group of one weight and record it."""
    wt = binding.to_wt(np.asarray(stored, np.float64))
    group_size = _group(plan, binding, result)
    rows = wt.shape[0] // binding.row_groups
    parts, error, reference = [], 0.0, 0.0
    for g, part in enumerate(stats):
        block = wt[g * rows : (g + 1) * rows]
        try:
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # _store reports non-finite results
                quantized = _method(plan, binding.name, block, part, group_size)
        except np.linalg.LinAlgError as exc:
            raise BaselineError(f"{plan.method} failed on weight '{binding.name}': {exc}", hint="use more calibration windows or a larger percdamp") from None
        parts.append(quantized)
        error += solvers.output_error(block, quantized.values, part) ** 2
        reference += solvers.output_error(block, _rtn(plan, block, group_size).values, part) ** 2
    result.errors[binding.name] = float(np.sqrt(error))
    result.rtn_errors[binding.name] = float(np.sqrt(reference))
    _store(result, binding, stored, parts, binding.name, plan.method)


def _method(plan: _Plan, name: str, wt: np.ndarray, stats: solvers.Hessian, group_size: int) -> solvers.Quantized:
    common = dict(group_size=group_size, scheme=plan.scheme, mse=plan.mse)
    solver = dict(percdamp=plan.percdamp, block_size=plan.block_size, act_order=plan.act_order, static_groups=plan.static_groups, **common)
    if plan.method == "gptq":
        return solvers.gptq(wt, stats.H, plan.bits, **solver)
    if plan.method == "gptaq":
        return solvers.gptaq(wt, stats.H, stats.G, plan.bits, alpha=plan.alpha, **solver)
    alpha = 0.0 if plan.qep_skip is not None and plan.qep_skip.search(name) else plan.alpha
    corrected = solvers.qep_correct(wt, stats.H, stats.G, alpha=alpha, percdampqep=plan.percdampqep)
    if not np.all(np.isfinite(corrected)):
        raise BaselineError(f"qep correction produced non-finite values for weight '{name}'")
    if plan.qep_base == "rtn":
        return solvers.rtn(corrected, plan.bits, **common)
    return solvers.gptq(corrected, stats.H, plan.bits, **solver)


def _store(result: BaselineResult, binding: WeightBinding, stored: np.ndarray, parts: list[solvers.Quantized], name: str, method: str) -> None:
    """Encode the row groups in the stored layout and keep the matching fake-quantized weight."""
    values = np.concatenate([p.values for p in parts])
    if not np.all(np.isfinite(values)) or not all(np.all(np.isfinite(p.scale)) for p in parts):
        raise BaselineError(f"{method} produced non-finite values for weight '{name}'", hint="this tensor cannot be quantized with these settings")
    encoded = _encode(binding, parts)
    result.encoded[name] = encoded
    result.weights[name] = encoded.dequantize().astype(np.asarray(stored).dtype, copy=False)


def _encode(binding: WeightBinding, parts: list[solvers.Quantized]) -> Encoded:
    """DequantizeLinear layout: per channel on the stored output axis, or blocks along K."""
    spec = parts[0].spec
    codes = binding.from_wt(np.concatenate([p.codes for p in parts]))
    scale = np.concatenate([p.scale for p in parts])
    zero = None if spec.signed else np.concatenate([p.zero for p in parts])
    axis, block = None, None
    if binding.perm is None:
        scale, zero = scale.reshape(()), None if zero is None else zero.reshape(())
    elif parts[0].group_size <= 0:
        axis, scale, zero = binding.perm[0], scale[:, 0], None if zero is None else zero[:, 0]
    else:
        axis, block = binding.perm[1], parts[0].group_size
        if binding.perm == (1, 0):
            scale, zero = scale.T, None if zero is None else zero.T
    return Encoded(
        codes=codes.astype(np.int32),
        scale=np.ascontiguousarray(scale, np.float32),
        zero_point=None if zero is None else np.ascontiguousarray(zero, np.int32),
        bits=spec.bits,
        signed=spec.signed,
        axis=axis,
        block_size=block,
    )


def write_baseline(model_path: str | Path, result: BaselineResult, output: str | Path) -> dict:
    """Write the baseline as the same deployable DequantizeLinear ONNX that `export` emits."""
    from graph_ops.qdq import apply_storage

    loaded = graph_ops.load_model(model_path)
    stored = {
        name: dataclasses.replace(encoded.to_stored(f"{result.method}-w{result.bits}"), dtype=result.weights[name].dtype.name)
        for name, encoded in result.encoded.items()
    }
    started = perf_counter()
    proto = apply_storage(loaded.proto, stored)
    path = graph_ops.save_model(proto, output)
    per = graph_ops.io.tensor_sizes(loaded.proto)
    reference = sum(per.values())
    total = reference - sum(per[n] for n in stored) + sum(s.payload_bits for s in stored.values())
    return {
        "method": result.method,
        "bits": result.bits,
        "output": str(path),
        "file_bytes": path.stat().st_size,
        "achieved_compression": reference / total,
        "weight_bytes": total / 8,
        "reference_bytes": reference / 8,
        "timings_s": {**{k: round(v, 4) for k, v in result.timings.items()}, "write": round(perf_counter() - started, 4)},
        "tensors": len(stored),
        "rtn_only": result.rtn_only,
        "layer_error": result.errors,
        "rtn_layer_error": result.rtn_errors,
        "notes": result.notes,
    }
