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
from graph_ops.layout import Layout
from tiers.encoded import Encoded
from tiers.formats.base import Tier
from tiers.gptq import Hessian, Quantized
from tiers.grid import find_grid

METHODS = ("rtn", "gptq", "gptaq", "qep")
DEFAULT_ALPHA = {"gptaq": 0.25, "qep": 0.5}
"""GPTAQ's hard-coded α and the QEP CLI's perccorr."""

@dataclass(frozen=True)
class Rounding:
    """How codes are chosen on a tier's grid, with the official defaults."""

    method: str = "rtn"
    percdamp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    alpha: float | None = None
    """GPTAQ's α (0.25) or QEP's perccorr (0.5) when None."""
    percdampqep: float = 1.0
    qep_base: str = "gptq"
    """QEP quantizes its corrected weights with 'gptq' or 'rtn'."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown rounding '{self.method}'; choose one of {', '.join(METHODS)}")
        if self.qep_base not in ("gptq", "rtn"):
            raise ValueError(f"QEP runs on 'gptq' or 'rtn', not '{self.qep_base}'")
        if self.block_size < 1:
            raise ValueError(f"block size must be positive, not {self.block_size}")

    @property
    def needs_stats(self) -> bool:
        return self.method != "rtn"

    @property
    def needs_cross(self) -> bool:
        """Needs G = (X_fp − X̂)ᵀX̂ as well as H (full-precision inputs next to quantized-prefix ones)."""
        return self.method in ("gptaq", "qep")

    @property
    def strength(self) -> float:
        return DEFAULT_ALPHA.get(self.method, 0.0) if self.alpha is None else self.alpha


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
    grid: the same tensors, types and shapes, without the clip search (what a size needs).
    """
    if not tier.quantized:
        raise ValueError(f"tier '{tier.name}' stores floats, not codes")
    spec = tier.grid if search else replace(tier.grid, search=False)
    group = _group(layout, group_size) if tier.blockwise else -1
    wt = layout.to_wt(np.asarray(weight, np.float64))
    if stats is None or not rounding.needs_stats or not tier.calibratable or layout.perm is None:
        return solvers.rtn(wt, spec, group)
    if np.may_share_memory(wt, weight) or not wt.flags.c_contiguous:
        wt = np.array(wt, order="C")  # the solvers' own copy: they work on it in place
    rows = wt.shape[0] // len(stats)
    parts = []
    for g, part in enumerate(stats):
        block = wt[g * rows : (g + 1) * rows]
        parts.append(_method(rounding, block, part, spec, group, correct))
    return Quantized.stack(parts)


def _method(rounding: Rounding, wt, stats: Hessian, spec, group: int, correct: bool) -> Quantized:
    """`wt` is this call's own: every solver works on it in place."""
    original = np.array(wt) if spec.search else None
    if rounding.method == "qep":
        wt = solvers.qep_correct(wt, stats.H, stats.G, alpha=rounding.strength if correct else 0.0, percdampqep=rounding.percdampqep, own=True, cache=stats)
    if original is None:
        return _solve(rounding, wt, stats, spec, group)
    return _better_rows(rounding, original, wt, stats, spec, group)


def _solve(rounding: Rounding, wt, stats: Hessian, spec, group: int) -> Quantized:
    """The base solve on `wt` (QEP's already corrected), in place."""
    solver = dict(group_size=group, percdamp=rounding.percdamp, block_size=rounding.block_size, act_order=rounding.act_order, own=True, cache=stats)
    if rounding.method == "gptaq":
        return solvers.gptaq(wt, stats.H, stats.G, spec, alpha=rounding.strength, **solver)
    if rounding.method == "qep" and rounding.qep_base == "rtn":
        return solvers.rtn(wt, spec, group)
    return solvers.gptq(wt, stats.H, spec, **solver)


def _better_rows(rounding: Rounding, original, wt, stats: Hessian, spec, group: int) -> Quantized:
    """Each output channel on whichever grid, clip-searched or plain min-max, gives it the lower
    calibration objective after the solve.

    The clip search (`tiers.grid`) picks the grid that rounds the weights themselves best; a
    compensating solve then moves them, and a clipped grid can cost more than it saved: on the
    weight-tied mixer example (thin Hessians of the heads) GPTQ and QEP on searched grids drifted
    1.2-1.6x more than on min-max ones at W4 and W2. Rows are independent in every solve (each row's
    error feeds only its own later columns), so each keeps its better grid, judged by the error the
    next layer sees: ‖X̂q − X_fp·w‖, the quantized-prefix output against the full-precision layer's,
    wherever the cross statistics exist (GPTAQ, QEP). Their α (GPTAQ's 0.25, QEP's perccorr 0.5) damps
    how far a solve moves the weights, not what the result is worth: judged at QEP's α = 0.5 the
    choice took clipped grids whose outputs sit further from full precision, and uniform QEP W2 on
    lorenz96 drifted 1.09x more than on min-max grids alone over 6 calibration sets (at α = 1: 1.04x,
    and W4 0.82x). GPTQ, or a method at α = 0, compares ‖X̂(q − w)‖, so α = 0 stays exactly the base.

    A per-channel row whose search kept the min-max grid would be solved the same on both: only the
    other rows are solved again (13-20% of the INT4 rows of the ETTh1 examples are not)."""
    plain_spec = replace(spec, search=False)
    searched = _solve(rounding, np.array(wt), stats, spec, group)
    rows = _off_min_max(wt, stats, plain_spec, searched) if group <= 0 else np.arange(wt.shape[0])
    if rows.size == 0:
        return searched
    plain = _solve(rounding, wt[rows], stats, plain_spec, group)  # rows are independent in every solve
    aim = 1.0 if rounding.needs_cross and rounding.strength else 0.0
    better = solvers.second_lower(original[rows], searched.take(rows), plain, stats, aim)
    chosen = rows[better]
    for field in ("codes", "scale", "zero"):
        getattr(searched, field)[chosen] = getattr(plain, field)[better]
    return searched


def _off_min_max(wt: np.ndarray, stats: Hessian, plain_spec, searched: Quantized) -> np.ndarray:
    """The rows whose searched per-channel grid is not the min-max one. The solver fits that grid once, to
    the weight with its dead inputs zeroed (`solvers.gptq`): the min-max grid is fitted to the same rows."""
    dead = np.diag(stats.H) == 0
    if dead.any():
        wt = np.array(wt)
        wt[:, dead] = 0
    grid = find_grid(wt, plain_spec)
    return np.flatnonzero((searched.scale[:, 0] != grid.scale) | (searched.zero[:, 0] != grid.zero))


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
    return Encoded(tier_name, "split", None, layout.shape, axis=layout.perm[0], dtype=parts[0].dtype, parts=tuple(parts))
