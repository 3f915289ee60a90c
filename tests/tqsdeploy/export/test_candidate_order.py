"""Which candidate ships on the scoring contexts: the least drifting, but a uniform model of another calibrated
method than the export's own must win by `OTHER_METHOD_MARGIN` (both were fitted to those windows)."""

from __future__ import annotations

import math

from tiers import Rounding
from tqsdeploy.export.allocate import Allocation
from tqsdeploy.export.candidates import OTHER_METHOD_MARGIN, Candidate, preferred, rank
from tqsdeploy.rollout.engine import Drift
from tqsdeploy.size import SizeBudget


def candidate(label: str, drift_pct: float) -> Candidate:
    """A candidate as the export makes it: a uniform one ('uniform TIER METHOD[/GRID]') names the encoder's (tier,
    rounding) it is and its method and grid; a mixed one has the export's rounding (QEP here)."""
    allocation = Allocation({"w": "int4-asym"}, {"w": 4 * 64}, SizeBudget(32 * 64), 8.0, "test", "trajectory")
    drift = Drift(drift_pct / 100, {"y": drift_pct}, [drift_pct])
    words = label.split()
    if words[0] != "uniform":
        return Candidate(label, allocation, {}, drift, rounding="qep")
    method, _, grids = words[2].partition("/")
    rounding = Rounding(method, grids=grids or "per-channel")
    return Candidate(label, allocation, {}, drift, cached=(words[1], rounding), rounding=words[2])


def labels(found: list[Candidate], own: str = "qep") -> list[str]:
    return [c.label for c in preferred(found, own)]


def test_another_method_within_the_margin_ships_after_the_exports_own_best():
    edge = 1 - OTHER_METHOD_MARGIN / 2  # ahead by half the margin
    found = [candidate("mixed, as priced", 1.0), candidate("uniform int2-asym gptaq/min-max", edge)]
    assert labels(found) == ["mixed, as priced", "uniform int2-asym gptaq/min-max"]


def test_another_method_past_the_margin_ships_first():
    found = [
        candidate("mixed, calibrated as allocated", 1.0),
        candidate("uniform int8-asym gptaq", 0.9),
        candidate("uniform int8-asym qep", 1.2),
    ]
    assert labels(found) == ["uniform int8-asym gptaq", "mixed, calibrated as allocated", "uniform int8-asym qep"]


def test_the_exports_own_uniform_model_and_rtn_are_ranked_by_drift_alone():
    """RTN fits no window, so winning there is no fit's luck; the export's own uniform model is its own method."""
    found = [
        candidate("mixed, as priced", 1.0),
        candidate("uniform int4-asym qep/min-max", 0.995),
        candidate("uniform int4-asym rtn", 0.99),
    ]
    assert labels(found) == ["uniform int4-asym rtn", "uniform int4-asym qep/min-max", "mixed, as priced"]


def test_auto_and_rtn_exports_order_by_drift_and_a_failed_measurement_never_leads():
    found = [candidate("mixed, as priced", 1.0), candidate("uniform int2-asym gptaq", 0.995)]
    assert labels(found, "auto") == labels(found, "rtn") == ["uniform int2-asym gptaq", "mixed, as priced"]
    failed = [candidate("mixed, as priced", math.nan), candidate("uniform int2-asym gptaq", 0.5)]
    assert labels(failed) == [c.label for c in sorted(failed, key=rank)]  # its own failed: drift alone decides
    broken = [candidate("mixed, as priced", 1.0), candidate("uniform int2-asym gptaq", math.nan)]
    assert labels(broken)[0] == "mixed, as priced"
