"""Export quality and speed on the bundled examples (run on demand).

For each example: one score run, then TQS-PTQ at C ~ 8 and C ~ 16 with each
objective (paper, response, measured) next to uniform INT4 and INT2 (every
unit at one tier, same tool), each evaluated against the truth with ONNX
Runtime's default optimisations. Also the export throughput (parameters per
second of quantize + write) and the peak memory of an export.

    python benchmarks/bench_export.py

Writes benchmarks/results/export.json and export.md.
"""

from __future__ import annotations

import json
import platform
import resource
import tempfile
import time
import tracemalloc
from pathlib import Path

from tqsdeploy import score
from tqsdeploy.errors import InfeasibleError
from tqsdeploy.evaluate import evaluate
from tqsdeploy.export import ExportSettings, Planner

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EXAMPLES = ("etth1_patchtst", "era5_emulator", "lorenz96")
DEFAULT = ("fp32", "bf16", "int8", "int4", "int2")
WITH_INT1 = DEFAULT + ("int1",)


def _degradation(path: Path, folder: Path) -> float:
    report = evaluate(path, folder / "model.onnx", folder / "contexts.npz", spec=folder / "rollout.toml", truth=folder / "truth.npz")
    return report["degradation_pct"]


def bench(example: str, tmp: Path) -> list[dict]:
    folder = REPO / "examples" / example
    run = tmp / example
    score(folder / "model.onnx", folder / "contexts.npz", spec=folder / "rollout.toml", out=run)
    rows = []
    for tier in ("int4", "int2"):
        planner = Planner(run, settings=ExportSettings(tiers=DEFAULT))
        path = tmp / f"{example}.{tier}.onnx"
        outcome = planner.export(None, path, uniform_tier=tier)
        rows.append({"example": example, "method": f"uniform {tier.upper()}", "target": None, "tiers": tier, "C": outcome.allocation.compression, "bytes": outcome.file_bytes, "degradation_pct": _degradation(path, folder), "fell_back_to": None})
        planner.close()
    for objective in ("paper", "response", "measured"):
        for target in (8, 16):
            for tiers in (DEFAULT, WITH_INT1):
                planner = Planner(run, settings=ExportSettings(tiers=tiers, objective=objective))
                path = tmp / f"{example}.{objective}.C{target}.{len(tiers)}.onnx"
                try:
                    outcome = planner.export(target, path)
                except InfeasibleError as exc:
                    rows.append({"example": example, "method": f"TQS-PTQ {objective}", "target": target, "tiers": "+int1" if tiers == WITH_INT1 else "default", "C": None, "bytes": None, "degradation_pct": None, "fell_back_to": "infeasible, largest reachable C " + str(exc).split("largest reachable is ")[-1].split()[0]})
                    continue
                finally:
                    planner.close()
                rows.append({"example": example, "method": f"TQS-PTQ {objective}", "target": target, "tiers": "+int1" if tiers == WITH_INT1 else "default", "C": outcome.allocation.compression, "bytes": outcome.file_bytes, "degradation_pct": _degradation(path, folder), "fell_back_to": outcome.fell_back_to})
    return rows


def throughput(example: str, tmp: Path) -> dict:
    """Quantize + write every unit at INT4 (no rollouts), timed and memory-traced."""
    planner = Planner(tmp / example, settings=ExportSettings())
    allocation = planner.uniform("int4")
    params = sum(u.params for u in planner.units)
    tracemalloc.start()
    started = time.perf_counter()
    planner.write(allocation, tmp / f"{example}.throughput.onnx")
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    planner.close()
    return {"example": example, "params": params, "seconds": round(seconds, 4), "params_per_s": round(params / seconds), "peak_traced_mb": round(peak / 1e6, 2), "model_mb": round(planner.model.file_bytes / 1e6, 2)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = [row for example in EXAMPLES for row in bench(example, tmp)]
        speed = [throughput(example, tmp) for example in EXAMPLES]
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "date": time.strftime("%Y-%m-%d"), "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}
    (RESULTS / "export.json").write_text(json.dumps({"meta": meta, "quality": rows, "throughput": speed}, indent=2))
    lines = [f"Export benchmark, {meta['date']}, {meta['machine']}", "", "Degradation: (MAE_q - MAE_fp32) / MAE_fp32 against the truth, ONNX Runtime default optimisations.", ""]
    lines += ["| example | method | target C | tiers | achieved C | bytes | degradation % | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = f"{r['C']:.2f}" if r["C"] else "-"
        d = f"{r['degradation_pct']:.3f}" if r["degradation_pct"] is not None else "-"
        note = f"fell back to uniform {r['fell_back_to']}" if r["fell_back_to"] and r["C"] else (r["fell_back_to"] or "")
        lines.append(f"| {r['example']} | {r['method']} | {r['target'] or '-'} | {r['tiers']} | {c} | {r['bytes'] or '-'} | {d} | {note} |")
    lines += ["", "| example | params | export s | params/s | peak traced MB | model MB |", "|---|---|---|---|---|---|"]
    lines += [f"| {s['example']} | {s['params']} | {s['seconds']} | {s['params_per_s']} | {s['peak_traced_mb']} | {s['model_mb']} |" for s in speed]
    (RESULTS / "export.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
