"""RTN, GPTQ, GPTAQ and QEP rounding on a tier's grid, in numpy (the solves in float32 or float64:
`solver_backend.solve_dtype`).

Everything works on Wt [N, K]: one row per output channel, one column per
input feature, the layout every official implementation uses (IST-DASLab/gptq,
GPTAQ, FujitsuResearch/qep; the methods are summarised in docs/baselines.md).
Callers map their stored weight to Wt and back (`graph_ops.layout.Layout`) and
gather the statistics solved on (`tiers.hessian.Hessian`). The grid is the
tier's (`tiers.grid`): these functions only decide which grid point each
weight lands on. Each returns codes, per-row (or per row-group) scales and zero
points, and the fake-quantized Wt.

Scales are float32-representable as soon as they are chosen: the grid the
solver propagates errors against is exactly the grid a float32
DequantizeLinear reproduces, so the fake-quantized weights equal their
encoding bit for bit.

Memory: a K x K float64 matrix is 134 MB at K = 4096, so the solvers work in
place where the arithmetic allows (LAPACK potrf/trtri/potrs through scipy,
lower-triangle zeroing row by row, updates in column blocks) and keep codes as
float32; a solve holds the weight, U, GPTAQ's P and the codes beside the
caller's statistics.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from tiers import solver_backend as backend
from tiers.column_loop import LoopPlan, code_dtype, column_loop, supported_on_device
from tiers.factors import damped_cholesky, inverse_cholesky, lapack_for
from tiers.grid import Grid, GridSpec, codes_on, find_grid
from tiers.hessian import Hessian, cached, working_dtype

ROUND_BLOCK = 1 << 20
"""Elements rounded at a time (8 MiB per float64 temporary)."""


@dataclass
class Quantized:
    """A quantized Wt: codes, parameters per row and group, and the fake-quantized values."""

    codes: np.ndarray
    """[N, K] codes: integers (a byte each from the column loop, `tiers.column_loop.code_dtype`; float32 from
    round to nearest), or for fp8 grids the FP8 values in float32, scale·code being the weight."""
    scale: np.ndarray
    """[N, groups] fp64, float32-representable (groups = 1 per channel)."""
    zero: np.ndarray
    """[N, groups] integer-valued fp64; all 0 for symmetric grids."""
    spec: GridSpec
    group_size: int
    """-1 per channel, else the number of consecutive input features per group."""

    @property
    def values(self) -> np.ndarray:
        """[N, K] fp64 = scale·(codes − zero), the fake-quantized Wt: made when read (nothing on the
        export path reads it; kept beside the codes it would be a weight-sized float64 array)."""
        columns = self.codes.shape[1]
        if self.group_size <= 0:
            scale, zero = self.scale[:, :1], self.zero[:, :1]
        else:
            scale = np.repeat(self.scale, self.group_size, axis=1)[:, :columns]
            zero = np.repeat(self.zero, self.group_size, axis=1)[:, :columns]
        return scale * (self.codes.astype(np.float64) - zero)

    def rows(self, start: int, stop: int) -> "Quantized":
        """Output channels start..stop (a channel group of the weight)."""
        part = slice(start, stop)
        return Quantized(self.codes[part], self.scale[part], self.zero[part], self.spec, self.group_size)

    def take(self, rows: np.ndarray) -> "Quantized":
        """The output channels at the indices `rows` (copies)."""
        return Quantized(self.codes[rows], self.scale[rows], self.zero[rows], self.spec, self.group_size)

    @staticmethod
    def stack(parts: list["Quantized"]) -> "Quantized":
        """Row blocks (Conv groups) back into one Wt."""
        first = parts[0]
        if len(parts) == 1:
            return first
        return Quantized(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")),
            first.spec,
            first.group_size,
        )


def _pack(codes, grids: list[Grid], spec: GridSpec, group_size: int) -> Quantized:
    scale = np.stack([g.scale for g in grids], axis=1)
    zero = np.stack([g.zero for g in grids], axis=1)
    return Quantized(codes, scale, zero, spec, group_size)


def _group_starts(columns: int, group_size: int) -> range:
    return range(0, columns, group_size if group_size > 0 else max(columns, 1))


def rtn(Wt: np.ndarray, spec: GridSpec, group_size: int = -1) -> Quantized:
    """Round to nearest on the grid, per row or row-group."""
    Wt = np.asarray(Wt, np.float64)
    codes, grids = np.zeros(Wt.shape, np.float32), []
    for g0 in _group_starts(Wt.shape[1], group_size):
        g1 = Wt.shape[1] if group_size <= 0 else min(g0 + group_size, Wt.shape[1])
        grid = find_grid(Wt[:, g0:g1], spec)
        step = max(1, ROUND_BLOCK // max(1, g1 - g0))
        for r0 in range(0, Wt.shape[0], step):  # rows in blocks: each temporary a block, not a copy of the weight
            rows = slice(r0, r0 + step)
            codes[rows, g0:g1] = codes_on(Wt[rows, g0:g1], grid.rows(rows), spec)
        grids.append(grid)
    return _pack(codes, grids, spec, group_size)


def _dead(Wt: np.ndarray, H: np.ndarray, own: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dead inputs (zero Hessian diagonal) neutralised, as GPTQ does: Wt a private copy (the solvers
    update it in place) unless the caller hands over its own (`own`: a float32 one stays float32, the dtype a
    float32 column loop reads without a copy), H copied only when it has dead inputs to change (K x K float64)."""
    kept = Wt.dtype if own and Wt.dtype == np.float32 else np.float64  # a float32 Wt handed over is the loop's own
    Wt = np.asarray(Wt, kept) if own else np.array(Wt, np.float64)
    H, dead = _dead_hessian(H)
    if dead.any():
        Wt[:, dead] = 0
    return Wt, H, dead


ROW_PART = 1 << 20
"""Elements per row part at least when a solve splits its rows over idle cores (`_row_parts`)."""
ROW_PART_ROWS = 1024
"""Rows per part at least: below this a column's numpy calls are too short to release the GIL for long, and
two parts gain nothing over one (docs/design-notes/tiers.md, 'Row parts')."""


def _row_parts(rows: int, columns: int) -> list[slice]:
    """Consecutive row ranges a solve runs side by side, one per core it has to itself: rows are independent in
    every column loop (each row's rounding error feeds only its own later columns, through U and P, which every
    part shares), so the parts give the codes of one solve. A solve alone in its wave has every core (a chain of
    large layers, one per wave; docs/design-notes/tiers.md, 'Row parts'). Where a wave's weights already run
    side by side (`backend.THREAD_CAP`), each keeps its share."""
    most = min(rows // ROW_PART_ROWS, rows * columns // ROW_PART)
    if most <= 1:  # one part whatever the cores: asking threadpoolctl costs ~2 ms a solve (thousands an export)
        return [slice(0, rows)]
    cores = backend.THREAD_CAP if backend.THREAD_CAP is not None else backend.solver_threads()
    count = max(1, min(cores, most))
    step = -(-rows // count)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _solve(Wt, U, P, plan: LoopPlan, grid: Grid | None = None, losses: np.ndarray | None = None) -> Quantized:
    """The GPTQ column loop (`tiers.column_loop`), on the GPU where the weight is large enough to gain from it,
    else on the host in row parts over the idle cores (`_row_parts`)."""
    xp = backend.array_module() if backend.loop_on_device(*Wt.shape) and supported_on_device(plan.spec) else np
    parts = _row_parts(*Wt.shape) if xp is np else [slice(None)]
    if len(parts) == 1:
        codes, grids = column_loop(xp, Wt, U, P, plan, grid, losses)
        return _pack(codes, grids, plan.spec, plan.group_size)

    dtype = working_dtype(Wt.shape[1])
    U, P = np.asarray(U, dtype), None if P is None else np.asarray(P, dtype)  # cast once, shared by every part
    codes = np.empty(Wt.shape, code_dtype(plan.spec))  # each part fills its rows: no per-part codes to join

    def part(rows: slice):
        own_grids = None if plan.static_grids is None else [g.rows(rows) for g in plan.static_grids]
        own = replace(plan, static_grids=own_grids)
        view = codes[rows]
        held, grids = column_loop(
            xp,
            Wt[rows],
            U,
            P,
            own,
            None if grid is None else grid.rows(rows),
            None if losses is None else losses[rows],
            out=view,
        )
        if held is not view:
            view[...] = held  # a permuted loop hands back its own array
        return grids

    with backend.shared_cores(len(parts)), ThreadPoolExecutor(len(parts), thread_name_prefix="tqs-rows") as pool:
        solved = list(pool.map(part, parts))
    grids = [Grid.stack([s[g] for s in solved]) for g in range(len(solved[0]))]
    return _pack(codes, grids, plan.spec, plan.group_size)


@dataclass(frozen=True)
class GptqSettings:
    """GPTQ's settings, with the official defaults (IST-DASLab/gptq `fasterquant`)."""

    group_size: int = -1
    """Consecutive input features per group; -1: one grid per output channel."""
    percdamp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    """Columns by decreasing Hessian diagonal; with groups it forces static groups (`gptq`)."""
    static_groups: bool = False


@dataclass(frozen=True)
class GptaqSettings(GptqSettings):
    """GPTAQ's settings: GPTQ's and its α."""

    alpha: float = 0.25
    """The official hard-coded value; 0 is exactly GPTQ."""


def factor_first(H: np.ndarray, settings: GptqSettings, cache: "Hessian") -> None:
    """Make the U `gptq(..., settings, cache=cache)` will read and keep it in `cache`, before the caller builds the
    rows it solves: U's float64 factorization and its float32 cast are a solve's largest moment, and beside a
    weight-sized stack of rows (`tiers.quantizer._both_grids`) they were the peak of a wide layer's solve. The same
    H `_prepare` derives (dead inputs set to 1, act order's permutation), so the same U, bit for bit."""
    H, _ = _act_order(_dead_hessian(H)[0], settings.act_order)
    _loop_factor(cache, H, settings.percdamp, settings.act_order)


def _dead_hessian(H: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """H with its dead inputs' (zero diagonal) diagonal set to 1, a copy only where there are any; the dead mask."""
    dead = np.diag(H) == 0
    if dead.any():
        H = np.array(H, np.float64)
        H[dead, dead] = 1
        return H, dead
    return np.asarray(H, np.float64), dead


def _prepare(Wt, H, spec: GridSpec, settings: GptqSettings, own: bool = False):
    group_size, act_order = settings.group_size, settings.act_order
    Wt, H, dead = _dead(Wt, H, own)
    static_groups = settings.static_groups or (act_order and group_size > 0)
    static_grids = None
    if static_groups and group_size > 0:
        static_grids = [find_grid(Wt[:, g : g + group_size], spec) for g in range(0, Wt.shape[1], group_size)]
    H, perm = _act_order(H, act_order)
    if perm is not None:
        Wt = Wt[:, perm]
    return Wt, H, dead, LoopPlan(spec, group_size, settings.block_size, perm, static_grids)


def _act_order(H: np.ndarray, act_order: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """H with its columns in act order (by decreasing diagonal) and that permutation; H itself and None without."""
    if not act_order:
        return H, None
    perm = np.argsort(-np.diag(H), kind="stable")
    return H[perm][:, perm], perm


def gptq(
    Wt: np.ndarray,
    H: np.ndarray,
    spec: GridSpec,
    settings: GptqSettings = GptqSettings(),
    own: bool = False,
    cache: "Hessian | None" = None,
    grid: Grid | None = None,
    losses: np.ndarray | None = None,
) -> Quantized:
    """GPTQ (Frantar et al., IST-DASLab/gptq `fasterquant`) on Wt with Hessian H = (2/n)XᵀX.

    With act_order and groups, static groups are forced: groups must stay
    contiguous in the original column order for a DequantizeLinear encoding.
    `own`: Wt is the caller's to overwrite (no weight-sized copy of it is made).
    `cache`: the statistic H is from; its factorization is kept there for the next solve on it.
    `grid`: per channel (group_size <= 0), each row's grid as the caller fitted it to Wt with its dead inputs
    zeroed, instead of the fit here: rows on different grids in one loop (`tiers.quantizer._better_rows`).
    `losses`: each row's (w − q)·(H + λI)·(w − q)ᵀ added to it (`column_loop`), λ = `damping(cache, percdamp)`.
    """
    percdamp, act_order = settings.percdamp, settings.act_order
    Wt, H, _, plan = _prepare(Wt, H, spec, settings, own)
    return _solve(Wt, _loop_factor(cache, H, percdamp, act_order), None, plan, grid, losses)


def _loop_factor(cache: "Hessian | None", H: np.ndarray, percdamp: float, act_order: bool) -> np.ndarray:
    """GPTQ's U as its column loop reads it: in the loop's dtype (`working_dtype`), so a float32 loop holds one
    float32 copy of it and no float64 one beside it (128 MB at K = 4096); float64 loops read the float64 U
    GPTAQ shares. The corner entry `damping` reads is kept in float64 beside a float32 U."""
    key = ("U", percdamp, act_order)
    dtype = working_dtype(H.shape[0])
    if dtype == np.float64 or (cache is not None and key in cache.factors):
        return cached(cache, key, lambda: inverse_cholesky(H, percdamp))

    return _narrowed_u(cache, percdamp, act_order, dtype, lambda: inverse_cholesky(H, percdamp))


def _narrowed_u(cache: "Hessian | None", percdamp: float, act_order: bool, dtype, wide: Callable[[], np.ndarray]):
    """U cast to a float32 loop's `dtype` from the float64 one `wide()` makes, kept in `cache` where GPTQ's and GPTAQ's
    loops both look for it, with the corner entry `damping` reads."""

    def narrowed():
        upper = wide()
        if cache is not None:
            cache.factors[("U corner", percdamp, act_order)] = float(upper[-1, -1])
        return np.asarray(upper, dtype)

    return cached(cache, ("U", percdamp, act_order, dtype.__name__), narrowed)


def gptaq(
    Wt: np.ndarray,
    H: np.ndarray,
    G: np.ndarray,
    spec: GridSpec,
    settings: GptaqSettings = GptaqSettings(),
    own: bool = False,
    cache: "Hessian | None" = None,
    grid: Grid | None = None,
) -> Quantized:
    """GPTAQ (GPTQv2): GPTQ plus the asymmetric-calibration terms of P = α·triu(G Uᵀ, 1)·U.

    G = (2/n)(X_fp − X̂)ᵀX̂ on the same rows as H = (2/n)X̂ᵀX̂; α = 0.25 is the
    official hard-coded value. α = 0 is exactly GPTQ. `own`, `cache` and `grid` as for `gptq`.
    """
    percdamp, act_order, alpha = settings.percdamp, settings.act_order, settings.alpha
    Wt, H, dead, plan = _prepare(Wt, H, spec, settings, own)
    if working_dtype(H.shape[0]) != np.float64:
        return _solve(Wt, *_narrow_gptaq_factors(cache, H, G, dead, plan.perm, settings), plan, grid)
    U = cached(cache, ("U", percdamp, act_order), lambda: inverse_cholesky(H, percdamp))
    P = cached(cache, ("P", percdamp, act_order, alpha), lambda: _asymmetric_terms(G, U, dead, plan.perm, alpha))
    return _solve(Wt, U, P, plan, grid)


def _narrow_gptaq_factors(cache: "Hessian | None", H, G, dead, perm, settings: GptaqSettings):
    """GPTAQ's U and P for a float32 loop: made in float64 (P from the float64 U) and kept only as the float32 casts
    the loop reads, the casts it made of the float64 ones on every solve: the same values, a K x K float64 less
    of each held (and none cast per solve). U's corner is kept for `damping`, as `_loop_factor` keeps it."""
    percdamp, act_order, alpha = settings.percdamp, settings.act_order, settings.alpha

    @functools.cache
    def wide() -> np.ndarray:  # made once, for P and for U's cast, only if either is not kept yet
        kept = cache.factors.get(("U", percdamp, act_order)) if cache is not None else None
        return inverse_cholesky(H, percdamp) if kept is None else kept

    key = ("P", percdamp, act_order, alpha, "float32")
    P = cached(cache, key, lambda: np.asarray(_asymmetric_terms(G, wide(), dead, perm, alpha), np.float32))
    return _narrowed_u(cache, percdamp, act_order, np.float32, wide), P


def _asymmetric_terms(G: np.ndarray, U: np.ndarray, dead: np.ndarray, perm, alpha: float) -> np.ndarray:
    """GPTAQ's P = α·triu(G Uᵀ, 1)·U (two K x K products: kept with the statistic like U)."""
    G = np.asarray(G, np.float64)
    if dead.any():
        G = np.array(G)
        G[:, dead] = 0
    if perm is not None:
        G = G[perm][:, perm]
    M = G @ U.T
    del G
    _keep_above_diagonal(M)
    M *= alpha
    P = M @ U
    del M
    return P


def _keep_above_diagonal(M: np.ndarray) -> None:
    """np.triu(M, k=1) in place (a row at a time: no K x K mask or copy)."""
    for i in range(M.shape[0]):
        M[i, : i + 1] = 0


def qep_correct(
    Wt: np.ndarray,
    H: np.ndarray,
    H_delta: np.ndarray,
    alpha: float = 0.5,
    percdampqep: float = 1.0,
    own: bool = False,
    cache: "Hessian | None" = None,
    product: dict | None = None,
) -> np.ndarray:
    """QEP's weight correction Wt + α·Wt·H_δ·(H + λI)⁻¹ (FujitsuResearch/qep `run_weight_correct`).

    Any base method then quantizes the returned weights with the same H.
    α = 0 skips the correction entirely, as the official script does for the
    layers it excludes. The solve is a Cholesky one (the damped H is symmetric
    positive definite), in place on Wt·H_δ; `own`: Wt is the caller's to overwrite; `cache` as for
    `gptq` (sibling weights share the factor of the damped H). `product`: gets Wt·H_δ as "WG" (a copy, in
    the solve's dtype) and the damping λ as "damping" (None where the factor needed more than the nominal).
    """
    lapack = lapack_for(H.shape[0])
    if alpha == 0:
        return np.asarray(Wt, np.float64) if own else np.array(Wt, np.float64)
    Wt, H, _ = _dead(Wt, H, own)
    dtype = working_dtype(H.shape[0])
    factor = cached(cache, ("qep", percdampqep, dtype.__name__), lambda: damped_cholesky(H, percdampqep, dtype))
    rhs = Wt.astype(dtype, copy=False) @ np.asarray(H_delta, dtype)  # a cast made for this product, not kept
    if product is not None:
        product["WG"], product["damping"] = (
            rhs.copy(),
            _nominal_damping(H, percdampqep, float(factor[0, 0]) ** 2 - float(H[0, 0]), 1e-4),
        )
    potrs = lapack.spotrs if dtype == np.float32 else lapack.dpotrs
    solved, info = potrs(factor, rhs.T, lower=1, overwrite_b=1)  # rhs.T is (K, N) in Fortran order: solved in place
    if info != 0:
        raise np.linalg.LinAlgError(f"the triangular solve of QEP's correction failed (LAPACK info {info})")
    if not np.shares_memory(solved, rhs):
        rhs = np.ascontiguousarray(solved.T)
    del solved
    rhs *= alpha
    Wt += rhs
    return Wt


def _nominal_damping(H: np.ndarray, percent: float, used: float, tolerance: float) -> float | None:
    """percent·mean(diag H), the damping a factorization of H + λI starts from, if `used` (what the factor's
    corner entry says it was) is it within `tolerance` relative to H's corner; None where it was raised."""
    nominal = percent * float(np.mean(np.diag(H)))
    return (
        nominal if abs(used - nominal) <= tolerance * (abs(float(H[-1, -1])) + abs(float(H[0, 0])) + nominal) else None
    )


def damping(cache: "Hessian", percdamp: float) -> float | None:
    """The λ of the U that `gptq` factored from `cache`'s H (percdamp·mean diag H) when it is kept there and was
    not raised by a failed Cholesky (its last diagonal entry is 1/√(H_KK + λ)); None otherwise."""
    U = cache.factors.get(("U", percdamp, False))
    corner = float(U[-1, -1]) if U is not None else cache.factors.get(("U corner", percdamp, False))
    if corner is None:
        return None
    H = cache.H
    return _nominal_damping(H, percdamp, 1.0 / corner**2 - float(H[-1, -1]), 1e-9)
