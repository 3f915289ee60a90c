"""Peak memory of exporting a large model: in memory vs streamed to external data.

Builds a synthetic MLP of `--mb` megabytes of fp32 weights (saved with
external data), then in a fresh process per mode loads it, quantizes every
weight to INT4 and writes it, reporting peak RSS against the model's size.

    python benchmarks/bench_export_memory.py [--mb 512]

Writes benchmarks/results/export_memory.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def build(folder: Path, megabytes: int) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    width = 2048
    layers = max(1, megabytes * 2**20 // (width * width * 4))
    rng = np.random.default_rng(0)
    nodes, inits, previous = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"W{i}"))
        nodes.append(helper.make_node("MatMul", [previous, f"W{i}"], [f"h{i}"]))
        previous = f"h{i}"
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", width])], [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["b", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = folder / "big.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="big.onnx.data")
    return path


def peak_rss_mb() -> float:
    """High-water RSS of this process image (VmHWM; unlike ru_maxrss it is not
    inherited from the parent across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: Path, mode: str) -> dict:
    import graph_ops
    from graph_ops.qdq import write_storage
    from tiers import TIERS, Layout

    started = time.perf_counter()
    loaded = graph_ops.load_model(path)
    after_load = peak_rss_mb()
    tensors = graph_ops.find_weight_tensors(loaded.proto)
    weights = graph_ops.read_weights(loaded.proto, [t.name for t in tensors])
    stored = {t.name: TIERS["int4"].quantize(weights[t.name], Layout(t.shape, t.channel_axis)) for t in tensors}
    write_storage(loaded.proto, stored, path.with_name(f"out-{mode}.onnx"), external_data=mode == "streamed")
    return {"mode": mode, "rss_after_load_mb": after_load, "peak_rss_mb": peak_rss_mb(), "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args.mb)
        size = (path.stat().st_size + path.with_name("big.onnx.data").stat().st_size) / 2**20
        rows = []
        for mode in ("in-memory", "streamed"):
            output = subprocess.run([sys.executable, __file__, "--measure", str(path), mode], check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(output.strip().splitlines()[-1]))
    lines = [f"Export memory, {time.strftime('%Y-%m-%d')}, {platform.platform()}: synthetic MLP, {size:.0f} MB fp32 with external data, every weight to INT4 (~{size / 7.5:.0f} MB out)", ""]
    lines += ["| mode | RSS after load MB | peak RSS MB | peak above load MB | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rss_after_load_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['rss_after_load_mb']:.0f} | {r['seconds']:.1f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "export_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
