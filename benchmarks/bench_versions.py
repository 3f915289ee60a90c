"""Uniform baselines of two checkouts on every example's held-out windows (run on demand; minutes).

A regression in a rounding method shows as held-out drift of the same command in two versions. This runs
`tqsdeploy baseline MODEL --method M --bits B --calib contexts.npz` with each checkout's CLI (the command a
user types; each version calibrates as it does by default) and evaluates every file with this checkout's
`evaluate` in exact dequantization on the example's held-out windows and rollout spec, so only the codes
differ. Prints a table and writes benchmarks/results/versions.csv and .md.

    python benchmarks/bench_versions.py --old /path/to/old/checkout/.venv/bin/tqsdeploy
        [--methods qep] [--bits 4,2] [--stem versions]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import polars as pl

from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate

REPO = Path(__file__).resolve().parents[1]
MIN_PARAMS = {"lorenz96": 256, "era5_emulator": 256}  # as run_frontiers.py: the small convs are quantized too


def held_out_drift(candidate: Path, folder: Path) -> float:
    """Mean drift % over the trajectory outputs on heldout.npz, exact dequantization."""
    report = evaluate(
        candidate,
        folder / "model.onnx",
        folder / "heldout.npz",
        spec=folder / "rollout.toml",
        settings=EvalSettings(exact=True),
    )
    drifts = [o["vs_reference"]["drift_pct"] for o in report["outputs"].values()]
    return sum(drifts) / len(drifts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the tqsdeploy executable of the older checkout")
    parser.add_argument(
        "--new", default=shutil.which("tqsdeploy") or "tqsdeploy", help="the tqsdeploy executable of this checkout"
    )
    parser.add_argument("--old-label", default="old")
    parser.add_argument(
        "--examples", default=",".join(sorted(p.parent.name for p in (REPO / "examples").glob("*/heldout.npz")))
    )
    parser.add_argument("--methods", default="qep")
    parser.add_argument("--bits", default="4,2")
    parser.add_argument("--stem", default="versions", help="results file names: benchmarks/results/STEM.csv and .md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for example in args.examples.split(","):
            folder = REPO / "examples" / example
            for method in args.methods.split(","):
                for bits in args.bits.split(","):
                    row = {"example": example, "method": method, "bits": int(bits)}
                    for label, cli in ((args.old_label, args.old), ("new", args.new)):
                        out = Path(tmp) / f"{example}.{method}{bits}.{label}.onnx"
                        command = [
                            cli,
                            "baseline",
                            str(folder / "model.onnx"),
                            "--method",
                            method,
                            "--bits",
                            bits,
                            "--calib",
                            str(folder / "contexts.npz"),
                            "-o",
                            str(out),
                        ]
                        command += ["--min-params", str(MIN_PARAMS[example])] if example in MIN_PARAMS else []
                        subprocess.run(command, check=True, capture_output=True, cwd=tmp)
                        row[f"drift_pct_{label}"] = held_out_drift(out, folder)
                    print(row, flush=True)
                    rows.append(row)
    frame = pl.DataFrame(rows).with_columns(
        (pl.col("drift_pct_new") / pl.col(f"drift_pct_{args.old_label}")).alias("ratio")
    )
    results = REPO / "benchmarks" / "results"
    frame.write_csv(results / f"{args.stem}.csv")
    header = (
        f"| example | method | bits | held-out drift % {args.old_label} | held-out drift % new | new / old |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['example']} | {r['method']} | W{r['bits']} | {r[f'drift_pct_{args.old_label}']:.4g} | "
        f"{r['drift_pct_new']:.4g} | {r['ratio']:.3f} |"
        for r in frame.iter_rows(named=True)
    ]
    (results / f"{args.stem}.md").write_text(__doc__.splitlines()[0] + "\n\n" + header + "\n".join(lines) + "\n")
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
