"""One walk from every stored weight to the ops that consume it.

A weight is a float initializer (or a Constant node's value). Following it
through layout-only ops (Transpose, Cast, Identity, and the reshaping ones)
to the compute ops that use it as a weight operand tells three things that
every later step needs, so they are read here once:
- which ops and nodes it feeds (units, reports);
- its layout as Wt [N, K], one row per output channel (`perm`: stored axes in
  Wt order), which quantizers, DequantizeLinear axes and channel groups use;
- for each consumer, the activation whose rows multiply it (`WeightUse`, read
  by `graph_ops.weight_use`), which GPTQ-family calibration collects, or why
  none can be rebuilt (`rtn_reason`).
Biases and norm scales reach no weight operand and so are not weights.
Row-preserving data movement (Slice, Split, Concat, Unsqueeze, Squeeze;
`MOVEMENT`) is followed too: every element keeps its stored row, so per-row
grids of the stored tensor stay valid, and the chain runs on the dequantized
tensor (torch's default exporter slices an LSTM's gate blocks and
concatenates them in ONNX's order).

`Layout` is the one type for "how a stored weight reads as Wt": the walk
finds it (`WeightLayout` is a `Layout` plus what the walk learnt about the
weight), and every quantizer and stored format maps arrays through it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from graph_ops.names import weight_labels
from graph_ops.weight_use import WEIGHT_OPERANDS, WeightUse, node_attributes, use_layout

PASS_THROUGH = {"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten"}
"""Layout-only ops a weight may pass through before its consumer (data input 0)."""

FOLLOWED = {"Transpose", "Identity", "Cast"}
"""Pass-through ops that keep the layout known; after the others (Reshape and
friends) the weight is still found, but gets per-tensor, uncalibrated quantization."""

MOVEMENT = {"Slice": (0,), "Split": (0,), "Concat": None, "Unsqueeze": (0,), "Squeeze": (0,)}
"""Row-preserving data movement followed with the layout known (op -> data input positions; None: any): each
element of the output is one of the weight's, its stored axes known (`_moved`)."""

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64",
}
"""Float element types numpy can feed to a runtime (bfloat16 cannot be fed from numpy)."""


@dataclass(frozen=True)
class Layout:
    """A stored weight's shape and where its output channels are."""

    shape: tuple[int, ...]
    perm: tuple[int, ...] | None = None
    """Stored axes in Wt order, output-channel axis first; None: unknown (one row, per-tensor scale)."""
    row_groups: int = 1
    """Conv groups: Wt's rows split into this many blocks, each reading its own inputs."""

    def __post_init__(self):
        if self.perm is not None and sorted(self.perm) != list(range(len(self.shape))):
            raise ValueError(f"perm {self.perm} does not permute the axes of shape {self.shape}")

    @classmethod
    def channels_on(cls, shape: tuple[int, ...], axis: int | None) -> "Layout":
        """Output channels on `axis`, the remaining axes flattened in order."""
        if axis is None or len(shape) == 0:
            return cls(tuple(shape))
        axis %= len(shape)
        return cls(tuple(shape), (axis,) + tuple(i for i in range(len(shape)) if i != axis))

    @property
    def channel_axis(self) -> int | None:
        return None if self.perm is None else self.perm[0]

    @property
    def params(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def wt_shape(self) -> tuple[int, int]:
        rows = 1 if self.perm is None else self.shape[self.perm[0]]
        return rows, self.params // max(rows, 1)

    @property
    def channels(self) -> int:
        return self.wt_shape[0]

    @property
    def block_axis(self) -> int | None:
        """The stored reduction axis DequantizeLinear blocks run along (rank-2 weights only)."""
        if len(self.shape) == 2 and self.perm is not None:
            return self.perm[1]
        return None

    def effective_group(self, group_size: int | None) -> int | None:
        """The block size this weight can use: blockwise needs a rank-2 weight with known layout."""
        return group_size if group_size and self.block_axis is not None else None

    def scale_shape(self, group_size: int | None) -> tuple[int, ...]:
        """Shape of the scale array DequantizeLinear takes for this layout."""
        if self.perm is None:
            return ()
        group = self.effective_group(group_size)
        if group:
            shape = list(self.shape)
            shape[self.block_axis] = math.ceil(shape[self.block_axis] / group)
            return tuple(shape)
        return (self.shape[self.perm[0]],)

    def to_wt(self, stored: np.ndarray) -> np.ndarray:
        """The stored tensor as Wt [N, K]."""
        moved = stored if self.perm is None else np.transpose(stored, self.perm)
        return np.reshape(moved, self.wt_shape)

    def from_wt(self, wt: np.ndarray) -> np.ndarray:
        """Wt [N, K] back in the stored layout."""
        if self.perm is None:
            return np.reshape(wt, self.shape)
        moved = np.reshape(wt, tuple(self.shape[a] for a in self.perm))
        return np.transpose(moved, np.argsort(self.perm))

    def rows(self, start: int, stop: int) -> "Layout":
        """The layout of output channels start..stop (a channel group of this weight)."""
        if self.perm is None:
            raise ValueError("a weight with unknown layout cannot be split by output channel")
        shape = list(self.shape)
        shape[self.perm[0]] = stop - start
        return Layout(tuple(shape), self.perm, 1)

    def take_rows(self, stored: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Output channels start..stop of the stored array."""
        return np.take(stored, np.arange(start, stop), axis=self.perm[0])


@dataclass(frozen=True, kw_only=True)
class WeightLayout(Layout):
    """A stored float tensor, what consumes it, and how it reads as Wt [N, K] (its `Layout`)."""

    name: str
    dtype: str
    source: str
    """'initializer' or 'constant' (the output of a Constant node)."""
    op_types: tuple[str, ...] = ()
    """Compute ops it feeds as a weight; empty if it feeds none (still float)."""
    nodes: tuple[str, ...] = ()
    """Names of the compute nodes it feeds, which often say more than an exporter's tensor name."""
    label: str = ""
    """What reports call it: its module path where an exporter generated its name (`graph_ops.names`), else its
    name (`display`)."""
    uses: tuple[WeightUse, ...] = ()
    rtn_reason: str | None = None
    """Why calibration inputs cannot be rebuilt (None when they can)."""

    @property
    def is_operand_weight(self) -> bool:
        return bool(self.op_types)

    @property
    def display(self) -> str:
        """Its label, or its name where it has none."""
        return self.label or self.name

    @property
    def calibratable(self) -> bool:
        return self.rtn_reason is None and bool(self.uses)


def constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Constant node outputs holding a tensor value, by output name."""
    found = {}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.HasField("t"):
                    found[node.output[0]] = attribute.t
    return found


UNFED_FLOAT_TYPES = {onnx.TensorProto.BFLOAT16: "bfloat16"}
"""Float weights ONNX Runtime's Python API cannot be fed from numpy: they cannot be perturbed, so never units."""


def unfed_float_tensors(graph: onnx.GraphProto) -> dict[str, tuple[str, int]]:
    """Stored tensors of a float type numpy cannot feed (`UNFED_FLOAT_TYPES`): name -> (type, element count)."""
    return {
        name: (UNFED_FLOAT_TYPES[tensor.data_type], int(np.prod(tensor.dims, dtype=np.int64)))
        for name, (tensor, _) in stored_tensors(graph).items()
        if tensor.data_type in UNFED_FLOAT_TYPES
    }


def read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Names read by nodes inside the bodies of `graph`'s control-flow nodes (Scan, Loop, If), at any depth:
    a main-graph weight read only there has no consumer `weight_layouts` sees."""
    names: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            for body in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                names.update(name for inner in body.node for name in inner.input if name)
                names.update(read_in_subgraphs(body))
    return names


def stored_tensors(graph: onnx.GraphProto) -> dict[str, tuple[onnx.TensorProto, str]]:
    """Initializers and Constant values by name, with where they live."""
    stored = {t.name: (t, "initializer") for t in graph.initializer}
    for name, tensor in constant_tensors(graph).items():
        stored[name] = (tensor, "constant")
    return stored


def _ints(node: onnx.NodeProto, attribute: str, position: int, stored) -> list[int] | None:
    """An int list from an attribute (older opsets) or a constant input: [] when absent, None when not constant."""
    attrs = node_attributes(node)
    if attribute in attrs:
        return [int(v) for v in np.atleast_1d(attrs[attribute])]
    if position >= len(node.input) or not node.input[position]:
        return []
    tensor = stored.get(node.input[position], (None,))[0]
    if tensor is None or tensor.data_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return None
    return [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]


def _moved(node: onnx.NodeProto, axes: tuple, stored) -> tuple[tuple, set] | None:
    """(the output's stored axes, the operand axes data moved along) after one `MOVEMENT` node; None when its
    axes are not constant (then followed as a reshaping op)."""
    rank, op = len(axes), node.op_type
    if op in ("Concat", "Split"):
        return axes, {int(node_attributes(node).get("axis", 0)) % max(rank, 1)}
    if op == "Slice":
        along = _ints(node, "axes", 3, stored)
        if along == []:
            starts = _ints(node, "starts", 1, stored)
            along = None if starts is None else list(range(len(starts)))
        return axes, set(range(rank)) if along is None else {a % max(rank, 1) for a in along}
    along = _ints(node, "axes", 1, stored)
    if not along:
        return None
    if op == "Unsqueeze":
        out_rank = rank + len(along)
        new, source = {a % out_rank for a in along}, iter(axes)
        return tuple(None if i in new else next(source) for i in range(out_rank)), set()
    gone = {a % max(rank, 1) for a in along}
    return tuple(a for i, a in enumerate(axes) if i not in gone), set()


def _reach(name: str, consumers, rank: int, stored=None):
    """(node, position, index, operand->stored axis map, layout still known, stored axes moved along, ops passed,
    slot) for each weight consumer. The map holds None for axes the weight does not have (added by Unsqueeze);
    `slot` (input position, inputs) is where a Concat along such an axis put it (None: no such Concat), which
    tells a bidirectional RNN's per-direction weight (torch's default exporter) which direction it is."""
    found = []
    frontier = [(name, tuple(range(rank)), True, frozenset(), (), None)]
    seen = {(name, tuple(range(rank)), None)}
    while frontier:
        tensor, axes, clean, moved, path, slot = frontier.pop()
        for node, position, index in consumers.get(tensor, []):
            operands = WEIGHT_OPERANDS.get(node.op_type, ())
            movement = MOVEMENT.get(node.op_type, ())
            default_domain = node.domain in ("", "ai.onnx")
            if default_domain and (operands is None or position in operands):
                found.append((node, position, index, axes, clean, moved, path, slot))
                continue
            stacked = (
                clean
                and node.op_type == "Concat"
                and axes
                and axes[int(node_attributes(node).get("axis", 0)) % len(axes)] is None
            )
            now_slot = slot
            if default_domain and stacked:  # beside other tensors along an axis it lacks: its own elements do not move
                step, follows, now_moved, now_slot = axes, True, moved, (position, len(node.input))
            elif default_domain and node.op_type in MOVEMENT and (movement is None or position in movement):
                moving = _moved(node, axes, stored or {}) if clean else None
                step, follows, now_moved = (
                    (axes, False, moved) if moving is None else (moving[0], True, moved | {axes[a] for a in moving[1]})
                )
            elif node.op_type in PASS_THROUGH and position == 0:
                step = axes
                if node.op_type == "Transpose":
                    order = node_attributes(node).get("perm", list(range(len(axes)))[::-1])
                    step = tuple(axes[o] for o in order) if len(order) == len(axes) else axes
                follows, now_moved = clean and node.op_type in FOLLOWED, moved
            else:
                continue
            for output in node.output:
                if (
                    output and (output, step, now_slot) not in seen
                ):  # a weight stacked twice (tied directions) reaches twice
                    seen.add((output, step, now_slot))
                    frontier.append((output, step, follows, frozenset(now_moved), path + (node.op_type,), now_slot))
    return found


def _stored_perm(perm, axes, rank: int):
    """An operand's Wt order as stored axes: None when its channel axis is not one of the weight's (axes the
    weight lacks dropped, stored axes the operand lacks, squeezed ones, last)."""
    if perm is None or len(perm) != len(axes) or axes[perm[0]] is None:
        return None
    mapped = [axes[p] for p in perm if axes[p] is not None]
    return tuple(mapped + [a for a in range(rank) if a not in mapped])


def _layout(name, tensor, source, reached, constants) -> WeightLayout:
    shape = tuple(int(d) for d in tensor.dims)
    perms, uses, reasons, groups, ops, nodes = set(), [], [], set(), set(), []
    for node, position, index, axes, clean, moved, path, slot in reached:
        ops.add(node.op_type)
        nodes.append(node.name or next((o for o in node.output if o), node.op_type))
        operand_shape = tuple(1 if a is None else shape[a] for a in axes)
        lacking = [i for i, a in enumerate(axes) if a is None]
        perm, use, reason, row_groups = use_layout(
            node, position, len(axes), index, constants, operand_shape, slot if lacking == [0] else None
        )
        perm = _stored_perm(perm, axes, len(shape))
        if not clean:
            reason, perm = f"reaches {node.op_type} through a reshaping op", None
        elif moved and (perm is None or not moved <= {perm[0]} or row_groups > 1):  # other rows or columns meet X
            reason, use, row_groups = (
                reason or f"reaches {node.op_type} through {', '.join(dict.fromkeys(path))}",
                None,
                1,
            )
        perms.add(perm)
        groups.add(row_groups)
        if reason:
            reasons.append(reason)
        elif use is not None:
            uses.append(use)
    base = dict(
        name=name,
        shape=shape,
        dtype=FLOAT_TYPES[tensor.data_type],
        source=source,
        op_types=tuple(sorted(ops)),
        nodes=tuple(nodes),
    )
    if not reached:
        return WeightLayout(**base, rtn_reason="feeds no weight operand")
    if len(perms) > 1 or len(groups) > 1:
        return WeightLayout(**base, uses=tuple(uses), rtn_reason="its consumers disagree on its layout")
    perm = perms.pop()
    if perm is not None and (len(perm) != len(shape) or len(shape) < 2):
        perm = None  # a vector or scalar gets one scale
    reason = reasons[0] if reasons else (None if perm is not None else "layout unknown")
    return WeightLayout(**base, perm=perm, row_groups=groups.pop(), uses=tuple(uses), rtn_reason=reason)


def unreached_reasons(graph: onnx.GraphProto, names) -> dict[str, str]:
    """Why each named stored tensor is no weight `weight_layouts` finds, for a user deciding on --include: the
    weight op it reaches through ops that compute on stored tensors alone ('reaches LSTM through Mul, Slice
    (not followed)'), else the ops that read it ('feeds no weight operand: Add, LSTM input 3')."""
    constant, consumers, inner = set(stored_tensors(graph)), defaultdict(list), read_in_subgraphs(graph)
    for node in graph.node:  # topological: a node of constant inputs makes constant outputs
        if node.input and all(not i or i in constant for i in node.input):
            constant.update(node.output)
        for position, input_name in enumerate(node.input):
            consumers[input_name].append((node, position))
    reasons = {}
    for name in names:
        frontier, seen, reached = [(name, ())], {name}, None
        while frontier and reached is None:
            tensor, path = frontier.pop(0)
            for node, position in consumers.get(tensor, []):
                operands = WEIGHT_OPERANDS.get(node.op_type, ())
                if path and (operands is None or position in operands):
                    reached = f"reaches {node.op_type} through {', '.join(dict.fromkeys(path))} (not followed)"
                    break
                if len(path) < 8 and node.output and node.output[0] in constant:
                    fresh = [o for o in node.output if o and o not in seen]
                    seen.update(fresh)
                    frontier.extend((o, path + (node.op_type,)) for o in fresh)
        readers = [
            f"{n.op_type} input {p}" if n.op_type in WEIGHT_OPERANDS else n.op_type for n, p in consumers.get(name, [])
        ]
        unread = "read only inside Scan/Loop/If bodies" if name in inner else "read by no node"
        reasons[name] = reached or (
            f"feeds no weight operand: {', '.join(dict.fromkeys(readers))}" if readers else unread
        )
    return reasons


def weight_layouts(model: onnx.ModelProto, names: list[str] | set[str] | None = None) -> dict[str, WeightLayout]:
    """Every float tensor stored in the main graph (or the named ones), with its consumers and layout.

    A weight shared by several nodes is one entry: its uses' statistics are
    summed and it is quantized once. Unless named, graph inputs that shadow an
    initializer are not weights (the user feeds them; before IR 4 every
    initializer was also listed as an input, so then they are).
    """
    graph = model.graph
    stored = stored_tensors(graph)
    consumers = defaultdict(list)
    for index, node in enumerate(graph.node):
        for position, input_name in enumerate(node.input):
            if input_name:
                consumers[input_name].append((node, position, index))
    graph_inputs = {value.name for value in graph.input} if model.ir_version >= 4 and names is None else set()
    wanted = set(names) if names is not None else None
    if wanted is not None and wanted - stored.keys():
        raise KeyError(f"no stored tensor named {sorted(wanted - stored.keys())[0]!r}")
    layouts, labels = {}, weight_labels(graph, {name: tensor for name, (tensor, _) in stored.items()})
    for name, (tensor, source) in stored.items():
        if (wanted is not None and name not in wanted) or tensor.data_type not in FLOAT_TYPES or name in graph_inputs:
            continue
        layout = _layout(name, tensor, source, _reach(name, consumers, len(tensor.dims), stored), set(stored))
        layouts[name] = replace(layout, label=labels[name])
    return layouts
