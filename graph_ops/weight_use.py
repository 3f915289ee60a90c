"""How a stored weight meets its input at each op that consumes it as a weight operand.

For one consumer (MatMul, Gemm, Conv, ConvTranspose, Einsum, Gather, RNN/GRU/LSTM) this reads the operand's
order as Wt [N, K], one row per output channel, and the activation whose rows multiply Wt (`WeightUse`),
which GPTQ-family calibration collects, or why no such activation can be rebuilt. `graph_ops.layout` walks
each weight to its consumers and asks this module about every one.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from graph_ops.recurrent import RECURRENT_OPS, RecurrentGeometry, initial_state, recurrent_states

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
    output_padding: tuple[int, ...] = ()
    """ConvTranspose: extra outputs at the end of each spatial axis."""
    transposed: bool = False
    """A ConvTranspose: its windows are a stride-1 Conv's over the stride-upsampled input, the kernel flipped."""

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
    recurrent: RecurrentGeometry | None = None
    x_axes: tuple[int, ...] | None = None
    """X = transpose(x, x_axes), its last `x_columns` axes one row (an Einsum's other operand, the letters it
    shares with the weight last, in Wt's column order)."""
    x_columns: int = 1

    @property
    def key(self) -> tuple:
        """Uses with equal keys see identical X (siblings such as q/k/v)."""
        return (self.x, self.transpose_x, self.conv, self.recurrent, self.x_axes, self.x_columns)

    @property
    def placed_after(self) -> str:
        """The tensor the node must wait for: its X, or for a recurrent weight the node's input sequence."""
        return self.recurrent.data if self.recurrent is not None else self.x


def node_attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _decode(value):
    return value.decode() if isinstance(value, bytes) else value


def _node_id(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def _conv_geometry(node: onnx.NodeProto, weight_shape: tuple[int, ...]) -> ConvGeometry:
    attrs = node_attributes(node)
    kernel = tuple(int(k) for k in attrs.get("kernel_shape", weight_shape[2:]))
    rank = len(kernel)
    return ConvGeometry(
        kernel=kernel,
        strides=tuple(int(s) for s in attrs.get("strides", [1] * rank)),
        dilations=tuple(int(d) for d in attrs.get("dilations", [1] * rank)),
        pads=tuple(int(p) for p in attrs.get("pads", [0] * (2 * rank))),
        auto_pad=_decode(attrs.get("auto_pad", "NOTSET")),
        group=int(attrs.get("group", 1)),
        output_padding=tuple(int(p) for p in attrs.get("output_padding", [0] * rank))
        if node.op_type == "ConvTranspose"
        else (),
        transposed=node.op_type == "ConvTranspose",
    )


def _einsum_rows(node: onnx.NodeProto, position: int, rank: int) -> tuple[int, ...] | None:
    """Operand order with the single output-channel axis first, or None if ambiguous."""
    terms = _einsum_terms(node)
    if terms is None or position >= len(terms[0]) or len(terms[0][position]) != rank:
        return None
    kept = [i for i, letter in enumerate(terms[0][position]) if letter in terms[1]]
    if len(kept) != 1:
        return None
    return (kept[0],) + tuple(i for i in range(rank) if i != kept[0])


def _einsum_terms(node: onnx.NodeProto) -> tuple[list[str], str] | None:
    equation = _decode(node_attributes(node).get("equation", "")).replace(" ", "")
    if "->" not in equation or "..." in equation:
        return None
    operands, output = equation.split("->")
    return operands.split(","), output


def _einsum_use(node, position, perm, index) -> tuple[WeightUse | None, str | None]:
    """The use of a weight that an Einsum multiplies as a matrix: two operands, the weight's letters its output
    channel and letters it shares with the other operand alone (summed), none repeated. X is the other operand
    with those letters last, in Wt's column order (`WeightUse.x_axes`)."""
    terms = _einsum_terms(node)
    if perm is None or terms is None or len(terms[0]) != 2:
        return None, "Einsum inputs are not rebuilt (not a two-operand product with one output-channel letter)"
    weight, other = terms[0][position], terms[0][1 - position]
    if len(set(weight)) != len(weight) or len(set(other)) != len(other):
        return None, "Einsum inputs are not rebuilt (a repeated letter)"
    columns = [weight[a] for a in perm[1:]]
    if weight[perm[0]] in other or any(c not in other for c in columns):
        return (
            None,
            "Einsum inputs are not rebuilt (its weight shares letters with the other operand beyond the summed ones)",
        )
    if any(c not in terms[1] and c not in columns for c in other):
        return None, "Einsum inputs are not rebuilt (the other operand sums a letter on its own)"
    x_axes = tuple(i for i, letter in enumerate(other) if letter not in columns) + tuple(
        other.index(c) for c in columns
    )
    return WeightUse(
        _node_id(node, index), index, node.op_type, node.input[1 - position], x_axes=x_axes, x_columns=len(columns)
    ), None


def use_layout(node, position, rank, index, constants, operand_shape, slot=None):
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
        attrs = node_attributes(node)
        trans_a, trans_b = bool(attrs.get("transA", 0)), bool(attrs.get("transB", 0))
        if position == 1:
            perm, use = ((0, 1) if trans_b else (1, 0)), WeightUse(name, index, op, inputs[0], transpose_x=trans_a)
        else:
            perm, use = ((1, 0) if trans_a else (0, 1)), WeightUse(name, index, op, inputs[1], transpose_x=not trans_b)
        if other_constant(1 - position):
            return perm, None, "both Gemm operands are constant", 1
        return perm, use, None, 1
    if op == "Conv" and position == 1:
        geometry = _conv_geometry(node, operand_shape)
        perm = tuple(range(rank))
        if other_constant(0):
            return perm, None, "Conv input is constant", geometry.group
        return perm, WeightUse(name, index, op, inputs[0], conv=geometry), None, geometry.group
    if op == "ConvTranspose":
        attrs = node_attributes(node)
        perm = (1, 0) + tuple(range(2, rank)) if int(attrs.get("group", 1)) == 1 and rank >= 2 else None
        if perm is None or position != 1 or rank < 3:
            return perm, None, "grouped ConvTranspose inputs are not rebuilt", 1
        if other_constant(0):
            return perm, None, "ConvTranspose input is constant", 1
        if "output_shape" in attrs or _decode(attrs.get("auto_pad", "NOTSET")) not in ("NOTSET", "", "VALID"):
            return perm, None, "ConvTranspose sized by output_shape or SAME padding is not rebuilt", 1
        return perm, WeightUse(name, index, op, inputs[0], conv=_conv_geometry(node, operand_shape)), None, 1
    if op in RECURRENT_OPS:
        return _recurrent_use(node, position, rank, index, operand_shape, slot)
    if op == "Gather":
        axis = int(node_attributes(node).get("axis", 0)) % max(rank, 1)
        return (axis,) + tuple(i for i in range(rank) if i != axis), None, "Gather (embedding) has no matrix input", 1
    if op == "Einsum":
        perm = _einsum_rows(node, position, rank)
        if other_constant(1 - position):
            return perm, None, "both Einsum operands are constant", 1
        use, reason = _einsum_use(node, position, perm, index)
        return perm, use, reason, 1
    return None, None, f"{op} inputs are not rebuilt", 1


def _recurrent_use(node, position, rank, index, operand_shape, slot):
    """(perm, WeightUse or None, reason, 1) for an RNN/GRU/LSTM W (position 1) or R (2) operand [directions,
    gates·H, K]: the whole of it, or (`slot`) one direction stacked beside the others by a Concat."""
    op, name, attrs = node.op_type, _node_id(node, index), node_attributes(node)
    if rank != 3:
        return None, None, f"{op} weight of rank {rank}", 1
    direction = _decode(attrs.get("direction", "forward"))
    directions = tuple(enumerate(("forward", "reverse") if direction == "bidirectional" else (direction,)))
    if (
        slot is not None and operand_shape[0] == 1 and slot[1] == len(directions)
    ):  # as many inputs as directions: one each
        directions = (directions[slot[0]],)
    elif slot is not None or operand_shape[0] != len(directions):
        return (
            (1, 0, 2),
            None,
            f"{op} weight holds {operand_shape[0]} of a {direction} node's directions, which is not told",
            1,
        )
    if not node.input or not node.input[0]:
        return (1, 0, 2), None, f"{op} has no input sequence", 1
    if position == 2 and op == "GRU" and not int(attrs.get("linear_before_reset", 0)):
        return (1, 0, 2), None, "GRU without linear_before_reset: R's candidate rows read r*h, which is not rebuilt", 1
    x = node.input[0] if position == 1 else recurrent_states(node)
    if x is None:
        return (1, 0, 2), None, f"{op} outputs nothing used", 1
    geometry = RecurrentGeometry(
        "W" if position == 1 else "R",
        directions,
        int(attrs.get("layout", 0)) == 1,
        node.input[0],
        initial_state(node) is not None,
    )
    return (1, 0, 2), WeightUse(name, index, op, x, recurrent=geometry), None, 1
