"""Channel-group prices shared from their unit's rollout against exact ones (run on demand; an hour or more).

For every example with held-out windows: `tqsdeploy score` as `run_frontiers.py` scores it, then `tqsdeploy
export --group-prices exact` and `--group-prices shared` at the uniform INT8, INT4 and INT2 sizes (the
frontier's W8/W4/W2 points), at C 4 and at the largest reachable C, each on a copy of the score run without its
price list (so each counts and times all its pricing rollouts), and `tqsdeploy eval`'s drift on the held-out
windows. Reported per point: held-out drift of both (worst output), their ratio, pricing rollouts and export
seconds.

    python benchmarks/bench_group_prices.py [--examples tied_mixer_etth1,...] [--note TEXT]

Rows land in tqs-bench-group-prices/rows.jsonl as they finish (a rerun skips those done); the tables go to
benchmarks/results/group-prices.md/.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_frontiers import MIN_PARAMS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "tqs-bench-group-prices"
RESULTS = REPO / "benchmarks" / "results"
TQS = [sys.executable, "-m", "tqsdeploy"]
EXAMPLES = (
    "etth1_patchtst",
    "era5_emulator",
    "lorenz96",
    "tied_mixer_etth1",
    "pangu_lorenz96",
    "timesfm_etth1",
    "era5_downscale",
    "dwconv_mixer_etth1",
)
MODES = ("exact", "shared")


def run(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as sink:
        done = subprocess.run(
            [str(c) for c in command], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=os.environ
        )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n" + "\n".join(log.read_text().splitlines()[-8:]))
    return time.perf_counter() - started


def targets(model: Path, run_dir: Path) -> dict[str, float]:
    """The uniform INT8/INT4/INT2 sizes, C 4 and the largest reachable C, close ones kept once."""
    from tqsdeploy.export import Planner

    with Planner(run_dir, model) as planner:
        found = {f"W{t[3]}": planner.comparison.uniform(t).compression for t in ("int8-asym", "int4-asym", "int2-asym")}
        found["C4"] = 4.0
        found["max"] = planner.max_compression() * (1 - 1e-6)
    kept: dict[str, float] = {}
    for label, value in sorted(found.items(), key=lambda item: item[1]):
        if not any(abs(value / other - 1) < 0.002 for other in kept.values()):
            kept[label] = value
    return kept


def heldout_drift(candidate: Path, folder: Path) -> dict[str, float]:
    from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate

    report = evaluate(
        candidate,
        folder / "model.onnx",
        folder / "heldout.npz",
        spec=folder / "rollout.toml",
        settings=EvalSettings(bootstrap=100),
    )
    return {name: out["vs_reference"]["drift_pct"] for name, out in report["outputs"].items() if "vs_reference" in out}


def one(example: str, label: str, target: float, mode: str, score_dir: Path) -> dict:
    folder = REPO / "examples" / example
    work = WORK / example / f"{label}-{mode}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(
        score_dir, work / "run", ignore=shutil.ignore_patterns("measured.jsonl", ".measured.lock", "export-*")
    )
    out = work / "model.onnx"
    seconds = run(
        [
            *TQS,
            "export",
            folder / "model.onnx",
            "--run",
            work / "run",
            "--C",
            repr(target),
            "--group-prices",
            mode,
            "-o",
            out,
            "--force",
            "--verbose",
        ],
        work / "export.log",
    )
    record = json.loads((work / "model.allocation.json").read_text())
    rollouts = len((work / "run" / "measured.jsonl").read_text().splitlines())
    drift = heldout_drift(out, folder)
    return {
        "example": example,
        "point": label,
        "target": target,
        "mode": mode,
        "export_s": round(seconds, 2),
        "profile_s": record.get("profile_s"),
        "pricing_rollouts": rollouts,
        "slots": len(record.get("tiers") or []),
        "compression": record["compression"],
        "scoring_drift_pct": record["drift_pct"],
        "shipped": record["shipped"],
        "heldout_drift_pct": drift,
        "heldout_worst_pct": max(drift.values()),
    }


def bench(example: str, done: set) -> list[dict]:
    folder = REPO / "examples" / example
    score_dir = WORK / example / "score"
    if not (score_dir / "run.json").exists():
        extra = ["--min-params", str(MIN_PARAMS[example])] if example in MIN_PARAMS else []
        run(
            [
                *TQS,
                "score",
                folder / "model.onnx",
                "--contexts",
                folder / "contexts.npz",
                "--spec",
                folder / "rollout.toml",
                "--out",
                score_dir,
                *extra,
            ],
            WORK / example / "score.log",
        )
    rows = []
    for label, target in targets(folder / "model.onnx", score_dir).items():
        for mode in MODES:
            if (example, label, mode) in done:
                continue
            rows.append(one(example, label, target, mode, score_dir))
            print(json.dumps(rows[-1]), flush=True)
            with (WORK / "rows.jsonl").open("a") as sink:
                sink.write(json.dumps(rows[-1]) + "\n")
    return rows


def table(rows: list[dict], note: str) -> str:
    by = {(r["example"], r["point"], r["mode"]): r for r in rows}
    lines = [
        f"Channel-group prices, shared against exact ({time.strftime('%Y-%m-%d %H:%M')}, {platform.platform()}, "
        f"{os.cpu_count()} CPUs). {note}",
        "",
        "Held-out drift % (worst output, `eval` on heldout.npz) of the shipped model, pricing rollouts (lines of a "
        "fresh measured.jsonl) and export wall seconds, exact / shared.",
        "",
        "| example | point | C | held-out exact | held-out shared | shared / exact | rollouts | export s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for (example, point, mode), r in by.items():
        if mode != "exact" or (example, point, "shared") not in by:
            continue
        s = by[(example, point, "shared")]
        ratio = s["heldout_worst_pct"] / r["heldout_worst_pct"] if r["heldout_worst_pct"] else math.nan
        ratios.append(ratio)
        lines.append(
            f"| {example} | {point} | {r['target']:.4g} | {r['heldout_worst_pct']:.4g} | {s['heldout_worst_pct']:.4g} "
            f"| {ratio:.3f} | {r['pricing_rollouts']} / {s['pricing_rollouts']} | {r['export_s']:.0f} / "
            f"{s['export_s']:.0f} |"
        )
    finite = [x for x in ratios if math.isfinite(x) and x > 0]
    if finite:
        mean = math.exp(sum(math.log(x) for x in finite) / len(finite))
        lines += [
            "",
            f"{len(finite)} points: geometric mean of shared / exact {mean:.3f}; shared lower at "
            f"{sum(x < 0.999 for x in finite)}, within 0.1% at {sum(abs(x - 1) <= 0.001 for x in finite)}, higher "
            f"at {sum(x > 1.001 for x in finite)}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    WORK.mkdir(exist_ok=True)
    rows_file = WORK / "rows.jsonl"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    done = {(r["example"], r["point"], r["mode"]) for r in rows}
    for example in args.examples.split(","):
        rows += bench(example, done)
    (RESULTS / "group-prices.json").write_text(json.dumps({"note": args.note, "rows": rows}, indent=1) + "\n")
    text = table(rows, args.note)
    (RESULTS / "group-prices.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
