"""Symmetric integer quantizers, vectorised in numpy.

`fake_quantize` returns the dequantized values (what the model sees); the
residual `fake_quantize(w) - w` is the TQS quantization probe.
"""

from __future__ import annotations

import numpy as np


def symmetric_scale(w: np.ndarray, bits: int, axis: int | None = None) -> np.ndarray:
    """Scale so that max|w| maps to the largest code, per tensor or per slice along `axis`."""
    if bits < 2:
        raise ValueError("symmetric integer quantization needs at least 2 bits")
    qmax = 2 ** (bits - 1) - 1
    magnitude = np.abs(w.astype(np.float32, copy=False))
    if axis is None:
        peak = np.asarray(magnitude.max() if magnitude.size else 0.0, dtype=np.float32)
    else:
        reduce = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
        peak = magnitude.max(axis=reduce, keepdims=True)
    return (peak / qmax).astype(np.float32)


def quantize_symmetric(w: np.ndarray, bits: int, axis: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes in [-(2^(b-1)-1), 2^(b-1)-1] and their scale."""
    scale = symmetric_scale(w, bits, axis)
    qmax = 2 ** (bits - 1) - 1
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w.astype(np.float32, copy=False) / safe), -qmax, qmax)
    return codes.astype(np.int32), scale


def fake_quantize(w: np.ndarray, bits: int, axis: int | None = None) -> np.ndarray:
    """Quantize then dequantize, keeping `w`'s dtype."""
    codes, scale = quantize_symmetric(w, bits, axis)
    return (codes.astype(np.float32) * scale).astype(w.dtype, copy=False)
