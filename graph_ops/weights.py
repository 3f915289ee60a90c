"""Find the weight tensors that quantization can act on.

A weight tensor is a float initializer (or a Constant node's value) that
reaches a *weight operand* of a compute op, possibly through layout-only ops.
Biases and norm scales do not reach such operands and are left out by
construction; the caller's size threshold removes the rest.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

WEIGHT_OPERANDS: dict[str, tuple[int, ...] | None] = {
    "MatMul": None,  # either operand may be the constant one
    "Gemm": (0, 1),
    "Conv": (1,),
    "ConvTranspose": (1,),
    "Gather": (0,),  # embedding tables
    "Einsum": None,
    "RNN": (1, 2),
    "LSTM": (1, 2),
    "GRU": (1, 2),
}
"""Op type -> input positions that hold weights (None: any input)."""

PASS_THROUGH = {"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten"}
"""Layout-only ops a weight may pass through before its consumer (data input 0)."""

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64",
}
"""Float element types numpy can feed to a runtime (bfloat16 cannot be fed from numpy)."""


@dataclass(frozen=True)
class WeightTensor:
    """One stored weight tensor and what consumes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    op_types: tuple[str, ...]
    """Compute ops it feeds as a weight; empty if it feeds none (still float)."""
    source: str
    """'initializer' or 'constant' (the output of a Constant node)."""
    channel_axis: int | None = None
    """Axis of the stored array that holds output channels (None: unknown or ambiguous)."""
    nodes: tuple[str, ...] = ()
    """Names of the compute nodes it feeds, which often say more than an exporter's tensor name."""

    @property
    def params(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def is_operand_weight(self) -> bool:
        return bool(self.op_types)


def _constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    found = {}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.HasField("t"):
                    found[node.output[0]] = attribute.t
    return found


def _stored_tensors(graph: onnx.GraphProto) -> dict[str, tuple[onnx.TensorProto, str]]:
    stored = {t.name: (t, "initializer") for t in graph.initializer}
    for name, tensor in _constant_tensors(graph).items():
        stored[name] = (tensor, "constant")
    return stored


def _attribute(node: onnx.NodeProto, name: str, default):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _consumer_channel_axis(node: onnx.NodeProto, position: int, rank: int) -> int | None:
    """Output-channel axis of a weight operand, in the consumer's view of the tensor."""
    op = node.op_type
    if op == "MatMul":
        return rank - 1 if position == 1 else max(rank - 2, 0)
    if op == "Gemm":
        transposed = _attribute(node, "transB" if position == 1 else "transA", 0)
        return (0 if transposed else 1) if position == 1 else (1 if transposed else 0)
    if op == "Conv" or op == "Gather":
        return 0
    if op == "ConvTranspose":
        return 1 if _attribute(node, "group", 1) == 1 else None
    return None


def _weight_consumers(
    name: str, rank: int, consumers: dict[str, list[tuple[onnx.NodeProto, int]]]
) -> tuple[set[str], int | None, list[str]]:
    """Op types that use `name` as a weight operand, following layout-only ops,
    the stored axis holding output channels if all consumers agree, and the
    consuming nodes' names."""
    found: set[str] = set()
    nodes: list[str] = []
    axes: set[int | None] = set()
    # Each frontier entry: tensor name and, per axis of that tensor, the stored axis (None once a reshape loses track).
    frontier, seen = [(name, list(range(rank)))], {name}
    while frontier:
        current, axis_map = frontier.pop()
        for node, position in consumers.get(current, []):
            operands = WEIGHT_OPERANDS.get(node.op_type, ())
            if node.domain in ("", "ai.onnx") and (operands is None or position in operands):
                found.add(node.op_type)
                nodes.append(node.name or node.output[0])
                axis = _consumer_channel_axis(node, position, len(axis_map)) if axis_map is not None else None
                axes.add(axis_map[axis] if axis is not None and axis < len(axis_map) else None)
            elif node.op_type in PASS_THROUGH and position == 0:
                if node.op_type == "Transpose" and axis_map is not None:
                    perm = _attribute(node, "perm", list(reversed(range(len(axis_map)))))
                    next_map = [axis_map[p] for p in perm]
                elif node.op_type in ("Cast", "Identity"):
                    next_map = axis_map
                else:
                    next_map = None
                for output in node.output:
                    if output not in seen:
                        seen.add(output)
                        frontier.append((output, next_map))
    channel_axis = axes.pop() if len(axes) == 1 else None
    return found, channel_axis, nodes


def find_weight_tensors(model: onnx.ModelProto) -> list[WeightTensor]:
    """Every float tensor stored in the main graph, with the weight ops it feeds.

    Callers decide which count as quantizable (usually: feeds a weight operand
    and is large enough).
    """
    graph = model.graph
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for position, input_name in enumerate(node.input):
            if input_name:
                consumers[input_name].append((node, position))
    graph_inputs = {value.name for value in graph.input}
    tensors = []
    for name, (tensor, source) in _stored_tensors(graph).items():
        if tensor.data_type not in FLOAT_TYPES or name in graph_inputs:
            continue
        shape = tuple(int(d) for d in tensor.dims)
        op_types, channel_axis, nodes = _weight_consumers(name, len(shape), consumers)
        tensors.append(
            WeightTensor(
                name=name,
                shape=shape,
                dtype=FLOAT_TYPES[tensor.data_type],
                op_types=tuple(sorted(op_types)),
                source=source,
                channel_axis=channel_axis,
                nodes=tuple(nodes),
            )
        )
    return tensors


def _view(tensor: onnx.TensorProto) -> np.ndarray:
    """A read-only numpy array over a float tensor's raw bytes (one copy: protobuf
    hands out raw_data as a new bytes object), else numpy_helper's conversion."""
    if tensor.raw_data and tensor.data_type in FLOAT_TYPES:
        dtype = np.dtype(FLOAT_TYPES[tensor.data_type]).newbyteorder("<")
        return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(tuple(tensor.dims))
    return numpy_helper.to_array(tensor)


def read_weights(model: onnx.ModelProto, names: list[str] | set[str]) -> dict[str, np.ndarray]:
    """The stored values of the named tensors, as read-only numpy arrays."""
    wanted = set(names)
    stored = _stored_tensors(model.graph)
    missing = wanted - stored.keys()
    if missing:
        raise KeyError(f"no stored tensor named {sorted(missing)[0]!r}")
    return {name: _view(stored[name][0]) for name in wanted}


def replace_weights(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` whose named initializers / Constant values hold `values`."""
    import copy

    result = copy.deepcopy(model)
    stored = _stored_tensors(result.graph)
    for name, value in values.items():
        if name not in stored:
            raise KeyError(f"no stored tensor named {name!r}")
        tensor = stored[name][0]
        tensor.CopyFrom(numpy_helper.from_array(np.asarray(value, dtype=numpy_helper.to_array(tensor).dtype), tensor.name))
    return result
