"""How an RNN/GRU/LSTM's weights meet their inputs, for calibration.

W multiplies the input sequence; R the previous state, which no graph tensor
holds as such: it is Y one step back in the order each direction runs, and the
initial state when one is fed. `recurrent_states` names the tensor that holds
them (the calibration graph builds it, `add_recurrent_states`) and
`recurrent_rows` cuts it into X rows, one column block per direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

RECURRENT_OPS = ("RNN", "GRU", "LSTM")


@dataclass(frozen=True)
class RecurrentGeometry:
    """How the X rows of an RNN/GRU/LSTM weight are rebuilt. W multiplies the input x_t; R the state h_{t-1},
    which is Y one step back in the order each direction runs (Y[:-1] forward, Y[1:] reverse), and the initial
    state when one is fed (a zero one adds nothing). Wt's columns hold one block per direction the operand stores,
    and each direction's rows fill only its own block: the solver sees one Hessian per direction, not their sum."""

    operand: str
    """'W' (input weights) or 'R' (recurrence weights)."""
    directions: tuple[tuple[int, str], ...]
    """(index on Y's direction axis, 'forward'/'reverse') for each direction block of the operand, in Wt column
    order."""
    batch_first: bool
    """ONNX layout 1: X [batch, seq, I], Y [batch, seq, directions, H]; else time first."""
    data: str
    """The node's input sequence X: where the node sits in the graph (R's X is the node's own output)."""
    initial: bool = False
    """R's rows come from Y with the fed initial state on both ends of the sequence axis (`recurrent_states`)."""


def initial_state(node: onnx.NodeProto) -> str | None:
    """An RNN node's initial state input (5), when one is fed."""
    return node.input[5] if len(node.input) > 5 and node.input[5] else None


def recurrent_states(node: onnx.NodeProto) -> str | None:
    """The tensor R's X rows come from: the node's Y, with its initial state (when fed) on both ends along the
    sequence axis, so a one-step cell carrying its state in from the rollout has rows too. The calibration
    graph makes it (`add_recurrent_states`) unless it is the node's own named Y; its name
    comes from the node's first named output (unique, found again without node indices). None: no output used."""
    named = [o for o in node.output if o]
    if not named:
        return None
    if initial_state(node):
        return f"{named[0]}/states"
    return _output_y(node)


def _output_y(node: onnx.NodeProto) -> str:
    """The node's Y: its own name, or the one the calibration graph gives it from its first named output."""
    return node.output[0] or f"{next(o for o in node.output if o)}/Y"


def recurrent_rows(geometry: RecurrentGeometry, value: np.ndarray) -> np.ndarray:
    """X rows of an RNN weight from its node's input sequence (W) or output Y (R): each direction's rows fill
    its own column block of Wt [gates·H, directions·K], zeros elsewhere."""
    blocks = []
    for d, direction in geometry.directions:
        if geometry.operand == "W":
            rows = value.reshape(-1, value.shape[-1])
        else:
            states = value if geometry.batch_first else np.transpose(value, (2, 0, 1, 3))  # [batch, seq, directions, H]
            ends = int(geometry.initial)  # the initial state on both ends: h_{t-1} of each direction's first step
            length = states.shape[1]
            states = (
                states[:, : length - 1 - ends, d] if direction == "forward" else states[:, 1 + ends :, d]
            )  # h_{t-1} in each one's order
            rows = states.reshape(-1, states.shape[-1])
        blocks.append(rows)
    if len(blocks) == 1:
        return blocks[0]
    width = blocks[0].shape[1]
    rows = np.zeros((sum(b.shape[0] for b in blocks), width * len(blocks)), dtype=blocks[0].dtype)
    start = 0
    for column, block in enumerate(blocks):
        rows[start : start + block.shape[0], column * width : (column + 1) * width] = block
        start += block.shape[0]
    return rows


def add_recurrent_states(model: onnx.ModelProto, layouts) -> onnx.ModelProto:
    """`model` (a copy the caller owns) with the tensor each calibrated R's rows come from
    (`recurrent_states`): a Y the exporter left unnamed (torch's do, when only the last state is used) named,
    and the fed initial state put on both ends of Y along the sequence axis."""
    wanted = {
        u.x: u.recurrent
        for layout in layouts.values()
        if layout.calibratable
        for u in layout.uses
        if u.recurrent is not None and u.recurrent.operand == "R"
    }
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    for node in list(model.graph.node):
        states = recurrent_states(node) if node.op_type in RECURRENT_OPS else None
        if states not in wanted:
            continue
        node.output[0] = _output_y(node)
        if not wanted[states].initial:
            continue
        initial, axis = initial_state(node), int(wanted[states].batch_first)
        if opset >= 13:
            model.graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), f"{states}/axis"))
            unsqueeze = helper.make_node("Unsqueeze", [initial, f"{states}/axis"], [f"{states}/initial"])
        else:
            unsqueeze = helper.make_node("Unsqueeze", [initial], [f"{states}/initial"], axes=[axis])
        ends = f"{states}/initial"
        model.graph.node.extend(
            [unsqueeze, helper.make_node("Concat", [ends, node.output[0], ends], [states], axis=axis)]
        )
    return model


__all__ = [
    "RECURRENT_OPS",
    "RecurrentGeometry",
    "add_recurrent_states",
    "initial_state",
    "recurrent_rows",
    "recurrent_states",
]
