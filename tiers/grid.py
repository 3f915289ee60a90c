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
- other kinds are registered by the stored format that owns them (`register_grid`):
  sign (1 bit, `tiers.formats.sign`), fp8 (E4M3, `tiers.formats.fp8`).

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
from typing import Callable, NamedTuple

import numpy as np

SEARCH_NORM, SEARCH_STEPS, SEARCH_STEP = 2.4, 80, 0.01
"""GPTQ `Quantizer` defaults for the MSE clip search (norm 2.4, grid 100, maxshrink 0.8)."""
SEARCH_BLOCK = 1 << 18
"""Elements per row block of the search at most (2 MiB of float64 per temporary). Each
block is ~10 numpy calls per shrink step, and every call hands the GIL over: blocks this large keep
the threads searching rather than waiting (docs/design-notes/tiers.md, 'Clip search blocks')."""
SEARCH_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
"""Threads the search spreads its row blocks over (the cores this process may use, at most 8)."""
SEARCH_SPLIT = 1 << 16
"""Weights of at least this many elements are split over the threads (smaller ones in one block: the
threads would cost more than they save)."""
SEARCH_CACHE = 256
"""Searched grids remembered (by the rows' bytes and the grid spec): a few KiB each."""
_SEARCHED: "OrderedDict[tuple, Grid]" = OrderedDict()


@dataclass(frozen=True)
class GridSpec:
    """What a tier says about its grid."""

    kind: str
    """'int' (integer codes), or a kind a stored format registered ('sign', 'fp8')."""
    bits: int
    symmetric: bool = True
    search: bool = False

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def code_range(self) -> tuple[int, int]:
        if self.symmetric:
            half = 2 ** (self.bits - 1)
            return -half, half - 1
        return 0, self.maxq


@dataclass(frozen=True)
class Grid:
    """Per-row parameters: scale (N,) float32-representable fp64, zero (N,) integer-valued fp64."""

    scale: np.ndarray
    zero: np.ndarray

    def rows(self, part) -> "Grid":
        """The grid of the rows `part` (a slice or indices) alone."""
        return Grid(self.scale[part], self.zero[part])

    @staticmethod
    def stack(parts: "list[Grid]") -> "Grid":
        """Grids of consecutive row blocks as one grid of all their rows."""
        return Grid(np.concatenate([p.scale for p in parts]), np.concatenate([p.zero for p in parts]))

    def divisor(self) -> np.ndarray:
        """The scale to divide by: 1 where a row's scale is 0 (a row of zeros), so its codes stay its zero point.
        A caller rounding many columns on one grid works it out once and passes it to `codes_on`."""
        return np.where(self.scale > 0, self.scale, 1.0)


def f32(x) -> np.ndarray:
    """Values rounded to float32 and held as float64 (the scales every grid stores)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


class GridKind(NamedTuple):
    """A grid other than the integer min-max one, as its stored format defines it."""

    fit: Callable[[np.ndarray], Grid]
    """rows [N, k] (k > 0) -> each row's grid, set by its values alone (no clip search)."""
    codes: Callable[[np.ndarray, np.ndarray], np.ndarray]
    """(w, divisor broadcast against w) -> the codes of w, float64."""


GRID_KINDS: dict[str, GridKind] = {}
"""Grid kind name -> its fit and rounding, registered by the stored formats that own them."""


def register_grid(
    kind: str, fit: Callable[[np.ndarray], Grid], codes: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> None:
    GRID_KINDS[kind] = GridKind(fit, codes)


def _candidate(lo: np.ndarray, hi: np.ndarray, spec: GridSpec) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) for per-row ranges lo <= 0 <= hi."""
    if spec.symmetric:
        peak = np.maximum(-lo, hi)
        return f32(2 * peak / spec.maxq), np.zeros_like(peak)
    scale = f32((hi - lo) / spec.maxq)
    return scale, np.rint(-lo / np.where(scale > 0, scale, 1.0))


def codes_on(w: np.ndarray, grid: Grid, spec: GridSpec, divisor: np.ndarray | None = None) -> np.ndarray:
    """Codes of w ((N,) column or (N, k) rows) on the grid, as float64 integers (fp8: fp8 values / scale);
    `divisor`: the grid's `Grid.divisor()`, when the caller already has it."""
    other = GRID_KINDS.get(spec.kind)
    safe = grid.divisor() if divisor is None else divisor
    safe, zero = (safe[:, None], grid.zero[:, None]) if np.ndim(w) == 2 else (safe, grid.zero)
    if other is not None:
        return other.codes(w, safe)
    low, high = spec.code_range
    q = np.rint(w / safe)  # in place from here: GPTQ's loop rounds every column through this
    q += zero
    return np.clip(q, low, high, out=q)


def values(q: np.ndarray, grid: Grid) -> np.ndarray:
    """Dequantized values scale · (q − zero)."""
    scale, zero = (grid.scale[:, None], grid.zero[:, None]) if np.ndim(q) == 2 else (grid.scale, grid.zero)
    return scale * (q - zero)


def round_to_grid(
    w: np.ndarray, grid: Grid, spec: GridSpec, divisor: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(codes, dequantized values) of w on the grid (`divisor` as for `codes_on`)."""
    q = codes_on(w, grid, spec, divisor)
    return q, values(q, grid)


def find_grid(rows: np.ndarray, spec: GridSpec) -> Grid:
    """The grid of each row of `rows` [N, k]."""
    rows = np.asarray(rows, np.float64)
    n = rows.shape[0]
    if rows.shape[1] == 0:
        return Grid(np.ones(n), np.zeros(n))
    if spec.kind in GRID_KINDS:
        return GRID_KINDS[spec.kind].fit(rows)
    lo = np.minimum(rows.min(axis=1), 0.0)
    hi = np.maximum(rows.max(axis=1), 0.0)
    empty = (lo == 0) & (hi == 0)
    lo, hi = np.where(empty, -1.0, lo), np.where(empty, 1.0, hi)
    scale, zero = _candidate(lo, hi, spec)
    if not spec.search:
        return Grid(scale, zero)
    key = (
        spec,
        rows.shape,
        hashlib.blake2b(np.ascontiguousarray(rows), digest_size=16).digest(),
    )  # no bytes copy of a contiguous weight
    if key in _SEARCHED:  # RTN, GPTQ and GPTAQ start from the same weight: search its grid once
        _SEARCHED.move_to_end(key)
        found = _SEARCHED[key]
        return Grid(found.scale.copy(), found.zero.copy())
    block = max(1, SEARCH_BLOCK // rows.shape[1])
    if rows.size >= SEARCH_SPLIT:
        block = min(block, -(-n // SEARCH_THREADS))  # a block per thread at least
    parts = [
        slice(start, start + block) for start in range(0, n, block)
    ]  # rows in blocks: the same result, in bounded memory

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


SCREEN_RANGE = (1e-10, 1e12)
"""Rows whose largest magnitude lies in this range are screened in float32 first (`_search`): there every
element's error, its square and its power stay finite float32 numbers."""
SCREEN_FROM = 1 << 14
"""Blocks of fewer elements take the exact search alone (the two passes' per-step overhead would outweigh it)."""
SCREEN_FLOOR = 1e-15
"""Errors below this are as good as zero to the screen: the slack allows each element SCREEN_FLOOR^2.4 (an
error whose square underflows float32, below 1e-19, is priced as 0)."""
SCREEN_REL, SCREEN_ABS = 1e-4, 16 * float(np.finfo(np.float32).eps)
"""A shrink stays a candidate while its float32 error is within SCREEN_REL of the row's least plus
SCREEN_ABS·Σ(2|w| + s)^2.4 (twice the bound on float32's rounding of each element's error, s the widest scale)."""


def _search(
    rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, spec: GridSpec, scale: np.ndarray, zero: np.ndarray
) -> None:
    """GPTQ's shrink search on a block of rows, writing the best (scale, zero) into the given views.

    The exact search works in float64 and raises each element's error to the power 2.4 at every one
    of 80 shrinks. Here a float32 pass (1.2·log2 of the squared error and exp2, ~4x cheaper than float64's
    power) first prices every shrink; a shrink whose float32 price is further from the row's least than
    float32's rounding can move it cannot be the float64 minimum, so the exact float64 sums are only worked
    out for the few that remain (1-5 per row): the same grids as the exact search, in a fraction of its time
    (docs/design-notes/tiers.md, 'The float32 screen').
    Rows of extreme magnitude take the exact search alone.
    """
    trials = _trials(lo, hi, spec)
    peak = np.maximum(-lo, hi)
    extreme = (peak < SCREEN_RANGE[0]) | (peak > SCREEN_RANGE[1])
    candidates = None
    if rows.size >= SCREEN_FROM and not extreme.all():
        with np.errstate(all="ignore"):  # rows past float32's range overflow there; they are searched exactly below
            candidates = _candidates(rows, trials, spec)
        candidates[:, extreme] = True
    _exact(rows, trials, spec, scale, zero, candidates)


def _trials(lo: np.ndarray, hi: np.ndarray, spec: GridSpec) -> list[tuple[np.ndarray, np.ndarray]]:
    """(scale, zero) per row at each shrink factor 1, 0.99, ..., in the search's order."""
    return [_candidate((1 - i * SEARCH_STEP) * lo, (1 - i * SEARCH_STEP) * hi, spec) for i in range(SEARCH_STEPS)]


def _residual(
    rows: np.ndarray, scale: np.ndarray, zero: np.ndarray, spec: GridSpec, buffer: np.ndarray, signed: bool = False
) -> np.ndarray:
    """|values(codes(rows)) − rows| into `buffer` (`signed`: without the absolute value), in the rows' own float
    type, one buffer for every step."""
    low, high = spec.code_range
    column_scale, column_zero = scale[:, None].astype(rows.dtype), zero[:, None].astype(rows.dtype)
    np.divide(rows, np.where(column_scale > 0, column_scale, 1), out=buffer)
    np.rint(buffer, out=buffer)
    # clip(q + z, low, high) − z, all small exact integers: maximum and minimum take a third of np.clip's time
    # with per-row bounds
    np.maximum(buffer, low - column_zero, out=buffer)
    np.minimum(buffer, high - column_zero, out=buffer)
    np.multiply(column_scale, buffer, out=buffer)
    buffer -= rows
    return buffer if signed else np.abs(buffer, out=buffer)


def _candidates(rows: np.ndarray, trials, spec: GridSpec) -> np.ndarray:
    """(steps, rows) mask of the shrinks that may be a row's exact minimum, from a float32 pass.

    A row leaves the pass once no later shrink can come near its least so far (`_clip_floors`: the error
    of clipping its outermost values alone already exceeds that least by more than the screen's slack),
    so it is priced only up to where clipping starts to dominate (about half of the 80 shrinks at 4 bits):
    the same mask, since a shrink left out could not have been a candidate."""
    reach = (
        np.abs(rows) * 2 + trials[0][0][:, None]
    )  # no element's error exceeds 2|w| + s (the first shrink's s is the widest)
    np.power(reach, SEARCH_NORM, out=reach)
    slack = SCREEN_ABS * reach.sum(axis=1) + 2 * rows.shape[1] * SCREEN_FLOOR**SEARCH_NORM
    del reach
    floors = _clip_floors(rows, trials, spec)
    rows32 = rows.astype(np.float32)
    approx = np.full((len(trials), rows.shape[0]), np.inf)
    least = np.full(rows.shape[0], np.inf)
    live = np.arange(rows.shape[0])  # rows in `work`, some perhaps finished but not yet dropped from it
    work, buffer = rows32, np.empty_like(rows32)
    for i, (trial_scale, trial_zero) in enumerate(trials):
        if floors is not None and i:
            done = floors[i, live] * (1 - FLOOR_MARGIN) > least[live] * (1 + SCREEN_REL) + 2 * slack[live]
            if done.all():
                break
            if done.sum() * 4 > len(live):  # drop finished rows in batches: a copy of the rest each time
                live, work = live[~done], work[~done]
        error = _residual(work, trial_scale[live], trial_zero[live], spec, buffer[: len(live)], signed=True)
        np.square(error, out=error)  # |e|^2.4 = exp2(1.2·log2 e²): no absolute value, and e = 0 gives exp2(−inf) = 0
        with np.errstate(divide="ignore"):
            np.log2(error, out=error)
        error *= np.float32(SEARCH_NORM / 2)
        np.exp2(error, out=error)
        approx[i, live] = error.sum(
            axis=1
        )  # float32's pairwise sum: within a few 1e-6 of the float64 one, far inside SCREEN_REL
        least[live] = np.minimum(least[live], approx[i, live])
    return approx <= approx.min(axis=0) * (1 + SCREEN_REL) + slack


FLOOR_VALUES = 32
"""Outermost values per side of a row that bound a shrink's clipping error from below (`_clip_floors`): on Gaussian
rows of 4096 at 4 bits, 32 stop the screen after 50 of 80 shrinks (half the row-steps), 256 hardly sooner and
at 4x the cost of the floors."""
FLOOR_FROM_BITS = 3
"""Grids this fine or finer take the floors: at 2 bits a row's least error is so large (a third of its range per
step) that on Gaussian rows of 4096 no floor of 32 values per side reached it before the last shrink."""
FLOOR_BLOCK = 4
"""Shrinks that share one floor (`_clip_floors`): a row leaves the screen at most 3 shrinks later than with a floor
per shrink, and the floors take a quarter of the time (docs/design-notes/tiers.md, 'The float32 screen')."""
FLOOR_MARGIN = 1e-9
"""Relative allowance for the summation order of a floor against the full sum it bounds."""


def _clip_floors(rows: np.ndarray, trials, spec: GridSpec) -> np.ndarray | None:
    """(steps, rows): for each shrink and row, a lower bound of its exact error Σ|ŵ − w|^2.4, from the
    row's outermost values alone (up to `FLOOR_VALUES` per side, at most an eighth of the row): a value
    beyond the grid's last point gmax = s·(high − z) (or below its first) lands at most there, so its
    error is at least its distance to it. Each entry is the least over that shrink and all later ones,
    so a row can stop at the first shrink whose floor is out of reach. None when rows are too short."""
    count = min(FLOOR_VALUES, rows.shape[1] // 8)
    if count == 0 or spec.bits < FLOOR_FROM_BITS:
        return None
    k = rows.shape[1]
    parted = np.partition(rows, [count - 1, k - count], axis=1)
    low, high = spec.code_range
    # each side as distances outward, the outermost value first: a shrink prices only the leading columns
    # where some row has a value outside
    outward = (-np.sort(-parted[:, k - count :], axis=1), -np.sort(parted[:, :count], axis=1))
    del parted
    blocks = range(0, len(trials), FLOOR_BLOCK)
    floors = np.zeros((len(blocks), rows.shape[0]))
    for b, first in enumerate(blocks):
        # a block's floor from each side's widest limit over its shrinks: a floor only falls as its limit widens,
        # so it bounds every shrink of the block
        block = trials[first : first + FLOOR_BLOCK]
        widest = (
            np.max([scale * (high - zero) for scale, zero in block], axis=0),
            np.max([scale * (zero - low) for scale, zero in block], axis=0),
        )
        for values, limit in zip(outward, widest):
            width = int(np.count_nonzero(values > limit[:, None], axis=1).max())
            if width:  # none lies outside at the first shrinks
                beyond = values[:, :width] - limit[:, None]
                # values inside count (1e-100)^2.4 = 1e-240 each, far inside the screen's slack (2k·SCREEN_FLOOR^2.4): a
                # power of zeros, or a masked one (`where=`), takes 4x the time of one on positive normal numbers
                np.maximum(beyond, 1e-100, out=beyond)
                np.power(beyond, SEARCH_NORM, out=beyond)
                floors[b] += beyond.sum(axis=1)
    return np.repeat(np.minimum.accumulate(floors[::-1], axis=0)[::-1], FLOOR_BLOCK, axis=0)[: len(trials)]


def _exact(
    rows: np.ndarray, trials, spec: GridSpec, scale: np.ndarray, zero: np.ndarray, candidates: np.ndarray | None
) -> None:
    """The exact search (float64, Σ|ŵ − w|^2.4, the first least shrink kept) over every shrink, or per
    shrink over the rows `candidates` leaves to it; writes the winners into `scale` and `zero`."""
    best = np.full(rows.shape[0], np.inf)
    buffer = np.empty_like(rows)
    for i, (trial_scale, trial_zero) in enumerate(trials):
        if candidates is None:
            picked, part = slice(None), rows
        else:
            picked = np.flatnonzero(candidates[i])
            if picked.size == 0:
                continue
            part = rows[picked]
        error = _residual(part, trial_scale[picked], trial_zero[picked], spec, buffer[: part.shape[0]])
        np.power(error, SEARCH_NORM, out=error)
        error = error.sum(axis=1)
        better = error < best[picked]
        rows_better = np.arange(rows.shape[0])[picked][better]
        best[rows_better] = error[better]
        scale[rows_better], zero[rows_better] = trial_scale[rows_better], trial_zero[rows_better]
