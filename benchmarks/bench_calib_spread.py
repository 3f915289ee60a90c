"""Held-out drift of the uniform baselines over several calibration sets (run on demand; minutes).

W4 and W2 drift of a weight-reusing model can swing between nearly equal codes, so one calibration set says
little: this draws 5 random sets of 8 windows from the ETTh1 rows the example's contexts come from, adds
the example's own contexts.npz, runs `baseline` on each (with any checkout's CLI, so two versions compare
on the same sets) and prints the held-out drift, mean |candidate − original| of the standardised forecasts
over the 4-step rollout of heldout.npz (exact dequantization), as mean ± sd over the 6 sets.

    python benchmarks/bench_calib_spread.py [--cli PATH/TO/tqsdeploy] [--methods qep,gptq] [--bits 4,2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from tqsdeploy.evaluate import EvalSettings, evaluate

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tied_mixer_etth1"
DATA = REPO.parent / "shared" / "data" / "ETTh1.csv"
L, FIRST, LAST, SETS = 2048, 9472, 12160, 5
"""Context length and the window starts contexts.npz spans (targets in the test rows)."""


def calibration_sets(folder: Path) -> list[Path]:
    """5 seeded random sets of 8 windows (seeds 100..104), then the example's own contexts."""
    norm = json.loads((EXAMPLE / "norm.json").read_text())
    raw = np.loadtxt(DATA, delimiter=",", skiprows=1, usecols=range(1, 8), dtype=np.float64)
    data = ((raw - np.array(norm["mean"])) / np.array(norm["std"])).astype(np.float32)
    paths = []
    for k in range(SETS):
        starts = np.random.default_rng(100 + k).integers(FIRST, LAST, 8)
        paths.append(folder / f"calib{k}.npz")
        np.savez(paths[-1], x=np.stack([data[s : s + L].T for s in starts]))
    return paths + [EXAMPLE / "contexts.npz"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", default=shutil.which("tqsdeploy") or "tqsdeploy", help="the tqsdeploy executable of the checkout to measure")
    parser.add_argument("--methods", default="qep,gptq,gptaq")
    parser.add_argument("--bits", default="4,2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sets = calibration_sets(folder)
        for method in args.methods.split(","):
            for bits in args.bits.split(","):
                drifts = []
                for k, calib in enumerate(sets):
                    out = folder / f"{method}{bits}.{k}.onnx"
                    subprocess.run([args.cli, "baseline", str(EXAMPLE / "model.onnx"), "--method", method, "--bits", bits, "--calib", str(calib), "-o", str(out)],
                                   check=True, capture_output=True, cwd=folder)
                    report = evaluate(out, EXAMPLE / "model.onnx", EXAMPLE / "heldout.npz", spec=EXAMPLE / "rollout.toml", settings=EvalSettings(exact=True))
                    drifts.append(report["outputs"]["forecast"]["vs_reference"]["mae"])
                values = " ".join(f"{d:.4f}" for d in drifts)
                print(f"{method} W{bits}: held-out drift {np.mean(drifts):.4f} ± {np.std(drifts):.4f} (sets: {values})", flush=True)


if __name__ == "__main__":
    main()
