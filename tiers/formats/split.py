"""A weight whose output-channel groups sit on different tiers ('split'): each group in its own stored
form, joined by a Concat along the output-channel axis. Not a tier: a container of other forms."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import numpy as np
from onnx import helper

from graph_ops.native import GATHER, MATMUL, NativePlan
from tiers.encoded import Encoded
from tiers.formats.base import Emission, Fed, StoredForm, register_form
from tiers.formats.native import float_part, merged, table_part


@register_form
class Split(StoredForm):
    forms: ClassVar[tuple[str, ...]] = ("split",)

    @classmethod
    def emit(cls, name: str, value: Encoded, layout: str) -> Emission:
        """Each channel group by its own form, joined along the output-channel axis."""
        initializers, nodes, pieces = [], [], []
        for index, part in enumerate(value.parts):
            piece = f"{name}__part{index}"
            tensors, producers = part.emit(piece, layout)
            initializers += tensors
            nodes += producers
            pieces.append(piece)
        nodes.append(helper.make_node("Concat", pieces, [name], axis=int(value.axis), name=f"{name}__concat"))
        return initializers, nodes

    @classmethod
    def native(cls, name: str, value: Encoded, use, options) -> NativePlan | None:
        """Channel groups of a matrix weight each as its own MatMulNBits, or as a float weight where the kernel cannot
        take its tier, their outputs joined (`graph_ops.native`); None for a table, or when no group goes native."""
        if use.kind == GATHER:
            return cls._table(name, value, options)
        if use.kind != MATMUL or value.axis != use.n_axis:
            return None
        parts = []
        for index, part in enumerate(value.parts):
            piece = f"{name}__part{index}"
            plan = part.native(piece, use, replace(options, min_params=0)) if part.form != "split" else None
            parts.append(plan.parts[0] if plan is not None else float_part(piece, part))
        parts = merged(tuple(parts))
        if len(parts) > 1 and 4 * int(np.prod(value.shape)) < options.split_min_bytes:
            return None  # several kernels for a small weight: slower than its folded float copy
        return NativePlan(MATMUL, parts) if any(p.op != "MatMul" for p in parts) else None

    @classmethod
    def _table(cls, name: str, value: Encoded, options) -> NativePlan | None:
        """Row groups of a Gather table, each as its own GatherBlockQuantized (or float Gather), the rows picked by
        index range (`graph_ops.native`); None for a table cut along its columns or with no group native."""
        if value.axis != 0 or any(part.form == "split" for part in value.parts):
            return None
        parts = merged(
            tuple(table_part(f"{name}__part{i}", part.expand(), options) for i, part in enumerate(value.parts))
        )
        return NativePlan(GATHER, parts) if any(p.op != "Gather" for p in parts) else None

    @classmethod
    def form_opset(cls, value: Encoded) -> int:
        return max([11] + [p.opset for p in value.parts])

    @classmethod
    def payload_bits(cls, value: Encoded) -> int:
        return sum(p.payload_bits for p in value.parts)

    @classmethod
    def dequantized(cls, value: Encoded) -> np.ndarray:
        out = np.empty(value.shape, np.float32)
        start, index = 0, [slice(None)] * len(value.shape)
        for part in value.parts:
            index[value.axis] = slice(start, start + part.shape[value.axis])
            out[tuple(index)] = part.as_float32()
            start += part.shape[value.axis]
        return out

    @classmethod
    def take_channels(cls, value: Encoded, index: np.ndarray, shape: tuple[int, ...], channel_axis: int) -> Encoded:
        raise ValueError("take channels of a weight before splitting it")

    @classmethod
    def fed(cls, name: str, value: Encoded) -> Fed | None:
        """Each part fed by its own form (all of them rebuilt, or the weight fed as floats), then a Concat."""
        pieces = [part.fed(f"{name}__part{i}") for i, part in enumerate(value.parts)]
        if any(piece is None for piece in pieces):
            return None
        inputs, feeds, nodes = [], {}, []
        for piece_inputs, piece_feeds, piece_nodes in pieces:
            inputs += piece_inputs
            feeds.update(piece_feeds)
            nodes += piece_nodes
        nodes.append(
            helper.make_node(
                "Concat",
                [f"{name}__part{i}" for i in range(len(pieces))],
                [name],
                axis=int(value.axis),
                name=f"{name}__fed_concat",
            )
        )
        return inputs, feeds, nodes
