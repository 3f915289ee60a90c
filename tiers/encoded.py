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
The container is the same for every form; what a form means (its numpy
dequantization, its ONNX emitters, its opset, how channels are cut out of it)
is the business of the stored format registered for it (`tiers.formats`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from graph_ops.io import element_bits
from tiers.formats.base import form_of

if TYPE_CHECKING:
    from graph_ops.native import NativePlan
    from tiers.formats.base import Emission, Fed


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
    """Bits one element of `dtype` takes on disk (sub-byte codes are packed)."""
    return element_bits(np.dtype(dtype))


def sub_byte(dtype) -> bool:
    """Code types numpy holds one per byte though they need fewer bits (ml_dtypes keeps the bits masked)."""
    return storage_bits(dtype) < 8


@dataclass(frozen=True, eq=False)
class PackedCodes:
    """Sub-byte codes packed as they are on disk (2 or 4 per byte): what a cache of
    encodings holds, so that several tiers' codes of a large model fit beside it."""

    data: np.ndarray
    dtype: np.dtype
    shape: tuple[int, ...]

    @classmethod
    def pack(cls, values: np.ndarray) -> "PackedCodes":
        bits = storage_bits(values.dtype)
        per = 8 // bits
        raw = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        raw = np.concatenate([raw, np.zeros(-raw.size % per, np.uint8)]).reshape(-1, per)
        data = np.zeros(raw.shape[0], np.uint8)
        for i in range(per):
            data |= raw[:, i] << np.uint8(i * bits)
        return cls(data, values.dtype, values.shape)

    def unpack(self) -> np.ndarray:
        bits = self.bits
        per, mask = 8 // bits, np.uint8((1 << bits) - 1)
        raw = np.empty((self.data.size, per), np.uint8)
        for i in range(per):
            raw[:, i] = (self.data >> np.uint8(i * bits)) & mask
        return raw.reshape(-1)[: self.size].view(self.dtype).reshape(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def bits(self) -> int:
        """Bits per code as ONNX stores them (8 // bits codes per byte)."""
        return storage_bits(self.dtype)


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
        form_of(self.form)  # an unknown form fails here, not when written

    def compact(self) -> "Encoded":
        """The same encoding with sub-byte codes packed (`PackedCodes`), for keeping; `expand` undoes it."""
        if self.form == "split":
            return replace(self, parts=tuple(p.compact() for p in self.parts))
        if isinstance(self.values, np.ndarray) and sub_byte(self.values.dtype):
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
        return self.as_float32().astype(self.dtype, copy=False)

    def as_float32(self) -> np.ndarray:
        """The dequantized weight in float32, computed in place: one weight-sized array, however large the weight."""
        return form_of(self.form).dequantized(
            self if self.form == "split" else self.expand()
        )  # a split's parts expand one by one

    def emit(self, name: str, layout: str) -> "Emission":
        """Initializers and nodes that produce tensor `name` in the file, in runtime `layout`
        (`graph_ops.qdq.LAYOUTS`)."""
        return form_of(self.form).emit(name, self.expand(), layout)

    def native(self, name: str, use, options) -> "NativePlan | None":
        """Tensor `name` as ONNX Runtime's own low-bit kernels read it (`graph_ops.native`), for consumers that read
        it as `use`, or None where its form or the kernels do not allow it (`tiers.formats.native`)."""
        if int(np.prod(self.shape, dtype=np.int64)) < options.min_params:
            return None
        return form_of(self.form).native(name, self if self.form == "split" else self.expand(), use, options)

    @property
    def opset(self) -> int:
        """Lowest default-domain opset the emitted nodes need."""
        return form_of(self.form).form_opset(self)

    def fed(self, name: str) -> "Fed | None":
        """Graph inputs, values and nodes that rebuild the weight from what a calibration run feeds (its codes);
        None when it is better fed as the floats it stands for."""
        return form_of(self.form).fed(name, self)

    @property
    def payload_bits(self) -> int:
        """Bits of values, scales and zero points (what the weight itself costs on disk)."""
        return form_of(self.form).payload_bits(self)

    def take_channels(self, start: int, stop: int, channel_axis: int) -> "Encoded":
        """Output channels start..stop (along `channel_axis` of the stored weight) in the same form."""
        shape = list(self.shape)
        shape[channel_axis] = stop - start
        return form_of(self.form).take_channels(self.expand(), np.arange(start, stop), tuple(shape), channel_axis)
