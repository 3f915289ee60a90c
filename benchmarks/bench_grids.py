"""Symmetric vs asymmetric integer grids, and letting the allocator choose per unit (run on demand; minutes).

For every example: the uniform W8/W4/W2 models on the symmetric (INT codes,
what TensorRT runs) and the asymmetric (UINT codes + zero points) grid, each
rounded to nearest and with QEP; then TQS-PTQ just below the W4 and W2 sizes
with asymmetric tiers only (the default) and with both grids on offer, so the
measured objective picks the grid per slot. Drift is the mean |difference
from the FP32 model| relative to its mean |output|, in percent, over the full
rollout, on the held-out windows (the scoring windows when an example has
none). Writes benchmarks/results/grids.md.

    python benchmarks/bench_grids.py [--examples etth1_patchtst,...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_PARAMS = {"era5_emulator": 256, "lorenz96": 256}


def _drift(report: dict) -> float:
    return max(o["vs_reference"]["drift_pct"] for o in report["outputs"].values())


def main() -> None:
    from tqsdeploy import ScoreSettings, UnitSelection, score
    from tqsdeploy.evaluation.evaluate import evaluate
    from tqsdeploy.export import ExportSettings, Planner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="etth1_patchtst,era5_emulator,lorenz96")
    args = parser.parse_args()
    lines = [
        "# Integer grids: symmetric vs asymmetric",
        "",
        "Made by `python benchmarks/bench_grids.py`. Drift from the FP32 model (%, lower is better) on held-out "
        "windows",
        "(scoring windows where an example has none), ONNX Runtime default mode.",
        "",
    ]
    for example in args.examples.split(","):
        folder = REPO / "examples" / example
        heldout = folder / "heldout.npz"
        windows = heldout if heldout.exists() else folder / "contexts.npz"
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            score(
                folder / "model.onnx",
                folder / "contexts.npz",
                spec=folder / "rollout.toml",
                out=tmp / "run",
                selection=UnitSelection(min_params=MIN_PARAMS.get(example, 1024)),
                settings=ScoreSettings(),
            )
            planner = Planner(tmp / "run")
            uniform = {}
            for bits in (8, 4, 2):
                for grid in ("int{b}", "int{b}-asym"):
                    tier = grid.format(b=bits)
                    for rounding in ("rtn", "qep"):
                        outcome = planner.export(
                            None, tmp / f"{tier}-{rounding}.onnx", uniform_tier=tier, rounding=rounding
                        )
                        report = evaluate(
                            outcome.path, folder / "model.onnx", windows, spec=tmp / "run" / "rollout.toml"
                        )
                        uniform[tier, rounding] = (outcome.compression, _drift(report))
            mixed = {}
            for tiers, label in (
                (None, "asymmetric tiers (default)"),
                (("fp32", "fp16", "bf16", "int8", "int8-asym", "int4", "int4-asym", "int2", "int2-asym"), "both grids"),
            ):
                chooser = Planner(tmp / "run", settings=ExportSettings(tiers=tiers))
                for bits in (4, 2):
                    target = 0.99 * uniform[f"int{bits}-asym", "qep"][0]
                    outcome = chooser.export(target, tmp / f"mixed-{bits}-{len(mixed)}.onnx")
                    report = evaluate(outcome.path, folder / "model.onnx", windows, spec=tmp / "run" / "rollout.toml")
                    chosen = outcome.table["tier"].to_list()
                    symmetric = sum(
                        1 for t in chosen if t.startswith("int") and not t.endswith("-asym") and t != "int1"
                    )
                    mixed[label, bits] = (outcome.compression, _drift(report), symmetric, len(chosen), outcome.shipped)
                chooser.close()
            planner.close()
        lines += [
            f"## {example} ({'held-out' if heldout.exists() else 'scoring'} windows)",
            "",
            "| uniform | C | RTN drift % | QEP drift % |",
            "|---|---|---|---|",
        ]
        for bits in (8, 4, 2):
            for tier in (f"int{bits}", f"int{bits}-asym"):
                c, rtn = uniform[tier, "rtn"]
                lines.append(f"| {tier} | {c:.3f} | {rtn:.4g} | {uniform[tier, 'qep'][1]:.4g} |")
        lines += [
            "",
            "| TQS-PTQ (QEP) | just below | C | drift % | symmetric slots / slots | shipped |",
            "|---|---|---|---|---|---|",
        ]
        for (label, bits), (c, drift, symmetric, slots, shipped) in mixed.items():
            lines.append(f"| {label} | W{bits} | {c:.3f} | {drift:.4g} | {symmetric} / {slots} | {shipped} |")
        lines.append("")
        print("\n".join(lines[-20:]), flush=True)
    target = REPO / "benchmarks" / "results" / "grids.md"
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
