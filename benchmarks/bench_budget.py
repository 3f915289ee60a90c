"""`export --max-drift PCT` (issue 54) against a grid of `--C` exports, on bundled examples' held-out windows.

For each example: score its contexts, run the budget search with `--validate heldout.npz`, then export a grid of
C values the ordinary way (chosen on the scoring windows, as `frontier` does) and evaluate each with `tqsdeploy eval`
on heldout.npz: the grid's most compressed point within the budget is what the frontier would mark. A second
search validates on the first half of heldout.npz and is checked on the second half, which neither the search nor
the calibration saw. Prints a Markdown table; results/budget.md is written by hand from it.

    python benchmarks/bench_budget.py --examples etth1_patchtst,lorenz96 --budget 1 --work /tmp/tqs-bench-budget
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GRID = (2, 3, 4, 5, 6, 8, 10, 12, 14, 16)


def tqs(*args, check: bool = True) -> tuple[int, str, float]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tqsdeploy", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "TQS_MEMORY": "0"},
    )
    seconds = time.perf_counter() - started
    if check and done.returncode not in (0, 1):
        raise SystemExit(f"tqsdeploy {' '.join(map(str, args))} failed: {done.stderr[-2000:]}")
    return done.returncode, done.stdout + done.stderr, seconds


def drift(model: Path, reference: Path, windows: Path, spec: Path, folder: Path) -> tuple[float, float, float]:
    """(point, low, high) of the worst output's drift as `eval` reports it on `windows`."""
    prefix = folder / f"{model.stem}.{windows.stem}"
    tqs("eval", model, "--reference", reference, "--contexts", windows, "--spec", spec, "--no-latency",
        "--report", prefix)  # fmt: skip
    report = json.loads(Path(f"{prefix}.json").read_text())
    worst = max((o["vs_reference"] for o in report["outputs"].values()), key=lambda r: r["drift_pct_ci95"][1])
    return worst["drift_pct"], *worst["drift_pct_ci95"]


def halves(heldout: Path, folder: Path) -> tuple[Path, Path]:
    """heldout.npz cut in two along its windows: the first half validates, the second checks."""
    arrays = dict(np.load(heldout))
    count = next(iter(arrays.values())).shape[0]
    first, second = folder / "val_a.npz", folder / "val_b.npz"
    np.savez(first, **{k: v[: count // 2] for k, v in arrays.items()})
    np.savez(second, **{k: v[count // 2 :] for k, v in arrays.items()})
    return first, second


def searched(model, run, budget, validate, out: Path) -> dict:
    code, text, seconds = tqs("export", model, "--run", run, "--max-drift", f"{budget}%", "--validate", validate,
                              "-o", out, "--force")  # fmt: skip
    if code != 0:
        return {"code": code, "text": text.strip().splitlines()[-1], "seconds": seconds}
    record = json.loads(out.with_suffix(".allocation.json").read_text())
    return {"code": code, "seconds": seconds, "record": record}


def example(name: str, budget: float, work: Path) -> dict:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    source = REPO / "examples" / name
    model, spec, heldout = source / "model.onnx", source / "rollout.toml", source / "heldout.npz"
    run = folder / "run"
    _, _, score_s = tqs("score", model, "--contexts", source / "contexts.npz", "--spec", spec, "--out", run)
    result = {"example": name, "score_s": score_s}
    search = searched(model, run, budget, heldout, folder / "search.onnx")
    result["search"] = search
    if search["code"] == 0:
        result["search_heldout"] = drift(folder / "search.onnx", model, heldout, spec, folder)
    grid = []
    for target in GRID:
        path = folder / f"grid.C{target}.onnx"
        code, text, seconds = tqs("export", model, "--run", run, "--C", target, "-o", path, "--force", check=False)
        if code != 0 or not path.exists():
            grid.append({"C": target, "status": text.strip().splitlines()[-1][:120]})
            continue
        record = json.loads(path.with_suffix(".allocation.json").read_text())
        point, low, high = drift(path, model, heldout, spec, folder)
        grid.append({"C": target, "compression": record["compression"], "shipped": record["shipped"],
                     "drift": point, "low": low, "high": high, "export_s": seconds})  # fmt: skip
    result["grid"] = grid
    first, second = halves(heldout, folder)
    split = searched(model, run, budget, first, folder / "split.onnx")
    if split["code"] == 0:
        split["check"] = drift(folder / "split.onnx", model, second, spec, folder)
    result["split"] = split
    return result


def table(results: list[dict], budget: float) -> str:
    lines = [
        f"| example | search: C chosen (x) | its drift on heldout.npz [95% CI] | targets tried | search s | "
        f"grid's best within {budget:g}% (upper end) | grid's best (point) | half-split: C (x), drift on the unseen "
        "half [95% CI] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        search = r["search"]
        if search["code"] == 0:
            b = search["record"]["budget"]
            chosen = f"{b['chosen_C']:.3g} ({search['record']['compression']:.3g}x)"
            point, low, high = r["search_heldout"]
            held = f"{point:.3g}% [{low:.3g}, {high:.3g}]"
            tried = str(len(b["tried"]))
        else:
            chosen, held, tried = f"none (exit {search['code']})", "-", "-"
        ok = [g for g in r["grid"] if "high" in g]
        upper = max((g for g in ok if g["high"] <= budget), key=lambda g: g["compression"], default=None)
        point_best = max((g for g in ok if g["drift"] <= budget), key=lambda g: g["compression"], default=None)

        def said(g):
            return (
                "none"
                if g is None
                else f"C {g['C']} ({g['compression']:.3g}x, {g['drift']:.3g}% [{g['low']:.3g}, {g['high']:.3g}])"
            )

        split = r["split"]
        if split["code"] == 0:
            p, lo, hi = split["check"]
            made = split["record"]
            half = f"{made['budget']['chosen_C']:.3g} ({made['compression']:.3g}x), {p:.3g}% [{lo:.3g}, {hi:.3g}]"
        else:
            half = f"none (exit {split['code']})"
        lines.append(
            f"| {r['example']} | {chosen} | {held} | {tried} | {search['seconds']:.0f} | {said(upper)} | "
            f"{said(point_best)} | {half} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="etth1_patchtst,lorenz96")
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--work", type=Path, default=Path("tqs-bench-budget"))
    args = parser.parse_args()
    results = [example(name, args.budget, args.work) for name in args.examples.split(",")]
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results, args.budget))
    for r in results:
        print(f"\n{r['example']} grid (scoring-chosen --C exports, eval on heldout.npz):")
        for g in r["grid"]:
            print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in g.items()})
        if r["search"]["code"] == 0:
            print("   search tried:", [
                (round(t["target_C"], 3), round(t["compression"], 3), t["shipped"], round(t["drift_pct"], 3),
                 [round(v, 3) for v in t["drift_ci95"]], t["meets_budget"])
                for t in r["search"]["record"]["budget"]["tried"]
            ])  # fmt: skip


if __name__ == "__main__":
    main()
