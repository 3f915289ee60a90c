"""Exports calibrated on too few windows, judged on windows they did not see (run on demand; minutes).

A MatMul stack (benchmarks/bench_memory.py's generator: random weights, `LAYERS` layers of WIDTH²) is scored on a few
windows, each a 2-step rollout fed back, so every weight sees 2 x WINDOWS input vectors against WIDTH inputs: far
fewer than a calibrated solve needs (`tiers.hessian.shrinkage`). Inputs are white (identity covariance: nothing to
learn, rounding to nearest is the best a solve can do in expectation) or structured (a power-law spectrum in a
random basis: the rows carry information). Per case: `export --C C` at default settings and with `--rounding rtn`
from one score run, with every CLI given, each export's drift on the scoring windows and on 32 other windows of the
same distribution (`eval --exact`).

    python benchmarks/bench_thin.py [--cases iid:1024:4:4,corr:1024:4:64] [--cli new=PATH,old=PATH] [--C 8]

A case is KIND:WIDTH:LAYERS:WINDOWS. With more than one CLI the score run is the first one's, and every export passes
--fresh (the run's cache does not know which checkout wrote it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calib_spread import command_of  # noqa: E402
from bench_memory import build  # noqa: E402

HELD_OUT = 32
SPEC = 'steps = 2\ntrajectory = ["y"]\n[[feedback]]\noutput = "y"\ninput = "x"\n'


def draw(kind: str, width: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` windows [count, 1, width]: white, or a fixed power-law spectrum (exponent -0.75) in a fixed random
    basis, scaled to the white inputs' norm."""
    if kind == "iid":
        return rng.standard_normal((count, 1, width)).astype(np.float32)
    basis = np.linalg.qr(np.random.default_rng(7).standard_normal((width, width)))[0]
    scales = (1.0 + np.arange(width)) ** -0.75
    x = (rng.standard_normal((count, width)) * scales) @ basis.T * (np.sqrt(width) / np.linalg.norm(scales))
    return x.reshape(count, 1, width).astype(np.float32)


def worst_drift(report: Path) -> float:
    outputs = json.loads(report.read_text())["outputs"].values()
    return max(o["vs_reference"]["drift_pct"] for o in outputs)


def run_case(case: str, clis: dict[str, str], target: str, folder: Path) -> list[dict]:
    kind, width, layers, windows = case.split(":")
    width, layers, windows = int(width), int(layers), int(windows)
    root = folder / case.replace(":", "_")
    root.mkdir(parents=True, exist_ok=True)
    model = build(root, layers * width * width * 4 / 1e9, width=width)
    rng = np.random.default_rng(1)
    np.savez(root / "contexts.npz", x=draw(kind, width, windows, rng))
    np.savez(root / "heldout.npz", x=draw(kind, width, HELD_OUT, rng))
    (root / "rollout.toml").write_text(SPEC)
    first = next(iter(clis.values()))
    run = root / "run"
    spec = ["--spec", str(root / "rollout.toml")]
    subprocess.run(
        [*command_of(first), "score", str(model), "--contexts", str(root / "contexts.npz"), *spec, "-o", str(run)],
        check=True,
        capture_output=True,
    )
    rows = []
    for label, cli in clis.items():
        for rounding in ("default", "rtn"):
            out = root / f"{label}.{rounding}.onnx"
            flags = ["--rounding", "rtn"] if rounding == "rtn" else []
            flags += ["--fresh"] if len(clis) > 1 else []
            subprocess.run(
                [*command_of(cli), "export", str(model), "--run", str(run), "--C", target, *flags, "-o", str(out)],
                check=True,
                capture_output=True,
            )
            drifts = {}
            for split, contexts in (("scoring", "contexts.npz"), ("held-out", "heldout.npz")):
                report = root / f"{label}.{rounding}.{split}"
                subprocess.run(
                    [*command_of(cli), "eval", str(out), "-r", str(model), "-c", str(root / contexts), *spec]
                    + ["--exact", "--no-latency", "--report", str(report)],
                    check=True,
                    capture_output=True,
                )
                drifts[split] = worst_drift(Path(f"{report}.json"))
            shipped = json.loads(out.with_suffix(".allocation.json").read_text())["shipped"]
            row = {"case": case, "cli": label, "rounding": rounding, **drifts, "shipped": shipped}
            print(
                f"{case} {label} {rounding}: scoring {drifts['scoring']:.4g}%, held-out {drifts['held-out']:.4g}% "
                f"({shipped})",
                flush=True,
            )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="iid:1024:4:4,corr:1024:4:4,corr:1024:4:64,corr:1024:4:300")
    parser.add_argument("--cli", default=f"new={Path(sys.executable).parent / 'tqsdeploy'}")
    parser.add_argument("--C", default="8")
    parser.add_argument("--keep", default=None, help="a folder to work in and keep (default: a temporary one)")
    args = parser.parse_args()
    clis = dict(item.split("=", 1) for item in args.cli.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        rows = [row for case in args.cases.split(",") for row in run_case(case, clis, args.C, folder)]
    print("\n| case (kind:width:layers:windows) | CLI | rounding | scoring drift % | held-out drift % | shipped |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['case']} | {row['cli']} | {row['rounding']} | {row['scoring']:.4g} | {row['held-out']:.4g} | "
            f"{row['shipped']} |"
        )


if __name__ == "__main__":
    main()
