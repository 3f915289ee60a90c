"""The precision tiers: how each quantizes, what it costs, how it is stored.

Every tier turns a float weight into a `Stored` value that says exactly what
goes into the ONNX file (raw floats, a narrower float + Cast, integer or FP8
codes + DequantizeLinear, or packed sign bits + an unpack subgraph) and can
reproduce, in numpy, the floats the runtime will compute from it.

Quantizers: symmetric (no zero point), per output channel by default (per
tensor when the channel axis is unknown), optionally blockwise along the
reduction axis (`group_size`). Integer tiers of 4 bits or fewer use the whole
signed range (INT2: {-2, -1, 0, 1}·s, not ternary) and pick each channel's
(or block's) scale by a small MSE search, because plain max-abs scaling
wastes most of a 2-bit grid on outliers. INT1 stores sign(w) times the mean
|w| of the channel (the L2-optimal binary scale).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

SCALE_BITS = 32
"""Scales are stored as float32 (DequantizeLinear's scale type for a float32 output)."""

CLIP_CANDIDATES = np.linspace(1.0, 0.15, 18)
"""Shrink factors tried by the MSE clipping search of low-bit integer tiers."""


@dataclass(frozen=True)
class Layout:
    """Where a weight's output channels are in its stored array."""

    shape: tuple[int, ...]
    channel_axis: int | None = None

    @property
    def params(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def block_axis(self) -> int | None:
        """The reduction axis that blocks run along (rank-2 weights only)."""
        if len(self.shape) == 2 and self.channel_axis is not None:
            return 1 - self.channel_axis % 2
        return None

    def scale_shape(self, group_size: int | None) -> tuple[int, ...]:
        """Shape of the scale array DequantizeLinear takes for this layout."""
        if self.channel_axis is None:
            return ()
        if group_size and self.block_axis is not None:
            shape = list(self.shape)
            shape[self.block_axis] = math.ceil(shape[self.block_axis] / group_size)
            return tuple(shape)
        return (self.shape[self.channel_axis],)

    def effective_group(self, group_size: int | None) -> int | None:
        return group_size if group_size and self.block_axis is not None else None


@dataclass(frozen=True)
class Stored:
    """What one weight becomes in the exported file."""

    tier: str
    kind: str
    """'raw' (float32 as is), 'cast' (fp16/bf16 + Cast), 'dequantize' (codes + DequantizeLinear), 'packed_sign' (bits + unpack)."""
    values: np.ndarray
    shape: tuple[int, ...]
    scale: np.ndarray | None = None
    axis: int | None = None
    block_size: int | None = None
    zero_point: np.ndarray | None = None
    """Integer zero points (same container type as `values`) for asymmetric codes."""
    dtype: str = "float32"
    """Float type the weight's consumers expect (what the stored form must produce)."""

    def dequantized(self) -> np.ndarray:
        """The weight the runtime computes from the stored form (exact dequantization), as `dtype`."""
        return self._dequantized().astype(self.dtype)

    def _dequantized(self) -> np.ndarray:
        if self.kind in ("raw", "cast"):
            return self.values.astype(np.float32)
        if self.kind == "packed_sign":
            size = int(np.prod(self.shape, dtype=np.int64))
            bits = np.unpackbits(self.values)[:size].reshape(self.shape).astype(np.float32)
            return (bits * 2 - 1) * broadcast_scale(self.scale, self.shape, self.axis, None)
        codes = self.values.astype(np.float32)
        if self.zero_point is not None:
            codes = codes - broadcast_scale(self.zero_point.astype(np.float32), self.shape, self.axis, self.block_size)
        return codes * broadcast_scale(self.scale, self.shape, self.axis, self.block_size)

    @property
    def payload_bits(self) -> int:
        """Bits actually written: values plus scales."""
        scale_bits = 0 if self.scale is None else int(np.asarray(self.scale).size) * SCALE_BITS
        if self.zero_point is not None:
            scale_bits += int(self.zero_point.size) * _storage_bits(self.zero_point.dtype)
        return int(self.values.nbytes if self.kind == "packed_sign" else self.values.size * _storage_bits(self.values.dtype) / 8) * 8 + scale_bits


def _storage_bits(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
        return 4
    if dtype in (np.dtype(ml_dtypes.int2), np.dtype(ml_dtypes.uint2)):
        return 2
    return dtype.itemsize * 8


def broadcast_scale(scale: np.ndarray, shape, axis: int | None, block_size: int | None) -> np.ndarray:
    """Broadcast a DequantizeLinear scale (or zero point) to the weight's shape, as float32."""
    scale = np.asarray(scale, dtype=np.float32)
    if scale.ndim == 0 or axis is None:
        return np.broadcast_to(scale, shape)
    axis = axis % len(shape)
    if block_size:
        return np.repeat(scale, block_size, axis=axis).take(np.arange(shape[axis]), axis=axis)
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return np.broadcast_to(scale.reshape(view), shape)


def _grouped(w: np.ndarray, layout: Layout, group: int | None) -> tuple[np.ndarray, callable]:
    """View w as (groups, members): one row per scale. Returns the view and its inverse."""
    shape = w.shape
    if layout.channel_axis is None:
        return w.reshape(1, -1), lambda g: g.reshape(shape)
    axis = layout.channel_axis % w.ndim
    if group is None:
        moved = np.moveaxis(w, axis, 0)
        inner = moved.shape
        return moved.reshape(inner[0], -1), lambda g: np.moveaxis(g.reshape(inner), 0, axis)
    block_axis = layout.block_axis
    k = shape[block_axis]
    padded_k = math.ceil(k / group) * group
    moved = np.moveaxis(w, block_axis, 1)  # (channels, K)
    padded = np.zeros((moved.shape[0], padded_k), dtype=w.dtype)
    padded[:, :k] = moved
    rows = padded.reshape(moved.shape[0], padded_k // group, group)

    def back(g):
        full = g.reshape(moved.shape[0], padded_k)[:, :k]
        return np.moveaxis(full, 1, block_axis)

    return rows.reshape(-1, group), back


def _scale_array(per_row: np.ndarray, layout: Layout, group: int | None) -> np.ndarray:
    """Per-row scales (row order of `_grouped`) in DequantizeLinear's layout."""
    if layout.channel_axis is None:
        return per_row.reshape(()).astype(np.float32)
    if group is None:
        return per_row.astype(np.float32)
    channels = layout.shape[layout.channel_axis % len(layout.shape)]
    blocks = per_row.reshape(channels, -1)  # (channels, blocks)
    return np.moveaxis(blocks, 1, layout.block_axis).astype(np.float32)


def _symmetric_codes(rows: np.ndarray, qmax: int, search: bool) -> tuple[np.ndarray, np.ndarray]:
    """Codes on the signed grid and a scale per row, optionally MSE-clipped.

    Without the search the grid is [-qmax, qmax] with max|w| at qmax (plain
    symmetric). With it, the whole two's-complement range [-qmax-1, qmax] is
    used (GPTQ-style symmetric: 4 levels at 2 bits instead of ternary) and
    each row keeps the scale, among shrunk max-abs candidates, with the least
    squared error.
    """
    rows = rows.astype(np.float32)
    peak = np.abs(rows).max(axis=1)
    best_scale, low = peak / qmax, -qmax
    if search:
        low = -qmax - 1
        best_error = np.full(rows.shape[0], np.inf)
        for shrink in CLIP_CANDIDATES:
            scale = (peak * shrink / qmax).astype(np.float32)
            safe = np.where(scale > 0, scale, 1.0)[:, None]
            error = np.square(np.clip(np.rint(rows / safe), low, qmax) * safe - rows).sum(axis=1)
            better = error < best_error
            best_error[better], best_scale[better] = error[better], scale[better]
    best_scale = best_scale.astype(np.float32)
    safe = np.where(best_scale > 0, best_scale, 1.0)[:, None]
    return np.clip(np.rint(rows / safe), low, qmax), best_scale


def _asymmetric_codes(rows: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unsigned codes, scale and integer zero point per row (min-max range that
    contains 0, shrunk by an MSE search): the grid GPTQ and RTN baselines use."""
    rows = rows.astype(np.float32)
    maxq = 2**bits - 1
    low, high = np.minimum(rows.min(axis=1), 0), np.maximum(rows.max(axis=1), 0)
    best_error, best_scale, best_zero = np.full(rows.shape[0], np.inf), np.ones(rows.shape[0], np.float32), np.zeros(rows.shape[0])
    for shrink in CLIP_CANDIDATES:
        lo, hi = low * shrink, high * shrink
        scale = np.where(hi > lo, (hi - lo) / maxq, 1.0).astype(np.float32)
        zero = np.clip(np.rint(-lo / scale), 0, maxq)
        codes = np.clip(np.rint(rows / scale[:, None]) + zero[:, None], 0, maxq)
        error = np.square((codes - zero[:, None]) * scale[:, None] - rows).sum(axis=1)
        better = error < best_error
        best_error[better], best_scale[better], best_zero[better] = error[better], scale[better], zero[better]
    codes = np.clip(np.rint(rows / best_scale[:, None]) + best_zero[:, None], 0, maxq)
    return codes, best_scale, best_zero


@dataclass(frozen=True)
class Tier:
    """One precision tier."""

    name: str
    bits: int
    family: str
    """'float' (fp32/bf16/fp16), 'int', 'fp8' or 'binary'."""
    runtimes: frozenset[str]
    opset: int
    """Lowest ONNX opset its stored form needs."""
    asymmetric: bool = False
    """Integer tiers only: unsigned codes with a zero point per scale (min-max grid)."""

    def cost_bits(self, layout: Layout, group_size: int | None = None) -> int:
        """Honest storage cost in bits, scales included."""
        if self.family == "float":
            return layout.params * self.bits
        group = layout.effective_group(group_size) if self.family == "int" else None
        scales = int(np.prod(layout.scale_shape(group), dtype=np.int64))
        if self.family == "binary":
            return math.ceil(layout.params / 8) * 8 + scales * SCALE_BITS
        zero_points = scales * self.bits if self.asymmetric else 0
        return layout.params * self.bits + scales * SCALE_BITS + zero_points

    def quantize(self, w: np.ndarray, layout: Layout, group_size: int | None = None) -> Stored:
        """The stored form of `w` at this tier, producing `w`'s own float type."""
        w = np.asarray(w)
        return dataclasses.replace(self._quantize(w, layout, group_size), dtype=w.dtype.name if w.dtype.kind == "f" else "float32")

    def _quantize(self, w: np.ndarray, layout: Layout, group_size: int | None) -> Stored:
        if self.name == "fp32":
            return Stored(self.name, "raw", w if w.dtype.itemsize <= 4 else w.astype(np.float32), w.shape)
        if self.name == "bf16":
            return Stored(self.name, "cast", w.astype(np.float32).astype(ml_dtypes.bfloat16), w.shape)
        if self.name == "fp16":
            return Stored(self.name, "cast", np.clip(w, -65504, 65504).astype(np.float16), w.shape)
        axis = None if layout.channel_axis is None else layout.channel_axis % w.ndim
        if self.family == "binary":
            rows, back = _grouped(w, layout, None)
            scale = np.abs(rows.astype(np.float32)).mean(axis=1).astype(np.float32)
            signs = back((rows >= 0).astype(np.uint8))
            return Stored(self.name, "packed_sign", np.packbits(signs.reshape(-1)), w.shape, _scale_array(scale, layout, None), axis)
        group = layout.effective_group(group_size) if self.family == "int" else None
        rows, back = _grouped(w, layout, group)
        if self.family == "fp8":
            peak = np.abs(rows.astype(np.float32)).max(axis=1)
            scale = np.where(peak > 0, peak / 448.0, 1.0).astype(np.float32)
            codes = (rows / scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
            return Stored(self.name, "dequantize", back(codes), w.shape, _scale_array(scale, layout, None), axis)
        block_axis = layout.block_axis if group else axis
        if self.asymmetric:
            codes, scale, zero = _asymmetric_codes(rows, self.bits)
            dtype = {8: np.uint8, 4: ml_dtypes.uint4, 2: ml_dtypes.uint2}[self.bits]
            zero_point = _scale_array(zero, layout, group).astype(dtype)
            return Stored(self.name, "dequantize", back(codes).astype(dtype), w.shape, _scale_array(scale, layout, group), block_axis, group, zero_point)
        qmax = 2 ** (self.bits - 1) - 1
        codes, scale = _symmetric_codes(rows, qmax, search=self.bits <= 4)
        dtype = {8: np.int8, 4: ml_dtypes.int4, 2: ml_dtypes.int2}[self.bits]
        return Stored(self.name, "dequantize", back(codes).astype(dtype), w.shape, _scale_array(scale, layout, group), block_axis, group)


TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        Tier("fp32", 32, "float", frozenset({"ort", "trt"}), 1),
        Tier("bf16", 16, "float", frozenset({"ort", "trt"}), 13),
        Tier("fp16", 16, "float", frozenset({"ort", "trt"}), 1),
        Tier("fp8", 8, "fp8", frozenset({"ort", "trt"}), 19),
        Tier("int8", 8, "int", frozenset({"ort", "trt"}), 13),
        Tier("int4", 4, "int", frozenset({"ort", "trt"}), 21),
        Tier("int2", 2, "int", frozenset({"ort"}), 25),
        Tier("int8-asym", 8, "int", frozenset({"ort"}), 13, asymmetric=True),
        Tier("int4-asym", 4, "int", frozenset({"ort"}), 21, asymmetric=True),
        Tier("int2-asym", 2, "int", frozenset({"ort"}), 25, asymmetric=True),
        Tier("int1", 1, "binary", frozenset({"ort"}), 18),
    )
}
"""Built-in tiers by name, from most to least precise."""

DEFAULT_TIERS = ("fp32", "bf16", "int8", "int4", "int2")
"""The paper's five-tier set (TimesFM-2.5)."""

TRT_BLOCK_SIZES = (64, 128)
"""TensorRT runs weight-only INT4 only blockwise with these block sizes."""


class TierError(ValueError):
    """An unknown tier, or a tier the target runtime cannot run."""


def get_tiers(names: list[str] | tuple[str, ...], target: str = "ort", group_size: int | None = None) -> list[Tier]:
    """Resolve tier names, most precise first, checking the target runtime takes them."""
    tiers = []
    for name in names:
        key = name.strip().lower()
        if key not in TIERS:
            raise TierError(f"unknown tier '{name}'; known tiers: {', '.join(TIERS)}")
        tier = TIERS[key]
        if target not in tier.runtimes:
            raise TierError(f"tier '{tier.name}' cannot run on target '{target}' (it runs on: {', '.join(sorted(tier.runtimes))})")
        if target == "trt" and tier.name == "int4" and group_size not in TRT_BLOCK_SIZES:
            raise TierError(f"TensorRT runs INT4 weights only in blocks of {' or '.join(map(str, TRT_BLOCK_SIZES))}; pass --group-size 64 or 128")
        tiers.append(tier)
    if not tiers:
        raise TierError("no tiers given")
    order = list(TIERS)
    return sorted(dict.fromkeys(tiers), key=lambda t: (-t.bits, order.index(t.name)))
