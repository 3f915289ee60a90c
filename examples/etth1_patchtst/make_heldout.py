"""Held-out windows for `tqsdeploy frontier --eval-contexts`: 8 test-split
windows placed halfway between the scoring windows of contexts.npz, so an
allocation that overfits the scoring contexts shows. numpy only.

    python examples/etth1_patchtst/make_heldout.py [--data ../shared/data/ETTh1.csv]
"""

import argparse
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[2] / "shared" / "data" / "ETTh1.csv"
TEST, L, H, STEPS, N = (11520, 14400), 512, 96, 8, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    norm = json.loads((HERE / "norm.json").read_text())
    raw = np.loadtxt(args.data, delimiter=",", skiprows=1, usecols=range(1, 8), dtype=np.float64)
    data = ((raw - np.array(norm["mean"])) / np.array(norm["std"])).astype(np.float32)
    scoring = np.linspace(TEST[0], TEST[1] - L - STEPS * H, N).astype(int)
    starts = (scoring[:-1] + np.diff(scoring) // 2).tolist()
    starts.append(int(scoring[-1] - np.diff(scoring)[-1] // 4))
    contexts = np.stack([data[s : s + L].T for s in starts])
    truth = np.stack([[data[s + L + k * H : s + L + (k + 1) * H].T for k in range(STEPS)] for s in starts])
    np.savez(HERE / "heldout.npz", x=contexts)
    np.savez(HERE / "heldout_truth.npz", y=truth)
    print(f"held-out window starts {starts}")


if __name__ == "__main__":
    main()
