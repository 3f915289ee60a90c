"""How to store the 1-bit tier: packed bits + unpack subgraph, or signs as INT2.

Both hold w = scale * sign(w) exactly. For one MatMul weight of each size it
reports file size, ONNX Runtime session build time and run time (default
optimisations), and checks both give identical outputs.

    python benchmarks/bench_int1.py

Writes benchmarks/results/int1.md.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graph_ops
from graph_ops.qdq import apply_storage
from runtimes import for_provider
from tiers import TIERS, Encoded, Layout, encode

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _model(n: int) -> onnx.ModelProto:
    w = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "int1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    model.ir_version = 13
    return model


def _as_int2(packed: Encoded) -> Encoded:
    """The same signs and scales, stored as INT2 codes in {-1, 1} behind a DequantizeLinear."""
    signs = np.sign(packed.dequantize()).astype(ml_dtypes.int2)
    return Encoded("int1", "dequantize", signs, packed.shape, packed.scale, None, packed.axis, None, packed.dtype)


def _time(function, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    lines = [
        f"INT1 storage, {time.strftime('%Y-%m-%d')}, {platform.platform()}, ORT default optimisations, 1 thread",
        "",
    ]
    lines += [
        "| weight | storage | file bytes | session build ms | run ms (batch 8) | rel. error vs exact fp32 of the same "
        "signs |",
        "|---|---|---|---|---|---|",
    ]
    for n in (512, 2048):
        model = _model(n)
        w = numpy_helper.to_array(model.graph.initializer[0])
        packed = encode(w, Layout.channels_on(w.shape, 1), TIERS["int1"])
        variants = {"packed bits + unpack": packed, "signs as INT2 + DQ": _as_int2(packed)}
        x = np.random.default_rng(1).standard_normal((8, n)).astype(np.float32)
        exact = x @ packed.dequantize()
        for label, stored in variants.items():
            data = graph_ops.model_bytes(apply_storage(model, {"W": stored}))
            runtime = for_provider("cpu", threads=1)
            build = _time(lambda: runtime.open(data), 3)
            session = runtime.open(data)
            run = _time(lambda: session.run({"x": x}), 20)
            error = np.abs(session.run({"x": x})["y"] - exact).max() / np.abs(exact).max()
            lines.append(f"| {n}×{n} | {label} | {len(data)} | {build * 1e3:.1f} | {run * 1e3:.3f} | {error:.1e} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "int1.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
