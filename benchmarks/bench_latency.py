"""Latency of exported models against their FP32 original, per runtime layout (run on demand, not in tests).

For every bundled example, a BERT-size encoder (22.6M parameters, 128 tokens, built here with onnx.helper)
and, with `--stack-gb G`, a MatMul stack of G GB (benchmarks/bench_memory.py's generator, external data):
score, then `export --C 4` once and write its allocation in both runtime layouts (`dequantized`, what
`--target ort-cpu` picks by default, and `fused`, DequantizeLinear that ONNX Runtime runs as MatMulNBits with
int8 activations), beside an FP16 copy (onnxconverter-common, keep_io_types). Each variant is timed against
FP32 with `tqsdeploy.evaluation.latency.measure` (both sessions open, paired rounds, order swapped each round, medians)
at batch 1 and at the example's batch (its context windows in one call; the BERT: 16 sequences), on ONNX
Runtime's CPU provider with its default threads; the held-out drift (eval as ONNX Runtime runs the variant)
is reported beside. The examples export with the tool's defaults; the generated models, which have no
trained weights, score with the quantization probe alone and export with RTN, no refinement and no comparison
with uniform baselines (whose calibrated roundings take minutes on the BERT, tens of minutes at 1 GB on 2 cores).

    python benchmarks/bench_latency.py [--models etth1_patchtst,...,bert] [--stack-gb 1.0] [--rounds 20]

Writes benchmarks/results/latency.csv and latency.md (`--out STEM`: STEM.csv/.md) and appends the run to
results/history/STEM.md (record.py; `--changed` says what changed). CUDA is measured only where a GPU is present
(`--provider cuda`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import build as build_stack  # noqa: E402
from bench_score import bert  # noqa: E402
from record import append_history  # noqa: E402

from runtimes import for_provider  # noqa: E402
from tqsdeploy import ScoreSettings, score  # noqa: E402
from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate  # noqa: E402
from tqsdeploy.evaluation.latency import LatencySettings, measure  # noqa: E402
from tqsdeploy.export import ExportSettings, Planner  # noqa: E402
from tqsdeploy.export.writing import Writer  # noqa: E402
from tqsdeploy.rollout import RolloutSpec  # noqa: E402
from tqsdeploy.rollout.contexts import ContextOptions, load_contexts  # noqa: E402
from tqsdeploy.rollout.engine import RolloutEngine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BERT_TOKENS, BERT_BATCH = 128, 16
EVERY_EXAMPLE = tuple(sorted(p.parent.name for p in (REPO / "examples").glob("*/model.onnx")))
"""Every bundled example (the frontier's list may lag behind the folder)."""


def case(name: str, tmp: Path, stack_gb: float) -> dict:
    """Model, scoring contexts, held-out contexts and truth (None for generated models: fresh random windows), spec."""
    if name == "bert":
        model = tmp / "bert.onnx" if (tmp / "bert.onnx").exists() else bert(tmp / "bert.onnx", tokens=BERT_TOKENS)
        rng = np.random.default_rng(1)
        np.savez(tmp / "bert_ctx.npz", ids=rng.integers(0, 30522, (2, 1, BERT_TOKENS)).astype(np.int64))
        np.savez(tmp / "bert_heldout.npz", ids=rng.integers(0, 30522, (BERT_BATCH, 1, BERT_TOKENS)).astype(np.int64))
        spec = RolloutSpec(steps=1, feedback=(), trajectory=("hidden",))
        return {
            "model": model,
            "contexts": tmp / "bert_ctx.npz",
            "heldout": tmp / "bert_heldout.npz",
            "truth": None,
            "spec": spec,
            "batch": BERT_BATCH,
            "generated": True,
        }
    if name == "stack":
        folder = tmp / "stack"
        folder.mkdir(exist_ok=True)
        model = folder / "chain.onnx" if (folder / "chain.onnx").exists() else build_stack(folder, stack_gb)
        width = onnx.load(str(model), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[1].dim_value
        rng = np.random.default_rng(1)
        np.savez(tmp / "stack_ctx.npz", x=rng.standard_normal((2, 4, width)).astype(np.float32))
        np.savez(tmp / "stack_heldout.npz", x=rng.standard_normal((8, 4, width)).astype(np.float32))
        spec = RolloutSpec.from_dict({"steps": 2, "feedback": [{"output": "y", "input": "x"}]})
        return {
            "model": model,
            "contexts": tmp / "stack_ctx.npz",
            "heldout": tmp / "stack_heldout.npz",
            "truth": None,
            "spec": spec,
            "batch": 8,
            "generated": True,
        }
    folder = REPO / "examples" / name
    count = int(next(iter(np.load(folder / "contexts.npz").values())).shape[0])
    heldout = (
        folder / "heldout.npz" if (folder / "heldout.npz").exists() else folder / "contexts.npz"
    )  # the token embedder has no held-out windows
    truth = folder / "heldout_truth.npz" if (folder / "heldout_truth.npz").exists() else None
    return {
        "model": folder / "model.onnx",
        "contexts": folder / "contexts.npz",
        "heldout": heldout,
        "truth": truth,
        "spec": RolloutSpec.from_toml(folder / "rollout.toml"),
        "batch": count,
        "generated": False,
    }


def fp16_copy(model: Path, out: Path) -> Path:
    from onnxconverter_common import float16

    proto = onnx.load(str(model))
    converted = float16.convert_float_to_float16(proto, keep_io_types=True)
    onnx.save_model(converted, str(out), save_as_external_data=converted.ByteSize() > (1 << 31) - (1 << 24))
    return out


def variants(name: str, item: dict, tmp: Path, provider: str) -> tuple[dict[str, Path], dict]:
    """FP16, and the `--C 4` export in each runtime layout (one allocation, written twice); reused from `tmp`
    when an earlier run with `--workdir` left them there (timing again costs no score or export)."""
    labels = {
        "fp16": tmp / f"{name}.fp16.onnx",
        "C4 dequantized (auto for ort-cpu)": tmp / f"{name}.C4.dequantized.onnx",
        "C4 fused": tmp / f"{name}.C4.fused.onnx",
    }
    if (tmp / "meta.json").exists():
        return {k: v for k, v in labels.items() if v.exists()}, json.loads((tmp / "meta.json").read_text())
    run = tmp / f"{name}_run"
    light = item["generated"]
    settings = ScoreSettings(gauss_draws=0 if light else 1)
    started = time.perf_counter()
    score(
        item["model"], item["contexts"], spec=item["spec"], out=run, settings=settings, runtime=for_provider(provider)
    )
    scored = time.perf_counter() - started
    export = ExportSettings(target="ort-cpu", rounding="rtn" if light else "qep", refine=0, fallback=not light)
    planner = Planner(run, item["model"], export, for_provider(provider))
    started = time.perf_counter()
    files = {"fp16": fp16_copy(item["model"], tmp / f"{name}.fp16.onnx") if not name == "stack" else None}
    outcome = planner.export(4, tmp / f"{name}.C4.dequantized.onnx")
    fused = Writer(
        dataclasses.replace(planner.job, settings=dataclasses.replace(planner.settings, runtime_layout="fused")),
        planner.roundings,
    )
    fused.write(outcome.encodings, tmp / f"{name}.C4.fused.onnx")
    planner.close()
    files.update(
        {
            "C4 dequantized (auto for ort-cpu)": tmp / f"{name}.C4.dequantized.onnx",
            "C4 fused": tmp / f"{name}.C4.fused.onnx",
        }
    )
    meta = {
        "score_s": scored,
        "export_s": time.perf_counter() - started,
        "compression": outcome.compression,
        "shipped": outcome.shipped,
        "scoring_drift_pct": outcome.drift_pct,
        "memory_after_load_mb": outcome.memory_bytes / 1e6,
    }
    (tmp / "meta.json").write_text(json.dumps(meta))
    return {k: v for k, v in files.items() if v is not None}, meta


def file_mb(path: Path) -> float:
    return (
        sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) / 1e6
        if path.suffix == ".onnx"
        else path.stat().st_size / 1e6
    )


def bench(name: str, tmp: Path, args) -> list[dict]:
    item = case(name, tmp, args.stack_gb)
    files, meta = variants(name, item, tmp, args.provider)
    runtime = for_provider(args.provider)
    fp32 = item["model"]
    probe = runtime.open(fp32)
    inputs = [s for s in probe.inputs if s.name not in probe.weights]
    heldout = load_contexts(Path(item["heldout"]), inputs, ContextOptions())
    engine = RolloutEngine(probe, heldout, item["spec"], 64)
    engine.chunks  # the batching decision, as eval makes it
    batched = engine.batched
    probe.close()
    batch = item["batch"]
    timing = LatencySettings(batches=(1, batch), min_rounds=args.rounds, min_seconds=args.seconds)
    rows = []
    for label, path in files.items():
        try:
            latency = measure(
                lambda p=path: runtime.open(p, external_data_dir=p.parent),
                lambda: runtime.open(fp32, external_data_dir=fp32.parent),
                heldout,
                inputs,
                batched,
                batch,
                timing,
            )
        except (
            Exception
        ) as exc:  # onnxconverter-common's copy of some graphs does not load (a float16 output it left behind)
            if label != "fp16":
                raise
            print(
                f"{name} {label}: skipped, ONNX Runtime refuses the converted model: {str(exc).splitlines()[0][:200]}",
                flush=True,
            )
            continue
        report = evaluate(
            path,
            fp32,
            item["heldout"],
            spec=item["spec"],
            truth=item["truth"],
            settings=EvalSettings(provider=args.provider),
        )
        drift = max(o["vs_reference"]["drift_pct"] for o in report["outputs"].values() if "vs_reference" in o)
        for entry in latency["batches"]:
            rows.append(
                {
                    "model": name,
                    "variant": label,
                    "provider": args.provider,
                    "windows_per_call": entry["windows"],
                    "rows": entry["rows"],
                    "fp32_ms": round(entry["reference"]["median_ms"], 4),
                    "variant_ms": round(entry["candidate"]["median_ms"], 4),
                    "ratio": round(entry["slowdown"], 4),
                    "paired_ratio": round(entry["paired_slowdown"], 4),
                    "rounds": entry["rounds"],
                    "fp32_mb": round(file_mb(fp32), 3),
                    "file_mb": round(file_mb(path), 3),
                    "memory_mb": round(latency["memory_bytes"]["candidate"] / 1e6, 1),
                    "fp32_memory_mb": round(latency["memory_bytes"]["reference"] / 1e6, 1),
                    "heldout_drift_pct": round(drift, 5),
                    "heldout_degradation_pct": round(report["degradation_pct"], 4) if item["truth"] else None,
                    "runtime_mode": report["runtime"]["mode"],
                    "per_call_dequantization": report["runtime"]["per_call_dequantization"],
                    **(
                        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in meta.items()}
                        if label.startswith("C4")
                        else {}
                    ),
                }
            )
        print(
            f"{name} {label}: "
            + ", ".join(
                f"batch {r['windows_per_call']}: {r['ratio']:.3f}x"
                for r in rows
                if r["variant"] == label and r["model"] == name
            ),
            flush=True,
        )
    return rows


def headline(rows: list[dict]) -> str:
    """A history row's numbers: each layout's range of ratios to FP32 over models and batches, the default's worst."""
    parts = []
    for label, start in (("dequantized (default)", "C4 dequantized"), ("fused", "C4 fused"), ("fp16", "fp16")):
        ratios = [r for r in rows if r["variant"].startswith(start)]
        if ratios:
            worst = max(ratios, key=lambda r: r["ratio"])
            low = min(r["ratio"] for r in ratios)
            where = f" (worst {worst['model']} at {worst['windows_per_call']})" if start == "C4 dequantized" else ""
            parts.append(f"{label} {low:.3f}-{worst['ratio']:.3f}x{where}")
    models = len({r["model"] for r in rows})
    return f"{models} model{'s' if models != 1 else ''}: " + ", ".join(parts)


def write(rows: list[dict], args) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    columns = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(RESULTS / f"{args.out}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# Latency of `export --C 4` against FP32 (`benchmarks/bench_latency.py`)",
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.platform()}, {platform.processor() or 'CPU'}, ONNX Runtime "
        f"{__import__('onnxruntime').__version__} {args.provider} provider with its default threads; the machine's 2 "
        "cores were shared with other "
        "jobs, so read the ratios (paired rounds, medians), not the milliseconds. CUDA was not measured: no GPU was "
        "lent to this run.",
        "",
        "ratio = variant median / FP32 median over the same paired rounds; paired = median of the rounds' ratios. "
        "Held-out drift: mean |variant − FP32| / mean |FP32| on the held-out windows (generated models: fresh random "
        "windows), "
        "as ONNX Runtime runs the variant (`eval`'s default). Memory: resident-memory growth of the session's creation "
        "and first call, the heap freed meanwhile returned first.",
        "",
        "| model | variant | windows/call | FP32 ms | variant ms | ratio | paired | file MB (FP32) | memory MB (FP32) "
        "| held-out drift % | per-call dequantization |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_call = r["per_call_dequantization"]
        shown = (
            "none"
            if per_call == {}
            else ("-" if per_call is None else ", ".join(f"{k} {v}" for k, v in per_call.items()))
        )
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['windows_per_call']} | {r['fp32_ms']:.3f} | {r['variant_ms']:.3f} | "
            f"**{r['ratio']:.3f}** | {r['paired_ratio']:.3f} | "
            f"{r['file_mb']:.3f} ({r['fp32_mb']:.3f}) | {r['memory_mb']:.1f} ({r['fp32_memory_mb']:.1f}) | "
            f"{r['heldout_drift_pct']:.4g} | {shown} |"
        )
    lines += [
        "",
        "Exports (C = 4 of the file, one allocation written in both layouts):",
        "",
        "| model | compression | shipped | scoring drift % | score s | export s |",
        "|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in rows:
        if "compression" in r and r["model"] not in seen:
            seen.add(r["model"])
            lines.append(
                f"| {r['model']} | {r['compression']:.3f} | {r['shipped']} | {r['scoring_drift_pct']:.4g} | "
                f"{r['score_s']:.1f} | {r['export_s']:.1f} |"
            )
    default = [r for r in rows if r["variant"].startswith("C4 dequantized")]
    worst = max(default, key=lambda r: r["ratio"]) if default else None
    if worst:
        lines += [
            "",
            f"Done-when check: the default layout for `--target ort-cpu` (dequantized) is at most "
            f"{worst['ratio']:.3f}x FP32 "
            f"(worst: {worst['model']} at {worst['windows_per_call']} windows/call); target <= 1.05.",
        ]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(EVERY_EXAMPLE + ("bert",)))
    parser.add_argument(
        "--stack-gb",
        type=float,
        default=0.0,
        help="Also a MatMul stack of this many GB (e.g. 1.0; minutes of scoring and export on 2 cores).",
    )
    parser.add_argument("--rounds", type=int, default=20, help="Paired rounds at least per batch size.")
    parser.add_argument("--seconds", type=float, default=2.0, help="Seconds of paired rounds at least per batch size.")
    parser.add_argument("--provider", default="cpu")
    parser.add_argument(
        "--workdir",
        default=None,
        help="Keep the scored and exported models here (default: a temporary folder); a second run times them again "
        "without scoring or exporting.",
    )
    parser.add_argument(
        "--out",
        default="latency",
        help="Stem of the result files in benchmarks/results/ (e.g. latency-stack for a --models '' --stack-gb 1 run).",
    )
    parser.add_argument("--changed", default="", help="What changed since the last run: the history row's last cell.")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n] + (["stack"] if args.stack_gb else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="tqs-bench-latency-") as tmp:
        for name in names:
            folder = Path(args.workdir or tmp) / name
            folder.mkdir(parents=True, exist_ok=True)
            rows += bench(name, folder, args)
            write(rows, args)  # after every model: a long run keeps what it measured
    append_history(args.out, headline(rows), args.changed)
    print((RESULTS / f"{args.out}.md").read_text())


if __name__ == "__main__":
    main()
