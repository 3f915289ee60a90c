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


def _codes(w: np.ndarray, divisor: np.ndarray) -> np.ndarray:
    """E4M3 values of w / s, saturated at ±448 as QuantizeLinear's saturate=1 does. Round to nearest never
    leaves the grid's range, but GPTQ-style error feedback can push a later weight past max|w|, and E4M3FN
    has no infinity: an unclipped cast above 464 is NaN, which would ship as a NaN weight."""
    return np.clip(w / divisor, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


register_grid("fp8", _fit, _codes)


class Fp8Tier(CodesTier):
    """FLOAT8E4M3FN codes, one scale per output channel; rounded to nearest (no compensating method fills it)."""

    family: ClassVar[str] = "fp8"
    code_opsets: ClassVar[dict[str, int]] = {"float8_e4m3fn": 19}

    @property
    def grid(self) -> GridSpec:
        return GridSpec("fp8", 8)

    def stored(self, quantized, layout, dtype: str) -> Encoded:
        codes, scale, _, axis, _ = placed(quantized, layout)
        return Encoded(
            self.name, "dequantize", codes.astype(ml_dtypes.float8_e4m3fn), layout.shape, scale, None, axis, None, dtype
        )
