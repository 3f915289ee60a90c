"""RTN, GPTQ, GPTAQ and QEP weight quantization in numpy (fp64 inside).

Everything works on Wt [N, K]: one row per output channel, one column per
input feature, the layout every official implementation uses (see
/work/shared/specs/baselines.md). Callers map their stored weight to Wt and
back. Each method returns integer codes plus per-row (or per row-group) scales
and zero points, so a DequantizeLinear encoding can be built from them, and the
fake-quantized Wt that is written back into the graph.

Scales are rounded to float32 as soon as they are chosen: the grid the solver
propagates errors against is then exactly the grid a float32 DequantizeLinear
reproduces, so the fake-quantized weights equal their encoding bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCHEMES = ("asym", "sym", "quarot", "sign")
"""asym: GPTQ Quantizer (default); sym: GPTQ symmetric; quarot: QuaRot/GPTAQ
symmetric; sign: our declared 1-bit extension, sign(w)·mean|w|."""

MSE_NORM, MSE_GRID, MSE_MAXSHRINK = 2.4, 100, 0.8
"""GPTQ `Quantizer` defaults for the optional MSE clip search."""

CHOLESKY_RETRIES = 8
"""Times the damping is multiplied by 10 before a failed Cholesky is reported."""


@dataclass(frozen=True)
class QuantSpec:
    """How one weight is quantized: bit width, grid family, granularity, clip search."""

    bits: int
    scheme: str = "asym"
    group_size: int = -1
    mse: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        if not 1 <= self.bits <= 16:
            raise ValueError(f"bits must be between 1 and 16, not {self.bits}")
        if (self.bits == 1) != (self.scheme == "sign"):
            raise ValueError("1-bit weights use the declared sign extension (scheme 'sign'), and 'sign' is 1-bit only")
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"group_size must be -1 (per channel) or positive, not {self.group_size}")

    @property
    def signed(self) -> bool:
        """Codes are signed with no zero point (all schemes except asym)."""
        return self.scheme != "asym"

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1


def quant_spec(bits: int, scheme: str | None = None, group_size: int = -1, mse: bool = False) -> QuantSpec:
    """A QuantSpec whose scheme defaults to asym (or sign at 1 bit)."""
    return QuantSpec(bits, scheme or ("sign" if bits == 1 else "asym"), group_size, mse)


@dataclass(frozen=True)
class Grid:
    """Quantization parameters of one column slice: one (scale, zero) per row."""

    scale: np.ndarray
    """(N,) fp64, float32-representable."""
    zero: np.ndarray
    """(N,) fp64 integer values; all 0 for signed schemes."""
    spec: QuantSpec


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _codes(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """Integer codes of w (rows broadcast against the (N,) scale)."""
    if w.ndim == 2:
        scale, zero = scale[:, None], zero[:, None]
    if spec.scheme == "sign":
        return np.where(w >= 0, 1.0, -1.0)
    safe = np.where(scale > 0, scale, 1.0)
    if spec.scheme == "asym":
        return np.clip(np.rint(w / safe) + zero, 0, spec.maxq)
    half = 2 ** (spec.bits - 1)
    return np.clip(np.rint(w / safe), -half, half - 1)


def _values(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    if codes.ndim == 2:
        scale, zero = scale[:, None], zero[:, None]
    return scale * (codes - zero)


def _candidate(lo: np.ndarray, hi: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) for a per-row range; lo <= 0 <= hi, symmetric schemes use hi only."""
    if spec.scheme == "asym":
        scale = _f32((hi - lo) / spec.maxq)
        return scale, np.rint(-lo / np.where(scale > 0, scale, 1.0))
    if spec.scheme == "sym":
        return _f32(2 * hi / spec.maxq), np.zeros_like(hi)
    return _f32(hi / (2 ** (spec.bits - 1) - 1)), np.zeros_like(hi)


def find_grid(w: np.ndarray, spec: QuantSpec) -> Grid:
    """Per-row grid of the slice w [N, k] (GPTQ `find_params`, QuaRot `WeightQuantizer`)."""
    w = np.asarray(w, np.float64)
    if spec.scheme == "sign":
        return Grid(_f32(np.abs(w).mean(axis=1)), np.zeros(w.shape[0]), spec)
    lo = np.minimum(w.min(axis=1), 0.0)
    hi = np.maximum(w.max(axis=1), 0.0)
    if spec.scheme == "asym":
        empty = (lo == 0) & (hi == 0)
        lo, hi = np.where(empty, -1.0, lo), np.where(empty, 1.0, hi)
    else:
        peak = np.maximum(-lo, hi)
        peak = np.where(peak == 0, 1.0, peak) if spec.scheme == "sym" else np.maximum(peak, 1e-5)
        lo, hi = -peak, peak
    scale, zero = _candidate(lo, hi, spec)
    if spec.mse:
        scale, zero = _mse_clip(w, lo, hi, scale, zero, spec)
    return Grid(scale, zero, spec)


def _mse_clip(w, lo, hi, scale, zero, spec):
    """GPTQ's `mse` search: shrink the range while Σ|ŵ-w|^2.4 per row decreases."""
    best = np.full(w.shape[0], np.inf)
    scale, zero = scale.copy(), zero.copy()
    for i in range(int(MSE_MAXSHRINK * MSE_GRID)):
        p = 1 - i / MSE_GRID
        s1, z1 = _candidate(p * lo, p * hi, spec)
        err = (np.abs(_values(_codes(w, s1, z1, spec), s1, z1) - w) ** MSE_NORM).sum(axis=1)
        better = err < best
        best[better], scale[better], zero[better] = err[better], s1[better], z1[better]
    return scale, zero


def quantize_column(w: np.ndarray, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """(integer codes, dequantized values) of a column w [N] (or a slice [N, k]) on `grid`."""
    w = np.asarray(w, np.float64)
    codes = _codes(w, grid.scale, grid.zero, grid.spec)
    return codes, _values(codes, grid.scale, grid.zero)


@dataclass
class Quantized:
    """A quantized Wt: codes, parameters per row and group, and the fake-quantized values."""

    codes: np.ndarray
    """int32 [N, K]; unsigned in [0, maxq] for asym, signed otherwise."""
    scale: np.ndarray
    """fp64 [N, groups] (groups = 1 per channel), float32-representable."""
    zero: np.ndarray | None
    """int32 [N, groups] for asym, None for signed schemes."""
    values: np.ndarray
    """fp64 [N, K] = scale·(codes - zero), the fake-quantized Wt."""
    spec: QuantSpec
    group_size: int
    """-1 for per channel, else the number of consecutive input features per group."""


def _pack(codes, values, grids: list[Grid], spec: QuantSpec, group_size: int) -> Quantized:
    scale = np.stack([g.scale for g in grids], axis=1)
    zero = None if spec.signed else np.stack([g.zero for g in grids], axis=1).astype(np.int32)
    return Quantized(codes.astype(np.int32), scale, zero, values, spec, group_size)


def _group_starts(columns: int, group_size: int) -> range:
    return range(0, columns, group_size if group_size > 0 else max(columns, 1))


def rtn(Wt: np.ndarray, bits: int, group_size: int = -1, scheme: str | None = None, mse: bool = False) -> Quantized:
    """Round to nearest on a min-max (or MSE-clipped) grid, per row or row-group."""
    spec = quant_spec(bits, scheme, group_size, mse)
    Wt = np.asarray(Wt, np.float64)
    codes, values, grids = np.zeros_like(Wt), np.zeros_like(Wt), []
    for g0 in _group_starts(Wt.shape[1], group_size):
        g1 = Wt.shape[1] if group_size <= 0 else min(g0 + group_size, Wt.shape[1])
        grid = find_grid(Wt[:, g0:g1], spec)
        codes[:, g0:g1], values[:, g0:g1] = quantize_column(Wt[:, g0:g1], grid)
        grids.append(grid)
    return _pack(codes, values, grids, spec, group_size)


def _dead(Wt: np.ndarray, H: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies with dead inputs (zero Hessian diagonal) neutralised, as GPTQ does."""
    Wt, H = np.array(Wt, np.float64), np.array(H, np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    Wt[:, dead] = 0
    return Wt, H, dead


def inverse_cholesky(H: np.ndarray, percdamp: float) -> np.ndarray:
    """Upper U with UᵀU = (H + λI)⁻¹, λ = percdamp·mean(diag H).

    Guard (not in the official code): when a Cholesky fails, the damping is
    multiplied by 10 and tried again, so a rank-deficient H from too little
    calibration data degrades gracefully instead of stopping a sweep.
    """
    eye = np.eye(H.shape[0])
    mean = float(np.mean(np.diag(H))) if H.size else 1.0
    damp = percdamp * mean
    for _ in range(CHOLESKY_RETRIES + 1):
        try:
            lower = np.linalg.cholesky(H + damp * eye)
            inverse_lower = np.linalg.inv(lower)
            upper = np.linalg.cholesky(inverse_lower.T @ inverse_lower).T
            if np.all(np.isfinite(upper)):
                return upper
        except np.linalg.LinAlgError:
            pass
        damp = max(damp, 1e-6 * abs(mean) or 1e-12) * 10
    raise np.linalg.LinAlgError(f"Hessian is not positive definite even with damping {damp / 10:.3g}")


def _solve(Wt, U, spec: QuantSpec, group_size: int, block_size: int, perm, static_grids, P) -> Quantized:
    """The GPTQ column loop with lazy batch updates; P adds GPTAQ's asymmetric terms."""
    N, K = Wt.shape
    codes, values = np.zeros_like(Wt), np.zeros_like(Wt)
    grids: dict[int, Grid] = {}
    grid = find_grid(Wt, spec) if group_size <= 0 else None
    for b0 in range(0, K, block_size):
        b1 = min(b0 + block_size, K)
        W1, E1 = Wt[:, b0:b1].copy(), np.zeros((N, b1 - b0))
        for i in range(b1 - b0):
            c = b0 + i
            w = W1[:, i].copy()
            if group_size > 0:
                if static_grids is not None:
                    grid = static_grids[(perm[c] if perm is not None else c) // group_size]
                elif c % group_size == 0:
                    grid = find_grid(_current(Wt, W1, E1, U, P, b0, b1, i, min(c + group_size, K)), spec)
                    grids[c // group_size] = grid
            codes[:, c], values[:, c] = quantize_column(w, grid)
            e = (w - values[:, c]) / U[c, c]
            E1[:, i] = e
            update = np.outer(e, U[c, c:b1])
            if P is not None:
                update -= np.outer(w, P[c, c:b1])
            W1[:, i:] -= update
        tail = E1 @ U[b0:b1, b1:]
        if P is not None:
            tail -= W1 @ P[b0:b1, b1:]
        Wt[:, b1:] -= tail
    if perm is not None:
        inverse = np.argsort(perm)
        codes, values = codes[:, inverse], values[:, inverse]
    if group_size <= 0:
        ordered = [grid]
    else:
        ordered = static_grids if static_grids is not None else [grids[g] for g in sorted(grids)]
    return _pack(codes, values, ordered, spec, group_size)


def _current(Wt, W1, E1, U, P, b0, b1, i, end) -> np.ndarray:
    """Columns c..end as they stand now, the block's pending lazy update applied.

    The official code reads the global W here, which misses the updates from
    the current block's earlier columns when a group straddles a block; this
    keeps group grids (and so Q) independent of block_size.
    """
    c = b0 + i
    inside = W1[:, i : min(end, b1) - b0]
    if end <= b1:
        return inside
    pending = E1[:, :i] @ U[b0:c, b1:end]
    if P is not None:
        pending -= W1[:, :i] @ P[b0:c, b1:end]
    return np.concatenate([inside, Wt[:, b1:end] - pending], axis=1)


def _prepare(Wt, H, bits, group_size, act_order, static_groups, scheme, mse):
    spec = quant_spec(bits, scheme, group_size, mse)
    Wt, H, dead = _dead(Wt, H)
    static_groups = static_groups or (act_order and group_size > 0)
    static_grids = None
    if static_groups and group_size > 0:
        static_grids = [find_grid(Wt[:, g : g + group_size], spec) for g in range(0, Wt.shape[1], group_size)]
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else None
    if perm is not None:
        Wt, H = Wt[:, perm], H[perm][:, perm]
    return spec, Wt, H, dead, perm, static_grids


def gptq(
    Wt: np.ndarray,
    H: np.ndarray,
    bits: int,
    group_size: int = -1,
    percdamp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    scheme: str | None = None,
    mse: bool = False,
) -> Quantized:
    """GPTQ (Frantar et al., IST-DASLab/gptq `fasterquant`) on Wt with Hessian H = (2/n)XᵀX.

    With act_order and groups, static groups are forced: groups must stay
    contiguous in the original column order for a DequantizeLinear encoding.
    """
    spec, Wt, H, _, perm, static_grids = _prepare(Wt, H, bits, group_size, act_order, static_groups, scheme, mse)
    U = inverse_cholesky(H, percdamp)
    return _solve(Wt, U, spec, group_size, block_size, perm, static_grids, None)


def gptaq(
    Wt: np.ndarray,
    H: np.ndarray,
    G: np.ndarray,
    bits: int,
    group_size: int = -1,
    percdamp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    scheme: str | None = None,
    mse: bool = False,
    alpha: float = 0.25,
) -> Quantized:
    """GPTAQ (GPTQv2): GPTQ plus the asymmetric-calibration terms of P = α·triu(G Uᵀ, 1)·U.

    G = (2/n)(X_fp - X̂)ᵀX̂ on the same rows as H = (2/n)X̂ᵀX̂; α = 0.25 is the
    official hard-coded value. α = 0 is exactly GPTQ.
    """
    spec, Wt, H, dead, perm, static_grids = _prepare(Wt, H, bits, group_size, act_order, static_groups, scheme, mse)
    G = np.array(G, np.float64)
    G[:, dead] = 0
    if perm is not None:
        G = G[perm][:, perm]
    U = inverse_cholesky(H, percdamp)
    P = alpha * np.triu(G @ U.T, k=1) @ U
    return _solve(Wt, U, spec, group_size, block_size, perm, static_grids, P)


def qep_correct(Wt: np.ndarray, H: np.ndarray, H_delta: np.ndarray, alpha: float = 0.5, percdampqep: float = 1.0) -> np.ndarray:
    """QEP's weight correction Wt + α·Wt·H_δ·(H + λI)⁻¹ (FujitsuResearch/qep `run_weight_correct`).

    Any base method then quantizes the returned weights with the same H.
    α = 0 skips the correction entirely, as the official script does for the
    layers it excludes.
    """
    if alpha == 0:
        return np.array(Wt, np.float64)
    Wt, H, _ = _dead(Wt, H)
    eye = np.eye(H.shape[0])
    mean = float(np.mean(np.diag(H)))
    damp = percdampqep * mean
    rhs = Wt @ np.asarray(H_delta, np.float64)
    for _ in range(CHOLESKY_RETRIES + 1):
        try:
            np.linalg.cholesky(H + damp * eye)
            return Wt + alpha * np.linalg.solve(H + damp * eye, rhs.T).T
        except np.linalg.LinAlgError:
            damp = max(damp, 1e-6 * abs(mean) or 1e-12) * 10
    raise np.linalg.LinAlgError(f"damped Hessian is not positive definite even with damping {damp / 10:.3g}")


class Hessian:
    """Running averages H = (2/n)·X̂ᵀX̂ and, with `cross`, G = (2/n)·(X_fp - X̂)ᵀX̂.

    Both share one sample count n, which GPTAQ's P needs (its scale relative
    to H matters, H's own scale does not). Rows are samples (tokens, patches);
    X is never stored.
    """

    def __init__(self, columns: int, cross: bool = False):
        self.H = np.zeros((columns, columns))
        self.G = np.zeros((columns, columns)) if cross else None
        self.count = 0

    def add(self, x: np.ndarray, x_fp: np.ndarray | None = None) -> None:
        x = np.asarray(x, np.float64).reshape(-1, self.H.shape[0])
        rows = x.shape[0]
        if rows == 0:
            return
        keep = self.count / (self.count + rows)
        self.count += rows
        self.H *= keep
        self.H += (2.0 / self.count) * (x.T @ x)
        if self.G is not None:
            if x_fp is None:
                raise ValueError("a cross statistic needs the full-precision inputs too")
            delta = np.asarray(x_fp, np.float64).reshape(x.shape) - x
            self.G *= keep
            self.G += (2.0 / self.count) * (delta.T @ x)

    @classmethod
    def merge(cls, parts: list["Hessian"]) -> "Hessian":
        """One statistic over the union of the parts' samples (shared weights, several uses)."""
        merged = cls(parts[0].H.shape[0], parts[0].G is not None)
        merged.count = sum(p.count for p in parts)
        for part in parts:
            if part.count:
                merged.H += part.H * (part.count / merged.count)
                if merged.G is not None:
                    merged.G += part.G * (part.count / merged.count)
        return merged


def output_error(Wt: np.ndarray, Q: np.ndarray, stats: Hessian) -> float:
    """‖X·Wtᵀ - X·Qᵀ‖_F on the samples behind `stats`, from H alone (XᵀX = n/2·H)."""
    delta = np.asarray(Wt, np.float64) - np.asarray(Q, np.float64)
    squared = float(np.einsum("ij,jk,ik->", delta, stats.H, delta)) * stats.count / 2
    return float(np.sqrt(max(squared, 0.0)))
