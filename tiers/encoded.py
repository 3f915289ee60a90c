"""One container for a weight as it is written into the ONNX file.

`Encoded` says exactly what the exporter stores for one weight and can
reproduce, in numpy, the floats the runtime computes from it:
- 'raw': the float weight as it is (its own dtype);
- 'cast': a narrower float (bf16/fp16) + Cast to the weight's dtype;
- 'dequantize': integer or FP8 codes + DequantizeLinear, scale (and zero
  point) per tensor, per axis, or blockwise with `block_size` along `axis`;
- 'packed_sign': sign bits packed 8 per byte + an unpack subgraph, one scale per channel;
- 'split': consecutive output-channel groups, each its own Encoded, joined by
  a Concat along `axis` (a weight whose channel groups sit on different tiers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

FORMS = ("raw", "cast", "dequantize", "packed_sign", "split")


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


def storage_bits(dtype) -> int:
    """Bits one element of `dtype` takes on disk (INT4/UINT4 and INT2/UINT2 are packed)."""
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
        return 4
    if dtype in (np.dtype(ml_dtypes.int2), np.dtype(ml_dtypes.uint2)):
        return 2
    return dtype.itemsize * 8


SUB_BYTE = {np.dtype(ml_dtypes.int4): 4, np.dtype(ml_dtypes.uint4): 4, np.dtype(ml_dtypes.int2): 2, np.dtype(ml_dtypes.uint2): 2}
"""Code types numpy holds one per byte though they need fewer bits (ml_dtypes keeps the bits masked)."""


@dataclass(frozen=True, eq=False)
class PackedCodes:
    """Sub-byte codes packed as they are on disk (2 or 4 per byte): what a cache of
    encodings holds, so that several tiers' codes of a large model fit beside it."""

    data: np.ndarray
    dtype: np.dtype
    shape: tuple[int, ...]

    @classmethod
    def pack(cls, values: np.ndarray) -> "PackedCodes":
        bits = SUB_BYTE[values.dtype]
        per = 8 // bits
        raw = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        raw = np.concatenate([raw, np.zeros(-raw.size % per, np.uint8)]).reshape(-1, per)
        data = np.zeros(raw.shape[0], np.uint8)
        for i in range(per):
            data |= raw[:, i] << np.uint8(i * bits)
        return cls(data, values.dtype, values.shape)

    def unpack(self) -> np.ndarray:
        bits = SUB_BYTE[self.dtype]
        per, mask = 8 // bits, np.uint8((1 << bits) - 1)
        raw = np.empty((self.data.size, per), np.uint8)
        for i in range(per):
            raw[:, i] = (self.data >> np.uint8(i * bits)) & mask
        return raw.reshape(-1)[: self.size].view(self.dtype).reshape(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Encoded:
    """What one weight becomes in the exported file (see the module docstring for the forms)."""

    tier: str
    form: str
    values: np.ndarray | None
    """Stored payload: floats, integer/FP8 codes in their ONNX container type, or packed bits
    (`PackedCodes` only in a compact encoding, see `compact`)."""
    shape: tuple[int, ...]
    scale: np.ndarray | None = None
    """float32 scales shaped as DequantizeLinear takes them (cast to `dtype` when written)."""
    zero_point: np.ndarray | None = None
    """Zero points in the codes' container type, shaped like `scale`; None when symmetric."""
    axis: int | None = None
    block_size: int | None = None
    dtype: str = "float32"
    """Float type the weight's consumers expect (what the stored form must produce)."""
    parts: tuple["Encoded", ...] = ()
    """'split' only: the channel groups in order along `axis`."""

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"unknown stored form '{self.form}'")

    def compact(self) -> "Encoded":
        """The same encoding with sub-byte codes packed (`PackedCodes`), for keeping; `expand` undoes it."""
        if self.form == "split":
            return replace(self, parts=tuple(p.compact() for p in self.parts))
        if self.form == "dequantize" and isinstance(self.values, np.ndarray) and self.values.dtype in SUB_BYTE:
            return replace(self, values=PackedCodes.pack(self.values))
        return self

    def expand(self) -> "Encoded":
        """The encoding with its codes as arrays again (what every reader of `values` expects)."""
        if self.form == "split":
            return replace(self, parts=tuple(p.expand() for p in self.parts))
        if isinstance(self.values, PackedCodes):
            return replace(self, values=self.values.unpack())
        return self

    def dequantize(self) -> np.ndarray:
        """The weight the runtime computes from the stored form (exact dequantization), as `dtype`."""
        if self.form == "raw":  # stored as it is: a float64 weight is not to pass through float32
            return np.asarray(self.values).astype(self.dtype, copy=False)
        return self._dequantize().astype(self.dtype, copy=False)

    def _dequantize(self) -> np.ndarray:
        """float32, computed in place: one weight-sized array, however large the weight."""
        if self.form == "split":
            out = np.empty(self.shape, np.float32)
            start, index = 0, [slice(None)] * len(self.shape)
            for part in self.parts:
                index[self.axis] = slice(start, start + part.shape[self.axis])
                out[tuple(index)] = part._dequantize()
                start += part.shape[self.axis]
            return out
        if self.form in ("raw", "cast"):
            return self.values.astype(np.float32)
        if self.form == "packed_sign":
            size = int(np.prod(self.shape, dtype=np.int64))
            bits = np.unpackbits(self.values)[:size].reshape(self.shape).astype(np.float32)
            return (bits * 2 - 1) * broadcast_scale(self.scale, self.shape, self.axis, None)
        values = self.values.unpack() if isinstance(self.values, PackedCodes) else self.values
        codes = values.astype(np.float32)
        del values
        if self.zero_point is not None:
            codes -= broadcast_scale(self.zero_point.astype(np.float32), self.shape, self.axis, self.block_size)
        written = np.asarray(self.scale).astype(np.float16) if self.dtype == "float16" else self.scale  # a float16 model's scales are written as float16
        codes *= broadcast_scale(written, self.shape, self.axis, self.block_size)
        return codes

    @property
    def payload_bits(self) -> int:
        """Bits of values, scales and zero points (what the weight itself costs on disk)."""
        if self.form == "split":
            return sum(p.payload_bits for p in self.parts)
        bits = int(self.values.nbytes) * 8 if self.form == "packed_sign" else int(self.values.size) * storage_bits(self.values.dtype)
        if self.scale is not None:
            bits += int(np.asarray(self.scale).size) * storage_bits(self.dtype)
        if self.zero_point is not None:
            bits += int(self.zero_point.size) * storage_bits(self.zero_point.dtype)
        return bits

    def take_channels(self, start: int, stop: int, channel_axis: int) -> "Encoded":
        """Output channels start..stop (along `channel_axis` of the stored weight) in the same form."""
        index = np.arange(start, stop)
        shape = list(self.shape)
        shape[channel_axis] = stop - start
        if self.form == "split":
            raise ValueError("take channels of a weight before splitting it")
        if self.form in ("raw", "cast"):
            return replace(self, values=np.take(self.values, index, axis=channel_axis), shape=tuple(shape))
        if self.form == "packed_sign":
            size = int(np.prod(self.shape, dtype=np.int64))
            signs = np.unpackbits(self.values)[:size].reshape(self.shape)
            packed = np.packbits(np.take(signs, index, axis=channel_axis).reshape(-1))
            return replace(self, values=packed, shape=tuple(shape), scale=np.take(self.scale, index, axis=0))
        values = np.take(self.values, index, axis=channel_axis)
        scale, zero = self.scale, self.zero_point
        if self.axis is not None and np.ndim(scale) > 0:
            along = 0 if np.ndim(scale) == 1 else channel_axis  # per-axis vector, or blockwise (weight rank)
            scale = np.take(scale, index, axis=along)
            zero = None if zero is None else np.take(zero, index, axis=along)
        return replace(self, values=values, shape=tuple(shape), scale=scale, zero_point=zero)
