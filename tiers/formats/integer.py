"""Integer tiers (int8 ... int2, symmetric or asymmetric): b-bit codes in the narrowest ONNX integer
type that holds them, behind DequantizeLinear (`tiers.formats.codes`).

Symmetric: signed codes, no zero point (what TensorRT runs). Asymmetric: unsigned codes and a zero
point per scale (the grid every GPTQ-family reference uses, and the better one at 2 to 4 bits).
Scales per output channel, or per block of input features with `--group-size`.
"""

from __future__ import annotations

from typing import ClassVar

import ml_dtypes
import numpy as np

from graph_ops.io import element_bits
from tiers.encoded import Encoded
from tiers.formats.base import placed
from tiers.formats.codes import CodesTier
from tiers.grid import GridSpec
from tiers.solver_backend import c_order

CONTAINERS = {
    True: {8: np.int8, 4: ml_dtypes.int4, 3: ml_dtypes.int4, 2: ml_dtypes.int2},
    False: {8: np.uint8, 4: ml_dtypes.uint4, 3: ml_dtypes.uint4, 2: ml_dtypes.uint2},
}
"""Narrowest ONNX integer type that holds b-bit codes (no 3-bit type exists)."""


class IntegerTier(CodesTier):
    """b-bit integer codes on a min-max grid (clip-searched at 4 bits and fewer)."""

    family: ClassVar[str] = "int"
    calibratable: ClassVar[bool] = True
    blockwise: ClassVar[bool] = True
    code_opsets: ClassVar[dict[str, int]] = {"int8": 13, "uint8": 13, "int4": 21, "uint4": 21, "int2": 25, "uint2": 25}

    @classmethod
    def make(cls, bits: int, symmetric: bool, runtimes: set[str]) -> "IntegerTier":
        """The b-bit tier: named int<b> (symmetric) or int<b>-asym, its opset its container's."""
        name = f"int{bits}" + ("" if symmetric else "-asym")
        container = np.dtype(CONTAINERS[symmetric][bits]).name
        return cls(name, bits, frozenset(runtimes), cls.code_opsets[container], symmetric)

    @property
    def grid(self) -> GridSpec:
        return GridSpec("int", self.bits, self.symmetric, search=self.bits <= 4)

    @property
    def container_bits(self) -> int:
        """3-bit codes travel in 4-bit containers."""
        return element_bits(CONTAINERS[self.symmetric][self.bits])

    def stored(self, quantized, layout, dtype: str) -> Encoded:
        codes, scale, zero, axis, block = placed(quantized, layout)
        container = CONTAINERS[self.symmetric][self.bits]
        zero_point = None if self.symmetric else np.array(zero, order="C").astype(container)
        return Encoded(
            self.name, "dequantize", c_order(codes, container), layout.shape, scale, zero_point, axis, block, dtype
        )
