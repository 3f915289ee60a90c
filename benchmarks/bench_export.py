"""Time to result: `export` against the uniform QEP baseline, per model (run on demand; minutes).

For every bundled example (examples/*/model.onnx), a BERT-size encoder (22.6M parameters, 128 tokens,
random weights, built here with numpy + onnx by benchmarks/bench_score.py) and, with `--stack-gb G`, a
MatMul stack of G GB (benchmarks/bench_memory.py's generator): `tqsdeploy score` with its defaults, then
`tqsdeploy export --C C --verbose` (C = 4 for the examples, 8 for the BERT and the stack) and `tqsdeploy
baseline --method qep` at the uniform grid nearest that C (32 / bits: W8 for C 4, W4 for C 8) on the same
contexts and rollout, each a process of its own timed from outside. Reported: export wall, the ONNX Runtime
time inside it (calibration and measurement rollouts), its solver and statistics time (the allocation
JSON's `profile_s`), and the ratio export / baseline. Then (issue 57) a second `export` of the same run at
another C (1.5 C), which reads what the first left in the run's cache (second / first), and for the bundled
examples `tqsdeploy frontier --C 2,4,8` with RTN, GPTQ, GPTAQ and QEP at W8/W4/W2 (its held-out windows where the
example has them) in a folder of its own, against the score plus one export (`--no-frontier`: skipped).
With `--largest` (the default for the examples), an `export` at the largest reachable C on the same score
run too, with its pricing rollouts (the lines it added to the run's measured.jsonl) and its ratio to the first.

    python benchmarks/bench_export.py [--models etth1_patchtst,...,bert] [--stack-gb 1.0] [--out export-quiet]
                                      [--note TEXT] [--changed TEXT] [--provider cuda] [--arrays numpy]
                                      [--solver-dtype float64] [--results-dir DIR] [--no-frontier]
                                      [--largest examples|all|none]

`--provider` runs score's and export's measurement rollouts on that ONNX Runtime provider (calibration rollouts
and the baseline stay on the CPU); `--arrays numpy` sets TQS_ARRAYS=numpy, keeping the solvers' products on the
host where CuPy would take them to a GPU (tiers.solver_backend).

Writes benchmarks/results/export-quiet.json and .md (`--out STEM`: STEM.json/.md, e.g. export-stack-1gb for
`--models stack --stack-gb 1`) and appends the run to results/history/STEM.md (record.py; not with `--results-dir`).
The machine this runs on is usually shared: ratios matter more than absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_score import bert  # noqa: E402
from record import append_history  # noqa: E402

from tiers.solver_backend import SOLVER_DTYPES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EVERY_EXAMPLE = tuple(sorted(p.parent.name for p in (REPO / "examples").glob("*/model.onnx")))
BERT_TOKENS = 128
TQS = [sys.executable, "-m", "tqsdeploy"]


def case(name: str, tmp: Path, stack_gb: float) -> dict:
    """Model, contexts and rollout spec (files), and the compression target."""
    if name == "bert":
        model = bert(tmp / "bert.onnx", tokens=BERT_TOKENS)
        np.savez(
            tmp / "bert_ctx.npz", ids=np.random.default_rng(1).integers(0, 30522, (2, 1, BERT_TOKENS)).astype(np.int64)
        )
        (tmp / "bert.toml").write_text('steps = 1\ntrajectory = ["hidden"]\n')
        return {"model": model, "contexts": tmp / "bert_ctx.npz", "spec": tmp / "bert.toml", "C": 8}
    if name == "stack":
        from bench_memory import build as build_stack

        folder = tmp / "stack"
        folder.mkdir(exist_ok=True)
        model = build_stack(folder, stack_gb)
        width = onnx.load(str(model), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[1].dim_value
        np.savez(tmp / "stack_ctx.npz", x=np.random.default_rng(1).standard_normal((2, 4, width)).astype(np.float32))
        (tmp / "stack.toml").write_text('steps = 2\ntrajectory = ["y"]\n[[feedback]]\noutput = "y"\ninput = "x"\n')
        return {"model": model, "contexts": tmp / "stack_ctx.npz", "spec": tmp / "stack.toml", "C": 8}
    folder = REPO / "examples" / name
    csv = not (folder / "contexts.npz").exists() and (folder / "score.csv").exists()  # patchtst_dynamo: CSVs, no spec
    return {
        "model": folder / "model.onnx",
        "contexts": folder / ("score.csv" if csv else "contexts.npz"),
        "spec": folder / "rollout.toml" if (folder / "rollout.toml").exists() else None,
        "C": 4,
    }


def rollout_flags(item: dict) -> list[str]:
    """--spec where the example has a rollout spec (else the rollout is found from the graph, as a user's is)."""
    return [] if item["spec"] is None else ["--spec", str(item["spec"])]


EXTRA_ENV: dict[str, str] = {}
"""Set by `--arrays` for every timed process."""


def timed(command: list[str], log: Path) -> float:
    """Wall seconds of one process; its output appended to `log`, a failure raised with the log's tail."""
    started = time.perf_counter()
    with log.open("a") as sink:
        done = subprocess.run(
            command,
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TQS_PROGRESS_INTERVAL": "60", **EXTRA_ENV},
        )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, command))} exited {done.returncode}:\n" + "\n".join(log.read_text().splitlines()[-15:])
        )
    return seconds


def priced(run: Path) -> int:
    """Pricing rollouts the run's price list holds (one line each)."""
    path = run / "measured.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def export(item: dict, run: Path, target: float, out: Path, on: list[str], log: Path) -> tuple[float, dict, int]:
    """(wall seconds, allocation record, pricing rollouts added) of `export --C target --verbose` on `run`."""
    before = priced(run)
    seconds = timed(
        [
            *TQS,
            "export",
            str(item["model"]),
            "--run",
            str(run),
            "--C",
            repr(target),
            "-o",
            str(out),
            "--force",
            "--verbose",
            *on,
        ],
        log,
    )
    record = json.loads(out.with_suffix(".allocation.json").read_text())
    return seconds, record, priced(run) - before


def largest(item: dict, run: Path) -> float:
    """The largest C the run's units reach with export's default tiers (what `export --C 1000` names)."""
    from tqsdeploy.export import Planner

    with Planner(run, item["model"]) as planner:
        return planner.max_compression() * (1 - 1e-6)


def bench(
    name: str, tmp: Path, stack_gb: float, provider: str = "cpu", logs: Path | None = None, at_largest: bool = False
) -> dict:
    item = case(name, tmp, stack_gb)
    run, log = tmp / f"{name}_run", (logs or tmp) / f"{name}.log"
    common = ["--contexts", str(item["contexts"]), *rollout_flags(item)]
    on = ["--provider", provider]
    score_s = timed([*TQS, "score", str(item["model"]), *common, "--out", str(run), *on], log)
    export_s, record, rollouts = export(item, run, item["C"], tmp / f"{name}.export.onnx", on, log)
    profile = record.get("profile_s", {})
    most = {}
    if at_largest:
        top = largest(item, run)
        top_s, top_record, top_rollouts = export(item, run, top, tmp / f"{name}.largest.onnx", on, log)
        most = {
            "largest_C": round(top, 4),
            "largest_export_s": round(top_s, 2),
            "largest_profile_s": top_record.get("profile_s", {}),
            "largest_pricing_rollouts": top_rollouts,
            "largest_over_first": round(top_s / export_s, 2),
            "largest_drift_pct": top_record.get("drift_pct"),
        }
    bits = min((8, 4, 2), key=lambda b: abs(32 / b - item["C"]))
    baseline_s = timed(
        [
            *TQS,
            "baseline",
            str(item["model"]),
            "--method",
            "qep",
            "--bits",
            str(bits),
            "--calib",
            str(item["contexts"]),
            *rollout_flags(item),
            "-o",
            str(tmp / f"{name}.qep-w{bits}.onnx"),
            "--force",
        ],
        log,
    )
    second_C = round(min(1.5 * item["C"], largest(item, run)), 4)  # another C, within reach (dwconv stops at 5.44)
    second_s = timed(
        [
            *TQS,
            "export",
            str(item["model"]),
            "--run",
            str(run),
            "--C",
            repr(second_C),
            "-o",
            str(tmp / f"{name}.second.onnx"),
            "--force",
            "--verbose",
            *on,
        ],
        log,
    )
    second = json.loads((tmp / f"{name}.second.allocation.json").read_text())
    frontier_s = frontier(name, item, tmp, log, on) if FRONTIER and name in EVERY_EXAMPLE else None
    params = sum(
        int(np.prod(t.dims)) for t in onnx.load(str(item["model"]), load_external_data=False).graph.initializer
    )
    return {
        "model": name,
        "params": params,
        "C": item["C"],
        "score_s": round(score_s, 2),
        "export_s": round(export_s, 2),
        "export_inside_s": profile.get("total"),
        "onnxruntime_s": round(profile.get("calibration_rollouts", 0.0) + profile.get("measurement_rollouts", 0.0), 2),
        "solver_s": profile.get("solver"),
        "statistics_s": profile.get("statistics"),
        "profile_s": profile,
        "pricing_rollouts": rollouts,
        "solver_arrays": record.get("solver_arrays"),
        "solver_dtype": record.get("solver_dtype"),
        "baseline": f"qep W{bits}",
        "baseline_s": round(baseline_s, 2),
        "ratio": round(export_s / baseline_s, 2),
        "shipped": record.get("shipped"),
        "compression": round(record.get("compression", 0.0), 3),
        "drift_pct": record.get("drift_pct"),
        "second_C": second_C,
        "second_export_s": round(second_s, 2),
        "second_ratio": round(second_s / export_s, 2),
        "second_profile_s": second.get("profile_s", {}),
        "second_cache": second.get("cache"),
        "frontier_s": None if frontier_s is None else round(frontier_s, 2),
        "frontier_ratio": None if frontier_s is None else round(frontier_s / (score_s + export_s), 2),
        **most,
    }


FRONTIER = True
"""Time a frontier of every bundled example (`--no-frontier`: not)."""
FRONTIER_TARGETS = "2,4,8"


def frontier(name: str, item: dict, tmp: Path, log: Path, on: list[str]) -> float:
    """Wall seconds of `tqsdeploy frontier --C 2,4,8` (every baseline method at W8/W4/W2, the default) in a folder
    of its own: it scores again, as a user's first frontier does."""
    folder = REPO / "examples" / name
    held_out = (
        ["--eval-contexts", str(folder / "heldout.npz"), "--eval-truth", str(folder / "heldout_truth.npz")]
        if (folder / "heldout.npz").exists()
        else ["--eval-contexts", str(folder / "heldout.csv")]
        if (folder / "heldout.csv").exists()
        else []
    )
    truth = ["--truth", str(folder / "truth.npz")] if (folder / "truth.npz").exists() else []
    command = [
        *TQS,
        "frontier",
        str(item["model"]),
        "--contexts",
        str(item["contexts"]),
        *rollout_flags(item),
        *truth,
        *held_out,
        "--C",
        FRONTIER_TARGETS,
        "--out",
        str(tmp / f"{name}_frontier"),
    ]
    return timed(command, log)


NAMED = ("etth1_patchtst", "dwconv_mixer_etth1", "bert", "stack")
"""Models a history row names one by one; the others of a run show as ranges."""


def headline(rows: list[dict]) -> str:
    """A history row's numbers: export s (solver s), ratio and drift per named model, the other models' ranges."""
    done = [r for r in rows if "error" not in r]
    named = [r for r in done if r["model"] in NAMED or len(done) <= 3]
    parts = [
        f"{r['model']} {r['export_s']:.1f} s (solver {r['solver_s']:.1f}) {r['ratio']:.2f}x, "
        f"drift {r['drift_pct']:.4g}%, second {r['second_ratio']:.2f}x"
        + (f", frontier {r['frontier_ratio']:.2f}x" if r.get("frontier_ratio") is not None else "")
        for r in named
    ]
    rest = [r for r in done if r not in named]
    if rest:
        seconds, ratios = [r["export_s"] for r in rest], [r["ratio"] for r in rest]
        parts.append(
            f"{len(rest)} others {min(seconds):.1f}-{max(seconds):.1f} s, {min(ratios):.2f}-{max(ratios):.2f}x"
        )
    top = [r["largest_over_first"] for r in done if "largest_over_first" in r]
    if top:
        parts.append(f"largest C {min(top):.2f}-{max(top):.2f}x the first export")
    failed = [r["model"] for r in rows if "error" in r]
    return "; ".join(parts + ([f"failed: {', '.join(failed)}"] if failed else []))


def largest_table(rows: list[dict]) -> list[str]:
    """The exports at the largest reachable C, each after the first export of its score run (its price list kept)."""
    if not rows:
        return []
    lines = [
        "",
        "At the largest reachable C, exported next on the same score run (its price list kept, as a user's second "
        "export finds it); ratio = this export / the first (`--C 4`, BERT `--C 8`):",
        "",
        "| model | largest C | export s | inside s | solver s | statistics s | calibration rollouts s | "
        "measurement rollouts s | other s | pricing rollouts | ratio | drift % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["largest_profile_s"]
        lines.append(
            f"| {r['model']} | {r['largest_C']:g} | {r['largest_export_s']:.1f} | {p.get('total', 0):.1f} | "
            f"{p.get('solver', 0):.1f} | {p.get('statistics', 0):.1f} | {p.get('calibration_rollouts', 0):.1f} | "
            f"{p.get('measurement_rollouts', 0):.1f} | {p.get('other', 0):.1f} | {r['largest_pricing_rollouts']} | "
            f"{r['largest_over_first']:.2f} | {r['largest_drift_pct']:.4g} |"
        )
    return lines


def write(rows: list[dict], stem: str, note: str, results: Path = RESULTS) -> None:
    results.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "note": note,
        "provider": rows[0].get("provider", "cpu") if rows else "cpu",
        "arrays": EXTRA_ENV.get("TQS_ARRAYS", "auto"),
        "solver_dtype": EXTRA_ENV.get("TQS_SOLVER_DTYPE", "default"),
    }
    (results / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Export time to result, {meta['date']}, {meta['machine']}, {meta['cpus']} CPUs. {note}",
        "",
        "Each figure is one process timed from outside (wall seconds); 'inside' is export's own total, split by its "
        "`profile_s`",
        "(ONNX Runtime = calibration + measurement rollouts). Ratio = export / `baseline --method qep` at the nearest "
        "uniform grid. Second: `export --C 1.5C` of the same run after the first (its cache warm); frontier: "
        f"`frontier --C {FRONTIER_TARGETS}` with every baseline method at W8/W4/W2 (held-out windows where the "
        "example has them), scoring in a folder of its own.",
        "",
        "| model | params | C | export s | inside s | ONNX Runtime s | solver s | statistics s | pricing rollouts "
        "| baseline | baseline s "
        "| ratio | shipped | drift % | second C | second s | second / first | score s | frontier s "
        "| frontier / (score + export) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | failed: {r['error'].splitlines()[0][:120]} |" + " |" * 16)
            continue
        front = "- | -" if r.get("frontier_s") is None else f"{r['frontier_s']:.1f} | {r['frontier_ratio']:.2f}"
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['C']} | {r['export_s']:.1f} | {r['export_inside_s']:.1f} | "
            f"{r['onnxruntime_s']:.1f} | {r['solver_s']:.1f} | "
            f"{r['statistics_s']:.1f} | {r.get('pricing_rollouts', '')} | {r['baseline']} | {r['baseline_s']:.1f} | "
            f"{r['ratio']:.2f} | {r['shipped']} | "
            f"{r['drift_pct']:.4g} | {r['second_C']:g} | {r['second_export_s']:.1f} | {r['second_ratio']:.2f} | "
            f"{r['score_s']:.1f} | {front} |"
        )
    lines += largest_table([r for r in rows if "largest_C" in r])
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=",".join(EVERY_EXAMPLE + ("bert",)), help="examples, 'bert', 'stack' (comma-separated)"
    )
    parser.add_argument("--stack-gb", type=float, default=0.0, help="also time a MatMul stack of this many GB")
    parser.add_argument(
        "--out",
        default="export-quiet",
        help="result file stem under benchmarks/results/ (its history: history/STEM.md)",
    )
    parser.add_argument("--note", default="", help="said beside the machine (e.g. that it was shared)")
    parser.add_argument("--changed", default="", help="what changed since the last run: the history row's last cell")
    parser.add_argument(
        "--provider",
        default="cpu",
        help="ONNX Runtime provider of score's and export's measurement rollouts (cpu, cuda)",
    )
    parser.add_argument(
        "--arrays",
        default="auto",
        choices=("auto", "numpy"),
        help="numpy: keep the solvers' products on the host (TQS_ARRAYS=numpy)",
    )
    parser.add_argument(
        "--solver-dtype",
        default=None,
        choices=SOLVER_DTYPES,
        help="TQS_SOLVER_DTYPE for every timed process (default: unset, the solvers' default)",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where STEM.json/.md are written")
    parser.add_argument(
        "--largest",
        default="examples",
        choices=("examples", "all", "none"),
        help="also export at the largest reachable C on each score run: the examples only (default), every model, "
        "or none",
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="keep each model's score/export/baseline output here (default: a temporary folder)",
    )
    parser.add_argument("--no-frontier", action="store_true", help="skip the frontier column (minutes per example)")
    args = parser.parse_args()
    global FRONTIER
    FRONTIER = not args.no_frontier
    if args.arrays == "numpy":
        EXTRA_ENV["TQS_ARRAYS"] = "numpy"
    if args.solver_dtype:
        EXTRA_ENV["TQS_SOLVER_DTYPE"] = args.solver_dtype
    names = [n for n in args.models.split(",") if n] + (
        ["stack"] if args.stack_gb > 0 and "stack" not in args.models else []
    )
    rows = []
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                at_largest = args.largest == "all" or (args.largest == "examples" and name in EVERY_EXAMPLE)
                rows.append(
                    {
                        **bench(name, Path(tmp), args.stack_gb, args.provider, args.logs, at_largest),
                        "provider": args.provider,
                    }
                )
            except RuntimeError as exc:
                rows.append({"model": name, "error": str(exc)})
            print(json.dumps(rows[-1]), flush=True)
    write(rows, args.out, args.note, args.results_dir)
    append_history(args.out, headline(rows), args.changed, args.results_dir)


if __name__ == "__main__":
    main()
