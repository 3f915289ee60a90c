"""Write quantized weights into a graph as standard ONNX ops.

Each replaced weight keeps its tensor name; what produces it changes:
- 'raw': a float32 initializer (unchanged precision);
- 'cast': a float16/bfloat16 initializer + Cast(to=FLOAT);
- 'dequantize': integer or FP8 codes + DequantizeLinear (per tensor, per axis,
  or blockwise with `block_size`, opset 21+);
- 'packed_sign': sign bits packed 8 per byte (uint8) + an unpack subgraph of
  standard ops (BitShift, BitwiseAnd, Cast, Mul, Sub) and the scale.
New nodes go first in the node list: they read only initializers, so the
graph stays topologically sorted, and every consumer keeps reading the same
name. Consumers are never edited, so shared weights are stored once.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from graph_ops.io import MAX_IR_VERSION, MAX_OPSET, GraphError

KIND_OPSET = {"raw": 1, "cast": 13, "dequantize": 13, "packed_sign": 18}


class StoredWeight(Protocol):
    """What `tiers.Stored` provides; graph_ops needs nothing else from a tier."""

    kind: str
    values: np.ndarray
    shape: tuple[int, ...]
    scale: np.ndarray | None
    axis: int | None
    block_size: int | None
    zero_point: np.ndarray | None
    dtype: str
    """numpy name of the float type consumers expect ('float32', 'float16')."""


def required_opset(stored: Mapping[str, StoredWeight]) -> int:
    """Lowest default-domain opset that can express every stored form."""
    needed = 1
    for value in stored.values():
        needed = max(needed, KIND_OPSET[value.kind])
        if value.kind == "dequantize" and getattr(value, "dtype", "float32") != "float32":
            needed = max(needed, 19)  # float16 scales
        if value.kind == "dequantize":
            dtype = np.dtype(value.values.dtype)
            if dtype.name in ("int4", "uint4"):
                needed = max(needed, 21)
            if dtype.name.startswith("float8"):
                needed = max(needed, 19)
            if dtype.name in ("int2", "uint2"):
                needed = max(needed, 25)
            if value.block_size:
                needed = max(needed, 21)
    return needed


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


def _emit(name: str, value: StoredWeight) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """Initializers and nodes that produce tensor `name` from its stored form."""
    dtype = np.dtype(getattr(value, "dtype", "float32"))
    if value.kind == "raw" or (value.kind == "cast" and value.values.dtype == dtype):
        return [numpy_helper.from_array(np.ascontiguousarray(value.values.astype(dtype, copy=False)), name)], []
    if value.kind == "cast":
        stored = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__{value.values.dtype.name}")
        to = helper.np_dtype_to_tensor_dtype(dtype)
        return [stored], [helper.make_node("Cast", [stored.name], [name], to=to, name=f"{name}__cast")]
    if value.kind == "dequantize":
        codes = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__q")
        scale = numpy_helper.from_array(np.ascontiguousarray(value.scale, dtype=dtype), f"{name}__scale")
        attributes = {}
        if value.axis is not None and np.ndim(value.scale) > 0:
            attributes["axis"] = int(value.axis)
        if value.block_size:
            attributes["block_size"] = int(value.block_size)
        initializers, inputs = [codes, scale], [codes.name, scale.name]
        if getattr(value, "zero_point", None) is not None:
            zero = numpy_helper.from_array(np.ascontiguousarray(value.zero_point), f"{name}__zero")
            initializers.append(zero)
            inputs.append(zero.name)
        node = helper.make_node("DequantizeLinear", inputs, [name], name=f"{name}__dq", **attributes)
        return initializers, [node]
    if value.kind == "packed_sign":
        return _unpack_signs(name, value)
    raise GraphError(f"unknown stored form '{value.kind}' for '{name}'")


def _unpack_signs(name: str, value: StoredWeight) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """packed uint8 -> bits (MSB first, as numpy.packbits) -> {-1, +1} * scale."""
    shape = list(value.shape)
    size = int(np.prod(shape, dtype=np.int64))
    p = f"{name}__"
    dtype = np.dtype(getattr(value, "dtype", "float32"))
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


def apply_storage(model: onnx.ModelProto, stored: Mapping[str, StoredWeight]) -> onnx.ModelProto:
    """A copy of `model` whose named weights are stored as given. Input untouched."""
    opset = max(_opset(model), required_opset(stored))
    result = upgrade_opset(copy.deepcopy(model), opset)
    graph = result.graph
    _lift_constants(result, set(stored))
    present = {t.name for t in graph.initializer}
    missing = set(stored) - present
    if missing:
        raise GraphError(f"no weight named '{sorted(missing)[0]}' in the model")
    kept = [t for t in graph.initializer if t.name not in stored]
    new_nodes = []
    for name, value in stored.items():
        initializers, nodes = _emit(name, value)
        kept.extend(initializers)
        new_nodes.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inputs = [i for i in graph.input if i.name not in stored]  # old-style models list initializers as inputs
    if len(inputs) != len(graph.input):
        del graph.input[:]
        graph.input.extend(inputs)
    nodes = new_nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    minimum_ir = helper.find_min_ir_version_for(list(result.opset_import), ignore_unknown=True)
    result.ir_version = min(max(result.ir_version, minimum_ir), MAX_IR_VERSION)
    return result


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


def _tensor_bytes(tensor: onnx.TensorProto) -> bytes | memoryview:
    if tensor.raw_data:
        return tensor.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name).raw_data


class _DataFile:
    """Appends tensor payloads to one external-data file and returns reference protos."""

    ALIGN = 64
    INLINE_BELOW = 1024
    """Tensors smaller than this stay inside the .onnx file, as onnx.save does."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = open(path, "wb")
        self.offset = 0

    def reference(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        payload = _tensor_bytes(tensor)
        if len(payload) < self.INLINE_BELOW:
            return tensor
        padding = -self.offset % self.ALIGN
        self.handle.write(b"\0" * padding)
        self.offset += padding
        self.handle.write(payload)
        ref = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))
        for key, value in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(len(payload)))):
            ref.external_data.add(key=key, value=value)
        ref.data_location = onnx.TensorProto.EXTERNAL
        self.offset += len(payload)
        return ref

    def close(self) -> None:
        self.handle.close()


def write_storage(model: onnx.ModelProto, stored: Mapping[str, StoredWeight], path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Write `model` with `stored` weights to `path`. Input untouched.

    Small models go through `apply_storage` in memory. Large ones (or
    `external_data=True`) are written tensor by tensor into `<name>.data`:
    each weight is quantized, emitted and written before the next, and kept
    tensors are written straight from the input's bytes, so peak memory stays
    near the input model's own copy plus one tensor.
    """
    from graph_ops.io import save_model, stored_bytes

    path = Path(path)
    if external_data is None:
        external_data = stored_bytes(model) >= STREAM_THRESHOLD
    if not external_data:
        return save_model(apply_storage(model, stored), path)
    path.parent.mkdir(parents=True, exist_ok=True)
    skeleton = _copy_without_initializers(model)
    _lift_constants(skeleton, set(stored))
    lifted = {t.name: t for t in skeleton.graph.initializer}  # weights that were Constant nodes
    del skeleton.graph.initializer[:]
    # Convert the opset before the new ops join. The converter wants every tensor
    # defined, so the (data-less) initializers stand in as graph inputs meanwhile.
    declared = {i.name for i in skeleton.graph.input}
    stand_ins = [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in list(model.graph.initializer) + list(lifted.values())
        if t.name not in declared
    ]
    skeleton.graph.input.extend(stand_ins)
    skeleton = upgrade_opset(skeleton, max(_opset(model), required_opset(stored)))
    temporary = {v.name for v in stand_ins}
    kept_inputs = [i for i in skeleton.graph.input if i.name not in temporary]
    del skeleton.graph.input[:]
    skeleton.graph.input.extend(kept_inputs)
    present = {t.name for t in model.graph.initializer} | set(lifted)
    missing = set(stored) - present
    if missing:
        raise GraphError(f"no weight named '{sorted(missing)[0]}' in the model")
    data = _DataFile(path.with_name(path.name + ".data"))
    new_nodes = []
    try:
        for tensor in list(model.graph.initializer) + list(lifted.values()):
            if tensor.name in stored:
                initializers, nodes = _emit(tensor.name, stored[tensor.name])
                skeleton.graph.initializer.extend(data.reference(t) for t in initializers)
                new_nodes.extend(nodes)
            else:
                skeleton.graph.initializer.append(data.reference(tensor))
    finally:
        data.close()
    inputs = [i for i in skeleton.graph.input if i.name not in stored]
    del skeleton.graph.input[:]
    skeleton.graph.input.extend(inputs)
    nodes = new_nodes + list(skeleton.graph.node)
    del skeleton.graph.node[:]
    skeleton.graph.node.extend(nodes)
    minimum_ir = helper.find_min_ir_version_for(list(skeleton.opset_import), ignore_unknown=True)
    skeleton.ir_version = min(max(skeleton.ir_version, minimum_ir), MAX_IR_VERSION)
    onnx.save_model(skeleton, str(path))
    return path
