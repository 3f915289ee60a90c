"""Held-out drift of small LSTM/GRU forecasters under uniform baselines and TQS-PTQ (run on demand; minutes).

Recurrent weights (an RNN/GRU/LSTM's W and R) were once always rounded to nearest; they are now calibrated like
any other weight. This measures what that does end to end, with the CLI a user types, on the models that
benchmarks/recurrent/build_models.py writes (both torch exporters). For each NAME.onnx in --models that has
NAME.ctx.npz and NAME.heldout.npz: `score` on the scoring windows; uniform `baseline` rtn/gptq/qep at 4 and
2 bits calibrated on the same windows over the score run's rollout (--spec run/rollout.toml); `export --C 4`
and `--C 8`; then `eval` of every file on the held-out windows (--no-latency): drift of the first output vs
the original (MAE / mean |reference|, %) and degradation vs the truth (MAE vs truth over the original's, %).
Deterministic: drift does not depend on machine load. The code measured is whatever `python -m tqsdeploy`
imports (set PYTHONPATH to compare checkouts); commands run in --work, never in a repository root (whose code
`python -m` would import first).

    python benchmarks/bench_recurrent.py --models DIR --out results.json --label "abc1234, what it is" [--table t.md]

Runs accumulate in --out by label (a rerun replaces its label's run); with two runs the table is before -> after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINES = [(method, bits) for bits in (4, 2) for method in ("rtn", "gptq", "qep")]
TARGETS = (4, 8)
LIBRARY = ("tqsdeploy", "graph_ops", "tiers", "runtimes")
"""The library code whose last commit names what was measured (a checkout's HEAD may be a later tests-only commit)."""
COLUMNS = [f"{method}{bits}" for method, bits in BASELINES] + [f"C{c}" for c in TARGETS]


def tqsdeploy(args: list[str], cwd: Path, log: Path) -> str | None:
    """Run one CLI command in cwd; None on success, else the last line it wrote (the error)."""
    with open(log, "w") as handle:
        done = subprocess.run(
            [sys.executable, "-m", "tqsdeploy", *args], cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, check=False
        )
    if done.returncode == 0:
        return None
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def code_under_test(cwd: Path) -> dict:
    """Where the tqsdeploy that the commands import lives, its checkout's HEAD, the last commit that changed its
    library code, and whether that code has uncommitted changes (so a wrong PYTHONPATH, or a result of
    uncommitted code, shows)."""
    probe = "import pathlib, tqsdeploy; print(pathlib.Path(tqsdeploy.__file__).resolve().parents[1])"
    root = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()
    git = ["git", "-C", root]
    commit = subprocess.run(
        [*git, "log", "-1", "--format=%h", "--", *LIBRARY], capture_output=True, text=True, check=False
    ).stdout.strip()
    head = subprocess.run(
        [*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    changes = subprocess.run(
        [*git, "status", "--porcelain", "--", *LIBRARY], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "root": root,
        "head": head or None,
        "library_commit": commit or None,
        "library_uncommitted_changes": bool(changes),
    }


def held_out(report: Path) -> dict:
    """What the table needs from an eval report, of the first output (the forecast the rollout feeds back)."""
    data = json.loads(report.read_text())
    first = next(iter(data["outputs"].values()))
    return {
        "drift_pct": first["vs_reference"]["drift_pct"],
        "degradation_vs_truth_pct": first.get("vs_truth", {}).get("degradation_pct"),
        "compression": data["compression"],
        "candidate_weight_bits": data["candidate_weight_bits"],
        "candidate_file_bytes": data["candidate_file_bytes"],
    }


def bench_model(model: Path, work: Path) -> dict:
    """Every baseline and export of one model, each evaluated on its held-out windows."""
    name = model.stem
    folder = model.parent
    contexts, heldout, truth = (folder / f"{name}.{tag}.npz" for tag in ("ctx", "heldout", "heldout_truth"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result: dict = {"model": name, "files": {}, "errors": {}}
    error = tqsdeploy(
        ["score", str(model), "--contexts", str(contexts), "--out", "run", "--fresh"], work, work / "score.log"
    )
    if error:
        result["errors"]["score"] = error
        return result
    spec = str(work / "run" / "rollout.toml")
    commands = {
        f"{method}{bits}": [
            "baseline",
            str(model),
            "--method",
            method,
            "--bits",
            str(bits),
            "--calib",
            str(contexts),
            "--spec",
            spec,
        ]
        for method, bits in BASELINES
    }
    commands |= {f"C{c}": ["export", str(model), "--run", "run", "--C", str(c)] for c in TARGETS}
    for what, command in commands.items():
        error = tqsdeploy([*command, "-o", f"{what}.onnx", "--force"], work, work / f"{what}.log")
        if not error:
            evaluate = [
                "eval",
                f"{what}.onnx",
                "--reference",
                str(model),
                "--contexts",
                str(heldout),
                "--spec",
                spec,
                "--no-latency",
                "--report",
                f"heldout_{what}",
            ]
            evaluate += ["--truth", str(truth)] if truth.exists() else []
            error = tqsdeploy(evaluate, work, work / f"heldout_{what}.log")
        if error:
            result["errors"][what] = error
        else:
            result["files"][what] = held_out(work / f"heldout_{what}.json")
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def cell(run: dict, model: str, what: str, key: str = "drift_pct", digits: str = ".3g") -> str:
    found = run["models"].get(model, {}).get("files", {}).get(what)
    return "failed" if found is None else format(found[key], digits)


def table(runs: list[dict]) -> str:
    """Held-out drift % per model and file (one run, or the first -> the last), then each file's compression."""
    first, last = runs[0], runs[-1]
    labels = " -> ".join(f"{run['label']}" for run in (runs if len(runs) == 1 else (first, last)))
    header = "| model | " + " | ".join(COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS) + "\n"
    lines = [f"Held-out drift % of the first output vs the original ({labels}):\n", header]
    for model in last["models"]:
        cells = [
            cell(last, model, what) if len(runs) == 1 else f"{cell(first, model, what)} -> {cell(last, model, what)}"
            for what in COLUMNS
        ]
        lines.append(f"| {model} | " + " | ".join(cells) + " |\n")
    lines += [f"\nCompression (reference weight bits / candidate weight bits; {last['label']}):\n\n", header]
    for model in last["models"]:
        lines.append(
            f"| {model} | " + " | ".join(cell(last, model, what, "compression", ".2f") for what in COLUMNS) + " |\n"
        )
    return "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        type=Path,
        required=True,
        help="folder of NAME.onnx with NAME.ctx.npz, NAME.heldout.npz (and NAME.heldout_truth.npz)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="results JSON; runs of other labels already in it are kept"
    )
    parser.add_argument("--label", required=True, help="names the code under test, e.g. 'abc1234, what it changed'")
    parser.add_argument(
        "--work",
        type=Path,
        default=REPO / "tqs-bench-recurrent",
        help="folder for score runs and quantized files (one subfolder per label)",
    )
    parser.add_argument("--only", default=None, help="comma-separated model names (default: every model in --models)")
    parser.add_argument("--table", type=Path, default=None, help="also write the Markdown table here")
    args = parser.parse_args()
    if os.environ.get("PYTHONPATH"):  # the commands run in --work: a relative entry would point there
        os.environ["PYTHONPATH"] = os.pathsep.join(
            str(Path(entry).resolve()) for entry in os.environ["PYTHONPATH"].split(os.pathsep) if entry
        )
    slug = "".join(c if c.isalnum() else "-" for c in args.label.split(",")[0]).strip("-")
    work = args.work.resolve() / slug
    models = sorted(
        p
        for p in args.models.resolve().glob("*.onnx")
        if (p.parent / f"{p.stem}.ctx.npz").exists() and (p.parent / f"{p.stem}.heldout.npz").exists()
    )
    if args.only:
        models = [p for p in models if p.stem in args.only.split(",")]
    work.mkdir(parents=True, exist_ok=True)
    run = {
        "label": args.label,
        "code": code_under_test(work),
        "python": sys.executable,
        "pythonpath": os.environ.get("PYTHONPATH"),
        "models_folder": str(args.models.resolve()),
        "date": time.strftime("%Y-%m-%d"),
        "models": {},
    }
    print(
        f"{args.label}: tqsdeploy from {run['code']['root']} (library code of {run['code']['library_commit']})",
        flush=True,
    )
    for model in models:
        result = bench_model(model, work / model.stem)
        run["models"][model.stem] = result
        drifts = ", ".join(f"{what} {found['drift_pct']:.4g}" for what, found in result["files"].items())
        print(f"{model.stem}: {drifts}" + (f"; errors: {result['errors']}" if result["errors"] else ""), flush=True)
    runs = [
        r for r in (json.loads(args.out.read_text())["runs"] if args.out.exists() else []) if r["label"] != args.label
    ] + [run]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "benchmarks/bench_recurrent.py", "runs": runs}, indent=1) + "\n")
    markdown = table(runs)
    if args.table:
        args.table.write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
