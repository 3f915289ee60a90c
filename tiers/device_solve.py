"""GPTQ's column loop on any numpy-like array library: CuPy on a GPU, numpy in CI.

`tiers.gptq._solve` is the host loop, tuned for numpy (rows held contiguous, one scratch buffer). On a
GPU the same loop pays a copy of the weight and of U per lazy-batch block if it stays on the host; here
the weight, U (and GPTAQ's P), the codes and the block updates stay on the device, and only the grids
cross (they are fitted on the host, where the clip search lives). Same float64 operations in the same
order as the host loop, so the codes agree except where a value sits on a rounding tie and another
summation order tips it (tests/test_gpu.py holds the device to ≥ 99.9% equal codes; CI runs this module
under numpy, where it must give the host loop's codes exactly).
"""

from __future__ import annotations

import numpy as np

from tiers.grid import Grid, GridSpec, find_grid


class _DeviceGrid:
    """A grid's per-row scale, zero point and divisor as device arrays (made once per grid)."""

    def __init__(self, grid: Grid, xp):
        self.grid = grid
        self.scale = xp.asarray(grid.scale)
        self.zero = xp.asarray(grid.zero)
        self.divisor = xp.asarray(grid.divisor())


def supported(spec: GridSpec) -> bool:
    """Integer grids (the min-max kinds every int tier uses); sign and fp8 grids keep the host loop."""
    return spec.kind == "int"


def solve(xp, Wt: np.ndarray, U: np.ndarray, spec: GridSpec, group_size: int, block_size: int, perm, static_grids, P):
    """The GPTQ/GPTAQ column loop of `tiers.gptq._solve` with its arrays in `xp`: (codes [N, K] float32 on
    the host, grids in column order)."""
    N, K = Wt.shape
    low, high = spec.code_range
    W = xp.asarray(Wt, dtype=xp.float64)
    Ud = xp.asarray(U, dtype=xp.float64)
    Pd = None if P is None else xp.asarray(P, dtype=xp.float64)
    codes = xp.zeros((N, K), xp.float32)
    fitted: dict[int, Grid] = {}
    on_device: dict[int, _DeviceGrid] = {}
    current = _DeviceGrid(find_grid(Wt, spec), xp) if group_size <= 0 else None
    for b0 in range(0, K, block_size):
        b1 = min(b0 + block_size, K)
        W1t = xp.ascontiguousarray(W[:, b0:b1].T)
        E1t = xp.zeros((b1 - b0, N))
        block_codes = xp.empty((b1 - b0, N), xp.float32)
        for i in range(b1 - b0):
            c = b0 + i
            w = W1t[i].copy()
            if group_size > 0:
                if static_grids is not None:
                    index = (perm[c] if perm is not None else c) // group_size
                    if index not in on_device:
                        on_device[index] = _DeviceGrid(static_grids[index], xp)
                    current = on_device[index]
                elif c % group_size == 0:
                    columns = _current(xp, W, W1t, E1t, Ud, Pd, b0, b1, i, min(c + group_size, K))
                    grid = find_grid(_host(xp, columns), spec)
                    fitted[c // group_size] = grid
                    current = _DeviceGrid(grid, xp)
            q = xp.rint(w / current.divisor)
            q += current.zero
            xp.clip(q, low, high, out=q)
            block_codes[i] = q
            e = (w - current.scale * (q - current.zero)) / Ud[c, c]
            E1t[i] = e
            update = Ud[c, c:b1, None] * e
            if Pd is not None:
                update -= Pd[c, c:b1, None] * w
            W1t[i:] -= update
        codes[:, b0:b1] = block_codes.T
        if b1 < K:
            tail = E1t.T @ Ud[b0:b1, b1:]
            if Pd is not None:
                tail -= W1t.T @ Pd[b0:b1, b1:]
            W[:, b1:] -= tail
    host_codes = _host(xp, codes)
    if perm is not None:
        host_codes = host_codes[:, np.argsort(perm)]
    if group_size <= 0:
        ordered = [current.grid]
    else:
        ordered = static_grids if static_grids is not None else [fitted[g] for g in sorted(fitted)]
    return host_codes, ordered


def _current(xp, W, W1t, E1t, Ud, Pd, b0, b1, i, end):
    """Columns c..end as they stand now, the block's pending lazy update applied (`tiers.gptq._current`)."""
    c = b0 + i
    inside = W1t[i : min(end, b1) - b0].T
    if end <= b1:
        return inside
    pending = E1t[:i].T @ Ud[b0:c, b1:end]
    if Pd is not None:
        pending -= W1t[:i].T @ Pd[b0:c, b1:end]
    return xp.concatenate([inside, W[:, b1:end] - pending], axis=1)


def _host(xp, value) -> np.ndarray:
    return value if xp is np else xp.asnumpy(value)
