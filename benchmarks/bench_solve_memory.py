"""One wide weight's calibrated solve: the numpy memory it holds at its peak, in K x K float64 units (run on demand).

Issue 56: a wide layer's QEP solve is a default export's memory peak (benchmarks/results/memory.md, "A wide layer's
solve is the export's peak"). This builds one K x K float32 MatMul weight and its statistics (H and G from 2K random
calibration rows, so not thin), then traces (tracemalloc) `tiers.quantize` at the tier and method asked. It reports
the traced peak above what the caller holds (weight, H, G), in MB and in K x K float64 units, the resident-set high
(VmHWM, reset through /proc/self/clear_refs), the seconds, and a digest of the codes, scales and zero points, so
that a change meant to hold less can be checked to compute the same bits.

    python benchmarks/bench_solve_memory.py [--k 2900] [--tier int4-asym] [--method qep] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import tracemalloc
from pathlib import Path

import numpy as np

from tiers import TIERS, Layout, Rounding, quantize
from tiers.hessian import Hessian


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def problem(k: int, seed: int) -> tuple[np.ndarray, Hessian]:
    """A K x K float32 weight (y = x @ W) and its statistics over 2K rows whose quantized-prefix inputs drift
    a little from the full-precision ones (QEP's and GPTAQ's cross term is then non-zero)."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float32)
    stats = Hessian(k, cross=True)
    for _ in range(4):  # 2K rows in four batches: fewer temporaries than one
        x_fp = rng.standard_normal((k // 2, k)).astype(np.float32)
        x = x_fp + (0.05 * rng.standard_normal(x_fp.shape)).astype(np.float32)
        stats.add(x, x_fp)
    stats.H  # folded now, outside the trace
    return weight, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2900)
    parser.add_argument("--tier", default="int4-asym")
    parser.add_argument("--method", default="qep")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    weight, stats = problem(args.k, args.seed)
    unit = args.k * args.k * 8
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm("VmRSS")
    tracemalloc.start()
    started = time.perf_counter()
    result = quantize(weight, Layout(weight.shape, (1, 0)), TIERS[args.tier], Rounding(args.method), [stats])
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    high = _vm("VmHWM") - before
    digest = hashlib.sha256()
    for array in (result.codes, result.scale, result.zero):
        digest.update(np.ascontiguousarray(array).tobytes())
    report = {
        "k": args.k,
        "tier": args.tier,
        "method": args.method,
        "traced_peak_mb": round(peak / 1e6, 1),
        "traced_peak_kxk_float64": round(peak / unit, 2),
        "rss_high_above_start_mb": round(high / 1e6, 1),
        "held_by_caller_kxk_float64": round((weight.nbytes + stats.H.nbytes + stats.G.nbytes) / unit, 2),
        "seconds": round(seconds, 2),
        "sha256": digest.hexdigest()[:16],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
