"""Would measuring the grid choice per model fix uniform QEP on lorenz96? (run on demand; ~3 min per grid)

For each of bench_calib_spread.py's 20 calibration sets (seeds 100..118 and contexts.npz): uniform QEP on today's
per-channel grid choice and on min-max grids alone (benchmarks/cli_min_max_grids.py, 95188a9's grids), each
model's drift on the rollout of its own calibration set, and the held-out drift of whichever of the two drifted
less there: a choice made by measurement on the calibration data, with no held-out data in it.

    python benchmarks/bench_grid_pick.py [--example lorenz96] [--bits 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calib_spread import MIN_PARAMS, REPO, etth1_sets, held_out_drift, trajectory_sets  # noqa: E402

from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate  # noqa: E402

CLIS = {
    "today": [sys.executable, "-m", "tqsdeploy"],
    "min-max": [sys.executable, str(REPO / "benchmarks" / "cli_min_max_grids.py")],
}


def calibration_drift(candidate: Path, example: Path, contexts: Path) -> float:
    """Mean drift % over the trajectory outputs on the calibration set's own rollout, exact dequantization."""
    report = evaluate(
        candidate, example / "model.onnx", contexts, spec=example / "rollout.toml", settings=EvalSettings(exact=True)
    )
    drifts = [o["vs_reference"]["drift_pct"] for o in report["outputs"].values()]
    return sum(drifts) / len(drifts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="lorenz96")
    parser.add_argument("--bits", default="2")
    args = parser.parse_args()
    example = REPO / "examples" / args.example
    extra = ["--min-params", str(MIN_PARAMS[args.example])] if args.example in MIN_PARAMS else []
    held, calib = {k: [] for k in CLIS}, {k: [] for k in CLIS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        drawn = (etth1_sets if (example / "norm.json").exists() else trajectory_sets)(folder, example, 19)
        for k, contexts in enumerate(drawn + [example / "contexts.npz"]):
            for label, cli in CLIS.items():
                out = folder / f"{label}{k}.onnx"
                subprocess.run(
                    [
                        *cli,
                        "baseline",
                        str(example / "model.onnx"),
                        "--method",
                        "qep",
                        "--bits",
                        args.bits,
                        "--calib",
                        str(contexts),
                        *extra,
                        "-o",
                        str(out),
                        "--force",
                    ],
                    check=True,
                    capture_output=True,
                    cwd=REPO,
                )
                held[label].append(held_out_drift(out, example))
                calib[label].append(calibration_drift(out, example, contexts))
            print(
                f"set {k}: "
                + ", ".join(
                    f"{label} held-out {held[label][-1]:.4g} calibration {calib[label][-1]:.4g}" for label in CLIS
                ),
                flush=True,
            )
    today, plain = np.array(held["today"]), np.array(held["min-max"])
    picked = np.where(np.array(calib["today"]) <= np.array(calib["min-max"]), today, plain)
    difference = picked - plain
    print(
        f"{args.example} W{args.bits} held-out drift %: today {today.mean():.4g}, min-max {plain.mean():.4g}, picked "
        f"{picked.mean():.4g} "
        f"(today's on {int((picked == today).sum())} of {len(today)}); picked - min-max {difference.mean():+.3g} ± "
        f"{difference.std(ddof=1):.2g}, "
        f"t = {difference.mean() / (difference.std(ddof=1) / np.sqrt(len(difference))):.2f}"
    )


if __name__ == "__main__":
    main()
