"""Integer-coded weights in exactly the layout ONNX DequantizeLinear takes.

w ≈ (codes - zero_point) * scale, with the scale broadcast as DequantizeLinear
does: one value (per tensor), a 1-D vector along `axis` (per axis), or, with
`block_size`, an array of the weight's rank whose `axis` dimension is
ceil(n / block_size) (blockwise, opset 21+).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tiers.registry import Stored, broadcast_scale

CONTAINERS = {
    True: {8: np.int8, 4: ml_dtypes.int4, 3: ml_dtypes.int4, 2: ml_dtypes.int2, 1: ml_dtypes.int2},
    False: {8: np.uint8, 4: ml_dtypes.uint4, 3: ml_dtypes.uint4, 2: ml_dtypes.uint2},
}
"""Narrowest ONNX integer type that holds b-bit codes (no 3- or 1-bit types exist)."""


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

    def dequantize(self) -> np.ndarray:
        codes = self.codes.astype(np.float32)
        if self.zero_point is not None:
            codes = codes - broadcast_scale(self.zero_point, codes.shape, self.axis, self.block_size)
        return codes * broadcast_scale(self.scale, codes.shape, self.axis, self.block_size)

    @property
    def scale_count(self) -> int:
        return int(np.asarray(self.scale).size)

    def to_stored(self, tier: str):
        """The DequantizeLinear form `graph_ops.qdq` writes (3-bit codes travel in a 4-bit container)."""
        try:
            container = CONTAINERS[self.signed][self.bits]
        except KeyError:
            raise ValueError(f"no ONNX integer container for {'signed' if self.signed else 'unsigned'} {self.bits}-bit codes") from None
        zero = None if self.zero_point is None else np.asarray(self.zero_point).astype(container)
        return Stored(
            tier=tier,
            kind="dequantize",
            values=self.codes.astype(container),
            shape=tuple(self.codes.shape),
            scale=np.asarray(self.scale, dtype=np.float32),
            axis=self.axis,
            block_size=self.block_size,
            zero_point=zero,
        )
