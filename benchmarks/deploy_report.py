"""bench_deploy.py's record: the JSON of every model measured, the Markdown tables, and issue 56's targets checked."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import time
from pathlib import Path

import onnx
from deploy_measure import WEIGHT_OPS
from deploy_models import EXAMPLES
from record import commit

MB = 1e6
BIG = ("minilm", "bert", "stack")
"""The >= 20M-parameter token model and the 1 GB stack: issue 56's first set of targets."""


def stamp() -> dict:
    return {"measured": time.strftime("%Y-%m-%d %H:%M"), "commit": commit()}


def parameters(model: Path) -> int:
    graph = onnx.load(str(model), load_external_data=False).graph
    return sum(math.prod(t.dims) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine(args, layouts: list[str]) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    ram = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal")) / 1024**2
    pydeps = Path(args.work) / "pydeps"
    found = sorted(pydeps.glob("onnx_ir-*.dist-info"))
    onnx_ir = found[0].name.removesuffix(".dist-info").split("-")[1] if found else "not installed"
    versions = {
        "python": platform.python_version(),
        **{n: _version(n) for n in ("onnxruntime", "onnx", "numpy", "onnxconverter-common")},
        "onnx_ir (work folder)": onnx_ir,
    }
    return {
        **stamp(),
        "machine": f"{platform.platform()}, {cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM",
        "load_average": os.getloadavg(),
        "versions": versions,
        "threads": args.threads,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "layouts": layouts,
        "note": args.note,
        "gpu": "ort-cuda not measured: no GPU lent",
    }


def load(path: Path, replace: bool) -> dict:
    if path.exists() and not replace:
        kept = json.loads(path.read_text())
        return {"run": kept.get("run", {}), "models": kept.get("models", {})}
    return {"run": {}, "models": {}}


def one_line(row: dict) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    lat = ", ".join(f"b{n} {v['paired_ratio']:.3f}x" for n, v in row["latency"].items())
    acc = row.get("accuracy") or {}
    shown = f", drift {acc['drift_pct']:.4g}%" if acc.get("drift_pct") is not None else ""
    shown += f", cosine {acc['cosine_mean']:.5f}" if acc.get("cosine_mean") is not None else ""
    return (
        f"{row['file_bytes'] / MB:.3f} MB, peak {row['memory']['peak_bytes'] / MB:.1f} MB, "
        f"steady {row['memory']['steady_bytes'] / MB:.1f} MB, {lat}{shown}"
    )


def _times(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference > 0 else "-"


def _latency(entry: dict | None) -> str:
    if not entry:
        return "-"
    fast = f", p10 {entry['p10_ratio']:.2f}" if "p10_ratio" in entry else ""
    return (
        f"**{entry['paired_ratio']:.3f}** [{entry['paired_p25']:.2f}-{entry['paired_p75']:.2f}{fast}] "
        f"{entry['candidate_ms']:.3g} ms"
    )


def _accuracy(row: dict, kind: str) -> str:
    acc = row.get("accuracy") or {}
    if kind == "token" and acc.get("cosine_mean") is not None:
        return f"{acc['cosine_mean']:.5f} / {acc['cosine_min']:.5f}"
    if acc.get("drift_pct") is None:
        return "-"
    truth = f" (vs truth {acc['degradation_pct']:+.3g}%)" if acc.get("degradation_pct") is not None else ""
    return f"{acc['drift_pct']:.4g}{truth}"


def _nodes(row: dict) -> str:
    nodes = row.get("nodes") or {}
    shown = [f"{op} {nodes[op]}" for op in WEIGHT_OPS if nodes.get(op)]
    return ", ".join(shown) or "none of " + "/".join(WEIGHT_OPS[:3])


def model_table(model: dict) -> list[str]:
    rows, kind = model["variants"], model["kind"]
    fp32 = rows.get("fp32", {})
    ref = fp32.get("memory", {"peak_bytes": 0, "steady_bytes": 0})
    batch = model["batch"]
    accuracy = "held-out cosine to FP32 (mean / min)" if kind == "token" else "held-out drift %"
    lines = [
        f"### {model['name']}: {model['parameters']:,} parameters ({model['note']})",
        "",
        f"Measured {model['measured']}, code {model['commit']}. FP32: {fp32.get('file_bytes', 0) / MB:.2f} MB file, "
        f"{ref['peak_bytes'] / MB:.1f} MB peak / {ref['steady_bytes'] / MB:.1f} MB steady RSS growth.",
        "",
        f"| variant | file MB | peak RSS MB (x FP32) | steady RSS MB (x FP32) | latency b1 (x FP32) | latency b{batch} "
        f"(x FP32) | {accuracy} | runtime nodes | made by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped'][:200]} | | | | | | | |")
            continue
        mem = row["memory"]
        lines.append(
            f"| {name} | {row['file_bytes'] / MB:.3f} | {mem['peak_bytes'] / MB:.1f} "
            f"({_times(mem['peak_bytes'], ref['peak_bytes'])}) | {mem['steady_bytes'] / MB:.1f} "
            f"({_times(mem['steady_bytes'], ref['steady_bytes'])}) | {_latency(row['latency'].get('1'))} | "
            f"{_latency(row['latency'].get(str(batch)))} | {_accuracy(row, kind)} | {_nodes(row)} | {row['how']} |"
        )
    builds = model.get("builds") or {}
    if builds:
        lines += ["", "Builds (wall s, peak RSS MB): " + "; ".join(
            f"{k} {v['wall_s']:.0f} s, {v['peak_rss_mb']:.0f} MB" for k, v in builds.items()
        )]  # fmt: skip
    return lines + [""]


def nearest_ort(rows: dict) -> str | None:
    """ONNX Runtime's int4 model nearest in file size to the default C 8 export."""
    ours = rows.get("tqs-c8", {}).get("file_bytes")
    candidates = [k for k, v in rows.items() if k.startswith("ort-") and "file_bytes" in v and "memory" in v]
    if not ours or not candidates:
        return None
    return min(candidates, key=lambda k: abs(math.log(rows[k]["file_bytes"] / ours)))


def _check(rows: list, target: str, model: str, variant: str, value, limit, fmt: str, higher: bool = False):
    """One target's row: value <= limit (>= with `higher`), PASS or FAIL."""
    if value is None or limit is None:
        rows.append((target, model, variant, "-", "-", "not measured"))
        return
    ok = value >= limit if higher else value <= limit
    rows.append((target, model, variant, format(value, fmt), format(limit, fmt), "PASS" if ok else "**FAIL**"))


def _big_targets(name: str, model: dict, out: list) -> None:
    rows, n = model["variants"], str(model["batch"])
    ours, fp32 = rows.get("tqs-c8", {}), rows.get("fp32", {})
    if "memory" not in ours or "memory" not in fp32:
        out.append(("default export at C 8 measured", name, "tqs-c8", "-", "-", "not measured"))
        return
    peak = ours["memory"]["peak_bytes"] / max(fp32["memory"]["peak_bytes"], 1)
    _check(out, "peak RSS growth <= 0.3x FP32's", name, "tqs-c8", peak, 0.3, ".3f")
    _check(out, "latency b1 <= 1.05x FP32", name, "tqs-c8", ours["latency"]["1"]["paired_ratio"], 1.05, ".3f")
    _check(out, f"latency b{n} <= 1.1x FP32", name, "tqs-c8", ours["latency"].get(n, {}).get("paired_ratio"), 1.1,
           ".3f")  # fmt: skip
    ort = nearest_ort(rows)
    if ort is None:
        out.append(("no slower than ONNX Runtime's int4 of the nearest size", name, "tqs-c8", "-", "-", "not measured"))
        return
    for b in ("1", n):
        theirs = rows[ort]["latency"].get(b, {}).get("paired_ratio")
        _check(out, f"latency b{b} <= {ort}'s (x FP32)", name, "tqs-c8", ours["latency"].get(b, {}).get("paired_ratio"),
               theirs, ".3f")  # fmt: skip
    theirs = rows[ort].get("accuracy") or {}
    for variant, said in (("tqs-c8", ""), (f"tqs-at-{ort}", " at its size")):
        if variant not in rows:
            continue
        acc = rows[variant].get("accuracy") or {}
        if model["kind"] == "token":
            _check(out, f"held-out cosine (mean) >= {ort}'s{said}", name, variant, acc.get("cosine_mean"),
                   theirs.get("cosine_mean"), ".5f", higher=True)  # fmt: skip
        else:
            _check(out, f"held-out drift % <= {ort}'s{said}", name, variant, acc.get("drift_pct"),
                   theirs.get("drift_pct"), ".4g")  # fmt: skip


def _example_targets(name: str, model: dict, out: list) -> None:
    rows = model["variants"]
    fp32 = rows.get("fp32", {})
    for variant in ("tqs-c8", "tqs-c4"):
        ours = rows.get(variant, {})
        if "memory" not in ours or "memory" not in fp32:
            continue
        for kind in ("peak", "steady"):
            _check(out, f"{kind} RSS growth <= FP32's (MB)", name, variant, ours["memory"][f"{kind}_bytes"] / MB,
                   fp32["memory"][f"{kind}_bytes"] / MB, ".1f")  # fmt: skip
        for b, entry in ours["latency"].items():
            _check(out, f"latency b{b} <= 1.05x FP32", name, variant, entry["paired_ratio"], 1.05, ".3f")


def targets(results: dict) -> list[tuple]:
    out: list[tuple] = []
    for name, model in results["models"].items():
        if name in BIG:
            _big_targets(name, model, out)
        elif name in EXAMPLES:
            _example_targets(name, model, out)
    return out


def headline(results: dict) -> str:
    parts = []
    for name in BIG:
        row = results["models"].get(name, {}).get("variants", {}).get("tqs-c8", {})
        fp32 = results["models"].get(name, {}).get("variants", {}).get("fp32", {})
        if "memory" in row and "memory" in fp32:
            peak = row["memory"]["peak_bytes"] / max(fp32["memory"]["peak_bytes"], 1)
            lat = "/".join(f"{v['paired_ratio']:.2f}" for v in row["latency"].values())
            parts.append(f"{name} tqs-c8 peak {peak:.2f}x, latency {lat}x")
    checked = [t for t in targets(results) if t[5] != "not measured"]
    passed = sum(1 for t in checked if t[5] == "PASS")
    return "; ".join(parts + [f"targets {passed}/{len(checked)} PASS over {len(results['models'])} models"])


METHOD = (
    "Each (model, variant) in a fresh process (`benchmarks/deploy_measure.py`), ONNX Runtime CPU, {threads} intra-op "
    "threads, default session options. **file**: the .onnx and its external data. **RSS**: growth of the process's "
    "resident set from just before the session is created to after its first calls (batch 1 and batch N); peak from "
    "VmHWM after resetting it through /proc/self/clear_refs, steady from VmRSS after the calls (freed heap returned "
    "by malloc_trim); it repeats to about +-1 MB. **latency**: median over paired rounds of variant/FP32 (the two "
    "sessions open in one process, called in alternation, order swapped each round; 3 warm-up calls each, at least "
    "{rounds} rounds and {seconds:g} s per batch); [p25-p75] of the rounds' ratios is the noise, then the variant's "
    "median ms; p10: the ratio of the two 10th percentiles (where calls that waited on a descheduled thread make the "
    "times bimodal, as on an oversubscribed machine, the fast mode is the model's cost). The fp32 row times FP32 "
    "against a second FP32 session: its spread is the noise floor. **accuracy**: "
    "`tqsdeploy.evaluation.evaluate.evaluate` on the held-out windows, as ONNX Runtime runs the variant (eval's "
    "default): drift % = mean |variant - FP32| / mean |FP32| (the worst trajectory output), and against the truth "
    "where there is one; token models: cosine of each embedding to FP32's. **runtime nodes**: op types of the graph "
    "ONNX Runtime optimised (`SessionOptions.optimized_model_filepath`) that carry weights."
)


def markdown(results: dict) -> str:
    run = results["run"]
    versions = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    lines = [
        "# Compressed where it runs: memory, latency and accuracy of each runtime form (`benchmarks/bench_deploy.py`)",
        "",
        f"Last run {run['measured']}, code {run['commit']}; {run['machine']}; load average at start "
        f"{', '.join(f'{x:.2f}' for x in run['load_average'])}. {run['note']}".rstrip(),
        f"Versions: {versions}. Threads: {run['threads']} intra-op. Layouts `export --help` offered: "
        f"{', '.join(run['layouts'])} (and auto, the default). **{run['gpu']}.**",
        "",
        METHOD.format(**run),
        "",
        "## Issue 56's targets",
        "",
        "The default export (`export --C 8`, no other flag) against FP32 and against ONNX Runtime's own int4 model "
        "nearest in size; on every example both default exports (C 8 and C 4). Latency: the paired median; memory: "
        "the growth above.",
        "",
        "| target | model | variant | measured | limit | result |",
        "|---|---|---|---|---|---|",
        *(f"| {' | '.join(map(str, t))} |" for t in targets(results)),
        "",
        "## Per model",
        "",
    ]
    for model in results["models"].values():
        lines += model_table(model)
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(results, indent=1)), (".md", markdown(results))):
        temporary = out.with_suffix(suffix + ".tmp")
        temporary.write_text(text)
        temporary.replace(out.with_suffix(suffix))
