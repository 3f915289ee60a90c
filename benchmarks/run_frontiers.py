"""The compression frontier of every bundled example (run on demand; minutes).

Runs `tqsdeploy frontier` on each example with its truth and held-out windows into tqs-frontier/<example>/ and copies
report.md, report.html, the plots and frontier.csv into benchmarks/results/frontier/<example>/.

    python benchmarks/run_frontiers.py [--examples etth1_patchtst,...]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_PARAMS = {"lorenz96": 256, "era5_emulator": 256}  # include the 320- and 288-weight input/output convs
EXTRA = {
    "etth1_patchtst": ["--variable-axis", "0"],
    "lorenz96": ["--variable-axis", "1", "--min-params", str(MIN_PARAMS["lorenz96"])],
    "era5_emulator": ["--min-params", str(MIN_PARAMS["era5_emulator"])],
    "tied_mixer_etth1": ["--variable-axis", "0"],
    "dwconv_mixer_etth1": ["--variable-axis", "0"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--examples",
        default="etth1_patchtst,era5_emulator,lorenz96,tied_mixer_etth1,pangu_lorenz96,timesfm_etth1,era5_downscale,"
        "dwconv_mixer_etth1",
    )
    args = parser.parse_args()
    for example in args.examples.split(","):
        folder = Path("examples") / example
        work = REPO / "tqs-frontier" / example  # kept (git-ignored): the score run resumes next time
        command = [
            sys.executable,
            "-m",
            "tqsdeploy",
            "frontier",
            str(folder / "model.onnx"),
            "--contexts",
            str(folder / "contexts.npz"),
            "--spec",
            str(folder / "rollout.toml"),
            "--truth",
            str(folder / "truth.npz"),
            "--out",
            str(work),
            *EXTRA.get(example, []),
        ]
        if (folder / "heldout.npz").exists():
            command += [
                "--eval-contexts",
                str(folder / "heldout.npz"),
                "--eval-truth",
                str(folder / "heldout_truth.npz"),
            ]
        subprocess.run(command, cwd=REPO, check=True)
        target = REPO / "benchmarks" / "results" / "frontier" / example
        target.mkdir(parents=True, exist_ok=True)
        for path in work.iterdir():
            if path.suffix in (".md", ".png", ".csv", ".html"):
                shutil.copy(path, target / path.name)
        print(f"{example}: wrote {target}")


if __name__ == "__main__":
    main()
