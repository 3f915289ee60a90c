"""The rounding solver on numpy against the CuPy path (run on demand where a GPU is lent; seconds).

For K x K statistics of growing order: the Hessian's product (rows -> H), `inverse_cholesky` and one whole GPTQ
int4 solve of an N x K weight, each timed with tiers.solver_backend on numpy and on CuPy in the same process,
and the share of codes that agree. Writes solver_backend.json/.md into --out.

    python benchmarks/bench_solver_backend.py [--orders 1024,2048,4096] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiers import solver_backend  # noqa: E402
from tiers.gptq import gptq, inverse_cholesky  # noqa: E402
from tiers.grid import GridSpec  # noqa: E402
from tiers.hessian import Hessian  # noqa: E402


def use(module: str) -> None:
    """Every step on `module`, whatever the size (the thresholds that route small work to the host are off)."""
    os.environ["TQS_ARRAYS"] = "numpy" if module == "numpy" else "auto"
    solver_backend._ARRAY_MODULE = None
    solver_backend.DEVICE_FROM_ORDER = solver_backend.DEVICE_LOOP_FROM = 0
    if solver_backend.array_module().__name__ != module:
        raise SystemExit(f"{module} is not available here")


def best_of(repeats: int, work):
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - started)
    return min(times), result


def measure(order: int, rows: int, module: str) -> dict:
    use(module)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, order))
    wt = rng.standard_normal((order, order)) / np.sqrt(order)
    best_of(1, lambda: Hessian(order).add(x))  # warm-up: CuPy's kernels and handles
    stats_s, stats = best_of(2, lambda: _stats(x, order))
    factor_s, _ = best_of(2, lambda: inverse_cholesky(stats.H, 0.01))
    solve_s, quantized = best_of(1, lambda: gptq(wt, stats.H, GridSpec("int", 4, symmetric=False)))
    return {
        "order": order,
        "rows": rows,
        "arrays": module,
        "statistics_s": round(stats_s, 4),
        "inverse_cholesky_s": round(factor_s, 4),
        "gptq_int4_s": round(solve_s, 4),
        "codes": quantized.codes,
    }


def _stats(x, order):
    stats = Hessian(order)
    stats.add(x)
    _ = stats.H
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", default="1024,2048,4096")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    rows = []
    for order in (int(o) for o in args.orders.split(",")):
        host = measure(order, args.rows, "numpy")
        device = measure(order, args.rows, "cupy")
        agree = float(np.mean(host.pop("codes") == device.pop("codes")))
        rows += [host, {**device, "codes_equal_to_numpy": round(agree, 6)}]
        print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")}
    (args.out / "solver_backend.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Rounding solver, numpy vs CuPy, {meta['date']}, {meta['machine']}, {meta['cpus']} CPUs ({args.rows} "
        "calibration rows; best of 2, the solve once).",
        "",
        "| K | arrays | statistics s | inverse Cholesky s | GPTQ int4 solve s | codes equal to numpy |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['order']} | {r['arrays']} | {r['statistics_s']} | {r['inverse_cholesky_s']} | {r['gptq_int4_s']} | "
        f"{r.get('codes_equal_to_numpy', '')} |"
        for r in rows
    ]
    (args.out / "solver_backend.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
