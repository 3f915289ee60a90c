"""Where each weight's calibration inputs come from, and in which order to collect them.

GPTQ-family methods need, for every weight, its layout as Wt [N, K] (one row
per output channel) and the activation X whose rows multiply it. This module
reads both off the graph (`weight_bindings`), orders the weight nodes into
waves so that each wave's inputs depend only on earlier waves (`waves`), adds
the needed activations as graph outputs (`expose_tensors`) and unfolds Conv
inputs into rows (`im2col`, `layer_inputs`). Numpy and onnx only.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from graph_ops.io import GraphError
from graph_ops.weights import FLOAT_TYPES, PASS_THROUGH, WEIGHT_OPERANDS, _stored_tensors

FOLLOWED = {"Transpose", "Identity", "Cast"}
"""Layout-only ops that keep the weight's layout known; the other PASS_THROUGH ops
(Reshape and friends) are still followed, but leave the weight RTN-only."""


@dataclass(frozen=True)
class ConvGeometry:
    """The attributes im2col needs to reproduce one Conv node's windows."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]
    """ONNX order: all begins, then all ends (used when auto_pad is NOTSET)."""
    auto_pad: str
    group: int

    def resolved_pads(self, spatial: tuple[int, ...]) -> tuple[int, ...]:
        """Explicit begin/end pads for an input of this spatial shape."""
        if self.auto_pad in ("NOTSET", ""):
            return self.pads
        if self.auto_pad == "VALID":
            return (0,) * (2 * len(spatial))
        begins, ends = [], []
        for size, k, s, d in zip(spatial, self.kernel, self.strides, self.dilations):
            total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
            small, large = total // 2, total - total // 2
            begins.append(small if self.auto_pad == "SAME_UPPER" else large)
            ends.append(large if self.auto_pad == "SAME_UPPER" else small)
        return tuple(begins + ends)


@dataclass(frozen=True)
class WeightUse:
    """One node that consumes a weight, and how to read its X from that node's input."""

    node: str
    node_index: int
    op_type: str
    x: str
    """The activation tensor whose rows multiply Wt."""
    transpose_x: bool = False
    """X = swapaxes(x, -1, -2) before flattening (weight on MatMul's left, Gemm transA)."""
    conv: ConvGeometry | None = None

    @property
    def key(self) -> tuple:
        """Uses with equal keys see identical X (siblings such as q/k/v)."""
        return (self.x, self.transpose_x, self.conv)


@dataclass(frozen=True)
class WeightBinding:
    """A stored weight, its Wt layout and the nodes that consume it."""

    name: str
    shape: tuple[int, ...]
    perm: tuple[int, ...] | None
    """Stored axes in Wt order (output-channel axis first); None: one row (per tensor)."""
    row_groups: int
    """Conv groups: Wt's rows split into this many blocks, each with its own inputs."""
    uses: tuple[WeightUse, ...]
    rtn_reason: str | None = None
    """Why only RTN applies (None when calibration inputs can be collected)."""

    @property
    def calibratable(self) -> bool:
        return self.rtn_reason is None

    @property
    def wt_shape(self) -> tuple[int, int]:
        size = int(np.prod(self.shape, dtype=np.int64))
        rows = 1 if self.perm is None else self.shape[self.perm[0]]
        return rows, size // max(rows, 1)

    @property
    def stored_rows_axis(self) -> int | None:
        return None if self.perm is None else self.perm[0]

    def to_wt(self, stored: np.ndarray) -> np.ndarray:
        """The stored tensor as Wt [N, K]."""
        moved = stored if self.perm is None else np.transpose(stored, self.perm)
        return moved.reshape(self.wt_shape)

    def from_wt(self, wt: np.ndarray) -> np.ndarray:
        """Wt [N, K] back in the stored layout."""
        if self.perm is None:
            return wt.reshape(self.shape)
        moved = wt.reshape(tuple(self.shape[a] for a in self.perm))
        return np.transpose(moved, np.argsort(self.perm))


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _decode(value):
    return value.decode() if isinstance(value, bytes) else value


def _node_id(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def _conv_geometry(node: onnx.NodeProto, weight_shape: tuple[int, ...]) -> ConvGeometry:
    attrs = _attributes(node)
    kernel = tuple(int(k) for k in attrs.get("kernel_shape", weight_shape[2:]))
    rank = len(kernel)
    return ConvGeometry(
        kernel=kernel,
        strides=tuple(int(s) for s in attrs.get("strides", [1] * rank)),
        dilations=tuple(int(d) for d in attrs.get("dilations", [1] * rank)),
        pads=tuple(int(p) for p in attrs.get("pads", [0] * (2 * rank))),
        auto_pad=_decode(attrs.get("auto_pad", "NOTSET")),
        group=int(attrs.get("group", 1)),
    )


def _einsum_rows(node: onnx.NodeProto, position: int, rank: int) -> tuple[int, ...] | None:
    """Operand order with the single output-channel axis first, or None if ambiguous."""
    equation = _decode(_attributes(node).get("equation", "")).replace(" ", "")
    if "->" not in equation or "..." in equation:
        return None
    operands, output = equation.split("->")
    terms = operands.split(",")
    if position >= len(terms) or len(terms[position]) != rank:
        return None
    kept = [i for i, letter in enumerate(terms[position]) if letter in output]
    if len(kept) != 1:
        return None
    return (kept[0],) + tuple(i for i in range(rank) if i != kept[0])


def _use_layout(node, position, rank, index, constants, weight_shape):
    """(operand perm to Wt, WeightUse or None, reason, row groups) for one consumer."""
    op, inputs = node.op_type, list(node.input)
    name = _node_id(node, index)

    def other_constant(position: int) -> bool:
        return position < len(inputs) and inputs[position] in constants

    if op == "MatMul":
        if rank != 2:
            axis = rank - 1 if position == 1 else max(rank - 2, 0)
            perm = (axis,) + tuple(i for i in range(rank) if i != axis) if rank else None
            return perm, None, f"MatMul weight of rank {rank}", 1
        if other_constant(1 - position):
            return ((1, 0) if position == 1 else (0, 1)), None, "both MatMul operands are constant", 1
        if position == 1:
            return (1, 0), WeightUse(name, index, op, inputs[0]), None, 1
        return (0, 1), WeightUse(name, index, op, inputs[1], transpose_x=True), None, 1
    if op == "Gemm":
        attrs = _attributes(node)
        trans_a, trans_b = bool(attrs.get("transA", 0)), bool(attrs.get("transB", 0))
        if position == 1:
            perm, use = ((0, 1) if trans_b else (1, 0)), WeightUse(name, index, op, inputs[0], transpose_x=trans_a)
        else:
            perm, use = ((1, 0) if trans_a else (0, 1)), WeightUse(name, index, op, inputs[1], transpose_x=not trans_b)
        if other_constant(1 - position):
            return perm, None, "both Gemm operands are constant", 1
        return perm, use, None, 1
    if op == "Conv" and position == 1:
        geometry = _conv_geometry(node, weight_shape)
        perm = tuple(range(rank))
        if other_constant(0):
            return perm, None, "Conv input is constant", geometry.group
        return perm, WeightUse(name, index, op, inputs[0], conv=geometry), None, geometry.group
    if op == "ConvTranspose":
        return (1, 0) + tuple(range(2, rank)), None, "ConvTranspose inputs are not rebuilt", 1
    if op in ("LSTM", "GRU", "RNN"):
        return ((1, 0, 2) if rank == 3 else None), None, f"{op} inputs are not rebuilt", 1
    if op == "Gather":
        axis = int(_attributes(node).get("axis", 0)) % max(rank, 1)
        return (axis,) + tuple(i for i in range(rank) if i != axis), None, "Gather (embedding) has no matrix input", 1
    if op == "Einsum":
        return _einsum_rows(node, position, rank), None, "Einsum inputs are not rebuilt", 1
    return None, None, f"{op} inputs are not rebuilt", 1


def _reach(name: str, consumers, shape: tuple[int, ...]):
    """(node, position, index, transpose from stored to operand, followed-only) for each weight consumer."""
    found = []
    frontier = [(name, tuple(range(len(shape))), True)]
    seen = {name}
    while frontier:
        tensor, perm, clean = frontier.pop()
        for node, position, index in consumers.get(tensor, []):
            operands = WEIGHT_OPERANDS.get(node.op_type, ())
            if node.domain in ("", "ai.onnx") and (operands is None or position in operands):
                found.append((node, position, index, perm, clean))
            elif node.op_type in PASS_THROUGH and position == 0:
                step, follows = perm, clean and node.op_type in FOLLOWED
                if node.op_type == "Transpose":
                    order = _attributes(node).get("perm", list(range(len(perm)))[::-1])
                    step = tuple(perm[o] for o in order) if len(order) == len(perm) else perm
                for output in node.output:
                    if output not in seen:
                        seen.add(output)
                        frontier.append((output, step, follows))
    return found


def weight_bindings(model: onnx.ModelProto, names: list[str] | set[str] | None = None) -> dict[str, WeightBinding]:
    """Wt layout and calibration uses of each named float weight (default: all that feed weight operands).

    A weight reached through Transpose/Identity/Cast keeps a known layout;
    through Reshape and friends, or used by LSTM/GRU/Einsum/ConvTranspose/
    Gather, it gets RTN only (with the reason). A weight shared by several
    nodes is bound once: its uses' statistics are summed.
    """
    graph = model.graph
    stored = _stored_tensors(graph)
    constants = set(stored)
    consumers = defaultdict(list)
    for index, node in enumerate(graph.node):
        for position, input_name in enumerate(node.input):
            if input_name:
                consumers[input_name].append((node, position, index))
    wanted = set(names) if names is not None else None
    if wanted is not None and wanted - stored.keys():
        raise GraphError(f"no stored tensor named {sorted(wanted - stored.keys())[0]!r}")
    bindings = {}
    for name, (tensor, _) in stored.items():
        if (wanted is not None and name not in wanted) or tensor.data_type not in FLOAT_TYPES:
            continue
        shape = tuple(int(d) for d in tensor.dims)
        reached = _reach(name, consumers, shape)
        if not reached:
            if wanted is not None:
                bindings[name] = WeightBinding(name, shape, None, 1, (), "feeds no weight operand")
            continue
        bindings[name] = _bind(name, shape, reached, constants)
    return bindings


def _bind(name, shape, reached, constants) -> WeightBinding:
    perms, uses, reasons, groups = set(), [], [], set()
    for node, position, index, to_operand, clean in reached:
        operand_shape = tuple(shape[a] for a in to_operand)
        perm, use, reason, row_groups = _use_layout(node, position, len(shape), index, constants, operand_shape)
        if not clean:
            reason = f"reaches {node.op_type} through a reshaping op"
            perm = None
        perms.add(None if perm is None else tuple(to_operand[p] for p in perm))
        groups.add(row_groups)
        if reason:
            reasons.append(reason)
        elif use is not None:
            uses.append(use)
    if len(perms) > 1 or len(groups) > 1:
        return WeightBinding(name, shape, None, 1, tuple(uses), "its consumers disagree on its layout")
    perm = perms.pop()
    if perm is not None and (len(perm) != len(shape) or len(shape) < 2):
        perm = None  # a vector or scalar gets one scale
    reason = reasons[0] if reasons else None
    if reason is None and perm is None:
        reason = "layout unknown"
    return WeightBinding(name, shape, perm, groups.pop(), tuple(uses), reason)


def waves(model: onnx.ModelProto, bindings: dict[str, WeightBinding]) -> list[list[str]]:
    """Calibratable weights grouped into stages that can be quantized together.

    level(node) = 0 without a weight node upstream of its X input, else 1 + the
    highest such level; equal levels form a wave. Siblings (q/k/v, up/gate)
    and independent branches thus share a wave with no architecture knowledge.
    A weight shared by nodes of different levels joins the wave of its last use.
    """
    node_weights: dict[int, list[WeightUse]] = defaultdict(list)
    for binding in bindings.values():
        if binding.calibratable:
            for use in binding.uses:
                node_weights[use.node_index].append(use)
    tensor_level: dict[str, int] = {}
    node_level: dict[int, int] = {}
    for index, node in enumerate(model.graph.node):
        upstream = max((tensor_level.get(i, -1) for i in node.input if i), default=-1)
        if index in node_weights:
            level = 1 + max(tensor_level.get(u.x, -1) for u in node_weights[index])
            node_level[index] = level
            upstream = max(upstream, level)
        for output in node.output:
            tensor_level[output] = upstream
    grouped: dict[int, list[str]] = defaultdict(list)
    for name, binding in bindings.items():
        if binding.calibratable and binding.uses:
            grouped[max(node_level[u.node_index] for u in binding.uses)].append(name)
    return [grouped[level] for level in sorted(grouped)]


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    graph = model.graph
    found = {t.name: helper.make_tensor_value_info(t.name, t.data_type, None) for t in graph.initializer}
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            found[value.name] = value
    return found


def expose_tensors(model: onnx.ModelProto, names: list[str] | set[str]) -> onnx.ModelProto:
    """A copy of `model` that also outputs the named intermediate tensors.

    Only the element type is declared (from value_info, or shape inference
    when missing): a stale static shape could clash with the batch a
    calibration run feeds, and the runtime needs no more. Graph inputs and
    existing outputs are left as they are: read those from the feeds or the
    normal outputs.
    """
    result = copy.deepcopy(model)
    graph = result.graph
    present = {v.name for v in graph.output} | {v.name for v in graph.input}
    wanted = [n for n in dict.fromkeys(names) if n not in present]
    if not wanted:
        return result
    infos = _value_infos(result)
    if any(n not in infos for n in wanted):
        try:
            infos = {**_value_infos(onnx.shape_inference.infer_shapes(model)), **infos}
        except Exception:  # inference is best effort; the check below names what is missing
            pass
    for name in wanted:
        if name not in infos:
            raise GraphError(f"cannot tell the element type of tensor '{name}' to expose it as an output")
        graph.output.append(helper.make_tensor_value_info(name, infos[name].type.tensor_type.elem_type, None))
    return result


def im2col(x: np.ndarray, geometry: ConvGeometry) -> np.ndarray:
    """Rows of Conv windows: x [B, C, *spatial] -> [B·prod(out), C·prod(kernel)], columns (c, k...).

    The column order matches weight.reshape(M, -1) (and nn.Unfold), so for
    group g the columns g·(C/g)·prod(k) ... (g+1)·(C/g)·prod(k) are its inputs.
    """
    rank = len(geometry.kernel)
    spatial = tuple(x.shape[2:])
    if len(spatial) != rank:
        raise GraphError(f"Conv input has {len(spatial)} spatial axes, kernel has {rank}")
    pads = geometry.resolved_pads(spatial)
    padded = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + rank]) for i in range(rank)])
    spans = [d * (k - 1) + 1 for k, d in zip(geometry.kernel, geometry.dilations)]
    windows = np.lib.stride_tricks.sliding_window_view(padded, spans, axis=tuple(range(2, 2 + rank)))
    picks = tuple(slice(None, None, s) for s in geometry.strides) + tuple(slice(None, None, d) for d in geometry.dilations)
    windows = windows[(slice(None), slice(None)) + picks]  # [B, C, *out, *kernel]
    order = (0,) + tuple(range(2, 2 + rank)) + (1,) + tuple(range(2 + rank, 2 + 2 * rank))
    moved = windows.transpose(order)  # [B, *out, C, *kernel]
    columns = x.shape[1] * int(np.prod(geometry.kernel))
    return moved.reshape(-1, columns)


def layer_inputs(use: WeightUse, value: np.ndarray, row_groups: int = 1) -> list[np.ndarray]:
    """X rows for each row group of the weight, from the activation tensor `value`."""
    value = np.asarray(value)
    if use.conv is not None:
        rows = im2col(value, use.conv)
        return np.split(rows, row_groups, axis=1)
    if use.transpose_x:
        value = value.reshape(1, -1) if value.ndim == 1 else np.swapaxes(value, -1, -2)
    return [value.reshape(-1, value.shape[-1])]


__all__ = [
    "ConvGeometry",
    "WeightBinding",
    "WeightUse",
    "expose_tensors",
    "im2col",
    "layer_inputs",
    "waves",
    "weight_bindings",
]
