"""Would one shared statistics pass price the tiers as the per-tier passes do? (issue 32; run on demand; minutes).

Export prices each slot at each calibratable tier on that tier's uniform encoding, one sequential calibration
pass per tier (every wave's statistics collected with the earlier waves at that tier). The alternative: one pass
collecting every weight's statistics on the original model (the earlier waves left at full precision), each tier's
codes solved on those. This scores an example, prices it both ways (refinement off), and compares the prices per
tier (Spearman rank correlation, median ratio), the allocations at C, and their drift on the scoring contexts.

    python benchmarks/bench_shared_statistics.py [--examples etth1_patchtst,timesfm_etth1] [--C 4]

Writes benchmarks/results/shared-statistics.md/.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from tiers import TIERS
from tiers.quantizer import encode
from tqsdeploy.export import ExportSettings, Planner
from tqsdeploy.scoring.score import score

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def shared_pass(planner: Planner) -> None:
    """Every calibratable tier's uniform codes solved on the original model's statistics (one pass for all)."""
    encoder, rounding = planner.encoder, planner.roundings.rounding
    tiers = [t for t in planner.tiers if t.calibratable]
    codes = {t.name: {} for t in tiers}

    def every_tier(name, stats):
        for tier in tiers:
            codes[tier.name][name] = encoder._encode(name, tier, rounding, stats).compact()
        return encode(
            encoder.weights[name], encoder.layouts[name], TIERS["fp32"]
        )  # later waves see the original weights

    encoder.calibrator.run(every_tier, rounding.needs_cross)
    for tier in tiers:
        encoder._uniform[(tier.name, rounding)] = codes[tier.name]


def compare(example: str, target: float, folder: Path) -> dict:
    source = REPO / "examples" / example
    for way in ("per_tier", "shared"):
        score(source / "model.onnx", source / "contexts.npz", spec=source / "rollout.toml", out=folder / way)
    per_tier, shared = (Planner(folder / way, settings=ExportSettings(refine=0)) for way in ("per_tier", "shared"))
    shared_pass(shared)
    allocations = {"per_tier": per_tier.pricing.allocate(target), "shared": shared.pricing.allocate(target)}
    prices = {way: planner.pricing.measured() for way, planner in (("per_tier", per_tier), ("shared", shared))}
    row = {"example": example, "C": target}
    for tier in [t for t in per_tier.tiers if t.calibratable]:
        keys = {
            way: [
                planner.prices.task(slot, tier).key
                for slot in planner.cut.slots
                if slot.unit not in planner.scored.dead
            ]
            for way, planner in (("per_tier", per_tier), ("shared", shared))
        }
        a, b = (np.array([sum(prices[way][k].div_sq) for k in keys[way]]) for way in ("per_tier", "shared"))
        row[tier.name] = {
            "spearman": round(float(spearmanr(a, b)[0]), 3),
            "median_shared_over_per_tier": round(float(np.median(b / np.maximum(a, 1e-300))), 3),
        }
    row["slots_allocated_differently"] = sum(
        allocations["per_tier"].tiers[s] != allocations["shared"].tiers[s] for s in allocations["per_tier"].tiers
    )
    row["slots"] = len(per_tier.cut.slots)
    row["drift_pct_per_tier"] = per_tier.measuring.measure_tiers(
        allocations["per_tier"].tiers, per_tier.roundings.rounding
    ).worst_pct
    row["drift_pct_shared_own_codes"] = shared.measuring.measure_tiers(
        allocations["shared"].tiers, shared.roundings.rounding
    ).worst_pct
    row["drift_pct_shared_allocation_on_per_tier_codes"] = per_tier.measuring.measure_tiers(
        allocations["shared"].tiers, per_tier.roundings.rounding
    ).worst_pct
    per_tier.close(), shared.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="etth1_patchtst,timesfm_etth1")
    parser.add_argument("--C", type=float, default=4.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for example in args.examples.split(","):
            rows.append(compare(example, args.C, Path(tmp) / example))
            print(json.dumps(rows[-1]), flush=True)
    (RESULTS / "shared-statistics.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "Pricing from one shared statistics pass (the original model's statistics, every tier solved on them) against "
        "one",
        "sequential pass per tier (export's), refinement off. Spearman / median ratio: the single-slot prices of the "
        "two ways.",
        "",
        "| example | C | tier | Spearman | median shared / per-tier | slots allocated differently | drift % per-tier | "
        "drift % shared (own codes) | drift % shared allocation on per-tier codes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for tier in [k for k, v in row.items() if isinstance(v, dict)]:
            lines.append(
                f"| {row['example']} | {row['C']:g} | {tier} | {row[tier]['spearman']} | "
                f"{row[tier]['median_shared_over_per_tier']} | "
                f"{row['slots_allocated_differently']} of {row['slots']} | {row['drift_pct_per_tier']:.4g} | "
                f"{row['drift_pct_shared_own_codes']:.4g} | "
                f"{row['drift_pct_shared_allocation_on_per_tier_codes']:.4g} |"
            )
    (RESULTS / "shared-statistics.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
