"""`inspect` and `score`: what would be scored, and the sensitivity sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from runtimes import provider_names
from tqsdeploy.cli.app import (
    COLUMNS,
    ZSCORE,
    app,
    csv_windows,
    err,
    fmt,
    frame_table,
    labelled,
    live_option,
    name_columns,
    out,
    parse_columns,
    parse_dims,
    parse_ints,
    print_warnings,
    progress_bar,
    provider_help,
    strategy_choices,
    strategy_help,
    user_errors,
)
from tqsdeploy.errors import RolloutError
from tqsdeploy.progress import counted


@app.command()
@user_errors
def inspect(
    model: Path = typer.Argument(..., help="ONNX model file."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected from shapes when omitted."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Rollout steps T (overrides the spec)."),
    min_params: int = typer.Option(1024, "--min-params", min=1, help="Smallest tensor that counts as a unit."),
    include: Optional[str] = typer.Option(
        None, "--include", help="Regex: tensors that are units regardless of size or op."
    ),
    exclude: Optional[str] = typer.Option(None, "--exclude", help="Regex: tensors that are never units."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    emit_spec: Optional[Path] = typer.Option(
        None,
        "--emit-spec",
        help="Write the detected rollout spec (or the ambiguous candidates, commented out) to this TOML file.",
    ),
    force: bool = typer.Option(False, "--force", help="Let --emit-spec overwrite an existing file."),
):
    """Show what would be scored: signature, ops, quantizable units and the rollout (and why it was detected)."""
    from tqsdeploy.scoring.inspect import emit_spec as write_spec
    from tqsdeploy.scoring.inspect import inspect_model
    from tqsdeploy.units import UnitSelection

    info = inspect_model(model, spec, steps, UnitSelection(min_params=min_params, include=include, exclude=exclude))
    if as_json:
        out.print_json(json.dumps(info))
        return
    out.print(
        f"[bold]{info['model']}[/]  IR {info['ir_version']}  opsets {info['opsets']}  {info['bytes'] / 1e6:.2f} MB"
    )
    for kind in ("inputs", "outputs"):
        for io in info[kind]:
            out.print(f"  {kind[:-1]:6} {io['name']}  {io['shape']}  {io['dtype']}")
    out.print("  ops: " + ", ".join(f"{k}×{v}" for k, v in info["ops"].items()))
    import polars as pl

    units = labelled(
        pl.DataFrame([{**u, "op_types": ";".join(u["op_types"]), "nodes": ";".join(u["nodes"])} for u in info["units"]])
    )
    out.print(
        frame_table(
            units,
            f"{units.height} units, {info['unit_params']:,} params ({info['unit_share']:.1%} of float weights)",
            [*name_columns(units), "shape", "params", "op_types", "nodes"],
        )
    )
    for note in info["notes"]:
        out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    rollout = info["rollout"]
    if "error" in rollout:
        out.print(f"[yellow]rollout:[/] {escape(rollout['error'])}")
        for i, toml in enumerate(rollout.get("candidates", []), 1):
            out.print(f"# --- candidate {i} ---\n{escape(toml)}", highlight=False)
    else:
        out.print(_describe_rollout(rollout), highlight=False)
        for name, reason in rollout.get("reasons", {}).items():
            out.print(f"  {name}: {escape(reason)}", highlight=False)
        if rollout.get("unused_outputs"):
            out.print(
                f"  outputs that feed nothing (listed, not in the trajectory): {', '.join(rollout['unused_outputs'])}"
            )
        if rollout.get("constant_inputs") and not rollout.get("single_step"):
            out.print(
                f"  inputs held constant: {', '.join(rollout['constant_inputs'])} "
                "(a calendar input that moves each step takes an edge with "
                'mode = "advance" in a --spec: README, Rollout specs)'
            )
    contexts = info["contexts"]
    line = f"contexts: an .npz with arrays {contexts['npz']}"
    if contexts["dynamic_axes"]:
        line += f"; --random-contexts needs {' '.join(f'--dim {d}=N' for d in contexts['dynamic_axes'])}"
    line += "".join(
        f"; '{name}' indexes a table of {rows} rows (random ids are drawn over them)"
        for name, rows in contexts["index_rows"].items()
    )
    out.print(escape(line), highlight=False)
    if emit_spec is not None:
        write_spec(info, emit_spec, force)
        out.print(f"wrote {emit_spec}" + (" (ambiguous: uncomment one candidate)" if "candidates" in rollout else ""))


def _describe_rollout(rollout: dict) -> str:
    """One line: steps, edges and trajectory; a single-step model said plainly."""
    if not rollout["feedback"]:
        return (
            f"rollout ({rollout['origin']}): single-step model, nothing fed back: T = {rollout['steps']}, "
            f"trajectory = its float outputs {rollout['trajectory']}"
        )

    def edge(e: dict) -> str:
        meaning = (
            ""
            if e.get("output") or rollout["origin"] != "detected"
            else (" = observed/attended" if e.get("fill") else " = not padded/missing")
        )
        source = e.get("output") or f"fill {e.get('fill')}{meaning}"
        extra = f", axis {e['axis']}" if e["mode"] == "shift" else ""
        extra += f", length {e['length']}" if e.get("length") else ""
        return f"{source} → {e['input']} ({e['mode']}{extra})"

    edges = "; ".join(edge(e) for e in rollout["feedback"])
    return (
        f"rollout ({rollout['origin']}): {counted(rollout['steps'], 'step')}; {edges}; "
        f"trajectory {rollout['trajectory']}"
    )


@app.command()
@user_errors
def score(
    model: Path = typer.Argument(..., help="ONNX model file (never modified)."),
    contexts: Optional[Path] = typer.Option(
        None,
        "--contexts",
        "-c",
        help="Context windows: .npz (one array per input, leading axis = windows) or .csv. "
        "Required unless --random-contexts.",
    ),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected from shapes when omitted."),
    steps: Optional[int] = typer.Option(
        None, "--steps", "-T", min=1, help="Rollout steps T (overrides the spec; default 8)."
    ),
    out_dir: Optional[Path] = typer.Option(
        None,
        "--out",
        "-o",
        help="Run folder (default tqs-runs/<model stem>; <folder>_model for a file named model.onnx).",
    ),
    validation: int = typer.Option(
        0,
        "--validation",
        metavar="N",
        min=0,
        help="Hold the last N context windows out of the sweep and the calibration: kept as the run's "
        "validation.npz, export chooses between its candidates and judges --max-drift on them (as --validate).",
    ),
    probe: str = typer.Option("both", "--probe", metavar="quant|gauss|both", help="quant, gauss or both."),
    probe_bits: int = typer.Option(6, "--probe-bits", help="Bits of the symmetric per-tensor quantization probe."),
    probes: int = typer.Option(4, "--probes", help="Gaussian probe draws per unit."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Gaussian draws and random contexts."),
    eps: float = typer.Option(1e-12, "--eps", help="Added to ||dθ||² in the score's denominator."),
    dead_rtol: float = typer.Option(
        1e-6, "--dead-rtol", help="A unit is dead when its relative RMS trajectory divergence is at most this."
    ),
    horizons: Optional[str] = typer.Option(
        None, "--horizons", help="Horizons to report γ at, e.g. 1,2,4,8 (default powers of 2 up to T)."
    ),
    early_stop: bool = typer.Option(False, "--early-stop", help="Stop a rollout once γ has converged."),
    early_stop_tol: float = typer.Option(0.01, "--early-stop-tol", help="Convergence tolerance on γ (nats per step)."),
    early_stop_window: int = typer.Option(
        3, "--early-stop-window", help="Consecutive steps γ must stay within the tolerance."
    ),
    min_params: int = typer.Option(
        1024, "--min-params", min=1, help="Smallest tensor that counts as a unit (drops biases and norm scales)."
    ),
    include: Optional[str] = typer.Option(
        None, "--include", help="Regex: tensors that are units regardless of size or op."
    ),
    exclude: Optional[str] = typer.Option(None, "--exclude", help="Regex: tensors that are never units."),
    granularity: str = typer.Option("tensor", "--granularity", metavar="tensor|block", help="tensor or block."),
    block_pattern: Optional[str] = typer.Option(
        None, "--block-pattern", help="Regex whose first group names a tensor's block."
    ),
    windows: Optional[int] = typer.Option(
        None, "--windows", min=1, help="Windows cut from a CSV (or random contexts); default 8."
    ),
    zscore: bool = ZSCORE,
    columns: Optional[str] = COLUMNS,
    random_contexts: bool = typer.Option(
        False,
        "--random-contexts",
        help="Score on random windows instead of data (warns): float inputs standard normal, "
        "ids uniform over the rows of the table they index, masks all present.",
    ),
    dims: Optional[list[str]] = typer.Option(
        None,
        "--dim",
        metavar="NAME=SIZE",
        help="Size of a named dynamic input axis for --random-contexts, e.g. --dim seq=128 (repeatable).",
    ),
    batch_windows: int = typer.Option(64, "--batch-windows", min=1, help="Most windows run as one batch."),
    provider: str = live_option(
        "cpu",
        "--provider",
        metavar=lambda: "|".join(provider_names(sweep=True)),
        help=lambda: provider_help(sweep=True),
    ),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="ONNX Runtime intra-op threads."),
    workers: int = typer.Option(
        1,
        "--workers",
        min=1,
        help="Processes (or Ray actors) running the sweep, one session each (threads split between them).",
    ),
    lanes: Optional[int] = typer.Option(
        None,
        "--lanes",
        min=1,
        help="Rollouts run side by side in this process, sharing one session "
        "(CPU provider; default: one per core, up to 8 and 1 + 512 MiB / model size, threads split between them).",
    ),
    ray: Optional[str] = typer.Option(
        None,
        "--ray",
        help="Run the sweep on Ray: 'local' starts a local cluster, 'auto' or an address joins one "
        "(pip install 'tqsdeploy\\[ray]').",
    ),
    strategy: str = live_option("auto", "--strategy", metavar=strategy_choices, help=strategy_help),
    fresh: bool = typer.Option(False, "--fresh", help="Discard an existing run in the output folder."),
    resume: bool = typer.Option(
        False, "--resume", help="Require an interrupted run to continue (default: continue one if it matches)."
    ),
    top: int = typer.Option(10, "--top", min=0, help="Rows shown of the most and least sensitive units."),
):
    """Score every weight tensor's quantization sensitivity by perturbed rollouts (TQS)."""
    from runtimes import for_provider
    from tqsdeploy.rollout.contexts import ContextOptions
    from tqsdeploy.scoring.gamma import ScoreSettings
    from tqsdeploy.scoring.request import ScoreProgress, ScoreRequest
    from tqsdeploy.scoring.score import run_score
    from tqsdeploy.sweep import SweepSettings
    from tqsdeploy.units import UnitSelection

    if probe not in ("quant", "gauss", "both"):
        raise typer.BadParameter("--probe must be quant, gauss or both")
    if fresh and resume:
        raise typer.BadParameter("--fresh and --resume exclude each other")
    settings = ScoreSettings(
        probe_bits=probe_bits,
        gauss_draws=probes if probe in ("gauss", "both") else 0,
        quant_probe=probe in ("quant", "both"),
        seed=seed,
        eps=eps,
        dead_rtol=dead_rtol,
        horizons=parse_ints(horizons, "--horizons"),
        early_stop=early_stop,
        early_stop_tol=early_stop_tol,
        early_stop_window=early_stop_window,
    )
    if probe in ("gauss", "both") and probes < 1:  # both with none drawn left gamma_gauss empty without a word
        raise typer.BadParameter(
            f"--probe {probe} needs --probes >= 1"
            + (" (--probe quant scores with the quantization probe alone)" if probe == "both" else "")
        )
    selection = UnitSelection(
        min_params=min_params, include=include, exclude=exclude, granularity=granularity, block_pattern=block_pattern
    )
    progress = progress_bar("scoring", "rollouts")

    def on_start(total: int, done: int) -> None:
        if done:
            err.print(f"resuming: {done} of {total} rollouts already done")
        progress.start(total, done)

    def on_result(result) -> None:
        progress.advance(detail=result.unit[-40:])

    try:
        request = ScoreRequest(
            model,
            contexts,
            spec=spec,
            steps=steps,
            out=out_dir,
            resume=False if fresh else (True if resume else None),
            settings=settings,
            selection=selection,
            runtime=for_provider(provider, threads),
            context_options=ContextOptions(
                windows=csv_windows(windows, contexts),
                zscore=zscore,
                random=random_contexts,
                seed=seed,
                max_batch_windows=batch_windows,
                columns=parse_columns(columns),
                dims=parse_dims(dims),
            ),
            sweep=SweepSettings(strategy=strategy, workers=workers, ray_address=ray, lanes=lanes),
            validation=validation,
        )
        table = run_score(request, ScoreProgress(on_start=on_start, on_result=on_result, on_estimate=progress.estimate))
    except RolloutError as exc:
        if not dims or exc.hint or "failed to run" not in str(exc):
            raise
        sizes = " ".join(f"--dim {d}" for d in dims)  # ONNX Runtime's own words name a node, not the size that broke it
        raise RolloutError(
            str(exc),
            hint=f"{sizes} sized the random contexts; a size past what the model takes (a position table's rows, say) "
            "fails like this: try a smaller one",
        ) from None
    finally:
        progress.stop()
    print_warnings(table.meta.get("warnings", []))
    _print_summary(table, top)


def _print_summary(table, top: int) -> None:
    """The most and least sensitive units, and one line each on the sweep and the rollout."""
    from runtimes.derived import FED_OPTIMIZED
    from tqsdeploy.rollout.contexts import describe_windows

    frame = labelled(table.frame)
    columns = ["rank", *name_columns(frame), "shape", "params", "gamma", "gamma_quant", "gamma_gauss", "a_max", "dead"]
    if frame.height <= 2 * top:
        out.print(frame_table(frame, f"All {frame.height} units, most sensitive first", columns))
    else:
        out.print(frame_table(frame.head(top), f"Most sensitive units (of {frame.height})", columns))
        out.print(frame_table(frame.tail(top), "Least sensitive units", columns))
    meta = table.meta
    rho = meta.get("spearman_quant_gauss")
    cuts = f" ({len(meta['prefix_cuts'])} cuts)" if meta.get("prefix_cuts") else ""
    fed_runs = meta["strategy"] == "feed" or (
        meta["strategy"] == "prefix" and meta["rollout"]["steps"] > 1
    )  # prefix: steps 2..T
    if fed_runs and meta.get("fed_session") == FED_OPTIMIZED:
        cuts += ", weights fed in ONNX Runtime's layouts"
    out.print(
        f"{meta['units']} units, {meta['dead_units']} dead; "
        f"rollout {counted(meta['rollout']['steps'], 'step')} ({meta['rollout']['origin']}); "
        f"{describe_windows(meta['contexts'])}; strategy {meta['strategy']}{cuts}{_lanes(meta)}; "
        f"Spearman(γ_quant, γ_gauss) = {fmt(rho)}; "
        f"sweep {meta['timings_s']['sweep']:.2f} s"
    )
    out.print(_describe_rollout(meta["rollout"]), highlight=False)
    out.print(f"wrote {table.run_dir}/scores.parquet, scores.csv, run.json")


def _lanes(meta: dict) -> str:
    """', 2 lanes x 1 thread' when the sweep ran tasks side by side (nothing otherwise)."""
    lanes = meta.get("lanes", 1)
    if lanes in (None, 1):
        return ""
    threads = meta.get("threads_per_lane")
    return f", {lanes} lanes" + (f" × {threads} thread{'s' if threads != 1 else ''}" if threads else "")
