"""The calibration statistics H and G of a weight's inputs, what the solvers keep with them, and the layer
objectives read off them.

H = (2/n)·X̂ᵀX̂ and G = (2/n)·(X_fp − X̂)ᵀX̂ are gathered a batch of rows at a time and merged across a
weight's uses (`Hessian`). Factorizations and casts the solvers in `tiers.gptq` derive from one statistic
are kept beside it (`cached`, `in_dtype`), so every weight, tier and grid solved on it pays for them once.
The objectives (`row_objective`, `second_lower`, `output_error`) measure a rounding from H and G alone.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from tiers import solver_backend as backend
from tiers.solver_backend import gram

if TYPE_CHECKING:
    from tiers.gptq import Quantized

STATS_BATCH_BYTES = 32 << 20
"""Calibration rows (as float64) gathered before they enter a statistic: one XᵀX of a few thousand rows
runs several times faster than one per sample of a few dozen (BLAS's fixed costs, and a K x K rescale each)."""


class Hessian:
    """Running averages H = (2/n)·X̂ᵀX̂ and, with `cross`, G = (2/n)·(X_fp − X̂)ᵀX̂.

    Both share one sample count n, which GPTAQ's P needs (its scale relative
    to H matters, H's own scale does not). Rows are samples (tokens, patches);
    X is never stored beyond a batch of rows (`STATS_BATCH_BYTES`), folded in
    when the batch is full or the statistic is read. Factorizations of H that
    the solvers need are kept with it (`factors`), so every weight, tier and
    grid solved on the same statistic pays for them once.
    """

    def __init__(self, columns: int, cross: bool = False):
        self._H = np.zeros((columns, columns))
        self._G = np.zeros((columns, columns)) if cross else None
        self._count = 0
        self._pending: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._pending_rows = 0
        self.factors: dict = {}
        """Solver-side products of H (and G), by what they depend on: filled by the solvers (`tiers.gptq`)."""
        self.lock = threading.Lock()
        """Held while a factor is computed: weights solved in parallel on one statistic compute it once."""

    @property
    def count(self) -> int:
        """Rows seen (n), pending ones included."""
        return self._count + self._pending_rows

    @count.setter
    def count(self, value: int) -> None:
        self._fold()
        self._count = value

    @property
    def H(self) -> np.ndarray:
        self._fold()
        return self._H

    @property
    def G(self) -> np.ndarray | None:
        self._fold()
        return self._G

    def add(self, x: np.ndarray, x_fp: np.ndarray | None = None) -> None:
        """Rows x (and their full-precision counterparts; `x_fp is x` says they are the same, G gains nothing)."""
        columns = self._H.shape[0]
        x = np.asarray(x).reshape(-1, columns)
        if x.shape[0] == 0:
            return
        if self._G is not None:
            if x_fp is None:
                raise ValueError("a cross statistic needs the full-precision inputs too")
            x_fp = None if x_fp is x else np.asarray(x_fp).reshape(x.shape)
        self._pending.append((x, x_fp))
        self._pending_rows += x.shape[0]
        if self._pending_rows * columns * 8 >= STATS_BATCH_BYTES:
            self._fold()

    def _fold(self) -> None:
        """The pending rows into H (and G) in one product each."""
        if not self._pending:
            return
        pending, self._pending, rows, self._pending_rows = self._pending, [], self._pending_rows, 0
        x = _stacked([p[0] for p in pending], rows)
        crossed = self._G is not None and any(p[1] is not None for p in pending)
        self._fold_rows(x, _deltas(pending, x) if crossed else None)

    def fold_in(self, x: np.ndarray, delta: np.ndarray | None = None) -> None:
        """Rows stacked as one fold would stack them (float64, C order) and their X_fp − X̂ (None: none), folded
        in at once after any pending rows: what adding them and reading H does, without the float32 copies
        the pending rows are (`tqsdeploy.encoding.wave_statistics`)."""
        self._fold()
        if x.shape[0]:
            self._fold_rows(x, delta if self._G is not None else None)

    def _fold_rows(self, x: np.ndarray, delta: np.ndarray | None) -> None:
        rows = x.shape[0]
        keep = self._count / (self._count + rows)
        self._count += rows
        self._H *= keep
        self._H += _scaled(gram(x, x), 2.0 / self._count)
        if self._G is not None:
            self._G *= keep
            if delta is not None:
                self._G += _scaled(gram(delta, x), 2.0 / self._count)
        self.factors.clear()

    @classmethod
    def merge(cls, parts: list["Hessian"]) -> "Hessian":
        """One statistic over the union of the parts' samples (shared weights, several uses); one part is itself."""
        if len(parts) == 1:
            return parts[0]
        merged = cls(parts[0].H.shape[0], parts[0].G is not None)
        for part in parts:
            part._fold()
        merged.count = sum(p.count for p in parts)
        for part in parts:
            if part.count:
                merged._H += part.H * (part.count / merged.count)
                if merged._G is not None:
                    merged._G += part.G * (part.count / merged.count)
        return merged


def _stacked(parts: list[np.ndarray], rows: int) -> np.ndarray:
    """The parts' rows as one float64 array, each cast straight into its place (the values of concatenating their
    float64 copies, without those copies: on a grouped conv's strided im2col columns they were most of a fold)."""
    if len(parts) == 1:
        return np.asarray(parts[0], np.float64)
    stacked = np.empty((rows, parts[0].shape[1]))
    start = 0
    for part in parts:
        stacked[start : start + part.shape[0]] = part
        start += part.shape[0]
    return stacked


def _deltas(pending: list[tuple[np.ndarray, np.ndarray | None]], x: np.ndarray) -> np.ndarray:
    """X_fp − X̂ of the pending rows in float64 (zero where a part has no full-precision counterpart), each part
    subtracted into its place: the same values as the float64 difference of each part, concatenated."""
    if len(pending) == 1:
        return np.asarray(pending[0][1], np.float64) - x
    delta = np.empty_like(x)
    start = 0
    for quantized, full in pending:
        stop = start + quantized.shape[0]
        if full is None:
            delta[start:stop] = 0.0
        else:
            np.subtract(full, x[start:stop], out=delta[start:stop], dtype=np.float64)
        start = stop
    return delta


def _scaled(product: np.ndarray, factor: float) -> np.ndarray:
    """factor · product in place: the same values as `factor * product` without a second K x K temporary."""
    product *= factor
    return product


def cached(cache: "Hessian | None", key: tuple, make):
    """make(), kept in `cache.factors` under `key` when the statistic is given: solves on one Hessian
    (both grids of `_better_rows`, sibling weights such as q/k/v, every tier of a mixed pass) factor it once."""
    if cache is None:
        return make()
    with cache.lock:
        if key not in cache.factors:
            cache.factors[key] = make()
        return cache.factors[key]


ROWS_PER_INPUT = 1024
"""Rows per input a weight's statistics take at most (shared between its uses): past that, and past one fold of
rows (`STATS_BATCH_BYTES`), every r-th row of each use (`tqsdeploy.encoding.wave_statistics`). GPTQ's
references calibrate on 24-64 rows per input; a long context's depthwise conv read ten times a step had 8,400
per input, and its statistics were the largest part of an export (docs/design-notes/encoding.md, "At most
1,024 rows per input"). 0: every row."""

THIN_ROWS_PER_INPUT = 2
"""A statistic of fewer rows than this many per input is thin (`shrinkage`; export's note names such weights)."""
MAX_SHRINKAGE = 1 - 1e-6
"""The most `shrinkage` returns: a weight on an all-but-identity H is rounded to nearest, with a finite damping."""


def is_thin(stats: Hessian) -> bool:
    """Fewer rows than `THIN_ROWS_PER_INPUT` per input: what `shrinkage` shrinks and export's note names."""
    return stats.count < THIN_ROWS_PER_INPUT * stats.H.shape[0]


def shrinkage(stats: Hessian) -> float:
    """How far a thin statistic's H is pulled toward μ·I (μ = mean diag H): the oracle-approximating shrinkage
    intensity ρ (Chen, Wiesel, Eldar and Hero 2010) from n rows and width p,

        ρ = min(1, ((1 − 2/p)·tr H² + (tr H)²) / ((n + 1 − 2/p)·(tr H² − (tr H)²/p))),

    0 where the rows are not thin (n ≥ `THIN_ROWS_PER_INPUT`·p: those solves stay as they were). Why: a solve
    fits the rows it saw; with fewer rows than inputs, H has no information outside their span, and the codes
    it fits drift more on other windows than rounding to nearest does (benchmarks/results/thin-statistics.md).
    Shrinking H, and G with it, by ρ is the same as raising each damping percent p to
    (p + ρ)/(1 − ρ) (`shrunk_rounding`), so no shrunk copy of H is made."""
    width, rows = stats.H.shape[0], stats.count
    if rows == 0 or not is_thin(stats):
        return 0.0

    def intensity() -> float:
        H = stats.H
        trace = float(np.trace(H))
        squares = float(np.vdot(H, H))
        spread = squares - trace * trace / width
        if spread <= 0:
            return MAX_SHRINKAGE
        rho = ((1 - 2 / width) * squares + trace * trace) / ((rows + 1 - 2 / width) * spread)
        return min(MAX_SHRINKAGE, max(0.0, rho))

    return cached(stats, ("shrinkage",), intensity)


def ridge(stats: Hessian) -> float:
    """What `shrinkage` adds to H's diagonal in the solves' frame (H + ρ/(1 − ρ)·μ·I): the objectives that judge a
    rounding from H (`second_lower`, the grid choice) add it times ‖q − w‖², so they judge on the shrunk H too."""
    rho = shrinkage(stats)
    return rho / (1 - rho) * float(np.mean(np.diag(stats.H))) if rho else 0.0


def shrunk_damping(percent: float, rho: float) -> float:
    """A damping percent of H once H is shrunk by ρ toward μ·I: (1 − ρ)·H + ρ·μ·I + p·μ·I is (1 − ρ)·(H +
    (p + ρ)/(1 − ρ)·μ·I), and every solve is unchanged by H's scale once G is shrunk by the same 1 − ρ."""
    return (percent + rho) / (1 - rho)


def working_dtype(order: int):
    """What QEP's correction and the grid choice's products with H and G compute in (`solver_backend.solve_dtype`)."""
    return np.float32 if backend.solve_dtype(order) == "float32" else np.float64


def in_dtype(cache: "Hessian | None", name: str, matrix: np.ndarray, dtype) -> np.ndarray:
    """The statistic's `matrix` (H or G) in `dtype`: itself in float64, else a copy kept with the statistic
    (`cache`) under `name`, so QEP's correction and the grid choice cast it once."""
    if dtype == np.float64:
        return np.asarray(matrix, np.float64)
    return cached(cache, (name, dtype.__name__), lambda: np.ascontiguousarray(matrix, dtype=dtype))


ERROR_ROWS = 512
"""Rows of ΔW per product with H in `row_objective` (bounds its temporaries to two ERROR_ROWS x K arrays)."""


def row_objective(Wt: np.ndarray, Q: np.ndarray, stats: Hessian, strength: float = 0.0) -> np.ndarray:
    """Per output channel, (2/n)·‖X̂·q − X_α·w‖² from the statistics alone, X_α = X̂ + α·(X_fp − X̂) the
    inputs a method aims at (α = 0: the calibration inputs themselves, GPTQ's aim; GPTAQ and QEP move
    α of the way to the full-precision ones), less the part that is the same for every q of the row.
    With d = q − w it is d·H·dᵀ − 2α·d·Gᵀ·wᵀ; ΔW·H through BLAS a block of rows at a time (a
    three-operand einsum loops in plain C)."""
    rows = np.zeros(Wt.shape[0])
    for start in range(0, Wt.shape[0], ERROR_ROWS):
        w = np.asarray(Wt[start : start + ERROR_ROWS], np.float64)
        delta = np.asarray(Q[start : start + ERROR_ROWS], np.float64) - w
        rows[start : start + len(w)] = np.einsum("ij,ij->i", delta @ stats.H, delta)
        if strength and stats.G is not None:
            rows[start : start + len(w)] -= 2 * strength * np.einsum("ij,ij->i", delta @ stats.G.T, w)
    return rows


def second_lower(
    Wt: np.ndarray, first: Quantized, second: Quantized, stats: Hessian, strength: float = 0.0
) -> np.ndarray:
    """Per output channel, whether `second`'s `row_objective` is below `first`'s (ties keep `first`).

    Worked out from their difference, not as two objectives: with e = q₂ − q₁ and dᵢ = qᵢ − w,
    obj₂ − obj₁ = e·H·(d₁ + d₂)ᵀ − 2α·e·Gᵀ·wᵀ (H symmetric), one product with H (and one with G)
    where the two objectives took two each: half the flops of the per-channel grid choice, which at
    K = 4096 cost as much as a column loop. Rows whose values are the same on both (e = 0) tie and
    skip the products. The products run in `solver_backend.solve_dtype`, the sums in float64. GPTQ and QEP
    decide without them, from their column loop's losses (`tiers.quantizer._second_lower_by_losses`)."""
    dtype = working_dtype(stats.H.shape[0])
    H = in_dtype(stats, "H", stats.H, dtype)
    G = in_dtype(stats, "G", stats.G, dtype) if strength and stats.G is not None else None
    shrunk = ridge(stats)
    better = np.zeros(Wt.shape[0], bool)
    for start in range(0, Wt.shape[0], ERROR_ROWS):
        stop = min(start + ERROR_ROWS, Wt.shape[0])
        one, two = first.rows(start, stop).values, second.rows(start, stop).values
        e = two - one
        differ = np.flatnonzero((e != 0).any(axis=1))
        if differ.size == 0:
            continue
        w = np.asarray(Wt[start:stop], np.float64)[differ]
        e, one, two = e[differ], one[differ], two[differ]
        one -= w
        two -= w
        one += two  # d₁ + d₂
        e = e.astype(dtype, copy=False)
        change = np.einsum("ij,ij->i", e @ H, one)
        if shrunk:
            change += shrunk * np.einsum("ij,ij->i", e, one, dtype=np.float64)
        if G is not None:
            change -= 2 * strength * np.einsum("ij,ij->i", e @ G.T, w)
        better[start + differ] = change < 0
    return better


def output_error(Wt: np.ndarray, Q: np.ndarray, stats: Hessian) -> float:
    """‖X·Wtᵀ − X·Qᵀ‖_F on the samples behind `stats`, from H alone (XᵀX = n/2·H)."""
    squared = float(row_objective(Wt, Q, stats).sum()) * stats.count / 2
    return float(np.sqrt(max(squared, 0.0)))
