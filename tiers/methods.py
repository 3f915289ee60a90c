"""The rounding methods: one entry each, the one list the CLI's choices and help and the reports' labels read.

A method's solver lives in `tiers.gptq` and its dispatch in `tiers.quantizer`; everything else about it is its
entry here: what it needs from calibration, its default strength, which methods it makes pointless to compare,
and whether `--rounding auto` tries it. A new method is its solver, its dispatch and one entry in `METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping


@dataclass(frozen=True)
class Method:
    """One rounding method: how codes are chosen on a tier's grid."""

    name: str
    """What `--rounding` and `baseline --method` take."""
    label: str
    """What reports call it (the frontier's rows: 'GPTQ W4')."""
    stats: bool = True
    """Needs the calibration statistics of the weight's inputs (one Hessian per row group); False: rounds to nearest."""
    cross: bool = False
    """Needs G = (X_fp − X̂)ᵀX̂ as well as H (full-precision inputs next to quantized-prefix ones)."""
    alpha: float = 0.0
    """Its strength where `Rounding.alpha` is None: GPTAQ's hard-coded α, the QEP CLI's perccorr."""
    dominates: tuple[str, ...] = ()
    """Methods whose uniform baseline never drifted less than this one's at the same grid: an export with this
    method does not compare them (each would cost a calibration pass to lose; `encoding.encoder.comparison_methods`)."""
    outrun_by: tuple[str, float] | None = None
    """(rival, factor): this method's uniform model is measured only while the rival's at the same grid drifted
    at most `factor` x the best candidate so far (`encoding.encoder.can_still_win`)."""
    auto_order: int | None = None
    """Its place among the methods `--rounding auto` tries on a calibratable tier (the first listed wins a tie);
    None: not tried."""


OUTRUN_FACTOR = 1.5
"""QEP's uniform drift past this many times the best candidate rules GPTAQ's and RTN's uniform models out: either
would need less than 1/1.5 of QEP's drift at the same grid to win, and the least measured is 0.84x (GPTAQ, lorenz96
INT2 on min-max grids; docs/baselines.md, "Which methods an export compares")."""

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("rtn", "RTN", stats=False, outrun_by=("qep", OUTRUN_FACTOR)),
        Method("gptq", "GPTQ", auto_order=2),
        Method("gptaq", "GPTAQ", cross=True, alpha=0.25, outrun_by=("qep", OUTRUN_FACTOR), auto_order=1),
        Method("qep", "QEP", cross=True, alpha=0.5, dominates=("gptq",), auto_order=0),
    )
}
"""Built-in methods by name, in the order the CLI lists them; why each `dominates` and `outrun_by` holds:
docs/baselines.md, "Which methods an export compares"."""


class _Labels(Mapping):
    """Method name -> report label, read off `METHODS` as it is now."""

    def __getitem__(self, name: str) -> str:
        return METHODS[name].label

    def __iter__(self) -> Iterator[str]:
        return iter(METHODS)

    def __len__(self) -> int:
        return len(METHODS)


METHOD_LABELS: Mapping[str, str] = _Labels()
"""What reports call each method ('gptq' -> 'GPTQ')."""


def auto_methods() -> tuple[str, ...]:
    """The methods `--rounding auto` tries, in its order (`Method.auto_order`)."""
    tried = [m for m in METHODS.values() if m.auto_order is not None]
    return tuple(m.name for m in sorted(tried, key=lambda m: m.auto_order))
