"""Score-sweep speed per strategy on the bundled examples and a BERT-size transformer (run on demand, not in tests).

For each model it reports, per sweep strategy (feed, rebuild, unit, prefix,
batch where the model's batch axis is dynamic, auto):
- the sweep's wall time (`tqsdeploy.scoring.score`, end to end: session builds,
  auto's timing, the nominal rollout, every task);
- ratio = that wall / (L·(1+N) × one plain ONNX Runtime rollout of the
  unmodified model over the same contexts), where L·(1+N) is the number of
  perturbed rollouts; the issue's targets are ≤ 0.8 for launch-bound and
  ≤ 1.02 for compute-bound models;
- each strategy's speed-up over feed, and auto's pick.
Strategies are run interleaved (round-robin, `--rounds` times) and medians
quoted, because the machine is shared.

    python benchmarks/bench_score.py [--models etth1_patchtst,...,bert] [--probes 4] [--rounds 2] [--threads 1]

`--threads N` (default 1) gives every session N threads and runs the sweep on one lane: the strategies
compared core for core. `--threads 0` measures the whole machine: score with its defaults (one lane
per core, ONNX Runtime's threads split between them) against the plain rollout at the faster of one
thread and ONNX Runtime's default (every core), taken per round.

Writes benchmarks/results/score.json and score.md (score-machine.* with --threads 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from runtimes import OrtRuntime
from tqsdeploy import ScoreSettings, score
from tqsdeploy.errors import TqsError
from tqsdeploy.rollout import RolloutSpec, rollout
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.scoring.prepare import prepare
from tqsdeploy.scoring.request import ScoreRequest
from tqsdeploy.sweep import SweepSettings

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EXAMPLES = ("etth1_patchtst", "era5_emulator", "lorenz96", "timesfm_etth1", "pangu_lorenz96", "era5_downscale")


def bert(
    path: Path,
    layers: int = 6,
    hidden: int = 384,
    heads: int = 6,
    ffn: int = 1536,
    vocab: int = 30522,
    tokens: int = 32,
) -> Path:
    """A BERT-size encoder (22.6M parameters with the defaults) built with onnx.helper; random weights.

    ids [batch, tokens] -> hidden states [batch, tokens, hidden]; single step.
    """
    rng = np.random.default_rng(0)
    init: dict[str, np.ndarray] = {}

    def weight(name, *shape, scale=None):
        init[name] = (rng.standard_normal(shape) * (scale or 1 / np.sqrt(shape[0]))).astype(np.float32)
        return name

    def const(name, value):
        init[name] = np.asarray(value)
        return name

    nodes = [
        helper.make_node("Gather", [weight("word_emb", vocab, hidden, scale=0.05), "ids"], ["we"]),
        helper.make_node(
            "Gather",
            [weight("pos_emb", tokens, hidden, scale=0.05), const("pos_ids", np.arange(tokens, dtype=np.int64))],
            ["pe"],
        ),
        helper.make_node("Add", ["we", "pe"], ["h0"]),
    ]
    const("ln_scale", np.ones(hidden, np.float32))
    const("ln_bias", np.zeros(hidden, np.float32))
    const("heads_shape", np.array([0, 0, heads, hidden // heads], np.int64))
    const("merge_shape", np.array([0, 0, hidden], np.int64))
    const("attn_scale", np.array(1 / np.sqrt(hidden // heads), np.float32))
    const("gelu_k", np.array(1.702, np.float32))
    x = "h0"
    for i in range(layers):
        p = f"l{i}_"
        for part in "qkv":
            nodes.append(helper.make_node("MatMul", [x, weight(p + part, hidden, hidden)], [p + part + "_flat"]))
            nodes.append(helper.make_node("Reshape", [p + part + "_flat", "heads_shape"], [p + part + "_heads"]))
            perm = [0, 2, 3, 1] if part == "k" else [0, 2, 1, 3]
            nodes.append(helper.make_node("Transpose", [p + part + "_heads"], [p + part + "_t"], perm=perm))
        nodes += [
            helper.make_node("MatMul", [p + "q_t", p + "k_t"], [p + "scores_raw"]),
            helper.make_node("Mul", [p + "scores_raw", "attn_scale"], [p + "scores"]),
            helper.make_node("Softmax", [p + "scores"], [p + "probs"], axis=-1),
            helper.make_node("MatMul", [p + "probs", p + "v_t"], [p + "ctx_t"]),
            helper.make_node("Transpose", [p + "ctx_t"], [p + "ctx_h"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [p + "ctx_h", "merge_shape"], [p + "ctx"]),
            helper.make_node("MatMul", [p + "ctx", weight(p + "o", hidden, hidden)], [p + "attn"]),
            helper.make_node("Add", [x, p + "attn"], [p + "res1"]),
            helper.make_node("LayerNormalization", [p + "res1", "ln_scale", "ln_bias"], [p + "n1"], axis=-1),
            helper.make_node("MatMul", [p + "n1", weight(p + "ff1", hidden, ffn)], [p + "ff1_out"]),
            helper.make_node("Mul", [p + "ff1_out", "gelu_k"], [p + "gk"]),
            helper.make_node("Sigmoid", [p + "gk"], [p + "gs"]),
            helper.make_node("Mul", [p + "ff1_out", p + "gs"], [p + "gelu"]),
            helper.make_node("MatMul", [p + "gelu", weight(p + "ff2", ffn, hidden)], [p + "ff2_out"]),
            helper.make_node("Add", [p + "n1", p + "ff2_out"], [p + "res2"]),
            helper.make_node("LayerNormalization", [p + "res2", "ln_scale", "ln_bias"], [p + "out"], axis=-1),
        ]
        x = p + "out"
    nodes.append(helper.make_node("Identity", [x], ["hidden"]))
    graph = helper.make_graph(
        nodes,
        "bert",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", tokens])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", tokens, hidden])],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save_model(model, str(path))
    return path


def case(name: str, tmp: Path, bert_contexts: int = 2) -> tuple[Path, Path | Contexts, RolloutSpec]:
    """(model, contexts, rollout spec) of a bundled example, or of the BERT built into `tmp`."""
    if name == "bert":
        ids = np.random.default_rng(1).integers(0, 30522, (bert_contexts, 1, 32)).astype(np.int64)
        return (
            bert(tmp / "bert.onnx"),
            Contexts({"ids": ids}, source="random token ids"),
            RolloutSpec(steps=1, feedback=(), trajectory=("hidden",)),
        )
    folder = REPO / "examples" / name
    return folder / "model.onnx", folder / "contexts.npz", RolloutSpec.from_toml(folder / "rollout.toml")


def _plain_rollout(
    model: Path,
    contexts: Contexts,
    spec: RolloutSpec,
    threads: int | None,
    batched: bool,
    repeats: int = 3,
    tiles: int = 1,
    runtime: OrtRuntime | None = None,
) -> float:
    """Best time of one nominal rollout over all contexts on a plain session of the unmodified model
    (with `tiles`, every context window repeated that many times along the batch); CPU unless `runtime` names a
    provider."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=(runtime or OrtRuntime()).providers())

    class Plain:
        def run(self, feeds, names):
            return dict(zip(names, session.run(names, dict(feeds))))

    from runtimes.ort import _spec

    inputs = [_spec(a) for a in session.get_inputs()]
    chunks = list(contexts.chunks(inputs, batched, 64))
    if tiles > 1:
        chunks = [
            (count * tiles, {name: np.concatenate([value] * tiles) for name, value in feeds.items()})
            for count, feeds in chunks
        ]
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _, feeds in chunks:
            for _ in rollout(Plain(), feeds, spec):
                pass
        best = min(best, time.perf_counter() - started)
    return best


def sweep_shape(model: Path, contexts, spec: RolloutSpec, settings: ScoreSettings, runtime: OrtRuntime):
    """The prepared sweep, whether its windows run batched, and its number of perturbed rollouts L·(1+N)."""
    prepared = prepare(
        ScoreRequest(model, contexts, spec, settings=settings, runtime=runtime, sweep=SweepSettings(lanes=1))
    )
    runner = prepared.open_runner()
    batched = runner.nominal.batched
    runner.close()
    return prepared, batched, len(prepared.units) * (int(settings.quant_probe) + settings.gauss_draws)


def bench(
    name: str,
    model: Path,
    contexts,
    spec: RolloutSpec,
    settings: ScoreSettings,
    threads: int | None,
    rounds: int,
    skip: tuple[str, ...] = (),
) -> dict:
    """One model's row. `threads` fixes every session's threads and runs the sweep on one lane; None gives
    score its defaults (lanes, threads split) and the plain rollout the faster of 1 thread and ORT's default."""
    runtime = OrtRuntime(threads=threads)
    lanes = 1 if threads else None
    prepared, batched, tasks = sweep_shape(model, contexts, spec, settings, runtime)

    def plain_rollout(tiles: int = 1) -> float:
        return min(
            _plain_rollout(model, prepared.contexts, prepared.spec, t, batched, tiles=tiles)
            for t in ((threads,) if threads else (1, None))
        )

    plains = [plain_rollout()]
    plain = plains[0]
    # Launch-bound or compute-bound: does a call of (1 + N + 1) times the windows, what a probe-batched call
    # carries, cost less than that many calls? Batching can only pay where it does (<= 0.8: launch-bound).
    # Measured in every round, each tiled call paired with a plain one just before it, and the median taken: a
    # single measurement on this shared machine classed ETTh1 at 0.914 in one run and 0.694 in the next.
    width = int(settings.quant_probe) + settings.gauss_draws + 1
    scalings: list[float] = []

    def measure_scaling() -> None:
        if batched:
            single = plain_rollout()
            scalings.append(plain_rollout(tiles=width) / (width * single))

    measure_scaling()
    strategies = [s for s in ["feed", "rebuild", "unit", "prefix", "batch", "auto"] if s not in skip]
    walls: dict[str, list[float]] = {s: [] for s in strategies}
    ratios: dict[str, list[float]] = {s: [] for s in strategies}
    picks, estimates, sweep_phase, refused, ran_as, lanes_seen = [], None, [], {}, {}, set()
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            measure_scaling()
            for strategy in [s for s in strategies if s not in refused]:
                # paired: the denominator is timed just before each sweep, as this machine's speed drifts between
                # minutes
                plains.append(plain_rollout())
                started = time.perf_counter()
                try:
                    table = score(
                        model,
                        prepared.contexts,
                        spec=prepared.spec,
                        out=Path(tmp) / strategy,
                        settings=settings,
                        runtime=runtime,
                        resume=False,
                        strategy=strategy,
                        lanes=lanes,
                    )
                except TqsError as exc:  # 'batch' refuses static-batch models and models whose rows mix
                    refused[strategy] = str(exc)
                    del walls[strategy], ratios[strategy]
                    continue
                walls[strategy].append(time.perf_counter() - started)
                ratios[strategy].append(walls[strategy][-1] / (tasks * plains[-1]))
                ran_as.setdefault(strategy, set()).add(
                    table.meta["strategy"]
                )  # a streamed model runs every strategy as feed
                lanes_seen.add((table.meta.get("lanes"), table.meta.get("threads_per_lane")))
                if strategy == "auto":
                    picks.append(table.meta["strategy"])
                    estimates = table.meta.get("strategy_estimates_s")
                    sweep_phase.append(table.meta["timings_s"]["sweep"] / (tasks * plains[-1]))
    wall = {s: statistics.median(v) for s, v in walls.items()}
    plain = statistics.median(plains)
    scaling = statistics.median(scalings) if scalings else None
    return {
        "model": name,
        "units": len(prepared.units),
        "params": sum(u.params for u in prepared.units),
        "steps": prepared.spec.steps,
        "windows": prepared.contexts.count,
        "batched": batched,
        "rollouts": tasks,
        "plain_rollout_s": round(plain, 5),
        "batch_scaling": round(scaling, 3) if scaling is not None else None,
        "bound": "launch" if scaling is not None and scaling <= 0.8 else "compute",
        "target": 0.8 if scaling is not None and scaling <= 0.8 else 1.02,
        "wall_s": {s: round(v, 3) for s, v in wall.items()},
        "ratio": {s: round(statistics.median(v), 3) for s, v in ratios.items()},
        "ratio_range": {s: [round(min(v), 3), round(max(v), 3)] for s, v in ratios.items()},
        "speedup_vs_feed": {s: round(wall["feed"] / v, 2) for s, v in wall.items()},
        "refused": refused,
        "ran_as": {s: sorted(v) for s, v in ran_as.items() if s != "auto" and v != {s}},
        "auto_picks": picks,
        "auto_estimates_s": estimates,
        "auto_sweep_phase_ratio": round(statistics.median(sweep_phase), 3) if sweep_phase else None,
        "lanes_x_threads": sorted(f"{lanes}x{threads or 'default'}" for lanes, threads in lanes_seen),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(EXAMPLES + ("bert",)))
    parser.add_argument(
        "--probes",
        type=int,
        default=ScoreSettings().gauss_draws,
        help="Gaussian draws per unit (N; default: score's own)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians are reported")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="ONNX Runtime intra-op threads for every session, one lane (0: the whole machine, see --help)",
    )
    parser.add_argument("--bert-contexts", type=int, default=2)
    args = parser.parse_args()
    settings = ScoreSettings(gauss_draws=args.probes)
    rows, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                model, contexts, spec = case(name, Path(tmp), args.bert_contexts)
            except TqsError as exc:
                skipped.append(f"{name}: {exc}")
                continue
            print(f"{name} ...", flush=True)
            # rebuild on the BERT builds a 90 MB session per task (~70 s a sweep here); auto's estimate stands in for it
            rows.append(
                bench(
                    name,
                    model,
                    contexts,
                    spec,
                    settings,
                    args.threads or None,
                    args.rounds,
                    skip=("rebuild",) if name == "bert" else (),
                )
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    whole = not args.threads
    stem = "score-machine" if whole else "score"
    setup = (
        f"the whole machine ({os.cpu_count()} cores): score with its defaults (lanes, ORT threads split between them), "
        "the plain rollout at the faster of 1 thread and ONNX Runtime's default (every core), per round"
        if whole
        else f"ORT threads={args.threads} for every session, one lane"
    )
    meta = {
        "machine": platform.platform(),
        "threads": args.threads,
        "setup": setup,
        "probes": f"quant + {args.probes} gauss",
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "note": "taken on a shared 2-core virtual machine whose speed drifts by tens of percent from one minute to the "
        "next: the plain rollout is timed in every round beside the strategies, so ratios are meaningful and absolute "
        "times are not",
        "skipped": skipped,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    names = ["feed", "rebuild", "unit", "prefix", "batch", "auto"]
    lines = [
        f"Score-sweep benchmark, {meta['date']}, {meta['machine']}, {setup}; probes: {meta['probes']}, median of "
        f"{args.rounds} interleaved rounds.",
        "",
        f"Note: {meta['note']}.",
        "",
        "ratio = score wall (end to end: load, session builds, auto's timing, nominal, every task) / (L·(1+N) rollouts "
        "× one plain ONNX Runtime rollout, the best of 3 timed just before that sweep), median over rounds (auto's "
        "range over the rounds in its own column); "
        "speed-up = feed wall / strategy wall. The last column is auto's task loop alone (the `sweep` timing in "
        "run.json) over the same denominator. "
        "batch scaling = a plain rollout with every window repeated P + 1 times (what a probe-batched call carries) / "
        "(P + 1) plain rollouts, paired and measured once per round plus once before, the median: "
        "at most 0.8 the model is launch-bound and the issue's target is ratio ≤ 0.8, otherwise it is compute-bound "
        "and the target is ≤ 1.02 "
        "(a model without a batch axis runs window by window and cannot be batched).",
        "",
        "| model | units | params | T | windows | rollouts | plain rollout ms | batch scaling (bound, target) | "
        + " | ".join(f"{s} s (ratio, ×)" for s in names)
        + " | auto's pick | auto's ratio, range over rounds | target met by auto (median) | auto, task loop only: "
        "ratio | lanes × threads |",
        "|" + "---|" * (13 + len(names)),
    ]
    for r in rows:
        cells = [
            (
                f"{r['wall_s'][s]} ({r['ratio'][s]}, {r['speedup_vs_feed'][s]}×)"
                + (f" ran as {', '.join(r['ran_as'][s])}" if s in r["ran_as"] else "")
            )
            if s in r["wall_s"]
            else "—"
            for s in names
        ]
        lines.append(
            f"| {r['model']} | {r['units']} | {r['params'] / 1e6:.2f}M | {r['steps']} | {r['windows']} | "
            f"{r['rollouts']} | {r['plain_rollout_s'] * 1e3:.1f} | "
            f"{r['batch_scaling'] if r['batch_scaling'] is not None else 'no batch axis'} ({r['bound']}, ≤ "
            f"{r['target']}) | "
            + " | ".join(cells)
            + f" | {', '.join(r['auto_picks'])} | {r['ratio_range']['auto'][0]}–{r['ratio_range']['auto'][1]} | "
            + ("yes" if r["ratio"]["auto"] <= r["target"] else "no")
            + f" | {r['auto_sweep_phase_ratio']} | {', '.join(r['lanes_x_threads'])} |"
        )
    lines += ["", "auto's own estimates of each sweep (s), from one window, one step and one build:", ""]
    lines += [
        f"- {r['model']}: " + ", ".join(f"{k} {v}" for k, v in (r["auto_estimates_s"] or {}).items()) for r in rows
    ]
    lines += [
        "",
        "— = not run: `rebuild` is skipped on the BERT (it would build a 90 MB session per task); `batch` refused:",
    ]
    lines += [f"- {r['model']}: {reason}" for r in rows for reason in r["refused"].values()]
    if any(r["ran_as"] for r in rows):
        lines += [
            "",
            '"ran as feed": the model holds 64 MiB or more (or external data), so score streams it from its file, '
            "where only feed and prefix run (README, Sweep strategies).",
        ]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
