"""One (model, variant) measurement of bench_deploy.py, in a fresh process: `python deploy_measure.py JOB.json`.

Memory first, before anything else is loaded: the peak and steady growth of the process's resident set from just
before the candidate's session is created to after its first calls (peak reset through /proc/self/clear_refs "5",
read from VmHWM/VmRSS). Then the FP32 reference is opened beside it and both are timed in paired rounds (candidate
and reference alternate, the order swapped each round) at batch 1 and batch N. Then, each only when asked (the
parent keeps them per file), the node types of the graph ONNX Runtime optimised and the held-out accuracy by
`tqsdeploy.evaluation.evaluate.evaluate`. The result is written to the job's "out" as JSON.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

WEIGHT_OPS = ("MatMulNBits", "GatherBlockQuantized", "DequantizeLinear", "MatMul", "FusedMatMul", "Gemm", "Conv")


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def options(threads: int, config: dict, optimized: str | None = None) -> ort.SessionOptions:
    """ONNX Runtime's default session options but for the intra-op threads (and a variant's own entries)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    for key, value in config.items():
        so.add_session_config_entry(key, str(value))
    if optimized:
        so.optimized_model_filepath = optimized
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return so


def session(path: str, so: ort.SessionOptions) -> ort.InferenceSession:
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def memory(job: dict, feeds: list[dict]) -> tuple[ort.InferenceSession, dict]:
    """Open the candidate and make its first calls; the resident growth of that, peak and steady."""
    so = options(job["threads"], job.get("config", {}))
    _trim()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    started = time.perf_counter()
    candidate = session(job["model"], so)
    load_s = time.perf_counter() - started
    for feed in feeds:
        candidate.run(None, feed)
    peak, right_after = _status("VmHWM"), _status("VmRSS")
    _trim()
    steady = _status("VmRSS")
    return candidate, {
        "peak_bytes": peak - before,
        "steady_bytes": steady - before,
        "after_calls_bytes": right_after - before,
        "baseline_bytes": before,
        "load_s": load_s,
    }


def paired(candidate, reference, feed: dict, rounds: int, min_seconds: float, warmup: int = 3) -> dict:
    """Paired rounds at one batch: medians of each, their ratio, the median of the rounds' ratios and its spread, and
    the ratio of the 10th percentiles (on an oversubscribed machine calls that wait for a descheduled thread make
    the times bimodal; the fast mode is what the model costs)."""
    for _ in range(warmup):
        candidate.run(None, feed), reference.run(None, feed)
    times = {"candidate": [], "reference": []}
    started, count = time.perf_counter(), 0
    while count < rounds or time.perf_counter() - started < min_seconds:
        order = ("candidate", "reference") if count % 2 == 0 else ("reference", "candidate")
        for label in order:
            run = candidate if label == "candidate" else reference
            tick = time.perf_counter()
            run.run(None, feed)
            times[label].append(time.perf_counter() - tick)
        count += 1
        if count >= 3 and time.perf_counter() - started > 120:  # seconds per call: 3 rounds do
            break
    c, r = np.asarray(times["candidate"]) * 1e3, np.asarray(times["reference"]) * 1e3
    ratios = c / np.maximum(r, 1e-9)
    return {
        "rounds": count,
        "candidate_ms": float(np.median(c)),
        "reference_ms": float(np.median(r)),
        "ratio": float(np.median(c) / max(np.median(r), 1e-9)),
        "paired_ratio": float(np.median(ratios)),
        "paired_p25": float(np.percentile(ratios, 25)),
        "paired_p75": float(np.percentile(ratios, 75)),
        "p10_ratio": float(np.percentile(c, 10) / max(np.percentile(r, 10), 1e-9)),
    }


def node_types(job: dict) -> dict:
    """Op-type counts of the graph ONNX Runtime optimised at its default level (written out, then read back)."""
    import onnx

    with tempfile.TemporaryDirectory(dir=job.get("scratch")) as tmp:
        target = str(Path(tmp) / "optimized.onnx")
        session(job["model"], options(job["threads"], job.get("config", {}), target))
        graph = onnx.load(target, load_external_data=False).graph
        counts = collections.Counter(n.op_type for n in graph.node)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def accuracy(job: dict) -> dict:
    """Held-out accuracy as `tqsdeploy eval` computes it: drift %, against the truth where there is one, cosine."""
    from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate

    settings = EvalSettings(cosine=True if job["kind"] == "token" else None)
    report = evaluate(job["model"], job["reference"], job["heldout"], spec=job["spec"], truth=job["truth"],
                      settings=settings)  # fmt: skip
    outputs = report["outputs"].values()
    cosines = [o["cosine"] for o in outputs if "cosine" in o]
    return {
        "drift_pct": max(o["vs_reference"]["drift_pct"] for o in outputs if "vs_reference" in o),
        "degradation_pct": report.get("degradation_pct") if job["truth"] else None,
        "cosine_mean": min(c["mean"] for c in cosines) if cosines else None,
        "cosine_min": min(c["min"] for c in cosines) if cosines else None,
        "runtime_mode": report["runtime"]["mode"],
    }


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    stored = np.load(job["feeds"])
    feeds = [{k[len(f"b{n}:") :]: stored[k] for k in stored.files if k.startswith(f"b{n}:")} for n in job["batches"]]
    candidate, mem = memory(job, feeds)
    result = {"memory": mem, "threads": job["threads"]}
    reference = session(job["reference"], options(job["threads"], {}))
    result["latency"] = {
        str(n): paired(candidate, reference, feed, job["rounds"], job["min_seconds"])
        for n, feed in zip(job["batches"], feeds)
    }
    del candidate, reference
    _trim()
    if job.get("nodes"):
        result["nodes"] = node_types(job)
    if job.get("accuracy"):
        result["accuracy"] = accuracy(job)
    Path(job["out"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
