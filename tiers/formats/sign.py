"""INT1 tier: the sign of each weight, packed 8 per byte, times one scale per output channel (±mean|w|,
the L2-optimal binary scale), rebuilt by an unpack subgraph of standard ops in either runtime layout."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import ml_dtypes
import numpy as np
from onnx import helper, numpy_helper

from graph_ops.native import GATHER, NativePlan
from tiers.encoded import Encoded, broadcast_scale
from tiers.formats.base import Emission, Tier, placed, register_form
from tiers.formats.native import gathered_part, matmul_part
from tiers.grid import Grid, GridSpec, f32, register_grid


def _fit(rows: np.ndarray) -> Grid:
    """±mean|w| per row: the L2-optimal binary scale."""
    return Grid(f32(np.abs(rows).mean(axis=1)), np.zeros(rows.shape[0]))


register_grid("sign", _fit, lambda w, divisor: np.where(w >= 0, 1.0, -1.0))


@register_form
class SignTier(Tier):
    """Packed sign bits + a scale per output channel ('packed_sign')."""

    family: ClassVar[str] = "binary"
    calibratable: ClassVar[bool] = True
    forms: ClassVar[tuple[str, ...]] = ("packed_sign",)

    @property
    def grid(self) -> GridSpec:
        return GridSpec("sign", 1)

    def stored(self, quantized, layout, dtype: str) -> Encoded:
        codes, scale, _, axis, _ = placed(quantized, layout)
        signs = np.packbits((codes > 0).astype(np.uint8).reshape(-1))
        return Encoded(self.name, "packed_sign", signs, layout.shape, scale, None, axis, None, dtype)

    @classmethod
    def form_opset(cls, value: Encoded) -> int:
        return 18  # BitwiseAnd

    @classmethod
    def _signs(cls, value: Encoded) -> np.ndarray:
        size = int(np.prod(value.shape, dtype=np.int64))
        return np.unpackbits(value.values)[:size].reshape(value.shape)

    @classmethod
    def dequantized(cls, value: Encoded) -> np.ndarray:
        bits = cls._signs(value).astype(np.float32)
        return (bits * 2 - 1) * broadcast_scale(value.scale, value.shape, value.axis, None)

    @classmethod
    def take_channels(cls, value: Encoded, index: np.ndarray, shape: tuple[int, ...], channel_axis: int) -> Encoded:
        packed = np.packbits(np.take(cls._signs(value), index, axis=channel_axis).reshape(-1))
        return replace(value, values=packed, shape=shape, scale=np.take(value.scale, index, axis=0))

    @classmethod
    def native(cls, name: str, value: Encoded, use, options) -> NativePlan | None:
        """A table's sign bits as packed codes a Gather reads; a matrix weight's as 2-bit codes {0, 2} around a zero
        point of 1 (exactly -|s| and +|s|), since MatMulNBits takes no 1-bit codes: twice the bits, but codes in
        memory rather than a float copy folded at load."""
        if use.kind == GATHER:
            part = gathered_part(name, value)
        else:
            part = matmul_part(name, cls._two_bit(value), use, options)
        return None if part is None else NativePlan(use.kind, (part,))

    @classmethod
    def _two_bit(cls, value: Encoded) -> Encoded:
        codes = (cls._signs(value).astype(np.uint8) * 2).astype(ml_dtypes.uint2)
        zero = np.ones(np.asarray(value.scale).shape, ml_dtypes.uint2)
        return replace(value, form="dequantize", values=codes, zero_point=zero)

    @classmethod
    def emit(cls, name: str, value: Encoded, layout: str) -> Emission:
        """packed uint8 -> bits (MSB first, as numpy.packbits) -> {-1, +1} * scale (folded at load in both layouts)."""
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
