"""Peak memory of every command against the model's size (issue 9's target:
peak RSS <= 1.5 x model + 0.5 GB), next to plain ONNX Runtime running the model.

Generates a state-to-state MatMul chain (x -> y, same shape, so the rollout is
detected) with external data, puts it in a read-only folder, and runs as
subprocesses under /usr/bin/time -v: inspect, score, score again (must resume),
export --C 4, eval (and with --baseline a uniform baseline). Checks the model folder gains no files.

    python benchmarks/bench_memory.py [--gb 0.3,1.2,2.5] [--rounding rtn] [--fallback-below 1] [--defaults]
        [--baseline qep]

Writes benchmarks/results/memory.md. Run it alone: it needs about 1.5 x the
largest model + 1 GB of free RAM and 2 x the largest model of free disk in /tmp.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GB = 1e9


def build(folder: Path, gigabytes: float, inline: bool = False, width: int | None = None) -> Path:
    """Write the weights layer by layer straight to the data file (one layer in memory at a time),
    or with `inline` into the .onnx itself (the single-file layout most exporters write below 2 GiB);
    `width`: the layers' size (default 2048 below 0.6 GB, else 4096; issue 56 measured 9 layers of 5800²)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    width = width or (2048 if gigabytes < 0.6 else 4096)
    layers = max(1, round(gigabytes * GB / (width * width * 4)))
    rng = np.random.default_rng(0)
    data = folder / "chain.onnx.data"
    nodes, inits, previous = [], [], "x"
    with open(data, "wb") as handle:
        for i in range(layers):
            offset = handle.tell()
            weight = rng.standard_normal((width, width), dtype=np.float32)
            weight *= 1.0 / np.sqrt(width)
            handle.write(weight.tobytes())
            tensor = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[width, width])
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(weight.nbytes))):
                tensor.external_data.add(key=key, value=value)
            inits.append(tensor)
            output = "y" if i == layers - 1 else f"h{i}"
            nodes.append(helper.make_node("MatMul", [previous, f"W{i}"], [output], name=f"layer{i}"))
            previous = output
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = folder / "chain.onnx"
    if inline:
        onnx.external_data_helper.load_external_data_for_model(model, str(folder))
        data.unlink()
    onnx.save_model(model, str(path))  # external: the proto alone, its tensors already point at the data file
    return path


PLAIN_ORT = """
import sys, numpy as np, onnxruntime as ort
s = ort.InferenceSession(sys.argv[1])
width = s.get_inputs()[0].shape[1]
s.run(None, {"x": np.ones((4, width), np.float32)})
"""


def timed(args: list[str], cwd: Path) -> dict:
    """Run under /usr/bin/time -v; its maximum resident set size is the peak of the process."""
    started = time.perf_counter()
    result = subprocess.run(
        ["/usr/bin/time", "-v", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seconds = time.perf_counter() - started
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    return {
        "rc": result.returncode,
        "peak_gb": int(peak.group(1)) * 1024 / GB if peak else float("nan"),
        "seconds": seconds,
        "error": errors[0] if errors else "",
    }


def export_flags(rounding: str | None, fallback: bool) -> list[str]:
    """Export options: the tool's defaults (rounding None: QEP, no refinement, the uniform-baseline
    comparison), or the light settings (`rounding`, no refinement, the comparison only with `fallback`)."""
    if rounding is None:
        return []
    return ["--rounding", rounding, "--refine", "0"] + ([] if fallback else ["--no-fallback"])


def bench(
    gigabytes: float,
    flags: list[str],
    steps: int,
    export: bool = True,
    inline: bool = False,
    baseline: str | None = None,
) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="tqs-bench-memory-") as tmp:
        tmp = Path(tmp)
        (tmp / "model").mkdir()
        path = build(tmp / "model", gigabytes, inline)
        size = sum(p.stat().st_size for p in (tmp / "model").iterdir()) / GB
        (tmp / "model").chmod(0o555)
        before = sorted(p.name for p in (tmp / "model").iterdir())
        run, cli = tmp / "run", [sys.executable, "-m", "tqsdeploy"]
        commands = [
            ("plain ONNX Runtime", [sys.executable, "-c", PLAIN_ORT, str(path)]),
            ("inspect", [*cli, "inspect", str(path)]),
            (
                "score",
                [
                    *cli,
                    "score",
                    str(path),
                    "--random-contexts",
                    "--windows",
                    "4",
                    "--steps",
                    str(steps),
                    "--probe",
                    "quant",
                    "-o",
                    str(run),
                ],
            ),
            (
                "score again (resume)",
                [
                    *cli,
                    "score",
                    str(path),
                    "--random-contexts",
                    "--windows",
                    "4",
                    "--steps",
                    str(steps),
                    "--probe",
                    "quant",
                    "-o",
                    str(run),
                ],
            ),
            (
                " ".join(["export --C 4", *flags]),
                [
                    *cli,
                    "export",
                    str(path),
                    "--run",
                    str(run),
                    "--C",
                    "4",
                    *flags,
                    "-o",
                    str(tmp / "out" / "chain.C4.onnx"),
                ],
            ),
            (
                "eval",
                [
                    *cli,
                    "eval",
                    str(tmp / "out" / "chain.C4.onnx"),
                    "--reference",
                    str(path),
                    "--contexts",
                    str(run / "contexts.npz"),
                    "--steps",
                    str(steps),
                ],
            ),
        ]
        if not export:  # eval then compares the model with itself (two sessions of it, as against an export)
            commands[-2:] = [
                (
                    "eval (model vs itself; export skipped)",
                    [
                        *cli,
                        "eval",
                        str(path),
                        "--reference",
                        str(path),
                        "--contexts",
                        str(run / "contexts.npz"),
                        "--steps",
                        str(steps),
                        "--report",
                        str(tmp / "eval"),
                    ],
                )
            ]
        if baseline:  # a uniform calibrated baseline, calibrated on the scoring windows
            calib = ["--calib", str(run / "contexts.npz")] if baseline != "rtn" else []
            commands.append(
                (
                    f"baseline --method {baseline} --bits 4",
                    [
                        *cli,
                        "baseline",
                        str(path),
                        "--method",
                        baseline,
                        "--bits",
                        "4",
                        *calib,
                        "-o",
                        str(tmp / "out" / f"chain.{baseline}.onnx"),
                    ],
                )
            )
        rows = []
        for name, args in commands:
            row = {
                "model_gb": size,
                "layout": "inline" if inline else "external data",
                "command": name,
                **timed(args, tmp),
            }
            row["target_gb"] = 1.5 * size + 0.5
            rows.append(row)
            print(row, flush=True)
        untouched = sorted(p.name for p in (tmp / "model").iterdir()) == before
        for row in rows:
            row["model_folder_untouched"] = untouched
        (tmp / "model").chmod(0o755)
        shutil.rmtree(tmp / "out", ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", default="0.3,1.2,2.5", help="Model sizes in GB (comma-separated).")
    parser.add_argument(
        "--rounding",
        default="rtn",
        help="Export rounding with --refine 0 (rtn keeps the run cheap; qep adds calibration).",
    )
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="Export with the tool's default settings instead (QEP and the uniform-baseline comparison).",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--export-below",
        type=float,
        default=float("inf"),
        help="Skip export for models of this many GB and more (it takes the longest).",
    )
    parser.add_argument(
        "--fallback-below",
        type=float,
        default=float("inf"),
        help="Export compares the uniform baselines (a calibration pass per method) only for models below this many "
        "GB; larger ones export with --no-fallback.",
    )
    parser.add_argument("--out", default=str(RESULTS / "memory.md"), help="Where to write the table.")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="rtn|gptq|gptaq|qep",
        help="Also run `baseline --method M --bits 4` (calibrated on the scoring windows).",
    )
    parser.add_argument(
        "--layouts",
        default="external",
        help="external (weights in a .data file), inline (inside the .onnx, below 2 GiB), or both comma-separated.",
    )
    args = parser.parse_args()
    rows = [
        r
        for layout in args.layouts.split(",")
        for gb in args.gb.split(",")
        for r in bench(
            float(gb),
            export_flags(None if args.defaults else args.rounding, float(gb) < args.fallback_below),
            args.steps,
            float(gb) < args.export_below,
            layout == "inline",
            args.baseline,
        )
        if layout != "inline" or float(gb) < 2.0  # protobuf cannot hold 2 GiB in one file
    ]
    lines = [
        f"Peak RSS per command, {time.strftime('%Y-%m-%d')}, {platform.platform()}, {os.cpu_count()} cores (shared "
        "machine).",
        f"State-to-state MatMul chains with external data in a read-only folder; score: --probe quant, 4 random "
        f"windows, {args.steps} steps;"
        f" export --C 4 {'with default settings' if args.defaults else f'--rounding {args.rounding} --refine 0'}. "
        "Target: peak <= 1.5 x model + 0.5 GB.",
        "",
        "| model GB | weights | command | exit | peak RSS GB | target GB | met | seconds | model folder untouched | "
        "error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = "yes" if r["rc"] == 0 and r["peak_gb"] <= r["target_gb"] else "no"
        lines.append(
            f"| {r['model_gb']:.2f} | {r['layout']} | {r['command']} | {r['rc']} | {r['peak_gb']:.2f} | "
            f"{r['target_gb']:.2f} | {met} | {r['seconds']:.1f} | {r['model_folder_untouched']} | {r['error'][:120]} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
