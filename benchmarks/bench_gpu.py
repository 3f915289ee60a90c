"""Scoring and exported models on a CUDA GPU against the CPU of the same machine (run on demand where a GPU is lent).

For every bundled example and the BERT-size transformer of bench_score.py:
- sweep throughput: perturbed rollouts per second (L·(1+N) / score wall, end to end)
  on the CPU (ONNX Runtime, all cores) and on the CUDA provider per strategy
  (feed, batch, prefix, auto), with auto's pick;
- the issue #12 ratio on the GPU: sweep wall / (L·(1+N) × one plain CUDA rollout),
  and batch scaling there (does a call carrying 1 + N + 1 times the windows cost
  less than that many calls? at most 0.8 = launch-bound);
- agreement with the CPU: Spearman correlation of the γ ranking (quant probe, over
  units alive on both) and the largest |Δγ|, with TF32 off (the default) and on;
- exported models (`--exported NAME=model.onnx,...`, each with the example's
  contexts): median latency of one call over all windows on CUDA and CPU, file
  size, beside the FP32 model and its FP16 conversion (onnxconverter-common).
TensorRT is reported as not run when `tensorrt` cannot be imported.

    python benchmarks/bench_gpu.py [--models ...] [--probes 2] [--out benchmarks/results]

Writes gpu.json and gpu.md into --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_score import EXAMPLES, _plain_rollout, case, sweep_shape  # noqa: E402

from runtimes import Runtime, for_provider  # noqa: E402
from tqsdeploy import ScoreSettings, score  # noqa: E402

STRATEGIES = ("feed", "batch", "prefix", "auto")


def environment() -> dict:
    info = {
        "onnxruntime": ort.__version__,
        "providers": ort.get_available_providers(),
        "python": platform.python_version(),
    }
    try:
        from onnxruntime.capi import build_and_package_info as build

        info["ort_cuda"] = getattr(build, "cuda_version", None)
        info["ort_cudnn"] = getattr(build, "cudnn_version", None)
    except ImportError:
        pass
    try:
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["gpu"] = query.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    info["tensorrt"] = "importable" if importlib.util.find_spec("tensorrt") else "not installed"
    return info


def _timed_score(model, contexts, spec, settings, runtime, strategy, out) -> tuple[float, object]:
    started = time.perf_counter()
    table = score(
        model, contexts, spec=spec, out=out, settings=settings, runtime=runtime, resume=False, strategy=strategy
    )
    return time.perf_counter() - started, table


def _agreement(cpu, gpu) -> dict:
    """Ranking and γ agreement of two score tables on the units alive in both."""
    a = {u: (g, d) for u, g, d in zip(cpu.frame["unit"], cpu.frame["gamma_quant"], cpu.frame["dead"])}
    b = {u: (g, d) for u, g, d in zip(gpu.frame["unit"], gpu.frame["gamma_quant"], gpu.frame["dead"])}
    alive = [u for u in a if not a[u][1] and not b[u][1]]
    x, y = np.array([a[u][0] for u in alive]), np.array([b[u][0] for u in alive])
    rho = float(spearmanr(x, y).statistic) if len(alive) > 2 else float("nan")
    return {
        "spearman": round(rho, 4),
        "max_abs_dgamma": float(np.max(np.abs(x - y))) if alive else 0.0,
        "dead_agree": all(a[u][1] == b[u][1] for u in a),
        "alive": len(alive),
    }


def sweep_row(name: str, model, contexts, spec, settings: ScoreSettings, rounds: int) -> dict:
    cpu_runtime, cuda_runtime = for_provider("cpu"), for_provider("cuda")
    prepared, batched, tasks = sweep_shape(model, contexts, spec, settings, cpu_runtime)
    width = int(settings.quant_probe) + settings.gauss_draws + 1
    walls: dict[str, list[float]] = {}
    picks, refused, tables, loops = [], {}, {}, {}
    plain_gpu, plain_cpu = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            plain_gpu.append(
                _plain_rollout(model, prepared.contexts, prepared.spec, None, batched, runtime=cuda_runtime)
            )
            plain_cpu.append(_plain_rollout(model, prepared.contexts, prepared.spec, None, batched))
            runs = [("cpu auto", cpu_runtime, "auto")] + [(f"cuda {s}", cuda_runtime, s) for s in STRATEGIES]
            if round_ == 0:
                runs.append(("cuda feed tf32", for_provider("cuda", tf32=True), "feed"))
            for label, runtime, strategy in runs:
                if label in refused:
                    continue
                try:
                    wall, table = _timed_score(
                        model,
                        prepared.contexts,
                        prepared.spec,
                        settings,
                        runtime,
                        strategy,
                        Path(tmp) / label.replace(" ", "_"),
                    )
                except Exception as exc:  # noqa: BLE001 - a refused strategy (batch on static shapes) or a GPU failure is a result here
                    refused[label] = f"{type(exc).__name__}: {exc}"
                    continue
                walls.setdefault(label, []).append(wall)
                loops.setdefault(label, []).append(table.meta["timings_s"]["sweep"])
                tables[label] = table
                if label == "cuda auto":
                    picks.append(table.meta["strategy"])
        scaling = (
            _plain_rollout(model, prepared.contexts, prepared.spec, None, batched, tiles=width, runtime=cuda_runtime)
            / (width * statistics.median(plain_gpu))
            if batched
            else None
        )
    wall = {label: statistics.median(v) for label, v in walls.items()}
    gpu_plain = statistics.median(plain_gpu)
    agreement = {}
    if "cpu auto" in tables:
        for label in ("cuda feed", "cuda batch", "cuda prefix", "cuda feed tf32"):
            if label in tables:
                agreement[label] = _agreement(tables["cpu auto"], tables[label])
    return {
        "model": name,
        "units": len(prepared.units),
        "params": sum(u.params for u in prepared.units),
        "steps": prepared.spec.steps,
        "windows": prepared.contexts.count,
        "rollouts": tasks,
        "plain_rollout_ms": {"cpu": round(statistics.median(plain_cpu) * 1e3, 3), "cuda": round(gpu_plain * 1e3, 3)},
        "gpu_batch_scaling": round(scaling, 3) if scaling is not None else None,
        "wall_s": {k: round(v, 3) for k, v in wall.items()},
        "rollouts_per_s": {k: round(tasks / v, 1) for k, v in wall.items()},
        "gpu_ratio": {k: round(v / (tasks * gpu_plain), 3) for k, v in wall.items() if k.startswith("cuda")},
        "gpu_ratio_task_loop": {
            k: round(statistics.median(v) / (tasks * gpu_plain), 3) for k, v in loops.items() if k.startswith("cuda")
        },
        "auto_picks": picks,
        "agreement": agreement,
        "refused": refused,
    }


def _latency(path: Path, feeds: dict, runtime: Runtime, repeats: int = 50) -> float:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=runtime.providers())
    for _ in range(5):
        session.run(None, feeds)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def latency_rows(exported: dict[str, Path], tmp: Path) -> list[dict]:
    """Latency of each exported model beside its example's FP32 model and that model converted to FP16."""
    from onnxconverter_common import float16

    rows = []
    for name, path in exported.items():
        folder = Path(__file__).resolve().parents[1] / "examples" / name
        fp32 = folder / "model.onnx"
        fp16 = tmp / f"{name}_fp16.onnx"
        onnx.save(float16.convert_float_to_float16(onnx.load(fp32), keep_io_types=True), fp16)
        session = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
        feeds = {
            k: v.reshape(-1, *v.shape[2:])
            for k, v in np.load(folder / "contexts.npz").items()
            if k in {i.name for i in session.get_inputs()}
        }
        for label, model in (("fp32", fp32), ("fp16 (onnxconverter-common)", fp16), ("tqsdeploy export", path)):
            row = {"example": name, "model": label, "bytes": model.stat().st_size}
            for provider in ("cuda", "cpu"):
                try:
                    row[f"{provider}_ms"] = round(_latency(model, feeds, for_provider(provider)) * 1e3, 3)
                except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                    row[f"{provider}_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    return rows


def markdown(meta: dict, rows: list[dict], latencies: list[dict]) -> str:
    labels = ["cpu auto", "cuda feed", "cuda batch", "cuda prefix", "cuda auto"]
    lines = [
        f"GPU benchmark, {meta['date']}: {meta['env'].get('gpu')}; ONNX Runtime {meta['env']['onnxruntime']} (CUDA "
        f"{meta['env'].get('ort_cuda')}, cuDNN {meta['env'].get('ort_cudnn')}); "
        f"CPU: {meta['cpus']} cores of the same machine, ONNX Runtime default threads; probes: {meta['probes']}; "
        f"median of {meta['rounds']} rounds; TensorRT: {meta['env']['tensorrt']}.",
        "",
        "Throughput = perturbed rollouts (L·(1+N)) per second of `score` wall, end to end (load, builds, auto's "
        "timing, nominal, every task). "
        "GPU ratio = wall / (L·(1+N) × one plain CUDA rollout), the #12 measure; GPU batch scaling = a plain CUDA "
        "rollout carrying 1 + N + 1 times the windows / that many plain rollouts (≤ 0.8: launch-bound).",
        "",
        "| model | params | T | windows | rollouts | plain rollout ms (cpu / cuda) | GPU batch scaling | "
        + " | ".join(f"{lb}: rollouts/s (GPU ratio)" for lb in labels)
        + " | auto's pick on GPU | cuda auto, task loop only: GPU ratio |",
        "|" + "---|" * (9 + len(labels)),
    ]
    for r in rows:
        cells = []
        for lb in labels:
            if lb in r["wall_s"]:
                cells.append(
                    f"{r['rollouts_per_s'][lb]}" + (f" ({r['gpu_ratio'][lb]})" if lb in r["gpu_ratio"] else "")
                )
            else:
                cells.append("refused" if lb in r["refused"] else "—")
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['steps']} | {r['windows']} | {r['rollouts']} | "
            f"{r['plain_rollout_ms']['cpu']} / {r['plain_rollout_ms']['cuda']} | "
            f"{r['gpu_batch_scaling'] if r['gpu_batch_scaling'] is not None else 'no batch axis'} | "
            + " | ".join(cells)
            + f" | {', '.join(r['auto_picks'])} | {r['gpu_ratio_task_loop'].get('cuda auto', '—')} |"
        )
    lines += [
        "",
        "Agreement with the CPU score (quant probe γ, units alive on both): Spearman ρ / largest |Δγ| (nats/step) / "
        "dead units identical:",
        "",
    ]
    lines += [
        "| model | " + " | ".join(["cuda feed", "cuda batch", "cuda prefix", "cuda feed, TF32 on"]) + " |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for lb in ("cuda feed", "cuda batch", "cuda prefix", "cuda feed tf32"):
            a = r["agreement"].get(lb)
            cells.append(
                f"{a['spearman']} / {a['max_abs_dgamma']:.2e} / {'yes' if a['dead_agree'] else 'NO'}" if a else "—"
            )
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    refusals = [f"- {r['model']}, {label}: {reason}" for r in rows for label, reason in r["refused"].items()]
    if refusals:
        lines += ["", "Refused or failed:", "", *refusals]
    if latencies:
        lines += [
            "",
            "Latency of one call over all context windows (median of 50 after 5 warm-ups), ONNX Runtime default "
            "optimizations:",
            "",
        ]
        lines += ["| example | model | file kB | CUDA ms | CPU ms |", "|---|---|---|---|---|"]
        lines += [
            f"| {x['example']} | {x['model']} | {x['bytes'] / 1e3:.1f} | {x['cuda_ms']} | {x['cpu_ms']} |"
            for x in latencies
        ]
    if meta["env"]["tensorrt"] != "importable":
        lines += [
            "",
            "TensorRT engines (refit sweep, `tqsdeploy engine` latency): not run, `tensorrt` is not installed on this "
            "machine.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(EXAMPLES + ("bert",)))
    parser.add_argument("--probes", type=int, default=2, help="Gaussian draws per unit (N)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bert-contexts", type=int, default=16)
    parser.add_argument("--exported", default="", help="example=path/to/exported.onnx,... (latency table)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    settings = ScoreSettings(gauss_draws=args.probes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in filter(None, args.models.split(",")):
            print(f"{name} ...", flush=True)
            model, contexts, spec = case(name, Path(tmp), args.bert_contexts)
            rows.append(sweep_row(name, model, contexts, spec, settings, args.rounds))
            print(json.dumps(rows[-1]), flush=True)
        exported = dict(item.split("=", 1) for item in filter(None, args.exported.split(",")))
        latencies = latency_rows({k: Path(v) for k, v in exported.items()}, Path(tmp))
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "env": environment(),
        "cpus": os.cpu_count(),
        "probes": f"quant + {args.probes} gauss",
        "rounds": args.rounds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps({"meta": meta, "results": rows, "latency": latencies}, indent=2))
    text = markdown(meta, rows, latencies)
    (args.out / "gpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
