"""The models an export considers: uniform models (every slot at one tier, rounded by one method) and mixed ones
(an allocation, as priced or calibrated as itself), each built by the one encoder and measured once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from tiers import METHODS, TIERS, Encoded, Rounding, Tier
from tqsdeploy.encoding.choices import AnyRounding, drift_order
from tqsdeploy.export.allocate import Allocation
from tqsdeploy.export.job import ExportJob
from tqsdeploy.export.measuring import Measuring
from tqsdeploy.export.sizing import Sizing
from tqsdeploy.sweep import Drift

MIXED = "mixed"
AS_PRICED = f"{MIXED}, as priced"
CALIBRATED = f"{MIXED}, calibrated as allocated"
KINDS = {
    MIXED: "each slot at the tier the allocation chose for it",
    "as priced": "each slot's codes taken from its tier's uniform model, as its price was measured",
    "calibrated as allocated": "the codes fitted again with every other slot already at its own tier, as the file "
    "would run",
    "with ": "the allocation with the named tier added below the lowest one",
    "uniform": "every slot at one tier, rounded by the method named",
}
"""What the words of a candidate's label mean (`explain`): the models an export compares, in a newcomer's words."""


OTHER_METHOD_MARGIN = 0.02
"""On the scoring contexts, a uniform model rounded by another calibrated method than the export's own (GPTAQ in a
QEP export) ships ahead of the export's own best candidate only when it drifts at least this share less. Both are
fitted to those windows, and between two such fits their order there is mostly calibration noise (measured:
benchmarks/results/calib_spread.md, "A uniform model of another method")."""


def mixed_with(tier: str) -> str:
    """The mixed candidate allocated with `tier` added below the lowest tier."""
    return f"{MIXED} with {tier}, calibrated as allocated"


def explain(labels) -> str:
    """What each kind of candidate among `labels` is, once: 'mixed: ...; as priced: ...; uniform: ...'."""
    words = [word for word in KINDS if any(word in label for label in labels)]
    return "; ".join(f"{word.strip() if word != 'with ' else 'with TIER'}: {KINDS[word]}" for word in words)


def about(label: str) -> str:
    """One candidate's label in words, for its record."""
    return "; ".join(KINDS[word] for word in KINDS if word in label)


@dataclass
class Candidate:
    """One model considered for a target: its encodings, size and measured drift."""

    label: str
    allocation: Allocation
    encodings: dict[str, Encoded]
    drift: Drift | None = None
    cached: tuple[str, Rounding] | None = None
    """For a uniform model: the encoder's (tier, rounding) cache its encodings are."""
    calibrated: bool = False
    """The mixed allocation calibrated as itself (its encodings are the encoder's mixed cache)."""
    rounding: str = ""
    """How its codes were chosen: a uniform model's method (and grid), or the export's for a mixed one ('auto': per
    tier)."""
    remake: Callable[[], dict[str, Encoded]] | None = None
    """Makes its encodings again after a large model dropped them while other candidates were calibrated
    (`Comparison.candidates`): from the encoder, whose uniform encodings the run's cache holds."""

    def record(self) -> dict:
        return {
            "label": self.label,
            "about": about(self.label),
            "objective": self.allocation.objective,
            "rounding": self.rounding,
            "compression": round(self.allocation.compression, 6),
            "drift_pct": None if self.drift is None else self.drift.worst_pct,
            "relative_rms": None if self.drift is None else self.drift.relative_rms,
        }


def rank(candidate: Candidate) -> tuple[float, float]:
    """How candidates are ordered, best first: worst output drift, then relative RMS drift."""
    return drift_order(candidate.drift)


def preferred(found: list[Candidate], own_method: str) -> list[Candidate]:
    """`found` best first on the scoring contexts: by drift (`rank`), but a uniform model of another calibrated
    method than the export's own (`own_method`) goes ahead of the export's best candidate only when it drifts
    `OTHER_METHOD_MARGIN` less; a failed measurement (NaN) never goes ahead. An export of `auto` (which measured
    every method to choose) or `rtn` (which compares no calibrated model) orders by drift alone."""
    ordered = sorted(found, key=rank)
    if own_method not in METHODS or not METHODS[own_method].stats:
        return ordered

    def other(candidate: Candidate) -> bool:
        method = candidate.rounding.split("/")[0]  # a uniform model's method and grid ('gptaq/min-max')
        return candidate.cached is not None and method != own_method and method in METHODS and METHODS[method].stats

    own = next((c for c in ordered if not other(c)), None)
    if own is None or not math.isfinite(own.drift.worst_pct):
        return ordered
    ahead = [c for c in ordered if other(c) and c.drift.worst_pct < (1 - OTHER_METHOD_MARGIN) * own.drift.worst_pct]
    return [*ahead, own, *(c for c in ordered if c is not own and all(c is not a for a in ahead))]


def _drift_key(tier: Tier, rounding: Rounding) -> tuple[str, Rounding]:
    """A uniform model's key among the measured ones: a tier that takes no calibration is rounded to nearest by any "
    "method."""
    return tier.name, rounding if tier.calibratable else Rounding()


class UniformModels:
    """Every slot at one tier, codes chosen by one rounding: the one way a uniform model is built (the fallback,
    `export --uniform`, the frontier's baselines, the choice of a tier's rounding), each measured once."""

    def __init__(self, job: ExportJob, sizing: Sizing, measuring: Measuring):
        self.job, self.sizing, self.measuring = job, sizing, measuring
        self._drifts: dict[tuple[str, Rounding], Drift] = {}

    def candidate(self, tier: Tier, rounding: Rounding, target: float | None) -> Candidate:
        allocation = self.sizing.uniform(tier.name, self.job.tiers, target)
        encodings = self.job.encoder.uniform(tier, rounding)
        method = rounding.label if tier.calibratable else "rtn"
        key = _drift_key(tier, rounding)
        if key not in self._drifts:
            self._drifts[key] = self.measuring.measure(encodings)
        return Candidate(
            f"uniform {tier.name} {method}",
            allocation,
            encodings,
            self._drifts[key],
            (tier.name, rounding),
            False,
            method,
        )

    def measured(self, tier: Tier, rounding: Rounding) -> bool:
        return _drift_key(tier, rounding) in self._drifts

    def remember(self, tier: Tier, rounding: Rounding, drift: Drift) -> None:
        """The uniform model's drift, measured by an earlier export of the run (`Roundings`' cached choice)."""
        self._drifts[_drift_key(tier, rounding)] = drift


class MixedModels:
    """A mixed allocation's encodings, as priced (assembled from the uniform encodings) or calibrated as itself."""

    def __init__(self, job: ExportJob, measuring: Measuring):
        self.job, self.measuring = job, measuring
        self._calibrated_drifts: dict[tuple[tuple[str, str], ...], Drift] = {}

    def encodings(self, allocation: Allocation, rounding: AnyRounding, calibrated: bool = False) -> dict[str, Encoded]:
        if calibrated:
            return self.job.encoder.calibrated(self.job.cut.slots, allocation.tiers, rounding)
        return self.job.encoder.assemble(self.job.cut.slots, allocation.tiers, rounding)

    @staticmethod
    def calibrates(allocation: Allocation, rounding: AnyRounding) -> bool:
        """The mixed model ships calibrated as itself (a calibration pass on its own tiers), not as priced."""
        return rounding.needs_stats and any(TIERS[t].calibratable for t in allocation.tiers.values())

    def calibrated_drift(self, allocation: Allocation, rounding: AnyRounding) -> Drift:
        """Drift of `allocation` calibrated as itself (a calibration pass), measured once per allocation."""
        key = tuple(sorted(allocation.tiers.items()))
        if key not in self._calibrated_drifts:
            self._calibrated_drifts[key] = self.measuring.measure(self.encodings(allocation, rounding, calibrated=True))
        return self._calibrated_drifts[key]

    def release_calibrated(self, allocation: Allocation) -> None:
        """A large model keeps only the calibrated codes it may still ship (up to a byte per weight each)."""
        if self.job.scored.one_session:
            self.job.encoder.forget_mixed(allocation.tiers)

    def calibrated_candidate(self, label: str, allocation: Allocation, rounding: AnyRounding) -> Candidate:
        return Candidate(
            label,
            allocation,
            self.encodings(allocation, rounding, calibrated=True),
            self.calibrated_drift(allocation, rounding),
            calibrated=True,
            rounding=rounding.method,
        )


def relabelled(candidate: Candidate, solver: str) -> Candidate:
    """`candidate` with its allocation's solver named `solver` (a uniform model shipped in a mixed one's place)."""
    return replace(candidate, allocation=replace(candidate.allocation, solver=solver))
