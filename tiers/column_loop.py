"""GPTQ's column loop with lazy batch updates, on numpy or, for large integer-grid weights, on CuPy.

One loop for both array libraries (`xp`): on the host it is tuned for numpy (a block's columns held as
contiguous rows, each column brought up to date by one matrix-vector product); on a GPU the weight, U (and
GPTAQ's P), the codes and the block updates stay on the device and only the grids cross, fitted on the host
where the clip search lives. `tiers.solver_backend.loop_on_device` says which: the device pays a dozen kernel
launches per column, so it wins only on large weights. Same float64 operations in the same order either way,
so the device's codes differ from the host's only where another summation order tips a rounding tie
(tests/runtimes/test_gpu.py holds it to ≥ 99.9% equal codes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiers.grid import GRID_KINDS, Grid, GridSpec, find_grid, round_to_grid
from tiers.solver_backend import solve_dtype

UPDATE_BLOCK = 1 << 20
"""Elements of a lazy-batch update computed at a time (8 MiB of float64), not the rest of the weight at once."""


def code_dtype(spec: GridSpec):
    """What a loop's codes are held in: a byte for integer codes of at most 8 bits (uint8 unsigned, int8 signed; the
    same integers a float32 array would hold, a quarter of its size: a 4096² weight's both-grid solve holds 32 MB of
    codes, not 128), float32 for the kinds whose codes are not integers (fp8 values, signs)."""
    if spec.kind in GRID_KINDS or spec.bits > 8:
        return np.float32
    low, _ = spec.code_range
    return np.int8 if low < 0 else np.uint8


def supported_on_device(spec: GridSpec) -> bool:
    """Integer grids (every int tier's min-max kind); sign and fp8 grids round through their formats' numpy code."""
    return spec.kind not in GRID_KINDS


class _Rounder:
    """A grid ready to round columns on: scale, zero point and divisor in the loop's array library, made once."""

    def __init__(self, grid: Grid, spec: GridSpec, xp):
        self.grid, self.spec, self.xp = grid, spec, xp
        self.scale, self.zero, self.divisor = (xp.asarray(a) for a in (grid.scale, grid.zero, grid.divisor()))

    def __call__(self, w):
        """(codes, dequantized values) of the column w: `tiers.grid.round_to_grid`, written out for integer grids
        so that it runs in any array library."""
        if self.spec.kind in GRID_KINDS:
            return round_to_grid(w, self.grid, self.spec, self.divisor)
        low, high = self.spec.code_range
        q = self.xp.rint(w / self.divisor)
        q += self.zero
        self.xp.clip(q, low, high, out=q)
        return q, self.scale * (q - self.zero)


@dataclass(frozen=True)
class LoopPlan:
    """How a column loop rounds a weight: on which grid kind, in which groups and lazy-batch blocks of columns,
    in which column order, on which group grids fitted ahead."""

    spec: GridSpec
    group_size: int
    """Consecutive input features per group; <= 0: one grid per output channel."""
    block_size: int
    perm: np.ndarray | None = None
    """act-order's column order (the columns as stored where None)."""
    static_grids: list[Grid] | None = None
    """Static groups: each group's grid, fitted before the loop (else fitted as the loop reaches it)."""


@dataclass(frozen=True)
class _Block:
    """A block of the loop's columns start..stop: its columns held as rows as they entered it (and, up to the
    column being rounded, as they were rounded), and their errors so far."""

    start: int
    stop: int
    columns: np.ndarray
    errors: np.ndarray


def column_loop(
    xp,
    Wt: np.ndarray,
    U: np.ndarray,
    P,
    plan: LoopPlan,
    grid: Grid | None = None,
    losses: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, list[Grid]]:
    """The GPTQ column loop; P adds GPTAQ's asymmetric terms. Returns the codes ([N, K] in `code_dtype`, on the
    host, in the caller's column order) and the grids in column order. With numpy it works on Wt in place. `grid`:
    each row's per-channel grid, fitted by the caller (else fitted here to Wt). `losses` ([N] float64, host): each
    row's Σ eᵢ² added to it, eᵢ = (wᵢ − qᵢ)/Uᵢᵢ the column errors; without P it is (w − q)·(H + λI)·(w − q)ᵀ of the
    weights the loop started from (the OBS identity behind GPTQ's `Losses`). `out`: an [N, K] `code_dtype` host
    array the codes are written to (numpy only; a solve split in row parts fills one array, not one per part to join).

    A block's columns are held as rows (W1ᵀ, E1ᵀ). Where the official loop follows each column with a rank-one
    update of the block's later columns (`W1[:, i:] -= outer(e, U[c, c:])`), each column here takes the block's
    earlier errors in one matrix-vector product when its turn comes (`_column`): the same sums in another order,
    so a code differs only where that order tips a rounding tie (float64: the same codes on every problem tried;
    float32: a few per weight, about as close to float64's as before)."""
    spec, group_size, block_size = plan.spec, plan.group_size, plan.block_size
    perm, static_grids = plan.perm, plan.static_grids
    N, K = Wt.shape
    dtype = (
        xp.float32 if solve_dtype(K) == "float32" else xp.float64
    )  # TQS_SOLVER_DTYPE: the loop's updates (the grids stay float64)
    W, Ud = xp.asarray(Wt, dtype=dtype), xp.asarray(U, dtype=dtype)
    Pd = None if P is None else xp.asarray(P, dtype=dtype)
    codes = out if out is not None and xp is np else xp.zeros((N, K), code_dtype(spec))
    fitted: dict[int, Grid] = {}
    ready: dict[int, _Rounder] = {}
    rounder = _Rounder(find_grid(Wt, spec) if grid is None else grid, spec, xp) if group_size <= 0 else None
    for b0 in range(0, K, block_size):
        b1 = min(b0 + block_size, K)
        W1t, E1t = W[:, b0:b1].T.copy(), xp.zeros((b1 - b0, N), dtype)
        block_codes = xp.empty((b1 - b0, N), xp.float32)
        block = _Block(b0, b1, W1t, E1t)
        for i in range(b1 - b0):
            c = b0 + i
            w = _column(W1t, E1t, Ud, Pd, b0, i)
            W1t[i] = w  # the column as it is rounded: GPTAQ's terms inside the block and the group grids read it
            if group_size > 0:
                if static_grids is not None:
                    index = (perm[c] if perm is not None else c) // group_size
                    if index not in ready:
                        ready[index] = _Rounder(static_grids[index], spec, xp)
                    rounder = ready[index]
                elif c % group_size == 0:
                    grid = find_grid(_host(xp, _current(xp, W, block, Ud, Pd, i, min(c + group_size, K))), spec)
                    fitted[c // group_size] = grid
                    rounder = _Rounder(grid, spec, xp)
            block_codes[i], value = rounder(w)
            E1t[i] = (w - value) / Ud[c, c]
        codes[:, b0:b1] = block_codes.T
        if losses is not None:
            losses += _host(xp, xp.square(E1t).sum(axis=0, dtype=xp.float64))  # in any array library
        _update(W, b1, E1t.T, Ud, None if Pd is None else _rounded(W1t, E1t, Ud, b0).T, Pd, b0, b1)
    codes = _host(xp, codes)
    if perm is not None:
        codes = codes[:, np.argsort(perm)]
    if group_size <= 0:
        return codes, [rounder.grid]
    return codes, static_grids if static_grids is not None else [fitted[g] for g in sorted(fitted)]


def _column(W1t, E1t, U, P, b0: int, i: int):
    """Column b0 + i of the block with the block's earlier columns' updates applied: W1t holds the block's columns as
    they entered it (and, before row i, as they were rounded), E1t their errors so far. One matrix-vector product
    per column (two with GPTAQ's P) in place of the official rank-one update of every later column of the block
    after each one: the same sums, each worked out once, and a pass over the earlier errors instead of three over
    the later columns (docs/design-notes/tiers.md, 'One product per column')."""
    if i == 0:
        return W1t[0].copy()
    c = b0 + i
    w = W1t[i] - U[b0:c, c] @ E1t[:i]
    if P is not None:
        w += P[b0:c, c] @ W1t[:i]
    return w


def _rounded(W1t, E1t, U, b0: int):
    """The block's first len(E1t) columns as the official loop leaves them after their own updates, w − U_cc·e = the
    dequantized values: what GPTAQ's terms beyond the block read (inside it they read the columns as rounded)."""
    count = len(E1t)
    return W1t[:count] - U.diagonal()[b0 : b0 + count, None] * E1t


def _update(Wt, start: int, E1, U, W1, P, b0: int, b1: int) -> None:
    """Wt[:, start:] −= E1·U[b0:b1, start:] (− W1·P[b0:b1, start:] for GPTAQ), a block of columns at a time."""
    step = max(1, UPDATE_BLOCK // max(1, Wt.shape[0]))
    for c0 in range(start, Wt.shape[1], step):
        c1 = min(c0 + step, Wt.shape[1])
        tail = E1 @ U[b0:b1, c0:c1]
        if P is not None:
            tail -= W1 @ P[b0:b1, c0:c1]
        Wt[:, c0:c1] -= tail


def _current(xp, Wt, block: _Block, U, P, i: int, end: int):
    """Columns c..end (c the block's column i) as they stand now, the block's pending lazy update applied.

    The official code reads the global W here, which misses the updates from
    the current block's earlier columns when a group straddles a block; this
    keeps group grids (and so Q) independent of block_size.
    """
    W1, E1, b0, b1 = block.columns.T, block.errors.T, block.start, block.stop
    c, inside = b0 + i, min(end, b1)
    later = xp.concatenate([W1[:, i + 1 : inside - b0], Wt[:, b1:end]], axis=1)  # as they entered the block
    if i:
        later = later - E1[:, :i] @ U[b0:c, c + 1 : end]
        if P is not None:  # GPTAQ's terms: the earlier columns as rounded inside the block, as left after it
            later[:, : inside - c - 1] += W1[:, :i] @ P[b0:c, c + 1 : inside]
            if end > b1:
                later[:, inside - c - 1 :] += _rounded(W1.T, E1.T[:i], U, b0).T @ P[b0:c, b1:end]
    return xp.concatenate([W1[:, i : i + 1], later], axis=1)


def _host(xp, value) -> np.ndarray:
    return value if xp is np else xp.asnumpy(value)
