"""The value grid of each tier: one implementation that every rounding method uses.

A grid gives each row of Wt (an output channel, or a channel's block of
input features) a float32 scale and, for asymmetric grids, an integer zero
point; values are scale · (code − zero). Round-to-nearest, GPTQ, GPTAQ and
QEP all round onto the same grid, so a tier means the same thing whichever
method fills it (the grid is the tier's business, not the method's).

- asymmetric (UINT codes 0..2^b−1): the min-max range stretched to contain 0
  (GPTQ's `Quantizer`), zero point round(−lo / s);
- symmetric (INT codes −2^(b−1)..2^(b−1)−1, zero point 0): s = 2·max|w| / (2^b−1),
  GPTQ's symmetric grid, which uses the whole two's-complement range
  (INT2 = {−2, −1, 0, 1}·s rather than ternary);
- sign (1 bit): ±mean|w| per row, the L2-optimal binary scale;
- fp8 (E4M3): s = max|w| / 448, values rounded to FLOAT8E4M3FN.

At 4 bits and fewer the range is shrunk per row by GPTQ's `mse` search (shrink
factors 1, 0.99, ..., 0.21; keep the one with the least Σ|ŵ − w|^2.4): plain
min-max wastes most of a 2-bit grid on outliers.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np

SEARCH_NORM, SEARCH_STEPS, SEARCH_STEP = 2.4, 80, 0.01
"""GPTQ `Quantizer` defaults for the MSE clip search (norm 2.4, grid 100, maxshrink 0.8)."""
FP8_MAX = 448.0
SEARCH_BLOCK = 1 << 15
"""Elements per row block of the search (256 KiB of float64 per temporary: about cache-sized)."""
SEARCH_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
"""Threads the search spreads its row blocks over (the cores this process may use, at most 8)."""
SEARCH_CACHE = 256
"""Searched grids remembered (by the rows' bytes and the grid spec): a few KiB each."""
_SEARCHED: "OrderedDict[tuple, Grid]" = OrderedDict()


@dataclass(frozen=True)
class GridSpec:
    """What a tier says about its grid."""

    kind: str
    """'int' (integer codes), 'sign' (1-bit ±s) or 'fp8'."""
    bits: int
    symmetric: bool = True
    search: bool = False

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def code_range(self) -> tuple[int, int]:
        if self.kind == "sign":
            return -1, 1
        if self.symmetric:
            half = 2 ** (self.bits - 1)
            return -half, half - 1
        return 0, self.maxq


@dataclass(frozen=True)
class Grid:
    """Per-row parameters: scale (N,) float32-representable fp64, zero (N,) integer-valued fp64."""

    scale: np.ndarray
    zero: np.ndarray


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _candidate(lo: np.ndarray, hi: np.ndarray, spec: GridSpec) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) for per-row ranges lo <= 0 <= hi."""
    if spec.symmetric:
        peak = np.maximum(-lo, hi)
        return _f32(2 * peak / spec.maxq), np.zeros_like(peak)
    scale = _f32((hi - lo) / spec.maxq)
    return scale, np.rint(-lo / np.where(scale > 0, scale, 1.0))


def codes_on(w: np.ndarray, grid: Grid, spec: GridSpec) -> np.ndarray:
    """Codes of w ((N,) column or (N, k) rows) on the grid, as float64 integers (fp8: fp8 values / scale)."""
    scale, zero = (grid.scale[:, None], grid.zero[:, None]) if np.ndim(w) == 2 else (grid.scale, grid.zero)
    if spec.kind == "sign":
        return np.where(w >= 0, 1.0, -1.0)
    safe = np.where(scale > 0, scale, 1.0)
    if spec.kind == "fp8":
        return (w / safe).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    low, high = spec.code_range
    return np.clip(np.rint(w / safe) + zero, low, high)


def values(q: np.ndarray, grid: Grid) -> np.ndarray:
    """Dequantized values scale · (q − zero)."""
    scale, zero = (grid.scale[:, None], grid.zero[:, None]) if np.ndim(q) == 2 else (grid.scale, grid.zero)
    return scale * (q - zero)


def round_to_grid(w: np.ndarray, grid: Grid, spec: GridSpec) -> tuple[np.ndarray, np.ndarray]:
    """(codes, dequantized values) of w on the grid."""
    q = codes_on(w, grid, spec)
    return q, values(q, grid)


def find_grid(rows: np.ndarray, spec: GridSpec) -> Grid:
    """The grid of each row of `rows` [N, k]."""
    rows = np.asarray(rows, np.float64)
    n = rows.shape[0]
    if rows.shape[1] == 0:
        return Grid(np.ones(n), np.zeros(n))
    if spec.kind == "sign":
        return Grid(_f32(np.abs(rows).mean(axis=1)), np.zeros(n))
    if spec.kind == "fp8":
        peak = np.abs(rows).max(axis=1)
        return Grid(_f32(np.where(peak > 0, peak / FP8_MAX, 1.0)), np.zeros(n))
    lo = np.minimum(rows.min(axis=1), 0.0)
    hi = np.maximum(rows.max(axis=1), 0.0)
    empty = (lo == 0) & (hi == 0)
    lo, hi = np.where(empty, -1.0, lo), np.where(empty, 1.0, hi)
    scale, zero = _candidate(lo, hi, spec)
    if not spec.search:
        return Grid(scale, zero)
    key = (spec, rows.shape, hashlib.blake2b(np.ascontiguousarray(rows), digest_size=16).digest())  # no bytes copy of a contiguous weight
    if key in _SEARCHED:  # RTN, GPTQ and GPTAQ start from the same weight: search its grid once
        _SEARCHED.move_to_end(key)
        found = _SEARCHED[key]
        return Grid(found.scale.copy(), found.zero.copy())
    block = max(1, SEARCH_BLOCK // rows.shape[1])
    parts = [slice(start, start + block) for start in range(0, n, block)]  # row blocks small enough to stay in cache: the same result, faster and in bounded memory

    def search(part: slice) -> None:
        _search(rows[part], lo[part], hi[part], spec, scale[part], zero[part])

    workers = min(SEARCH_THREADS, len(parts))
    if workers > 1:  # numpy releases the GIL in its loops: blocks write disjoint rows, so threads give the same grids
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(search, parts))
    else:
        for part in parts:
            search(part)
    _SEARCHED[key] = Grid(scale.copy(), zero.copy())
    while len(_SEARCHED) > SEARCH_CACHE:
        _SEARCHED.popitem(last=False)
    return Grid(scale, zero)


def _search(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, spec: GridSpec, scale: np.ndarray, zero: np.ndarray) -> None:
    """GPTQ's shrink search on a block of rows, writing the best (scale, zero) into the given views.

    The arithmetic of `values(codes(...)) - rows` done in place in one buffer: the same
    operations in the same order, so the same grids, without a temporary per operation.
    """
    best = np.full(rows.shape[0], np.inf)
    low, high = spec.code_range
    buffer = np.empty_like(rows)
    for i in range(SEARCH_STEPS):
        shrink = 1 - i * SEARCH_STEP
        trial_scale, trial_zero = _candidate(shrink * lo, shrink * hi, spec)
        column_scale, column_zero = trial_scale[:, None], trial_zero[:, None]
        np.divide(rows, np.where(column_scale > 0, column_scale, 1.0), out=buffer)
        np.rint(buffer, out=buffer)
        buffer += column_zero
        np.clip(buffer, low, high, out=buffer)
        buffer -= column_zero
        np.multiply(column_scale, buffer, out=buffer)
        buffer -= rows
        np.abs(buffer, out=buffer)
        np.power(buffer, SEARCH_NORM, out=buffer)
        error = buffer.sum(axis=1)
        better = error < best
        best[better] = error[better]
        scale[better], zero[better] = trial_scale[better], trial_zero[better]
