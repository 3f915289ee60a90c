"""What a folded weight costs a session at load (run on demand; seconds).

One Conv of C x C x K float32 weights, written four ways: the float weight; codes read by Cast, Sub and Mul (the
folded form tqsdeploy writes where no low-bit kernel runs a weight); codes read by one Cast; codes read by
DequantizeLinear. Each is opened in a fresh process (`_measure`): resident-set growth from just before the session
is created to after it (load) and to after 3 calls (peak from VmHWM after /proc/self/clear_refs, steady from VmRSS
after malloc_trim), and the node types ONNX Runtime runs.

    python benchmarks/bench_fold_peak.py [--channels 512] [--kernel 5] [--out fold-peak]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper
from onnx import numpy_helper as nh

RESULTS = Path(__file__).resolve().parent / "results"
FORMS = {
    "float": "the float32 weight (the original)",
    "cast-sub-mul": "uint8 codes read by Cast, Sub (zero point) and Mul (scale): folded at load",
    "int8-sub": "uint8 codes centred in int16 (Cast, Sub) before one Cast to float and Mul: folded at load",
    "cast-mul": "int8 codes (symmetric: no zero point) read by Cast and Mul: folded at load",
    "cast": "uint8 codes read by one Cast: folded at load (not the weight's values; the shortest chain)",
    "dequantizelinear": "uint8 codes read by DequantizeLinear (per output channel): not folded, runs per call",
}

_MEASURE = r"""
import ctypes, gc, json, sys, collections, tempfile, os
from pathlib import Path
import numpy as np, onnxruntime as ort, onnx
def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
def trim():
    gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
path, channels, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
options = ort.SessionOptions(); options.intra_op_num_threads = 2
trim(); Path("/proc/self/clear_refs").write_text("5"); before = status("VmRSS")
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
loaded, load_peak = status("VmRSS"), status("VmHWM")
x = np.zeros((1, channels, steps), np.float32)
for _ in range(3):
    session.run(None, {"x": x})
peak = status("VmHWM"); trim(); steady = status("VmRSS")
with tempfile.TemporaryDirectory() as tmp:
    so = ort.SessionOptions(); so.optimized_model_filepath = os.path.join(tmp, "o.onnx")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    nodes = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
print(json.dumps({"load": loaded - before, "load_peak": load_peak - before, "peak": peak - before,
                  "steady": steady - before, "nodes": dict(nodes)}))
"""


def build(form: str, channels: int, kernel: int, path: Path) -> None:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((channels, channels, kernel)) * 0.05).astype(np.float32)
    scale = np.full((channels, 1, 1), 0.01, np.float32)
    codes = np.clip(np.round(weight / scale) + 128, 0, 255).astype(np.uint8)
    initializers, nodes = [], []
    if form == "float":
        initializers.append(nh.from_array(weight, "w"))
    else:
        initializers.append(nh.from_array(codes, "q"))
        if form == "cast-sub-mul":
            initializers += [nh.from_array(scale, "s"), nh.from_array(np.full_like(scale, 128.0), "z")]
            nodes += [
                helper.make_node("Cast", ["q"], ["codes"], to=onnx.TensorProto.FLOAT),
                helper.make_node("Sub", ["codes", "z"], ["centred"]),
                helper.make_node("Mul", ["centred", "s"], ["w"]),
            ]
        elif form == "int8-sub":
            initializers += [nh.from_array(scale, "s"), nh.from_array(np.full(scale.shape, 128, np.int16), "z")]
            nodes += [
                helper.make_node("Cast", ["q"], ["codes"], to=onnx.TensorProto.INT16),
                helper.make_node("Sub", ["codes", "z"], ["centred"]),
                helper.make_node("Cast", ["centred"], ["centred_float"], to=onnx.TensorProto.FLOAT),
                helper.make_node("Mul", ["centred_float", "s"], ["w"]),
            ]
        elif form == "cast-mul":
            initializers[0] = nh.from_array((codes.astype(np.int16) - 128).astype(np.int8), "q")
            initializers.append(nh.from_array(scale, "s"))
            nodes += [
                helper.make_node("Cast", ["q"], ["codes"], to=onnx.TensorProto.FLOAT),
                helper.make_node("Mul", ["codes", "s"], ["w"]),
            ]
        elif form == "cast":
            nodes.append(helper.make_node("Cast", ["q"], ["w"], to=onnx.TensorProto.FLOAT))
        else:
            initializers += [
                nh.from_array(scale.reshape(-1), "s"),
                nh.from_array(np.full(channels, 128, np.uint8), "z"),
            ]
            nodes.append(helper.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=0))
    nodes.append(helper.make_node("Conv", ["x", "w"], ["y"], pads=[kernel // 2, kernel // 2]))
    graph = helper.make_graph(
        nodes,
        "fold_peak",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, channels, None])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--kernel", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per form (the table keeps the last)")
    parser.add_argument("--out", default="fold-peak", help="stem in benchmarks/results/")
    args = parser.parse_args()
    import onnxruntime

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for form in FORMS:
            path = Path(tmp) / f"{form}.onnx"
            build(form, args.channels, args.kernel, path)
            for _ in range(args.repeats):
                done = subprocess.run(
                    [sys.executable, "-c", _MEASURE, str(path), str(args.channels), str(args.steps)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                measured = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"form": form, "file_bytes": path.stat().st_size, **measured})
    weight_mb = args.channels * args.channels * args.kernel * 4 / 1e6
    lines = [
        "# A folded weight's cost at load (`benchmarks/bench_fold_peak.py`)",
        "",
        f"One Conv of {args.channels} x {args.channels} x {args.kernel} float32 weights ({weight_mb:.2f} MB), "
        f"ONNX Runtime {onnxruntime.__version__} CPU, 2 intra-op threads, each form in a fresh process "
        f"({args.repeats} runs, the last kept; they repeat to about 0.1 MB). Resident growth from just before the "
        "session is created: after it (load), its peak while it was created, the peak over load and 3 calls "
        "(VmHWM after /proc/self/clear_refs) and after the calls with the freed heap returned (steady). "
        "`python benchmarks/bench_fold_peak.py`.",
        "",
        "| form | file MB | after load MB | peak while loading MB | peak MB | steady MB | nodes ONNX Runtime runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        nodes = ", ".join(f"{k} {v}" for k, v in sorted(row["nodes"].items()))
        lines.append(
            f"| {row['form']}: {FORMS[row['form']]} | {row['file_bytes'] / 1e6:.2f} | {row['load'] / 2**20:.1f} | "
            f"{row['load_peak'] / 2**20:.1f} | "
            f"{row['peak'] / 2**20:.1f} | {row['steady'] / 2**20:.1f} | {nodes} |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"weight_mb": weight_mb, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
