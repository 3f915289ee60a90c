"""FP8 tier: E4M3 codes, s = max|w| / 448 per output channel, behind DequantizeLinear (`tiers.formats.codes`)."""

from __future__ import annotations

from typing import ClassVar

import ml_dtypes
import numpy as np

from tiers.encoded import Encoded
from tiers.formats.base import placed
from tiers.formats.codes import CodesTier
from tiers.grid import Grid, GridSpec, f32, register_grid

FP8_MAX = 448.0
"""Largest finite FLOAT8E4M3FN value."""


def _fit(rows: np.ndarray) -> Grid:
    """s = max|w| / 448 per row (1 for a row of zeros)."""
    peak = np.abs(rows).max(axis=1)
    return Grid(f32(np.where(peak > 0, peak / FP8_MAX, 1.0)), np.zeros(rows.shape[0]))


register_grid("fp8", _fit, lambda w, divisor: (w / divisor).astype(ml_dtypes.float8_e4m3fn).astype(np.float64))


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
