"""What joint refinement (`export --refine`) buys on each example (run on demand; minutes).

Reuses the score runs that `benchmarks/run_frontiers.py` leaves in tqs-frontier/<example>/score (scoring afresh, with
the frontier's settings, where they are absent), exports TQS-PTQ (default settings otherwise) at the committed
frontier's matched W2/W4/W8 points (benchmarks/results/frontier/<example>/frontier.csv) with --refine 0 and the
default, and evaluates both on the held-out windows (scoring windows where an example has none).

    python benchmarks/bench_refine.py [--examples etth1_patchtst,...] [--rounds 0,2]

Writes benchmarks/results/refine.md.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import polars as pl
from run_frontiers import MIN_PARAMS

from tqsdeploy.evaluation.evaluate import evaluate
from tqsdeploy.export import ExportSettings, Planner
from tqsdeploy.scoring.score import score
from tqsdeploy.units import UnitSelection

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _matched_targets(example: str) -> list[tuple[str, float]]:
    """The frontier's TQS-PTQ targets matched to the QEP baselines (just below each W grid point)."""
    frame = pl.read_csv(RESULTS / "frontier" / example / "frontier.csv", infer_schema_length=None)
    rows = frame.filter(
        (pl.col("family") == "tqs") & pl.col("setting").str.contains("@W") & pl.col("setting").str.contains("@")
    )
    found = {}
    for setting, target in rows.select("setting", "target_C").unique().iter_rows():
        grid = setting.split("@")[1]
        found.setdefault(grid, target)
    return sorted(found.items())


def _drift(path: Path, model: Path, folder: Path, spec: Path) -> tuple[str, float]:
    contexts = folder / "heldout.npz" if (folder / "heldout.npz").exists() else folder / "contexts.npz"
    report = evaluate(path, model, contexts, spec=spec)
    worst = max(o["vs_reference"]["drift_pct"] for o in report["outputs"].values())
    return ("held-out" if contexts.name == "heldout.npz" else "scoring"), worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="etth1_patchtst,era5_emulator,lorenz96")
    parser.add_argument("--rounds", default="0,2")
    args = parser.parse_args()
    rounds = [int(r) for r in args.rounds.split(",")]
    lines = [
        f"# Joint refinement (`export --refine N`)\n\n{time.strftime('%Y-%m-%d')}, {platform.platform()}. Made by "
        "`python benchmarks/bench_refine.py`. Worst output drift from the FP32 model (%, lower is better), ONNX "
        "Runtime default "
        "mode, at the frontier's points matched to the uniform QEP baselines; export seconds include pricing each slot "
        "once "
        "when a round count is first used (prices are cached in the score run).\n"
    ]
    for example in args.examples.split(","):
        folder = REPO / "examples" / example
        run = REPO / "tqs-frontier" / example / "score"
        model = folder / "model.onnx"
        if not (run / "scores.parquet").exists():
            score(
                model,
                folder / "contexts.npz",
                spec=folder / "rollout.toml",
                out=run,
                selection=UnitSelection(min_params=MIN_PARAMS.get(example, UnitSelection().min_params)),
            )
        lines += [
            f"\n## {example}\n",
            "| point | target C | " + " | ".join(f"refine {r}: C, drift %, seconds" for r in rounds) + " |",
            "|---|---|" + "---|" * len(rounds),
        ]
        planners = {r: Planner(run, model, replace(ExportSettings(), refine=r)) for r in rounds}
        with tempfile.TemporaryDirectory() as tmp:
            for grid, target in _matched_targets(example):
                cells = []
                for r, planner in planners.items():
                    started = time.perf_counter()
                    outcome = planner.export(target, Path(tmp) / f"{grid}.r{r}.onnx")
                    seconds = time.perf_counter() - started
                    split, drift = _drift(Path(tmp) / f"{grid}.r{r}.onnx", model, folder, run / "rollout.toml")
                    cells.append(f"{outcome.compression:.3f}, {drift:.4g} ({split}), {seconds:.1f}")
                    print(example, grid, r, cells[-1], outcome.shipped, flush=True)
                lines.append(f"| {grid} | {target:.3f} | " + " | ".join(cells) + " |")
        for planner in planners.values():
            planner.close()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "refine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
