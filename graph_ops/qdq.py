"""Write quantized weights into a graph as standard ONNX ops.

Each replaced weight keeps its tensor name; what produces it changes, by the
stored form (`tiers.Encoded`), one emitter per form in `EMITTERS`:
- 'raw': a float initializer (unchanged precision);
- 'cast': a float16/bfloat16 initializer + Cast to the weight's type;
- 'dequantize': integer or FP8 codes + DequantizeLinear (per tensor, per axis,
  or blockwise with `block_size`, opset 21+), zero points when asymmetric;
- 'packed_sign': sign bits packed 8 per byte (uint8) + an unpack subgraph of
  standard ops (BitShift, BitwiseAnd, Cast, Mul, Sub) and the scale;
- 'split': each output-channel group emitted by its own form, then a Concat.
New nodes go first in the node list: they read only initializers, so the
graph stays topologically sorted, and every consumer keeps reading the same
name. Consumers are never edited, so shared weights are stored once.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper, version_converter

from graph_ops.io import MAX_IR_VERSION, MAX_OPSET, GraphError, tensor_bits


class StoredWeight(Protocol):
    """What `tiers.Encoded` provides; graph_ops needs nothing else from a tier."""

    form: str
    values: np.ndarray | None
    shape: tuple[int, ...]
    scale: np.ndarray | None
    axis: int | None
    block_size: int | None
    zero_point: np.ndarray | None
    dtype: str
    """numpy name of the float type consumers expect ('float32', 'float16')."""
    parts: tuple

    def expand(self) -> "StoredWeight":
        """The same stored form with `values` an array (a cached encoding may hold its codes packed:
        then `values` has `data`, uint8 with 8 // bits codes per byte, the first in the low bits, as ONNX
        stores INT4/INT2, and the codes' `dtype` and `shape`)."""

    def dequantize(self) -> np.ndarray:
        """The weight the runtime computes from the stored form, as `dtype`."""


def _form_opset(value: StoredWeight) -> int:
    """Lowest default-domain opset that expresses one stored form."""
    if value.form == "split":
        return max([11] + [_form_opset(p) for p in value.parts])
    if value.form == "raw":
        return 1
    if value.form == "cast":
        return 13 if value.values.dtype.name == "bfloat16" else 6
    if value.form == "packed_sign":
        return 18  # BitwiseAnd
    needed = 19 if value.dtype == "float16" else 13  # float16 scales; float64 weights dequantize in float32
    name = np.dtype(value.values.dtype).name
    if name in ("int4", "uint4") or value.block_size:
        needed = max(needed, 21)
    if name.startswith("float8"):
        needed = max(needed, 19)
    if name in ("int2", "uint2"):
        needed = max(needed, 25)
    return needed


def required_opset(stored: Mapping[str, StoredWeight]) -> int:
    """Lowest default-domain opset that can express every stored form."""
    return max([1] + [_form_opset(value) for value in stored.values()])


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Convert the default-domain opset up to `opset` (no-op when already there)."""
    current = _opset(model)
    if current >= opset:
        return model
    if opset > MAX_OPSET:
        raise GraphError(f"the chosen tiers need opset {opset}, above the supported {MAX_OPSET}")
    try:
        converted = version_converter.convert_version(model, opset)
    except Exception as exc:
        raise GraphError(f"cannot convert the model from opset {current} to {opset} (needed by the chosen tiers): {str(exc).splitlines()[0]}") from None
    return converted


def _lift_constants(model: onnx.ModelProto, names: set[str]) -> None:
    """Turn Constant nodes that hold any of `names` into initializers, in place."""
    kept = []
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] in names:
            value = next(a.t for a in node.attribute if a.name == "value")
            tensor = copy.deepcopy(value)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
        else:
            kept.append(node)
    if len(kept) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(kept)


def _raw(name: str, value: StoredWeight):
    dtype = np.dtype(value.dtype)
    return [numpy_helper.from_array(np.ascontiguousarray(value.values.astype(dtype, copy=False)), name)], []


def _cast(name: str, value: StoredWeight):
    if value.values.dtype == np.dtype(value.dtype):
        return _raw(name, value)
    stored = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__{value.values.dtype.name}")
    to = helper.np_dtype_to_tensor_dtype(np.dtype(value.dtype))
    return [stored], [helper.make_node("Cast", [stored.name], [name], to=to, name=f"{name}__cast")]


DEQUANTIZED_TYPES = ("float32", "float16")
"""Weight types DequantizeLinear can produce here (its output takes the scale's type; bfloat16 aside, which
numpy cannot hold). A float64 weight is dequantized in float32 and Cast, as `tiers.Encoded.dequantize` computes it."""


def _dequantize(name: str, value: StoredWeight):
    dtype = np.dtype(value.dtype)
    through = dtype if dtype.name in DEQUANTIZED_TYPES else np.dtype(np.float32)
    produced = name if through == dtype else f"{name}__dq_{through.name}"
    codes = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__q")
    scale = numpy_helper.from_array(np.ascontiguousarray(value.scale, dtype=through), f"{name}__scale")
    attributes = {}
    if value.axis is not None and np.ndim(value.scale) > 0:
        attributes["axis"] = int(value.axis)
    if value.block_size:
        attributes["block_size"] = int(value.block_size)
    initializers, inputs = [codes, scale], [codes.name, scale.name]
    if value.zero_point is not None:
        zero = numpy_helper.from_array(np.ascontiguousarray(value.zero_point), f"{name}__zero")
        initializers.append(zero)
        inputs.append(zero.name)
    nodes = [helper.make_node("DequantizeLinear", inputs, [produced], name=f"{name}__dq", **attributes)]
    if produced != name:
        nodes.append(helper.make_node("Cast", [produced], [name], to=helper.np_dtype_to_tensor_dtype(dtype), name=f"{name}__to_{dtype.name}"))
    return initializers, nodes


def _widened(prefix: str, array: np.ndarray, value: StoredWeight, shared: str) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto], str]:
    """A scale or zero point stored with its own elements and bytes, only reshaped, and the nodes that make it
    float32 and broadcastable against the weight: per axis it is stored as [1, n, 1, ...]; per block as
    [..., blocks, 1, ...], then Expanded to [..., blocks, block_size, ...], Reshaped to the blocked axis and
    Sliced to its length (DequantizeLinear's last block may be partial); those shape constants are named from
    `shared`, so a scale and a zero point store them once."""
    shape, axis = list(value.shape), (value.axis or 0) % max(len(value.shape), 1)
    array = np.asarray(array)
    stored, tensors, nodes = array, [], []
    if array.ndim and value.block_size:
        blocks, size = array.shape[axis], int(value.block_size)
        stored = array.reshape(shape[:axis] + [blocks, 1] + shape[axis + 1:])
        tensors += [numpy_helper.from_array(np.array(shape[:axis] + [blocks, size] + shape[axis + 1:], np.int64), shared + "expand"),
                    numpy_helper.from_array(np.array(shape[:axis] + [blocks * size] + shape[axis + 1:], np.int64), shared + "blocked")]
    elif array.ndim:
        stored = array.reshape([shape[i] if i == axis else 1 for i in range(len(shape))])
    tensors.insert(0, numpy_helper.from_array(np.ascontiguousarray(stored), prefix + "stored"))
    current = prefix + "stored"
    if stored.dtype != np.float32:
        nodes.append(helper.make_node("Cast", [current], [prefix + "float"], to=onnx.TensorProto.FLOAT, name=prefix + "float"))
        current = prefix + "float"
    if array.ndim and value.block_size:
        nodes += [helper.make_node("Expand", [current, shared + "expand"], [prefix + "expanded"], name=prefix + "expand"),
                  helper.make_node("Reshape", [prefix + "expanded", shared + "blocked"], [prefix + "full"], name=prefix + "reshape")]
        current = prefix + "full"
        if array.shape[axis] * int(value.block_size) != shape[axis]:
            tensors += [numpy_helper.from_array(np.array([0], np.int64), shared + "start"), numpy_helper.from_array(np.array([shape[axis]], np.int64), shared + "stop"),
                        numpy_helper.from_array(np.array([axis], np.int64), shared + "axis")]
            nodes.append(helper.make_node("Slice", [current, shared + "start", shared + "stop", shared + "axis"], [prefix + "sliced"], name=prefix + "slice"))
            current = prefix + "sliced"
    return tensors, nodes, current


def _dequantize_at_load(name: str, value: StoredWeight):
    """The same codes, scales and zero points as `_dequantize`, rebuilt into the weight by plain ops (Cast, Sub,
    Mul; Expand/Reshape/Slice for blocks) instead of DequantizeLinear. ONNX Runtime constant-folds such nodes on
    initializers when a session is created, and leaves DequantizeLinear alone (to fuse it into MatMulNBits, or
    to run it on every call): this layout runs the original's float kernels from the small file. The arithmetic
    is `tiers.Encoded.dequantize`'s in float32 (exact small integers, one rounding at the Mul, then a Cast to
    the weight's type), so the folded weight equals the numpy fake-quantized one to the bit."""
    dtype = np.dtype(value.dtype)
    p = f"{name}__"
    codes = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__q")
    tensors = [codes]
    nodes = [helper.make_node("Cast", [codes.name], [p + "codes"], to=onnx.TensorProto.FLOAT, name=p + "codes")]
    current = p + "codes"
    if value.zero_point is not None:
        zero_tensors, zero_nodes, zero = _widened(p + "zero_", value.zero_point, value, p + "block_")
        tensors, nodes = tensors + zero_tensors, nodes + zero_nodes
        nodes.append(helper.make_node("Sub", [current, zero], [p + "centred"], name=p + "centre"))
        current = p + "centred"
    scale_type = dtype if dtype.name in DEQUANTIZED_TYPES else np.dtype(np.float32)  # stored as `_dequantize` stores it
    scale_tensors, scale_nodes, scale = _widened(p + "scale_", np.asarray(value.scale, dtype=scale_type), value, p + "block_")
    tensors += [t for t in scale_tensors if t.name not in {known.name for known in tensors}]
    nodes += scale_nodes
    scaled = name if dtype == np.float32 else p + "scaled"
    nodes.append(helper.make_node("Mul", [current, scale], [scaled], name=p + "scale"))
    if scaled != name:
        nodes.append(helper.make_node("Cast", [scaled], [name], to=helper.np_dtype_to_tensor_dtype(dtype), name=f"{name}__to_{dtype.name}"))
    return tensors, nodes


def _packed_sign(name: str, value: StoredWeight):
    """packed uint8 -> bits (MSB first, as numpy.packbits) -> {-1, +1} * scale."""
    shape = list(value.shape)
    size = int(np.prod(shape, dtype=np.int64))
    p = f"{name}__"
    dtype = np.dtype(value.dtype)
    scale = np.asarray(value.scale, dtype=dtype)
    if scale.ndim == 1:  # per axis: reshape for broadcasting against the weight
        view = [1] * len(shape)
        view[value.axis] = shape[value.axis]
        scale = scale.reshape(view)
    initializers = [
        numpy_helper.from_array(np.ascontiguousarray(value.values).reshape(-1, 1), p + "bits"),
        numpy_helper.from_array(np.arange(7, -1, -1, dtype=np.uint8).reshape(1, 8), p + "shifts"),
        numpy_helper.from_array(np.array([1], np.uint8), p + "one"),
        numpy_helper.from_array(np.array([-1], np.int64), p + "flat"),
        numpy_helper.from_array(np.array([0], np.int64), p + "start"),
        numpy_helper.from_array(np.array([size], np.int64), p + "stop"),
        numpy_helper.from_array(np.array(shape, np.int64), p + "shape"),
        numpy_helper.from_array(np.array(2.0, dtype), p + "two"),
        numpy_helper.from_array(np.array(1.0, dtype), p + "unit"),
        numpy_helper.from_array(scale, p + "scale"),
    ]
    nodes = [
        helper.make_node("BitShift", [p + "bits", p + "shifts"], [p + "shifted"], direction="RIGHT"),
        helper.make_node("BitwiseAnd", [p + "shifted", p + "one"], [p + "bit"]),
        helper.make_node("Reshape", [p + "bit", p + "flat"], [p + "flat_bits"]),
        helper.make_node("Slice", [p + "flat_bits", p + "start", p + "stop"], [p + "used"]),
        helper.make_node("Reshape", [p + "used", p + "shape"], [p + "shaped"]),
        helper.make_node("Cast", [p + "shaped"], [p + "float"], to=helper.np_dtype_to_tensor_dtype(dtype)),
        helper.make_node("Mul", [p + "float", p + "two"], [p + "double"]),
        helper.make_node("Sub", [p + "double", p + "unit"], [p + "sign"]),
        helper.make_node("Mul", [p + "sign", p + "scale"], [name], name=p + "unpack"),
    ]
    return initializers, nodes


def _split(name: str, value: StoredWeight, layout: str = "fused"):
    """Each channel group by its own form, joined along the output-channel axis."""
    initializers, nodes, pieces = [], [], []
    for index, part in enumerate(value.parts):
        piece = f"{name}__part{index}"
        tensors, producers = _emit(piece, part, layout)
        initializers += tensors
        nodes += producers
        pieces.append(piece)
    nodes.append(helper.make_node("Concat", pieces, [name], axis=int(value.axis), name=f"{name}__concat"))
    return initializers, nodes


EMITTERS: dict[str, Callable[[str, StoredWeight], tuple[list[onnx.TensorProto], list[onnx.NodeProto]]]] = {
    "raw": _raw,
    "cast": _cast,
    "dequantize": _dequantize,
    "packed_sign": _packed_sign,
    "split": _split,
}
"""Stored form -> emitter of the initializers and nodes that produce the weight."""


LAYOUTS = ("dequantized", "fused")
"""How integer and FP8 codes reach their consumers (`export --runtime-layout`):
- 'fused': DequantizeLinear, which ONNX Runtime fuses with a MatMul into MatMulNBits (weights stay compressed in
  memory; fast for few rows, slower than float for batched calls; DequantizeLinear before other ops runs on every
  call) and which TensorRT's explicit quantization reads;
- 'dequantized': plain ops that ONNX Runtime folds into a float weight when the session is created (the small
  file, the original's kernels and speed, float-size weights in memory after load).
Float16/bfloat16 Casts and INT1's unpack subgraph are folded at load in both."""


def _emit(name: str, value: StoredWeight, layout: str = "fused") -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """Initializers and nodes that produce tensor `name` from its stored form, in `layout` (see `LAYOUTS`)."""
    if value.form not in EMITTERS:
        raise GraphError(f"unknown stored form '{value.form}' for '{name}'")
    if layout not in LAYOUTS:
        raise GraphError(f"unknown runtime layout '{layout}'; choose one of {', '.join(LAYOUTS)}")
    if value.form == "split":
        return _split(name, value.expand(), layout)
    if layout == "dequantized" and value.form == "dequantize":
        return _dequantize_at_load(name, value.expand())
    return EMITTERS[value.form](name, value.expand())


FED_CODES = {"int8": np.int8, "uint8": np.uint8, "int4": np.int8, "uint4": np.uint8, "int2": np.int8, "uint2": np.uint8}
"""Code containers a calibration feeds as bytes (numpy has no sub-byte type ONNX Runtime reads)."""


PACKED_BITS = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2}
"""Bits per code of the types a cache keeps packed, as ONNX stores them."""


def _unpacked_codes(prefix: str, packed, signed: bool) -> tuple[dict[str, np.ndarray], list[onnx.NodeProto], str]:
    """Feeds and nodes turning sub-byte codes packed as on disk (`packed.data`, 8 // bits per byte, the
    first in the low bits) into their values as float32, shaped like the weight: every byte cast to
    float, digit i = floor(byte / 2^(bits·i)) - 2^bits · floor(byte / 2^(bits·(i+1))), two's complement
    for signed codes; all small integers, so exact. The name of the result is returned."""
    bits = PACKED_BITS[np.dtype(packed.dtype).name]
    per, base = 8 // bits, float(2**bits)
    feeds = {f"{prefix}_packed": packed.data, f"{prefix}_column": np.array([-1, 1], np.int64), f"{prefix}_shape": np.array(packed.shape, np.int64)}
    feeds.update({f"{prefix}_div{i}": np.array(base**i, np.float32) for i in range(1, per + 1)})
    feeds[f"{prefix}_base"] = np.array(base, np.float32)
    nodes = [helper.make_node("Cast", [f"{prefix}_packed"], [f"{prefix}_q0"], to=onnx.TensorProto.FLOAT, name=f"{prefix}_bytes")]
    for i in range(1, per + 1):  # q_i = floor(byte / base^i)
        nodes.append(helper.make_node("Div", [f"{prefix}_q0", f"{prefix}_div{i}"], [f"{prefix}_d{i}"], name=f"{prefix}_div{i}"))
        nodes.append(helper.make_node("Floor", [f"{prefix}_d{i}"], [f"{prefix}_q{i}"], name=f"{prefix}_floor{i}"))
    digits = []
    for i in range(per):  # digit i = q_i - base · q_{i+1}, a column of the [bytes, per] table
        nodes.append(helper.make_node("Mul", [f"{prefix}_q{i + 1}", f"{prefix}_base"], [f"{prefix}_h{i}"], name=f"{prefix}_high{i}"))
        nodes.append(helper.make_node("Sub", [f"{prefix}_q{i}", f"{prefix}_h{i}"], [f"{prefix}_x{i}"], name=f"{prefix}_digit{i}"))
        nodes.append(helper.make_node("Reshape", [f"{prefix}_x{i}", f"{prefix}_column"], [f"{prefix}_c{i}"], name=f"{prefix}_column{i}"))
        digits.append(f"{prefix}_c{i}")
    nodes.append(helper.make_node("Concat", digits, [f"{prefix}_table"], axis=1, name=f"{prefix}_table"))
    nodes.append(helper.make_node("Reshape", [f"{prefix}_table", f"{prefix}_shape"], [f"{prefix}_digits"], name=f"{prefix}_reshape"))
    if not signed:
        return feeds, nodes, f"{prefix}_digits"
    feeds[f"{prefix}_half"] = np.array(base / 2, np.float32)
    nodes += [  # two's complement: a digit of base / 2 or more stands for digit - base
        helper.make_node("Div", [f"{prefix}_digits", f"{prefix}_half"], [f"{prefix}_sd"], name=f"{prefix}_signdiv"),
        helper.make_node("Floor", [f"{prefix}_sd"], [f"{prefix}_neg"], name=f"{prefix}_sign"),
        helper.make_node("Mul", [f"{prefix}_neg", f"{prefix}_base"], [f"{prefix}_wrap"], name=f"{prefix}_wrap"),
        helper.make_node("Sub", [f"{prefix}_digits", f"{prefix}_wrap"], [f"{prefix}_signed"], name=f"{prefix}_signed"),
    ]
    return feeds, nodes, f"{prefix}_signed"


def fed_weight(name: str, value: StoredWeight) -> tuple[list[onnx.ValueInfoProto], dict[str, np.ndarray], list[onnx.NodeProto]] | None:
    """Graph inputs, their values and the nodes that rebuild weight `name` from its codes at run time:
    Cast, Sub the zero point, Mul the scale, DequantizeLinear's arithmetic in float32 (so the same
    values as `dequantize`, at any opset). What a calibration run feeds instead of a float copy of
    every weight quantized so far: a byte per weight, or the packed bytes of INT4/INT2 codes as a
    cache keeps them (half or a quarter of a byte, unpacked in the graph). None for a form better fed
    as floats (raw, FP8, packed signs, blockwise scales, bfloat16)."""
    prefix = f"{name}__fed"
    dtype = np.dtype(value.dtype)
    packed = value.values if value.form == "dequantize" and not isinstance(value.values, np.ndarray) and not value.block_size else None
    if packed is not None and packed.data.size * (8 // PACKED_BITS[np.dtype(packed.dtype).name]) != int(np.prod(packed.shape, dtype=np.int64)):
        packed = None  # codes that do not fill their last byte: fed unpacked
    if packed is None and value.form != "split":  # a split weight's parts each decide
        value = value.expand()
    if value.form == "split":
        pieces = [fed_weight(f"{name}__part{i}", part) for i, part in enumerate(value.parts)]
        if any(piece is None for piece in pieces):
            return None
        inputs, feeds, nodes = [], {}, []
        for piece_inputs, piece_feeds, piece_nodes in pieces:
            inputs += piece_inputs
            feeds.update(piece_feeds)
            nodes += piece_nodes
        nodes.append(helper.make_node("Concat", [f"{name}__part{i}" for i in range(len(pieces))], [name], axis=int(value.axis), name=f"{prefix}_concat"))
        return inputs, feeds, nodes
    if value.form == "cast" and value.values.dtype == np.float16:
        feeds = {f"{prefix}_half": value.values}
        nodes = [helper.make_node("Cast", [f"{prefix}_half"], [name], to=helper.np_dtype_to_tensor_dtype(dtype), name=f"{prefix}_cast")]
        return [helper.make_tensor_value_info(f"{prefix}_half", onnx.TensorProto.FLOAT16, list(value.shape))], feeds, nodes
    view = [1] * len(value.shape)
    if value.axis is not None and np.ndim(value.scale) > 0:
        view[value.axis] = value.shape[value.axis]
    if packed is not None:
        feeds, nodes, centred = _unpacked_codes(prefix, packed, np.dtype(packed.dtype).name.startswith("int"))
    else:
        container = FED_CODES.get(np.dtype(value.values.dtype).name) if value.form == "dequantize" else None
        if container is None or value.block_size:
            return None
        codes = value.values if value.values.dtype == container else value.values.astype(container)
        feeds = {f"{prefix}_codes": codes}
        nodes = [helper.make_node("Cast", [f"{prefix}_codes"], [f"{prefix}_float"], to=onnx.TensorProto.FLOAT, name=f"{prefix}_cast")]
        centred = f"{prefix}_float"
    written = np.asarray(value.scale).astype(np.float16) if dtype == np.float16 else value.scale  # a float16 weight's scale as the file stores it
    feeds[f"{prefix}_scale"] = np.asarray(written, np.float32).reshape(view)
    if value.zero_point is not None:
        feeds[f"{prefix}_zero"] = np.asarray(value.zero_point).astype(np.float32).reshape(view)
        nodes.append(helper.make_node("Sub", [centred, f"{prefix}_zero"], [f"{prefix}_centred"], name=f"{prefix}_sub"))
        centred = f"{prefix}_centred"
    scaled = name if dtype == np.float32 else f"{prefix}_scaled"
    nodes.append(helper.make_node("Mul", [centred, f"{prefix}_scale"], [scaled], name=f"{prefix}_mul"))
    if scaled != name:
        nodes.append(helper.make_node("Cast", [scaled], [name], to=helper.np_dtype_to_tensor_dtype(dtype), name=f"{prefix}_to_{dtype.name}"))
    inputs = [helper.make_tensor_value_info(key, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape)) for key, array in feeds.items()]
    return inputs, feeds, nodes


def _node_reads(node: onnx.NodeProto) -> set[str]:
    """Every name a node reads, those its subgraphs read from the outer scope included (over-approximated)."""
    names = {i for i in node.input if i}
    for attribute in node.attribute:
        graphs = list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else [])
        for graph in graphs:
            for inner in graph.node:
                names |= _node_reads(inner)
    return names


def fed_codes_model(model: onnx.ModelProto, stored: Mapping[str, StoredWeight], outputs: list[str] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`model` (weights as graph inputs) cut down to what computes `outputs` (default: its own outputs),
    with every weight of `stored` it reads rebuilt from its codes (`fed_weight`). Returns the model
    and what to feed for the weights of `stored` it reads: their codes, or the floats they stand for
    where a form is not rebuilt; the other weights stay inputs, for the caller to feed.

    What runs a quantized candidate at a byte per weight instead of a float copy of every weight:
    a calibration wave (ONNX Runtime runs the whole graph whatever a run fetches, so the cut also
    skips the layers after the wave) and a large model's measured candidates. The rebuilding nodes
    go first in the node list, which ONNX Runtime's default order runs just before each consumer
    (measured: 18 weights rebuilt up front would hold 18 float copies at once)."""
    graph = model.graph
    outputs = list(outputs) if outputs is not None else [v.name for v in graph.output]
    needed = set(outputs)
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed |= _node_reads(node)
    kept.reverse()
    rebuilt, feeds, inputs = [], {}, []
    for value in graph.input:
        form = stored.get(value.name) if value.name in needed else None  # an unused input stays declared (ONNX Runtime wants every input fed; it reads no unused one)
        fed = fed_weight(value.name, form) if form is not None else None
        if fed is None:
            inputs.append(value)
            if form is not None:  # fed as the float it stands for (raw: the weight itself, no copy)
                feeds[value.name] = np.asarray(form.values).astype(form.dtype, copy=False) if form.form == "raw" else form.dequantize()
            continue
        new_inputs, new_feeds, nodes = fed
        inputs += new_inputs
        feeds.update(new_feeds)
        rebuilt += nodes
    infos = {v.name: v for v in graph.output}
    missing = [name for name in outputs if name not in infos]
    if missing:
        raise GraphError(f"tensors {missing[:3]} are not outputs of the graph")
    cut = helper.make_graph(
        rebuilt + kept, graph.name, inputs, [infos[name] for name in dict.fromkeys(outputs)],
        [t for t in graph.initializer if t.name in needed], value_info=[v for v in graph.value_info if v.name in needed],
    )
    cut.sparse_initializer.extend(t for t in graph.sparse_initializer if t.values.name in needed)
    result = helper.make_model(cut, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    result.functions.extend(model.functions)
    return result, feeds


def emitted_bits(name: str, value: StoredWeight, layout: str = "fused") -> int:
    """Bits of every tensor the weight's stored form puts in the file (what eval and gate count)."""
    return sum(tensor_bits(t) for t in _emit(name, value, layout)[0])


STREAM_THRESHOLD = 1 << 30
"""Models with at least this many bytes of tensors are written with external data, streamed."""


def _copy_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model's structure (nodes, I/O, metadata) without initializer data."""
    skeleton = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name == "graph":
            continue
        target = getattr(skeleton, field.name)
        if field.is_repeated:
            target.extend(value)
        elif field.type == field.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(skeleton, field.name, value)
    for field, value in model.graph.ListFields():
        if field.name == "initializer":
            continue
        target = getattr(skeleton.graph, field.name)
        if field.is_repeated:
            target.extend(value)
        elif field.type == field.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(skeleton.graph, field.name, value)
    return skeleton


def _tensor_bytes(tensor: onnx.TensorProto, source: Path | None = None) -> bytes | memoryview:
    """A tensor's payload; one that points into an external-data file is read from it (`source`: the input model's folder)."""
    if external_data_helper.uses_external_data(tensor):
        if source is None:
            raise GraphError(f"tensor '{tensor.name}' lives in external data, but no folder to read it from was given")
        info = external_data_helper.ExternalDataInfo(tensor)
        with open(Path(source) / info.location, "rb") as handle:
            handle.seek(int(info.offset or 0))
            payload = handle.read(int(info.length)) if info.length else handle.read()
        return payload
    if tensor.raw_data:
        return tensor.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name).raw_data


def _loaded(tensor: onnx.TensorProto, source: Path | None, payload: bytes | memoryview | None = None) -> onnx.TensorProto:
    """`tensor` with its payload inside it (read from its external-data file when it points to one, unless given)."""
    if not external_data_helper.uses_external_data(tensor):
        return tensor
    inline = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))
    inline.raw_data = bytes(payload if payload is not None else _tensor_bytes(tensor, source))
    return inline


class _DataFile:
    """Appends tensor payloads to one external-data file and returns reference protos."""

    ALIGN = 64
    INLINE_BELOW = 1024
    """Tensors smaller than this stay inside the .onnx file, as onnx.save does."""

    def __init__(self, path: Path, location: str, source: Path | None = None):
        self.path = path
        self.location = location
        """The name model files refer to (the data is written under a temporary name first)."""
        self.source = source
        """The input model's folder, for kept tensors that live in its external data."""
        self.handle = open(path, "wb")
        self.offset = 0

    def reference(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        payload = _tensor_bytes(tensor, self.source)
        if len(payload) < self.INLINE_BELOW:
            return _loaded(tensor, self.source, payload)
        padding = -self.offset % self.ALIGN
        self.handle.write(b"\0" * padding)
        self.offset += padding
        self.handle.write(payload)
        ref = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(len(payload)))):
            ref.external_data.add(key=key, value=value)
        ref.data_location = onnx.TensorProto.EXTERNAL
        self.offset += len(payload)
        return ref

    def close(self) -> None:
        self.handle.close()


def _skeleton(model: onnx.ModelProto, lift: set[str], opset: int) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """The model's structure at `opset`, without initializers, and the Constant weights in `lift` as tensors.

    The opset is converted before new ops join. The converter wants every
    tensor defined, so the (data-less) initializers stand in as graph inputs
    meanwhile.
    """
    skeleton = _copy_without_initializers(model)
    _lift_constants(skeleton, lift)
    lifted = {t.name: t for t in skeleton.graph.initializer}  # weights that were Constant nodes
    del skeleton.graph.initializer[:]
    declared = {i.name for i in skeleton.graph.input}
    stand_ins = [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in list(model.graph.initializer) + list(lifted.values())
        if t.name not in declared
    ]
    skeleton.graph.input.extend(stand_ins)
    annotated = list(skeleton.graph.value_info)
    skeleton = upgrade_opset(skeleton, opset)
    # The converter infers shapes and records them as value_info; ONNX Runtime fuses more with them (on the
    # ETTh1 example an Add + LayerNormalization became a SkipLayerNormalization 5x slower than the pair),
    # so the output keeps the annotations the model came with, and runs the graph the original runs.
    del skeleton.graph.value_info[:]
    skeleton.graph.value_info.extend(annotated)
    temporary = {v.name for v in stand_ins}
    kept_inputs = [i for i in skeleton.graph.input if i.name not in temporary]
    del skeleton.graph.input[:]
    skeleton.graph.input.extend(kept_inputs)
    return skeleton, lifted


def conversion_overhead_bits(model: onnx.ModelProto, opset: int) -> int:
    """Stored bits the opset conversion adds (attributes that become constant inputs)."""
    from graph_ops.io import weight_bits

    before = _copy_without_initializers(model)
    after, _ = _skeleton(model, set(), max(_opset(model), opset))
    return max(0, weight_bits(after) - weight_bits(before))


def _build(model: onnx.ModelProto, stored: Mapping[str, StoredWeight], sink: Callable[[onnx.TensorProto], onnx.TensorProto], layout: str = "fused") -> onnx.ModelProto:
    """The model with `stored` weights in `layout`; every initializer passes through `sink` (kept, or moved to external data)."""
    skeleton, lifted = _skeleton(model, set(stored), max(_opset(model), required_opset(stored)))
    present = {t.name for t in model.graph.initializer} | set(lifted)
    missing = set(stored) - present
    if missing:
        raise GraphError(f"no weight named '{sorted(missing)[0]}' in the model")
    new_nodes, emitted, replaced = [], [], []
    for tensor in list(model.graph.initializer) + list(lifted.values()):
        if tensor.name in stored:
            initializers, nodes = _emit(tensor.name, stored[tensor.name], layout)
            if nodes:
                emitted += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in initializers]
                replaced.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            skeleton.graph.initializer.extend(sink(t) for t in initializers)
            new_nodes.extend(nodes)
        else:
            skeleton.graph.initializer.append(sink(tensor))
    _check_emitted(new_nodes, emitted, replaced, skeleton)
    inputs = [i for i in skeleton.graph.input if i.name not in stored]  # old-style models list initializers as inputs
    del skeleton.graph.input[:]
    skeleton.graph.input.extend(inputs)
    nodes = new_nodes + list(skeleton.graph.node)
    del skeleton.graph.node[:]
    skeleton.graph.node.extend(nodes)
    minimum_ir = helper.find_min_ir_version_for(list(skeleton.opset_import), ignore_unknown=True)
    skeleton.ir_version = min(max(skeleton.ir_version, minimum_ir), MAX_IR_VERSION)
    return skeleton


def _check_emitted(nodes: list[onnx.NodeProto], stored: list[onnx.ValueInfoProto], weights: list[onnx.ValueInfoProto], model: onnx.ModelProto) -> None:
    """Type-check the nodes that now produce the weights, alone (their stored tensors declared, not copied):
    each must be valid at the model's opset and yield its weight's original type and shape. A form a runtime
    cannot load must fail here, not when the user opens the file."""
    if not nodes:
        return
    graph = helper.make_graph(nodes, "emitted", stored, weights)
    check = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    try:
        onnx.checker.check_model(check, full_check=True)
    except Exception as exc:
        kinds = sorted({onnx.helper.tensor_dtype_to_np_dtype(w.type.tensor_type.elem_type).name for w in weights})
        raise GraphError(f"the quantized weights cannot be written as valid ONNX for this model's {'/'.join(kinds)} weights: {str(exc).strip().splitlines()[0]}") from None


def apply_storage(model: onnx.ModelProto, stored: Mapping[str, StoredWeight], source: Path | None = None, layout: str = "fused") -> onnx.ModelProto:
    """A new model whose named weights are stored as given, in `layout` (`LAYOUTS`), every tensor inside it (kept
    ones that point into the input's external data, in folder `source`, are read in). Input untouched."""
    return _build(model, stored, lambda tensor: _loaded(tensor, source), layout)


@dataclass(frozen=True)
class Written:
    """A model on disk: its files (the model, then its external data) and its stored-tensor bits."""

    files: tuple[Path, ...]
    weight_bits: int

    @property
    def path(self) -> Path:
        return self.files[0]

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def write_storage(
    model: onnx.ModelProto, stored: Mapping[str, StoredWeight], path: str | os.PathLike, *, external_data: bool | None = None, source: Path | None = None,
    layout: str = "fused",
) -> Written:
    """Write `model` with `stored` weights to `path`, atomically (external data together with its model).

    Small models are built in memory into one file (`external_data=False` insists on one file, and
    fails when it would pass protobuf's 2 GiB). Large ones (or `external_data=True`) are
    written tensor by tensor into `<name>.<token>.data`: each emitted or kept tensor
    goes to disk before the next, kept tensors straight from the input's
    bytes, so peak memory stays near the input model's own copy plus one tensor.
    A `model` loaded without its external data names its folder in `source`:
    kept tensors are then read from the input's data files one at a time.
    """
    from graph_ops.io import PROTOBUF_LIMIT, OutputError, atomic_output, data_location, drop_stale_data, save_model, stored_bytes, weight_bits

    path = Path(path)
    if external_data is None:  # an input that keeps its weights outside gets an output that does too
        external_data = source is not None or stored_bytes(model) >= STREAM_THRESHOLD
    if not external_data:
        built = apply_storage(model, stored, source, layout)
        if stored_bytes(built) >= PROTOBUF_LIMIT:  # only when one file was asked for: the default streams from 1 GiB
            raise OutputError(f"cannot write {path} as one file: it holds {stored_bytes(built) / 2**30:.2f} GiB, past protobuf's 2 GiB limit")
        return Written((save_model(built, path, external_data=False),), weight_bits(built))
    location = data_location(path)
    with atomic_output(path.with_name(location)) as partial:  # the data lands under its final name first ...
        data = _DataFile(partial, location, source)
        try:
            built = _build(model, stored, data.reference, layout)
        finally:
            data.close()
    with atomic_output(path) as temporary:  # ... then the model that points to it replaces the old one
        onnx.save_model(built, str(temporary))
    drop_stale_data(path, location)
    return Written((path, path.with_name(location)), weight_bits(built))


CODE_TYPES = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.INT2, onnx.TensorProto.UINT2,
              onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2, onnx.TensorProto.FLOAT8E5M2FNUZ}
"""Element types of stored codes (MatMulNBits' packed weights are UINT8)."""


def per_call_dequantization(optimized: onnx.ModelProto) -> dict[str, int]:
    """Nodes of the graph a runtime saved after optimizing (`SessionOptions.optimized_model_filepath`) that read
    stored codes, by op type: dequantization that runs on every call. Empty when every weight was folded into a
    float initializer at load (the 'dequantized' layout, fp16/bf16 Casts, INT1's unpacking)."""
    codes = {t.name for t in optimized.graph.initializer if t.data_type in CODE_TYPES}
    found: dict[str, int] = {}
    for node in optimized.graph.node:
        if any(i in codes for i in node.input):
            found[node.op_type] = found.get(node.op_type, 0) + 1
    return found
