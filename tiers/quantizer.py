"""One quantizer contract: any rounding method at any tier.

    quantize(weight, layout, tier, rounding, stats) -> Quantized   (Wt level: codes, scales, zero points)
    to_encoded(quantized, layout, tier, dtype)      -> Encoded     (what the file stores)
    encode(...)                                     -> Encoded     (both, float tiers included)

Rounding is an axis separate from the tier: round-to-nearest, GPTQ, GPTAQ and
QEP all land on the tier's grid. The compensating methods take the
calibration statistics of the weight's inputs (one `Hessian` per Conv row
group); without them, or on a tier they cannot fill (fp8), they round to
nearest, and the caller records why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

import tiers.gptq as solvers
import tiers.hessian as statistics
from graph_ops.layout import Layout
from tiers.encoded import Encoded
from tiers.formats.base import Tier
from tiers.gptq import Quantized
from tiers.grid import Grid, find_grid
from tiers.hessian import Hessian, shrinkage, shrunk_damping, working_dtype
from tiers.methods import METHODS
from tiers.solver_backend import c_order

GRIDS = ("per-channel", "min-max")
"""Which grid a clip-searched tier (4 bits and fewer) rounds onto: 'per-channel', each output channel on the
clip-searched or the plain min-max grid, whichever gives it the lower calibration objective after the solve
(`_better_rows`); 'min-max', the plain min-max grid alone. Neither wins everywhere (docs/design-notes/tiers.md,
'Per-channel or min-max grids'), so `export` and `baseline` measure both (`--grids auto`)."""


@dataclass(frozen=True)
class Rounding:
    """How codes are chosen on a tier's grid, with the official defaults."""

    method: str = "rtn"
    percdamp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    alpha: float | None = None
    """GPTAQ's α or QEP's perccorr; None: the method's own (`Method.alpha`: 0.25, 0.5)."""
    percdampqep: float = 1.0
    qep_base: str = "gptq"
    """QEP quantizes its corrected weights with 'gptq' or 'rtn'."""
    grids: str = "per-channel"
    """The grid a clip-searched tier rounds onto (`GRIDS`)."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown rounding '{self.method}'; choose one of {', '.join(METHODS)}")
        if self.grids not in GRIDS:
            raise ValueError(f"unknown grids '{self.grids}'; choose one of {', '.join(GRIDS)}")
        if self.qep_base not in ("gptq", "rtn"):
            raise ValueError(f"QEP runs on 'gptq' or 'rtn', not '{self.qep_base}'")
        if self.block_size < 1:
            raise ValueError(f"block size must be positive, not {self.block_size}")

    @property
    def needs_stats(self) -> bool:
        return METHODS[self.method].stats

    @property
    def needs_cross(self) -> bool:
        """Needs G = (X_fp − X̂)ᵀX̂ as well as H (full-precision inputs next to quantized-prefix ones)."""
        return METHODS[self.method].cross

    @property
    def strength(self) -> float:
        return METHODS[self.method].alpha if self.alpha is None else self.alpha

    @property
    def label(self) -> str:
        """The method, and the grids where they are not the default: 'qep', 'qep/min-max'."""
        return self.method if self.grids == GRIDS[0] else f"{self.method}/{self.grids}"


RTN = Rounding()


def _group(layout: Layout, group_size: int | None) -> int:
    group = layout.effective_group(group_size)
    return group if group and layout.row_groups == 1 else -1


def quantize(
    weight: np.ndarray,
    layout: Layout,
    tier: Tier,
    rounding: Rounding = RTN,
    stats: Sequence[Hessian] | None = None,
    group_size: int | None = None,
    correct: bool = True,
    search: bool = True,
) -> Quantized:
    """Codes of `weight` on `tier`'s grid, chosen by `rounding` (Wt level).

    `stats` holds one Hessian per Conv row group (None: round to nearest).
    `correct=False` skips QEP's weight correction for this weight (the
    official script skips it on layers it excludes). `search=False` keeps the plain min-max
    grid: the same tensors, types and shapes, without the clip search (what a size needs); so does
    a rounding on 'min-max' grids (`GRIDS`).
    """
    if not tier.quantized:
        raise ValueError(f"tier '{tier.name}' stores floats, not codes")
    spec = tier.grid if search and rounding.grids != "min-max" else replace(tier.grid, search=False)
    group = _group(layout, group_size) if tier.blockwise else -1
    if stats is None or not rounding.needs_stats or not tier.calibratable or layout.perm is None:
        return solvers.rtn(layout.to_wt(np.asarray(weight, np.float64)), spec, group)
    weight = np.asarray(weight)
    wt = c_order(layout.to_wt(weight), np.float64)  # the solvers' own copy: they work on it in place
    rows = wt.shape[0] // len(stats)
    before = _original_values(weight, layout) if spec.search else None
    parts = []
    for g, part in enumerate(stats):
        block = wt[g * rows : (g + 1) * rows]
        original = None if before is None else before[g * rows : (g + 1) * rows]
        parts.append(_method(rounding, block, part, spec, group, correct, original))
    return Quantized.stack(parts)


def _original_values(weight: np.ndarray, layout: Layout) -> np.ndarray:
    """The weight's values in Wt order, read-only, for the grid choice to compare against once the solve has moved
    the solver's copy: the caller's own array seen as Wt where its dtype is float32 or float64 (a view, no copy:
    a K x K float32 weight is half a K x K float64 at the solve's peak), else a copy in the narrowest dtype that
    holds them exactly."""
    values = layout.to_wt(weight)
    if values.dtype in (np.float32, np.float64):
        return values
    return np.array(values, _exact_dtype(weight))


def _method(rounding: Rounding, wt, stats: Hessian, spec, group: int, correct: bool, original=None) -> Quantized:
    """`wt` is this call's own: every solver works on it in place. `original`: the weight's values before the solve
    (`_original_values`; None: the grid is not searched, nothing compares against them), read only."""
    product: dict | None = {} if original is not None else None
    rounding = shrunk_rounding(rounding, stats)
    if rounding.method == "qep":
        wt = solvers.qep_correct(
            wt,
            stats.H,
            stats.G,
            alpha=rounding.strength if correct else 0.0,
            percdampqep=rounding.percdampqep,
            own=True,
            cache=stats,
            product=product,
        )
    if original is None:
        return _solve(rounding, wt, stats, spec, group)
    return _better_rows(rounding, original, wt, stats, spec, group, product)


def shrunk_rounding(rounding: Rounding, stats: Hessian) -> Rounding:
    """`rounding` with its dampings raised as far as `stats` is thin (`tiers.hessian.shrinkage`); itself where
    the rows are enough."""
    rho = shrinkage(stats)
    if not rho:
        return rounding
    return replace(
        rounding,
        percdamp=shrunk_damping(rounding.percdamp, rho),
        percdampqep=shrunk_damping(rounding.percdampqep, rho),
    )


def _solve(
    rounding: Rounding, wt, stats: Hessian, spec, group: int, grid: Grid | None = None, losses: np.ndarray | None = None
) -> Quantized:
    """The base solve on `wt` (QEP's already corrected), in place; `grid` as for `solvers.gptq`; `losses` filled
    by a GPTQ loop (`solvers.gptq`), left alone by the others."""
    if rounding.method == "gptaq":
        options = solvers.GptaqSettings(**_loop_settings(rounding, group), alpha=rounding.strength)
        return solvers.gptaq(wt, stats.H, stats.G, spec, options, own=True, cache=stats, grid=grid)
    if rounding.method == "qep" and rounding.qep_base == "rtn":
        return solvers.rtn(wt, spec, group)
    options = solvers.GptqSettings(**_loop_settings(rounding, group))
    return solvers.gptq(wt, stats.H, spec, options, own=True, cache=stats, grid=grid, losses=losses)


def _loop_settings(rounding: Rounding, group: int) -> dict:
    return dict(
        group_size=group, percdamp=rounding.percdamp, block_size=rounding.block_size, act_order=rounding.act_order
    )


def _better_rows(
    rounding: Rounding, original, wt, stats: Hessian, spec, group: int, product: dict | None = None
) -> Quantized:
    """Each output channel on whichever grid, clip-searched or plain min-max, gives it the lower
    calibration objective after the solve.

    The clip search (`tiers.grid`) picks the grid that rounds the weights themselves best; a
    compensating solve then moves them, and a clipped grid can cost more than it saved (thin Hessians
    especially). Rows are independent in every solve (each row's error feeds only its own later
    columns), so each keeps its better grid, judged by the error the next layer sees: ‖X̂q − X_fp·w‖,
    the quantized-prefix output against the full-precision layer's, wherever the cross statistics exist
    (GPTAQ, QEP). Their α (GPTAQ's 0.25, QEP's perccorr 0.5) damps how far a solve moves the weights,
    not what the result is worth, so the judgement is at α = 1. GPTQ, or a method at α = 0, compares
    ‖X̂(q − w)‖, so α = 0 stays exactly the base (docs/design-notes/tiers.md, 'Per-channel or min-max
    grids').

    Per channel, both grids are fitted first and the rows whose searched grid is the min-max one are
    solved once; the others are solved on both grids in one column loop, the weight's rows followed by a
    copy of those rows on their min-max grids (`_both_grids`). GPTQ and QEP then compare the rows'
    objectives from that loop's own losses (`_second_lower_by_losses`); GPTAQ, and weights with dead
    inputs, through products with H and G (`statistics.second_lower`)."""
    plain_spec = replace(spec, search=False)
    if group > 0 or (rounding.method == "qep" and rounding.qep_base == "rtn"):
        searched = _solve(rounding, np.array(wt), stats, spec, group)
        rows, losses = np.arange(wt.shape[0]), None
        plain = _solve(rounding, wt, stats, plain_spec, group)
    else:
        searched, rows, plain, losses = _both_grids(rounding, wt, stats, spec, plain_spec)
        if rows.size == 0:
            return searched
    aim = 1.0 if rounding.needs_cross and rounding.strength else 0.0
    better = None
    if losses is not None:  # one loop solved both grids (per channel)
        n = wt.shape[0]
        solved = _BothGrids(searched, plain, (losses[:n][rows], losses[n:]))
        better = _second_lower_by_losses(rounding, original, wt, solved, stats, aim, product or {}, rows)
    if better is None:
        better = statistics.second_lower(np.asarray(original[rows], np.float64), searched.take(rows), plain, stats, aim)
    chosen = rows[better]
    for field in ("codes", "scale", "zero"):
        getattr(searched, field)[chosen] = getattr(plain, field)[better]
    return searched


def _both_grids(
    rounding: Rounding, wt: np.ndarray, stats: Hessian, spec, plain_spec
) -> tuple[Quantized, np.ndarray, Quantized]:
    """(every row solved on its searched grid, the rows whose searched grid is not the min-max one, those rows
    solved on the min-max grid), from one column loop over both (two past `ONE_LOOP_BYTES`). The grids are fitted
    as the solver fits them, to the weight with its dead inputs zeroed (in place: `wt` is this call's own); one
    loop pays numpy's per-column calls once, not twice (on layers of a few hundred rows they are most of a solve)."""
    dead = np.diag(stats.H) == 0
    wt[:, dead] = 0  # as the solver zeroes them in `wt`, this call's own, before it solves
    searched_grid, plain_grid = find_grid(wt, spec), find_grid(wt, plain_spec)
    rows = np.flatnonzero((searched_grid.scale != plain_grid.scale) | (searched_grid.zero != plain_grid.zero))
    if rows.size == 0:
        return _solve(rounding, wt, stats, spec, -1, searched_grid), rows, None, None
    n, dtype = wt.shape[0], working_dtype(wt.shape[1])
    if rounding.method in ("gptq", "qep"):  # a GPTQ loop (QEP's base: `_solve`): its U made before the rows are
        solvers.factor_first(stats.H, solvers.GptqSettings(**_loop_settings(rounding, -1)), stats)
    losses = None if dead.any() or rounding.act_order else np.zeros(n + rows.size)
    if (n + rows.size) * wt.shape[1] * np.dtype(dtype).itemsize <= ONE_LOOP_BYTES:
        stacked = np.empty((n + rows.size, wt.shape[1]), dtype)
        stacked[:n] = wt
        _rows_into(stacked[n:], wt, rows)
        both = _solve(rounding, stacked, stats, spec, -1, Grid.stack([searched_grid, plain_grid.rows(rows)]), losses)
        return both.rows(0, n), rows, both.rows(n, n + rows.size), losses
    # a wide weight: the grids one loop after the other, each on its own rows (every row is solved alone, so the
    # same codes and losses), the rows of one grid in memory at a time
    first = _solve(rounding, np.array(wt, dtype), stats, spec, -1, searched_grid, _part(losses, 0, n))
    picked = _rows_into(np.empty((rows.size, wt.shape[1]), dtype), wt, rows)
    second = _solve(rounding, picked, stats, spec, -1, plain_grid.rows(rows), _part(losses, n, None))
    return first, rows, second, losses


ONE_LOOP_BYTES = 64 << 20
"""Up to this size both grids' rows are stacked and solved in one column loop (numpy's per-column calls paid once:
on layers of a few hundred rows they are most of a solve); past it (a 2900-wide layer) each grid's rows are solved
in a loop of their own, so the rows of only one are in memory."""


def _part(losses: np.ndarray | None, start: int, stop: int | None) -> np.ndarray | None:
    return None if losses is None else losses[start:stop]  # a view: the loop adds each row's loss into it


def _rows_into(out: np.ndarray, wt: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`out` (the loop's dtype: not cast again) filled with wt's `rows`, STACK_ROWS at a time (wt[rows] whole would
    be a float64 copy of them all at once)."""
    for start in range(0, rows.size, STACK_ROWS):
        part = rows[start : start + STACK_ROWS]
        out[start : start + part.size] = wt[part]
    return out


STACK_ROWS = 256
"""Rows of the weight copied at a time into `_both_grids`' stack (a float64 copy of this many rows at most)."""


def _exact_dtype(weight: np.ndarray):
    """The narrowest dtype that holds `weight`'s values exactly among float32 and float64: what a copy of them kept
    beside the solve's float64 one needs."""
    return np.float32 if weight.dtype.kind == "f" and weight.dtype.itemsize <= 4 else np.float64


@dataclass(frozen=True)
class _BothGrids:
    """The same rows solved in one column loop on two grids: their codes on each (`first` holds every row of the
    weight, `second` only the rows compared), and the loop's losses of each (of the rows compared)."""

    first: Quantized
    second: Quantized
    losses: tuple[np.ndarray, np.ndarray]


def _second_lower_by_losses(
    rounding: Rounding,
    original,
    corrected,
    solved: _BothGrids,
    stats: Hessian,
    aim: float,
    product: dict,
    rows: np.ndarray,
) -> np.ndarray | None:
    """`statistics.second_lower` from what the solve already knows, without its products with H and G (as many flops
    as a column loop at K = 4096): the loop's losses Lᵢ = aᵢ·(H + δI)·aᵢᵀ, aᵢ = qᵢ − w* (w* the weight it solved,
    QEP-corrected), and QEP's W·G with its damping λ. With c = w* − w = α·W·G·(H + λI)⁻¹, c·H = α·W·G − λ·c, so

        obj₂ − obj₁ = L₂ − L₁ − δ·(‖a₂‖² − ‖a₁‖²) + 2·e·((α − aim)·W·G − λ·c)ᵀ,   e = q₂ − q₁

    (GPTQ: c = 0 and aim 0; `solved` holds q₁, q₂, L₁ and L₂). None where a term is missing (GPTAQ's loop has
    other terms; a QEP weight left uncorrected has no W·G; a damping raised past the nominal one): the products
    decide then. `rows`: the weight's rows compared; `original` and `corrected` hold every row of the weight, read
    a part of `rows` at a time (bounded temporaries, no copy of the rows compared)."""
    if rounding.method not in ("gptq", "qep") or rounding.qep_base != "gptq":
        return None
    delta = solvers.damping(stats, rounding.percdamp)
    product_of = product.get("WG")
    if delta is None or (aim and product_of is None) or (product_of is not None and product["damping"] is None):
        return None
    first, second, losses = solved.first, solved.second, solved.losses
    ridge = statistics.ridge(stats)
    better = np.zeros(rows.size, bool)
    for start in range(0, rows.size, statistics.ERROR_ROWS):  # bounded temporaries, as `second_lower`
        part = slice(start, min(start + statistics.ERROR_ROWS, rows.size))
        one, two = first.take(rows[part]).values, second.rows(part.start, part.stop).values
        w_star = np.asarray(corrected[rows[part]], np.float64)
        e = two - one
        shrunk = 0.0
        if ridge:  # λ·(‖d₂‖² − ‖d₁‖²) = λ·e·(d₁ + d₂)ᵀ, dᵢ = qᵢ − w: what shrinking H adds to the objective
            shrunk = ridge * np.einsum("ij,ij->i", e, one + two - 2 * np.asarray(original[rows[part]], np.float64))
        one -= w_star
        two -= w_star
        change = (
            losses[1][part]
            - losses[0][part]
            - delta * (np.einsum("ij,ij->i", two, two) - np.einsum("ij,ij->i", one, one))
            + shrunk
        )
        if product_of is not None:
            pull = (rounding.strength - aim) * np.asarray(product_of[rows[part]], np.float64) - product["damping"] * (
                w_star - np.asarray(original[rows[part]], np.float64)
            )
            change += 2 * np.einsum("ij,ij->i", e, pull)
        better[part] = change < 0
    return better


def to_encoded(quantized: Quantized, layout: Layout, tier: Tier, dtype: str = "float32") -> Encoded:
    """The stored form of Wt-level codes (the tier's format decides it), in the stored layout."""
    return tier.stored(quantized, layout, dtype)


def encode(
    weight: np.ndarray,
    layout: Layout,
    tier: Tier,
    rounding: Rounding = RTN,
    stats: Sequence[Hessian] | None = None,
    group_size: int | None = None,
    correct: bool = True,
    search: bool = True,
) -> Encoded:
    """`weight` stored at `tier`, its codes chosen by `rounding`; produces the weight's own float type."""
    weight = np.asarray(weight)
    if not tier.quantized:
        return tier.float_copy(weight)
    dtype = weight.dtype.name if weight.dtype.kind == "f" else "float32"
    return to_encoded(quantize(weight, layout, tier, rounding, stats, group_size, correct, search), layout, tier, dtype)


def split(parts: Sequence[Encoded], layout: Layout, tier_name: str = "mixed") -> Encoded:
    """Channel groups (consecutive along the output-channel axis) joined into one weight."""
    if len(parts) == 1:
        return parts[0]
    return Encoded(
        tier_name, "split", None, layout.shape, axis=layout.perm[0], dtype=parts[0].dtype, parts=tuple(parts)
    )
