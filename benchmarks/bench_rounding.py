"""`export --rounding auto` against `--rounding qep`: held-out drift and export wall time (run on demand; minutes).

For each example, a copy of its frontier score run (tqs-frontier/<example>/score, made by run_frontiers.py) with no
measured prices, so each export prices from scratch; each export runs as the command line runs it, and its model is
evaluated on the example's held-out windows against the original (drift: MAE / mean |reference|, percent).

    python benchmarks/bench_rounding.py [--examples etth1_patchtst:4,3.73 ...] [--runs DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"etth1_patchtst": (4.0, 3.73), "tied_mixer_etth1": (4.0, 3.05)}
"""--C 4 and the size of uniform INT8 (the frontier's W8 point) per example."""


def heldout_drift(model: Path, folder: Path) -> float:
    from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate

    report = evaluate(
        model,
        folder / "model.onnx",
        folder / "heldout.npz",
        spec=folder / "rollout.toml",
        truth=folder / "heldout_truth.npz",
        settings=EvalSettings(latency=None),
    )
    return max(o["vs_reference"]["drift_pct"] for o in report["outputs"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=",".join(TARGETS))
    parser.add_argument("--targets", default=None, help="Only these --C values (comma-separated).")
    parser.add_argument("--runs", type=Path, default=REPO / "tqs-frontier", help="Folder holding <example>/score runs.")
    parser.add_argument("--out", type=Path, default=REPO / "tqs-bench-rounding")
    args = parser.parse_args()
    rows = []
    for example in args.examples.split(","):
        folder = REPO / "examples" / example
        for target in [
            t for t in TARGETS[example] if args.targets is None or t in {float(v) for v in args.targets.split(",")}
        ]:
            for rounding in ("qep", "auto"):
                work = args.out / example / f"{rounding}-C{target:g}"
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(args.runs / example / "score", work / "run")
                (work / "run" / "measured.jsonl").unlink(missing_ok=True)
                started, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tqsdeploy",
                        "export",
                        str(folder / "model.onnx"),
                        "--run",
                        str(work / "run"),
                        "--C",
                        f"{target:g}",
                        "--rounding",
                        rounding,
                        "-o",
                        str(work / "model.onnx"),
                    ],
                    cwd=REPO,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                wall = time.perf_counter() - started
                used = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu_s = (
                    used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
                )  # less swayed than wall by other work on a shared machine
                record = json.loads((work / "model.allocation.json").read_text())
                row = {
                    "example": example,
                    "C": target,
                    "rounding": rounding,
                    "export_s": round(wall, 1),
                    "export_cpu_s": round(cpu_s, 1),
                    "timings_s": record["timings_s"],
                    "heldout_drift_pct": heldout_drift(work / "model.onnx", folder),
                    "scoring_drift_pct": record["drift_pct"],
                    "shipped": record["shipped"],
                    "rounding_by_tier": record["rounding_by_tier"],
                    "rounding_choice": record.get("rounding_choice", {}),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.jsonl", "a") as log:
        for row in rows:
            log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
