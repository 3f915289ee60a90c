"""Score-sweep speed on the bundled examples (run on demand, not in tests).

For each example model it reports:
- sweep wall time of `tqsdeploy.score` (one session, weights fed per run);
- the same rollouts done naively: a fresh ONNX Runtime session per perturbed
  model (measured on a sample of tasks and extrapolated, said so in the output);
- overhead = sweep wall / (rollouts x one nominal rollout timed with plain
  ONNX Runtime on the unmodified model).
Targets from the issue: overhead <= 1.15, >= 3x faster than naive.

    python benchmarks/bench_score.py [--examples etth1_patchtst,...] [--naive-sample 40]

Writes benchmarks/results/score.json and score.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import onnxruntime as ort

import graph_ops
from tqsdeploy import ScoreSettings, score
from tqsdeploy.probes import perturb
from tqsdeploy.rollout import RolloutSpec, rollout
from tqsdeploy.score import prepare
from tqsdeploy.sweep import plan_tasks

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


class PlainSession:
    """Minimal session over a plain InferenceSession, for timing the baseline."""

    def __init__(self, source, threads):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    def run(self, feeds, names):
        return dict(zip(names, self.session.run(names, feeds)))


def _batched_feeds(prepared):
    session = prepared.job.session_factory()
    inputs = [s for s in session.inputs if s.name not in session.weights]
    batch = prepared.contexts.count > 1 and all(s.is_dynamic(0) for s in inputs)
    return list(prepared.contexts.chunks(inputs, batch, 64))


def _time_rollouts(session, chunks, spec: RolloutSpec, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _, feeds in chunks:
            for _ in rollout(session, feeds, spec):
                pass
        best = min(best, time.perf_counter() - started)
    return best


def bench(example: str, naive_sample: int, threads: int, short: bool = False) -> dict:
    """One example; `short` isolates the per-perturbation mechanics (1 step, 1 window)."""
    from runtimes import OrtRuntime
    from tqsdeploy.contexts import Contexts

    folder = REPO / "examples" / example
    model, spec_path = folder / "model.onnx", folder / "rollout.toml"
    spec = RolloutSpec.from_toml(spec_path)
    settings = ScoreSettings()
    runtime = OrtRuntime(threads=threads)
    probe = prepare(model, folder / "contexts.npz", spec, settings=settings, runtime=runtime)
    contexts = probe.contexts
    if short:
        spec = spec.with_steps(1)
        contexts = Contexts(arrays={k: v[:1] for k, v in contexts.arrays.items()}, source="first window")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        table = score(model, contexts, spec=spec, out=Path(tmp) / "run", settings=settings, runtime=runtime, resume=False)
        total_wall = time.perf_counter() - started
    sweep_wall = table.meta["timings_s"]["sweep"]
    prepared = prepare(model, contexts, spec, settings=settings, runtime=runtime)
    chunks = _batched_feeds(prepared)
    tasks = plan_tasks(prepared.units, settings.quant_probe, settings.gauss_draws)
    plain = PlainSession(str(model), threads)
    nominal = _time_rollouts(plain, chunks, prepared.spec, repeats=5)

    sample = tasks[:: max(1, len(tasks) // naive_sample)][:naive_sample]
    started = time.perf_counter()
    for task in sample:
        change = perturb(prepared.job.units[task.unit], prepared.job.weights, task.probe, task.draw, settings.probe_bits, settings.seed)
        variant = graph_ops.replace_weights(prepared.model.proto, change.weights)
        session = PlainSession(variant.SerializeToString(), threads)
        for _, feeds in chunks:
            for _ in rollout(session, feeds, prepared.spec):
                pass
    naive_per_task = (time.perf_counter() - started) / len(sample)
    naive_wall = naive_per_task * len(tasks)
    return {
        "example": example,
        "setting": "1 step, 1 window (perturbation mechanics)" if short else f"{prepared.spec.steps} steps, {prepared.contexts.count} windows (full sweep)",
        "strategy": table.meta["strategy"],
        "units": len(prepared.units),
        "params": sum(u.params for u in prepared.units),
        "rollouts": len(tasks),
        "steps": prepared.spec.steps,
        "windows": prepared.contexts.count,
        "sweep_wall_s": round(sweep_wall, 3),
        "score_total_s": round(total_wall, 3),
        "nominal_rollout_s": round(nominal, 5),
        "overhead": round(sweep_wall / (len(tasks) * nominal), 3),
        "naive_wall_s": round(naive_wall, 3),
        "naive_sampled_tasks": len(sample),
        "speedup_vs_naive": round(naive_wall / sweep_wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="etth1_patchtst,era5_emulator,lorenz96")
    parser.add_argument("--naive-sample", type=int, default=40, help="tasks timed naively (then extrapolated)")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads for every session")
    args = parser.parse_args()
    rows = [bench(name, args.naive_sample, args.threads, short) for short in (False, True) for name in args.examples.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "processor": platform.processor(), "threads": args.threads, "date": time.strftime("%Y-%m-%d")}
    (RESULTS / "score.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    header = "| example | setting | strategy | units | rollouts | sweep s | nominal rollout ms | overhead | naive s (sampled) | speed-up vs naive |"
    lines = [f"Score-sweep benchmark, {meta['date']}, {meta['machine']}, ORT threads={args.threads}", "", header, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['example']} | {r['setting']} | {r['strategy']} | {r['units']} | {r['rollouts']} | {r['sweep_wall_s']} | {r['nominal_rollout_s'] * 1e3:.2f} | "
            f"{r['overhead']} | {r['naive_wall_s']} ({r['naive_sampled_tasks']} timed) | {r['speedup_vs_naive']}x |"
        )
    (RESULTS / "score.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
