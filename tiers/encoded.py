"""Integer-coded weights in exactly the layout ONNX DequantizeLinear takes.

w ≈ (codes - zero_point) * scale, with the scale broadcast as DequantizeLinear
does: one value (per tensor), a 1-D vector along `axis` (per axis), or, with
`block_size`, an array of the weight's rank whose `axis` dimension is
ceil(n / block_size) (blockwise, opset 21+).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Encoded:
    codes: np.ndarray
    """Integer codes, same shape as the weight (ONNX layout), held as int32."""
    scale: np.ndarray
    """float32 scales (see module docstring for the shape)."""
    zero_point: np.ndarray | None
    """Integer zero points shaped like `scale`, or None when symmetric."""
    bits: int
    signed: bool
    axis: int | None = None
    block_size: int | None = None

    def expanded_scale(self, name: str = "scale") -> np.ndarray:
        """Scale (or zero point) broadcast to the weight's full shape."""
        value = self.scale if name == "scale" else self.zero_point
        value = np.asarray(value)
        shape = self.codes.shape
        if value.ndim == 0 or self.axis is None:
            return np.broadcast_to(value, shape)
        axis = self.axis % len(shape)
        if self.block_size:
            return np.repeat(value, self.block_size, axis=axis).take(np.arange(shape[axis]), axis=axis)
        view = [1] * len(shape)
        view[axis] = shape[axis]
        return np.broadcast_to(value.reshape(view), shape)

    def dequantize(self) -> np.ndarray:
        codes = self.codes.astype(np.float32)
        if self.zero_point is not None:
            codes = codes - self.expanded_scale("zero_point").astype(np.float32)
        return codes * self.expanded_scale("scale").astype(np.float32)

    @property
    def scale_count(self) -> int:
        return int(np.asarray(self.scale).size)
