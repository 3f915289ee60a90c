"""FP8 tier: E4M3 codes, s = max|w| / 448 per output channel, behind DequantizeLinear (`tiers.formats.codes`)."""

from __future__ import annotations

from typing import ClassVar

import ml_dtypes

from tiers.encoded import Encoded
from tiers.formats.base import placed
from tiers.formats.codes import CodesTier
from tiers.grid import GridSpec


class Fp8Tier(CodesTier):
    """FLOAT8E4M3FN codes, one scale per output channel; rounded to nearest (no compensating method fills it)."""

    family: ClassVar[str] = "fp8"
    code_opsets: ClassVar[dict[str, int]] = {"float8_e4m3fn": 19}

    @property
    def grid(self) -> GridSpec:
        return GridSpec("fp8", 8)

    def stored(self, quantized, layout, dtype: str) -> Encoded:
        codes, scale, _, axis, _ = placed(quantized, layout)
        return Encoded(self.name, "dequantize", codes.astype(ml_dtypes.float8_e4m3fn), layout.shape, scale, None, axis, None, dtype)
