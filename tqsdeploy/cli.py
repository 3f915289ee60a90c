"""The `tqsdeploy` command: a thin layer over the library.

Exit codes: 0 success, 1 a gate failed, 2 bad usage or input (one-line
message, no traceback), 3 an internal error (a bug: please report it).
"""

from __future__ import annotations

import functools
import math
import json
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tiers import DEFAULT_TIERS, METHODS, TIERS, TRT_TIERS

try:  # typer >= 0.29 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions
from tqsdeploy.errors import USER_ERRORS, InputError
from tqsdeploy.progress import counted

ABORT = getattr(click_exceptions, "Abort", None) or typer.Abort  # typer 0.29's click copy keeps Abort in typer itself

class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a wrong option, a bad value) as one line on stderr and exit 2, like every other input error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            self._refuse_repeated_options(list(sys.argv[1:] if args is None else args))
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as exc:
            exc.show()
            result = exc.exit_code
        except click_exceptions.ClickException as exc:
            context = getattr(exc, "ctx", None)
            where = f" (see '{context.command_path} --help')" if context is not None else ""
            err.print(f"[bold red]error:[/] {escape(exc.format_message())}{escape(where)}", highlight=False, soft_wrap=True)
            result = exc.exit_code
        except ABORT:
            result = 130
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)

    def _refuse_repeated_options(self, args: list[str]) -> None:
        """An option given twice keeps its last value in click, silently: `gate --max-degradation 1%
        --max-degradation 50%` would pass at 50%. Options that take one value must be given once."""
        name = next((a for a in args if not a.startswith("-")), None)
        command = self.commands.get(name) if name else None
        if command is None:
            return
        single = {flag: param for param in command.params if getattr(param, "opts", None) and not getattr(param, "multiple", False)
                  for flag in (*param.opts, *getattr(param, "secondary_opts", ()))}
        seen: dict[str, int] = {}
        for arg in args[args.index(name) + 1:]:
            if arg == "--":
                break
            param = single.get(arg.split("=", 1)[0])
            if param is not None and param.param_type_name == "option":
                flag = max(param.opts, key=len)
                seen[flag] = seen.get(flag, 0) + 1
        repeated = [flag for flag, count in seen.items() if count > 1]
        if repeated:
            raise click_exceptions.UsageError(f"{', '.join(repeated)} given more than once; give {'it' if len(repeated) == 1 else 'each'} once")


app = typer.Typer(
    cls=_OneLineErrors,
    name="tqsdeploy",
    help="Trajectory-based quantization sensitivity (TQS) and mixed-precision PTQ for ONNX forecasting models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _version(value: bool) -> None:
    if value:
        from tqsdeploy import __version__

        out.print(f"tqsdeploy {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit.")) -> None:
    """Trajectory-based quantization sensitivity (TQS) and mixed-precision PTQ for ONNX forecasting models."""
    from runtimes import return_large_allocations

    return_large_allocations()  # weight-sized arrays go back to the OS when freed, not into a heap that only grows


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


INTERRUPTED = {
    "score": "finished rollouts are saved in the run folder (sweep.jsonl); run the same command again to resume",
    "export": "the run folder keeps the measured tier prices (measured.jsonl) and every weight a calibration pass finished "
              "(export-checkpoints/); run the same command again to resume from them",
    "frontier": "its score run keeps the finished rollouts, the measured tier prices and every weight a calibration pass finished; "
                "run the same command again to resume from them",
}
"""What an interrupted command kept, by command; the others write each output whole or not at all."""


def user_errors(command):
    """Turn user errors into one line + exit 2, bugs into exit 3, Ctrl-C into what it kept and exit 130."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, click_exceptions.ClickException):
            raise
        except USER_ERRORS as exc:
            fail(str(exc))
        except OSError as exc:  # disk full, permissions, a vanished folder: the machine's state, not a bug
            where = f" {exc.filename}" if exc.filename else ""
            fail(f"cannot use{where}: {exc.strerror or exc}")
        except KeyboardInterrupt:
            kept = INTERRUPTED.get(command.__name__, "no partial output was left (every file is written whole or not at all)")
            err.print(f"interrupted: {kept}", soft_wrap=True)
            raise typer.Exit(130)
        except Exception as exc:
            if os.environ.get("TQS_DEBUG"):
                raise
            fail(f"internal error ({type(exc).__name__}: {exc}); rerun with TQS_DEBUG=1 for a traceback and please report it", code=3)

    return wrapper


def _csv_ints(text: Optional[str], option: str) -> Optional[tuple[int, ...]]:
    if not text:
        return None
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated integers, e.g. 1,2,4,8") from None


def _columns(text: Optional[str]) -> Optional[tuple[str, ...]]:
    """--columns a,b,c as a tuple of CSV column names."""
    names = tuple(c.strip() for c in (text or "").split(",") if c.strip())
    return names or None


def _dims(items: Optional[list[str]]) -> tuple[tuple[str, int], ...]:
    """--dim seq=128 (repeatable) as ((name, size), ...); each name once, each size a positive integer."""
    sizes: dict[str, int] = {}
    for item in items or []:
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise typer.BadParameter(f"--dim takes NAME=SIZE with a positive integer size, e.g. seq=128, not {item!r}")
        if name in sizes:
            raise typer.BadParameter(f"--dim gives axis '{name}' twice")
        sizes[name] = int(value)
    return tuple(sizes.items())


COLUMNS_HELP = "CSV contexts: comma-separated columns (series) to use, e.g. OT,HUFL (default every numeric column)."


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _progress(description: str, unit: str, total: int | None = None):
    """The one progress display (tqsdeploy.progress): a bar on a terminal, periodic lines with ETA elsewhere; on stderr."""
    from tqsdeploy.progress import Progress

    return Progress(err, description, total, unit)


LABELS = {"gamma": "γ", "gamma_quant": "γ quant", "gamma_gauss": "γ gauss", "a_max": "A max", "params": "params"}


def _table(frame, title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        text = column in ("unit", "shape", "op_types", "nodes")
        table.add_column(LABELS.get(column, column), justify="left" if text else "right", overflow="fold" if text else "ellipsis", no_wrap=not text)
    for row in frame.iter_rows(named=True):
        table.add_row(*[_fmt(row.get(c)) for c in columns])
    return table


@app.command()
@user_errors
def inspect(
    model: Path = typer.Argument(..., help="ONNX model file."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected from shapes when omitted."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Rollout steps T (overrides the spec)."),
    min_params: int = typer.Option(1024, "--min-params", min=1, help="Smallest tensor that counts as a unit."),
    include: Optional[str] = typer.Option(None, "--include", help="Regex: tensors that are units regardless of size or op."),
    exclude: Optional[str] = typer.Option(None, "--exclude", help="Regex: tensors that are never units."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    emit_spec: Optional[Path] = typer.Option(None, "--emit-spec", help="Write the detected rollout spec (or the ambiguous candidates, commented out) to this TOML file."),
    force: bool = typer.Option(False, "--force", help="Let --emit-spec overwrite an existing file."),
):
    """Show what would be scored: signature, ops, quantizable units and the rollout (and why it was detected)."""
    from tqsdeploy.inspect import emit_spec as write_spec, inspect_model
    from tqsdeploy.units import UnitSelection

    info = inspect_model(model, spec, steps, UnitSelection(min_params=min_params, include=include, exclude=exclude))
    if as_json:
        out.print_json(json.dumps(info))
        return
    out.print(f"[bold]{info['model']}[/]  IR {info['ir_version']}  opsets {info['opsets']}  {info['bytes'] / 1e6:.2f} MB")
    for kind in ("inputs", "outputs"):
        for io in info[kind]:
            out.print(f"  {kind[:-1]:6} {io['name']}  {io['shape']}  {io['dtype']}")
    out.print("  ops: " + ", ".join(f"{k}×{v}" for k, v in info["ops"].items()))
    import polars as pl

    units = pl.DataFrame([{**u, "op_types": ";".join(u["op_types"]), "nodes": ";".join(u["nodes"])} for u in info["units"]])
    out.print(_table(units, f"{units.height} units, {info['unit_params']:,} params ({info['unit_share']:.1%} of float weights)", ["unit", "shape", "params", "op_types", "nodes"]))
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
            out.print(f"  outputs that feed nothing (listed, not in the trajectory): {', '.join(rollout['unused_outputs'])}")
        if rollout.get("constant_inputs") and not rollout.get("single_step"):
            out.print(f"  inputs held constant: {', '.join(rollout['constant_inputs'])}")
    contexts = info["contexts"]
    line = f"contexts: an .npz with arrays {contexts['npz']}"
    if contexts["dynamic_axes"]:
        line += f"; --random-contexts needs {' '.join(f'--dim {d}=N' for d in contexts['dynamic_axes'])}"
    line += "".join(f"; '{name}' indexes a table of {rows} rows (random ids are drawn over them)" for name, rows in contexts["index_rows"].items())
    out.print(escape(line), highlight=False)
    if emit_spec is not None:
        write_spec(info, emit_spec, force)
        out.print(f"wrote {emit_spec}" + (" (ambiguous: uncomment one candidate)" if "candidates" in rollout else ""))


def _describe_rollout(rollout: dict) -> str:
    """One line: steps, edges and trajectory; a single-step model said plainly."""
    if not rollout["feedback"]:
        return f"rollout ({rollout['origin']}): single-step model, nothing fed back: T = {rollout['steps']}, trajectory = its float outputs {rollout['trajectory']}"

    def edge(e: dict) -> str:
        meaning = "" if e.get("output") or rollout["origin"] != "detected" else (" = observed/attended" if e.get("fill") else " = not padded/missing")
        source = e.get("output") or f"fill {e.get('fill')}{meaning}"
        extra = f", axis {e['axis']}" if e["mode"] == "shift" else ""
        extra += f", length {e['length']}" if e.get("length") else ""
        return f"{source} → {e['input']} ({e['mode']}{extra})"

    edges = "; ".join(edge(e) for e in rollout["feedback"])
    return f"rollout ({rollout['origin']}): {counted(rollout['steps'], 'step')}; {edges}; trajectory {rollout['trajectory']}"


@app.command()
@user_errors
def score(
    model: Path = typer.Argument(..., help="ONNX model file (never modified)."),
    contexts: Optional[Path] = typer.Option(None, "--contexts", "-c", help="Context windows: .npz (one array per input, leading axis = windows) or .csv. Required unless --random-contexts."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected from shapes when omitted."),
    steps: Optional[int] = typer.Option(None, "--steps", "-T", min=1, help="Rollout steps T (overrides the spec; default 8)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Run folder (default tqs-runs/<model stem>; <folder>_model for a file named model.onnx)."),
    probe: str = typer.Option("both", "--probe", metavar="quant|gauss|both", help="quant, gauss or both."),
    probe_bits: int = typer.Option(6, "--probe-bits", help="Bits of the symmetric per-tensor quantization probe."),
    probes: int = typer.Option(4, "--probes", help="Gaussian probe draws per unit."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Gaussian draws and random contexts."),
    eps: float = typer.Option(1e-12, "--eps", help="Added to ||dθ||² in the score's denominator."),
    dead_rtol: float = typer.Option(1e-6, "--dead-rtol", help="A unit is dead when its relative RMS trajectory divergence is at most this."),
    horizons: Optional[str] = typer.Option(None, "--horizons", help="Horizons to report γ at, e.g. 1,2,4,8 (default powers of 2 up to T)."),
    early_stop: bool = typer.Option(False, "--early-stop", help="Stop a rollout once γ has converged."),
    early_stop_tol: float = typer.Option(0.01, "--early-stop-tol", help="Convergence tolerance on γ (nats per step)."),
    early_stop_window: int = typer.Option(3, "--early-stop-window", help="Consecutive steps γ must stay within the tolerance."),
    min_params: int = typer.Option(1024, "--min-params", min=1, help="Smallest tensor that counts as a unit (drops biases and norm scales)."),
    include: Optional[str] = typer.Option(None, "--include", help="Regex: tensors that are units regardless of size or op."),
    exclude: Optional[str] = typer.Option(None, "--exclude", help="Regex: tensors that are never units."),
    granularity: str = typer.Option("tensor", "--granularity", metavar="tensor|block", help="tensor or block."),
    block_pattern: Optional[str] = typer.Option(None, "--block-pattern", help="Regex whose first group names a tensor's block."),
    windows: int = typer.Option(8, "--windows", min=1, help="Windows cut from a CSV (or random contexts)."),
    zscore: bool = typer.Option(False, "--zscore", help="Standardise CSV columns before cutting windows."),
    columns: Optional[str] = typer.Option(None, "--columns", help=COLUMNS_HELP),
    random_contexts: bool = typer.Option(False, "--random-contexts", help="Score on random windows instead of data (warns): float inputs standard normal, ids uniform over the rows of the table they index, masks all present."),
    dims: Optional[list[str]] = typer.Option(None, "--dim", metavar="NAME=SIZE", help="Size of a named dynamic input axis for --random-contexts, e.g. --dim seq=128 (repeatable)."),
    batch_windows: int = typer.Option(64, "--batch-windows", min=1, help="Most windows run as one batch."),
    provider: str = typer.Option("cpu", "--provider", metavar="cpu|cuda|tensorrt|trt-engine", help="cpu, cuda or tensorrt (ONNX Runtime execution providers), or trt-engine (native TensorRT, weights refitted)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="ONNX Runtime intra-op threads."),
    workers: int = typer.Option(1, "--workers", min=1, help="Processes (or Ray actors) running the sweep, one session each (threads split between them)."),
    lanes: Optional[int] = typer.Option(None, "--lanes", min=1, help="Rollouts run side by side in this process, sharing one session (CPU provider; default: one per core, up to 8 and 1 + 512 MiB / model size, threads split between them)."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Run the sweep on Ray: 'local' starts a local cluster, 'auto' or an address joins one (pip install 'tqsdeploy\\[ray]')."),
    strategy: str = typer.Option("auto", "--strategy", metavar="auto|feed|rebuild|unit|prefix|batch", help="feed (one session, weights fed per run), rebuild (a session per perturbation, constant weights), unit (a session per unit, only its weights fed), prefix (the first step runs only the graph downstream of the unit), batch (all of a unit's probes in one rollout, the batch tiled per probe; dynamic-batch models) or auto (time them, pick the cheapest)."),
    fresh: bool = typer.Option(False, "--fresh", help="Discard an existing run in the output folder."),
    resume: bool = typer.Option(False, "--resume", help="Require an interrupted run to continue (default: continue one if it matches)."),
    top: int = typer.Option(10, "--top", min=0, help="Rows shown of the most and least sensitive units."),
):
    """Score every weight tensor's quantization sensitivity by perturbed rollouts (TQS)."""
    from runtimes import make_runtime
    from tqsdeploy.contexts import describe_windows
    from tqsdeploy.score import FED_OPTIMIZED, ContextOptions, score as run_score
    from tqsdeploy.scoring import ScoreSettings
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
        horizons=_csv_ints(horizons, "--horizons"),
        early_stop=early_stop,
        early_stop_tol=early_stop_tol,
        early_stop_window=early_stop_window,
    )
    if probe == "gauss" and probes < 1:
        raise typer.BadParameter("--probe gauss needs --probes >= 1")
    selection = UnitSelection(min_params=min_params, include=include, exclude=exclude, granularity=granularity, block_pattern=block_pattern)
    progress = _progress("scoring", "rollouts")

    def on_start(total: int, done: int) -> None:
        if done:
            err.print(f"resuming: {done} of {total} rollouts already done")
        progress.start(total, done)

    def on_result(result) -> None:
        progress.advance(detail=result.unit[-40:])

    try:
        table = run_score(
            model,
            contexts,
            spec=spec,
            steps=steps,
            out=out_dir,
            selection=selection,
            settings=settings,
            runtime=make_runtime(provider, threads),
            context_options=ContextOptions(windows=windows, zscore=zscore, random=random_contexts, seed=seed, max_batch_windows=batch_windows, columns=_columns(columns),
                                           dims=_dims(dims)),
            resume=False if fresh else (True if resume else None),
            strategy=strategy,
            workers=workers,
            ray_address=ray,
            on_start=on_start,
            on_result=on_result,
            lanes=lanes,
            on_estimate=progress.estimate,
        )
    finally:
        progress.stop()
    for warning in table.meta.get("warnings", []):
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    frame = table.frame
    columns = ["rank", "unit", "shape", "params", "gamma", "gamma_quant", "gamma_gauss", "a_max", "dead"]
    if frame.height <= 2 * top:
        out.print(_table(frame, f"All {frame.height} units, most sensitive first", columns))
    else:
        out.print(_table(frame.head(top), f"Most sensitive units (of {frame.height})", columns))
        out.print(_table(frame.tail(top), "Least sensitive units", columns))
    meta = table.meta
    rho = meta.get("spearman_quant_gauss")
    cuts = f" ({len(meta['prefix_cuts'])} cuts)" if meta.get("prefix_cuts") else ""
    fed_runs = meta["strategy"] == "feed" or (meta["strategy"] == "prefix" and meta["rollout"]["steps"] > 1)  # prefix: steps 2..T
    if fed_runs and meta.get("fed_session") == FED_OPTIMIZED:
        cuts += ", weights fed in ONNX Runtime's layouts"
    out.print(
        f"{meta['units']} units, {meta['dead_units']} dead; rollout {counted(meta['rollout']['steps'], 'step')} ({meta['rollout']['origin']}); "
        f"{describe_windows(meta['contexts'])}; strategy {meta['strategy']}{cuts}{_lanes(meta)}; Spearman(γ_quant, γ_gauss) = {_fmt(rho)}; "
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


def _floats(text: str, option: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated numbers, e.g. 2,4,8") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise typer.BadParameter(f"{option} needs positive finite numbers, not {text!r}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise typer.BadParameter(f"{option} lists {', '.join(f'{v:g}' for v in repeated)} more than once")
    return values


def _say_sidecar(files, size: int, alternative: str | None = None) -> None:
    """Name a model's external-data file: shipped without it, the .onnx does not load."""
    if len(files) > 1:
        out.print(f"  [yellow]external data:[/] {escape(' + '.join(str(f) for f in files))}: the .onnx reads its weights from the .data file, "
                  f"so ship and keep both together in one folder" + (f" ({alternative})" if alternative and size < 2**31 else ""), soft_wrap=True)


def _refuse_overwrite(*paths, elsewhere: str = "-o / --out-dir") -> None:
    """Fail before any work when an output exists (--force overwrites)."""
    for path in paths:
        if Path(path).exists():
            raise InputError(f"{path} already exists", hint=f"pass --force to overwrite it, or choose another name with {elsewhere}")


def _feeds_matmul_integer_codes(encodings, layouts) -> bool:
    """Whether an export stores integer codes (DequantizeLinear) for a weight a MatMul reads: what ONNX
    Runtime fuses into MatMulNBits with int8 activations."""
    def integer(encoded) -> bool:
        if encoded.form == "split":
            return any(integer(part) for part in encoded.parts)
        return encoded.form == "dequantize" and not np.dtype(encoded.values.dtype).name.startswith("float")  # packed codes keep their type: no unpacking

    return any("MatMul" in layouts[name].op_types and integer(encoded) for name, encoded in encodings.items() if name in layouts)


def _layout_cost(outcome, settings) -> str:
    """What the written layout costs at run time, in one line."""
    memory = f"about {outcome.memory_bytes / 1e6:.3f} MB of weights in memory after load"
    chosen = f"{outcome.layout}" + (f" (auto for --target {settings.target})" if settings.runtime_layout == "auto" else "")
    if outcome.layout == "dequantized":
        return (f"{chosen}: ONNX Runtime rebuilds the float weights once when the session is created and runs the original's "
                f"kernels at its speed, exactly (no dequantization per call); {memory} (the original's float size; the file stays {outcome.file_bytes / 1e6:.3f} MB)")
    return (f"{chosen}: DequantizeLinear nodes; ONNX Runtime runs those before a MatMul as MatMulNBits (fast for few rows, "
            f"slower than float for batched calls) and the others on every call; {memory}")


def _check_output_file(path: Path, given: str | None, inputs) -> None:
    """An output must be a file name, and never one of the input model's files, --force or not."""
    if (given or "").endswith(("/", os.sep)) or path.is_dir():
        raise InputError(f"output {given or path} is a folder; name the file (or use --out-dir where the command has it)")
    for source in inputs:
        if source is not None and Path(source).exists() and path.exists() and os.path.samefile(path, source):
            raise InputError(f"output {path} is the input model's own file {source}; the input is never overwritten", hint="choose another name")


@app.command()
@user_errors
def export(
    model: Optional[Path] = typer.Argument(None, help="The scored ONNX model (default: the model of the run)."),
    compression: Optional[str] = typer.Option(None, "--C", help="Target compression(s), e.g. 4 or 2,4,8,16 (reference stored bits / exported stored bits; see --basis)."),
    uniform_tier: Optional[str] = typer.Option(None, "--uniform", metavar="TIER", help=f"Store every unit at this tier instead (a uniform baseline): {', '.join(TIERS)}."),
    run: Optional[Path] = typer.Option(None, "--run", help="Score run folder (default: the model's run in tqs-runs/; without a model, the only run there)."),
    tiers: Optional[str] = typer.Option(None, "--tiers", help=f"Tiers to choose from ({', '.join(TIERS)}); default {','.join(DEFAULT_TIERS)} (--target trt: {','.join(TRT_TIERS)})."),
    rounding: str = typer.Option("qep", "--rounding", metavar="|".join(METHODS), help="How codes are chosen on each tier's grid: rtn, gptq, gptaq or qep (calibrated on the run's contexts)."),
    target: str = typer.Option("ort-cpu", "--target", metavar="ort-cpu|ort-cuda|trt", help="Runtime the model is for: ort-cpu (default; 'ort' too), ort-cuda or trt (restricts tiers, trt uses symmetric grids; decides --runtime-layout auto)."),
    runtime_layout: str = typer.Option("auto", "--runtime-layout", metavar="auto|dequantized|fused", help="dequantized: codes rebuilt by plain ops ONNX Runtime folds into float weights at load (FP32 speed and memory, the small file); fused: DequantizeLinear (MatMulNBits on ORT, fast for few rows; what TensorRT needs); auto (default): dequantized for ort-cpu/ort-cuda, fused for trt."),
    group_size: Optional[int] = typer.Option(None, "--group-size", min=1, help="Blockwise integer quantization along the reduction axis (e.g. 32, 64, 128)."),
    objective: str = typer.Option("measured", "--objective", metavar="measured|response|paper", help="Allocation objective: measured, response or paper."),
    allocator: str = typer.Option("mckp", "--allocator", metavar="mckp|greedy", help="mckp (pulp, HiGHS then CBC) or greedy."),
    fp32_fraction: Optional[float] = typer.Option(None, "--fp32-fraction", min=0.0, max=1.0, help="Share of the units' FP32 size forced to FP32 for the most sensitive units (default 0.10 with --objective paper, else 0)."),
    no_fallback: bool = typer.Option(False, "--no-fallback", help="Ship the mixed allocation even if a uniform baseline within budget drifts less."),
    refine: int = typer.Option(2, "--refine", min=0, help="Rounds of joint re-pricing against interactions between units (2 joint rollouts per slot per round; 0: off)."),
    lanes: Optional[int] = typer.Option(None, "--lanes", min=1, help="Rollouts priced side by side (CPU provider; default: one per core, up to 8 and 1 + 512 MiB / model size, sessions of cores/lanes threads)."),
    split: float = typer.Option(0.02, "--split", min=0.0, max=0.99, help="Split units holding more than this share of the parameters into output-channel groups (0: never)."),
    basis: str = typer.Option("file", "--basis", metavar="file|units", help="What --C counts: file (every stored tensor) or units (the scored units only)."),
    output_given: Optional[str] = typer.Option(None, "-o", "--output", help="Output file (single target only)."),
    out_dir: Path = typer.Option(Path("."), "--out-dir", help="Folder for <stem>.C<C>.onnx files (a model named model.onnx adds its folder's name: <folder>_model.C<C>.onnx)."),
    provider: str = typer.Option("cpu", "--provider", metavar="cpu|cuda|tensorrt", help="Execution provider for the measurement rollouts."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing output files (default: refuse before any work)."),
    single_file: bool = typer.Option(False, "--single-file", help="Write every tensor inside the .onnx, no external-data file beside it (up to protobuf's 2 GiB; default: one file unless the input keeps its weights in external-data files or the output reaches 1 GiB)."),
    max_drift: Optional[float] = typer.Option(None, "--max-drift", min=0.0, help="Largest drift (%, as eval --exact reports it: exact dequantization) on the scoring contexts: a model drifting more is not written and export exits 1, like a failed gate."),
):
    """Allocate precision tiers under a compression target and write mixed-precision ONNX.

    Prints each model's drift from the original on the scoring contexts in percent (eval's unit) and warns above 5%.
    Exit codes: 0 written, 1 a model exceeded --max-drift (nothing written for it), 2 bad input."""
    from runtimes import OrtRuntime
    from tqsdeploy.export import ExportSettings, Planner, find_run

    output = Path(output_given) if output_given is not None else None  # the text kept: a trailing '/' means a folder
    if (compression is None) == (uniform_tier is None):
        raise typer.BadParameter("give exactly one of --C and --uniform")
    targets = _floats(compression, "--C") if compression is not None else [None]
    if output is not None and len(targets) > 1:
        raise typer.BadParameter("-o names one file; use --out-dir with several --C values")
    if output is not None and out_dir != Path("."):
        raise typer.BadParameter("give -o (one file) or --out-dir (a folder), not both")
    if tiers is not None and not [t for t in tiers.split(",") if t.strip()]:
        raise typer.BadParameter(f"--tiers names no tier: {tiers!r}")
    if tiers is not None and uniform_tier is not None:
        raise typer.BadParameter("--tiers is for --C (the tiers the allocation picks from); --uniform names its one tier")
    settings = ExportSettings(
        tiers=tuple(t.strip() for t in tiers.split(",") if t.strip()) if tiers else None,
        target=target,
        runtime_layout=runtime_layout,
        group_size=group_size,
        objective=objective,
        rounding=rounding,
        fp32_fraction=fp32_fraction,
        allocator=allocator,
        fallback=not no_fallback,
        refine=refine,
        split_fraction=split,
        basis=basis,
        lanes=lanes,
        single_file=single_file,
    )
    from tqsdeploy.files import check_writable

    check_writable(output.parent if output is not None else out_dir)  # before the work, not after it
    run_dir = find_run(model, run)
    planner = Planner(run_dir, model, settings, OrtRuntime(provider=provider), resumable=True)
    if compression:
        planner.check_targets(targets)
    planner.check_single_file(targets, uniform_tier)
    from tqsdeploy.score import model_label

    stem = model_label(planner.model.path)
    paths = [output or out_dir / f"{stem}.{f'C{value:g}' if value is not None else uniform_tier.lower()}.onnx" for value in targets]
    for path in paths:
        _check_output_file(path, output_given, (planner.model.path, *planner.model.external_files))
    if not force:
        for path in paths:
            _refuse_overwrite(path, f"{path.with_suffix('')}.allocation.json")
    progress = _progress("measuring tiers", "rollouts")

    pending = planner.pending_measurements() if compression else 0

    def on_result(result) -> None:
        if progress.total is None:
            progress.start(pending)
        progress.advance(detail=result.unit[-40:])

    encoding = []

    def on_pass(label: str, count: int, done: int) -> None:  # one display at a time: the tier measurements are over or not begun
        progress.stop()
        if done:
            err.print(f"encoding ({label}): resuming, {done} of {count} weights read from the checkpoints of an interrupted export")
        encoding[:] = [_progress(f"encoding ({label})", "weights")]
        encoding[0].start(count, done)
        if done >= count:
            encoding[0].stop()

    def on_weight(name: str) -> None:
        encoding[0].advance(detail=name[-40:])
        if encoding[0].done >= encoding[0].total:
            encoding[0].stop()

    planner.encoder.on_pass, planner.encoder.on_weight = on_pass, on_weight

    rows = []
    try:
        for index, (value, path) in enumerate(zip(targets, paths)):
            outcome = planner.export(value, path, uniform_tier=uniform_tier, on_result=on_result, max_drift_pct=max_drift, final=index == len(targets) - 1)
            fused = settings.layout == "fused" and _feeds_matmul_integer_codes(outcome.encodings, planner.layouts)
            outcome.encodings = {}  # written: the table and the record are what is left to show
            rows.append((value, outcome, fused))
        planner.discard_checkpoints()  # every model is written (or refused by --max-drift): nothing left to resume
    finally:
        progress.stop()
        for bar in encoding:
            bar.stop()
        planner.close()
    import polars as pl

    from tqsdeploy.export import WARN_DRIFT_PCT

    for value, outcome, fused in rows:
        if outcome.refused:
            err.print(f"[bold red]drift too large:[/] {escape(outcome.refused)}", soft_wrap=True)
            continue
        summary = outcome.table.group_by("tier").agg(pl.len().alias("slots"), pl.col("params").sum(), pl.col("bytes").sum())
        summary = summary.sort("bytes", descending=True)
        wanted = "uniform" if value is None else f"{value:g}x of the {settings.basis}"
        title = (
            f"{outcome.path}: target {wanted}; compression {outcome.compression:.3f}x of the file, {outcome.unit_compression:.3f}x of the units; "
            f"{outcome.file_bytes / 1e6:.3f} MB on disk; shipped {outcome.shipped}"
        )
        out.print(escape(title))
        _say_sidecar(outcome.files, outcome.file_bytes, "--single-file writes one file")
        out.print(_table(summary, "", ["tier", "slots", "params", "bytes"]))
        out.print(f"  runtime layout: {_layout_cost(outcome, settings)}")
        if outcome.drift is not None:
            compared = ", ".join(f"{c['label']}: {c['drift_pct']:.4g}%" for c in outcome.compared[1:])
            out.print(f"  drift from the original on the scoring contexts (exact dequantization): {outcome.drift_pct:.4g}%" + (f" (compared: {escape(compared)})" if compared else ""))
            if fused:
                out.print("  note: ONNX Runtime runs its DequantizeLinear→MatMul pairs as MatMulNBits with int8 activations by default, which can drift more: "
                          "`tqsdeploy eval` measures what it runs (`--exact` for this number)")
        for note in outcome.notes:
            out.print(f"  [yellow]note:[/] {escape(note)}")
        if outcome.drift_pct is not None and not outcome.drift_pct <= WARN_DRIFT_PCT:
            err.print(
                f"[bold yellow]warning:[/] {escape(str(outcome.path))} drifts {outcome.drift_pct:.4g}% from the original on the scoring contexts "
                f"(above {WARN_DRIFT_PCT:g}%): it may be badly damaged; check it with `tqsdeploy eval`, or pass --max-drift PCT to fail instead",
                soft_wrap=True,
            )
    written = [o for _, o, _ in rows if not o.refused]
    sidecars = sum(len(o.files) > 1 for o in written)
    out.print(f"wrote {len(written)} model(s) with .allocation.parquet/.json beside each" + (f", {sidecars} of them with an external-data file (listed above)" if sidecars else ""))
    if len(written) < len(rows):
        raise typer.Exit(1)


@app.command()
@user_errors
def baseline(
    model: Path = typer.Argument(..., help="ONNX model file (never modified)."),
    method: str = typer.Option(..., "--method", metavar="|".join(METHODS), help="rtn, gptq, gptaq or qep."),
    bits: int = typer.Option(..., "--bits", metavar="1|2|3|4|8", help="Bits per weight: 1, 2, 3, 4 or 8 (1 = sign(w)·mean|w|; 3-bit codes travel in 4-bit containers)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration windows (.npz in the contexts format, or a .csv cut into 8 windows); not needed for rtn."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec: calibrate on every step of the windows' nominal rollout (default: the windows alone)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Rollout steps calibrated on (overrides the spec)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", min=1, help="Input features per quantization group (default: per channel)."),
    symmetric: bool = typer.Option(False, "--symmetric", help="Symmetric grid (INT codes, no zero point) instead of the asymmetric default."),
    act_order: bool = typer.Option(False, "--act-order", help="GPTQ column order by decreasing Hessian diagonal (static groups)."),
    min_params: int = typer.Option(1024, "--min-params", min=1, help="Smallest tensor that is quantized."),
    output_given: Optional[str] = typer.Option(None, "-o", "--output", help="Output ONNX (default <stem>.<method>-w<bits>.onnx; a model named model.onnx adds its folder's name)."),
    runtime_layout: str = typer.Option("dequantized", "--runtime-layout", metavar="dequantized|fused", help="As export's: dequantized (default, export's pick for ort-cpu: float weights rebuilt at load) or fused (DequantizeLinear)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
):
    """Quantize every unit uniformly with RTN, GPTQ, GPTAQ or QEP (numpy, calibrated on ONNX Runtime)."""
    from tiers import Rounding
    from tqsdeploy.baselines import quantize_baseline, write_baseline
    from tqsdeploy.files import check_writable, write_json

    if method not in METHODS:
        raise typer.BadParameter(f"--method must be one of {', '.join(METHODS)}")
    if bits not in (1, 2, 3, 4, 8):
        raise typer.BadParameter("--bits must be 1, 2, 3, 4 or 8")
    if runtime_layout not in ("dequantized", "fused"):
        raise typer.BadParameter("--runtime-layout must be dequantized or fused")
    from tqsdeploy.score import model_label

    path = Path(output_given) if output_given is not None else Path(f"{model_label(model)}.{method}-w{bits}.onnx")
    _check_output_file(path, output_given, (model,))
    check_writable(path.parent)  # before the calibration, not after it
    if not force:
        _refuse_overwrite(path, str(path.with_suffix("")) + ".baseline.json", elsewhere="-o")
    with _progress(f"{method} W{bits}", "weights") as progress:
        result = quantize_baseline(
            model, method, bits, calib, spec=spec, steps=steps, group_size=group_size, symmetric=symmetric,
            rounding=Rounding(method, act_order=act_order), min_params=min_params,
            on_start=progress.start, on_weight=lambda name: progress.advance(detail=name[-40:]),
        )
    summary = write_baseline(model, result, path, runtime_layout)
    write_json(str(path.with_suffix("")) + ".baseline.json", summary)
    timings = summary["timings_s"]
    out.print(
        f"{path}: {method} W{bits} ({summary['tier']}), {summary['tensors']} tensors, compression {summary['compression']:.3f}x of the file "
        f"({summary['unit_compression']:.3f}x of the units), {summary['file_bytes'] / 1e6:.3f} MB; calibration {timings['calibration']:.2f} s"
    )
    _say_sidecar(summary["files"], summary["file_bytes"])
    if summary["layer_error"]:
        ratio = [summary["layer_error"][k] / summary["rtn_layer_error"][k] for k in summary["layer_error"] if summary["rtn_layer_error"].get(k)]
        if ratio:
            out.print(f"  layer reconstruction error vs round to nearest on the calibration data: median {float(np.median(ratio)):.3f}x")
    for name, reason in summary["rtn_only"].items():
        out.print(f"  note: '{escape(name)}' is rounded to nearest whatever the method: {escape(reason)}")
    for note in summary["notes"]:
        out.print(f"  note: {escape(note)}")


@app.command()
@user_errors
def frontier(
    model: Path = typer.Argument(..., help="ONNX model file (never modified)."),
    contexts: Path = typer.Option(..., "--contexts", "-c", help="Scoring contexts (.npz or .csv): TQS scores and calibration both use them."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected when omitted."),
    steps: Optional[int] = typer.Option(None, "--steps", "-T", min=1, help="Rollout steps."),
    truth: Optional[Path] = typer.Option(None, "--truth", help="Ground truth for the contexts (.npz); CSV contexts default to the rows after each window."),
    eval_contexts: Optional[Path] = typer.Option(None, "--eval-contexts", help="Held-out contexts: the report leads with them (scores on the scoring contexts flatter)."),
    eval_truth: Optional[Path] = typer.Option(None, "--eval-truth", help="Ground truth for the held-out contexts."),
    targets: str = typer.Option("2,4,8,12,16", "--C", help="TQS-PTQ compression targets (points matched to every baseline are added)."),
    baselines: str = typer.Option(",".join(METHODS), "--baselines", help="Uniform baselines ('' for none)."),
    bits: str = typer.Option("2,4,8", "--bits", help="Baseline bit widths."),
    tiers: str = typer.Option(",".join(DEFAULT_TIERS), "--tiers", help="TQS-PTQ tiers."),
    rounding: str = typer.Option("qep", "--rounding", metavar="|".join(METHODS), help="TQS-PTQ's rounding method."),
    objective: str = typer.Option("measured", "--objective", metavar="measured|response|paper", help="TQS-PTQ's allocation objective."),
    also: Optional[str] = typer.Option(None, "--also", help="Extra TQS-PTQ lines as objective/rounding, e.g. paper/rtn,measured/gptq."),
    group_size: Optional[int] = typer.Option(None, "--group-size", min=1, help="Blockwise integer tiers."),
    variable_axis: Optional[int] = typer.Option(None, "--variable-axis", help="Per-step output axis to report per variable (win counts)."),
    min_params: int = typer.Option(1024, "--min-params", min=1, help="Smallest tensor quantized (by every method alike)."),
    buckets: Optional[str] = typer.Option(None, "--buckets", help="Role buckets by name, e.g. 'input=embed|patch,output=head' (default: from the graph structure)."),
    exact: bool = typer.Option(False, "--exact", help="Evaluate with exact dequantization."),
    columns: Optional[str] = typer.Option(None, "--columns", help=COLUMNS_HELP),
    latency: bool = typer.Option(False, "--latency", help="Also time every model against the original (as eval does, on the first split's windows): latency_ms, reference_latency_ms and slowdown columns; about 1 s and two sessions per point."),
    out_dir: Path = typer.Option(None, "--out", "-o", help="Output folder (default tqs-frontier/<model stem>; <folder>_model for a file named model.onnx)."),
):
    """Score once, export TQS-PTQ at every C, run the uniform baselines, evaluate all, and report."""
    from tqsdeploy.evaluate import EvalSettings
    from tqsdeploy.export import ExportSettings
    from tqsdeploy.frontier import FrontierSettings, run_frontier
    from tqsdeploy.report import build_report

    from tiers import get_tiers

    patterns = None
    if buckets:
        items = [item.strip() for item in buckets.split(",") if item.strip()]
        if not items or any("=" not in item for item in items):
            raise typer.BadParameter(f"--buckets takes ROLE=REGEX items, e.g. 'input=embed|patch,output=head', not {buckets!r}")
        patterns = dict(item.split("=", 1) for item in items)
    tier_names = tuple(t.strip() for t in tiers.split(",") if t.strip())
    get_tiers(tier_names, "ort", group_size)  # unknown names fail now, not after the score
    if baselines.strip() and any(b not in (1, 2, 3, 4, 8) for b in _floats(bits, "--bits")):
        raise typer.BadParameter(f"--bits takes 1, 2, 3, 4 and 8, not {bits!r}")
    base = ExportSettings(tiers=tier_names, group_size=group_size, rounding=rounding, objective=objective)
    variants = []
    for item in (also or "").split(","):
        if item.strip():
            chosen_objective, _, chosen_rounding = item.strip().partition("/")
            variant = ExportSettings(tiers=tier_names, group_size=group_size, objective=chosen_objective, rounding=chosen_rounding or rounding)
            variants.append((f"TQS-PTQ {variant.objective}/{variant.rounding}", variant))
    settings = FrontierSettings(
        targets=tuple(_floats(targets, "--C")),
        baselines=tuple(b.strip() for b in baselines.split(",") if b.strip()),
        bits=tuple(int(b) for b in _floats(bits, "--bits")) if baselines.strip() else (),
        export=base,
        variants=tuple(variants),
        evaluation=EvalSettings(exact=exact, variable_axis=variable_axis, columns=_columns(columns), latency=_latency(not latency, None)),
        min_params=min_params,
    )
    for method in settings.baselines:
        if method not in METHODS:
            raise typer.BadParameter(f"--baselines takes {', '.join(METHODS)}, not '{method}'")
    from tqsdeploy.score import model_label

    folder = out_dir or Path("tqs-frontier") / model_label(model)
    with _progress("frontier", "steps") as progress:
        frame = run_frontier(
            model, contexts, folder, spec=spec, steps=steps, truth=truth, eval_contexts=eval_contexts, eval_truth=eval_truth,
            settings=settings, progress=progress,
        )
    md, page = build_report(folder, model, patterns)
    import polars as pl

    split = "held-out" if eval_contexts else "scoring"
    shown = frame.filter((pl.col("variable") == "all") | pl.col("variable").is_null()).filter(pl.col("split") == split)
    metric = "degradation_pct"
    out.print(_table(shown.sort(["family", "method", "achieved_C"]), f"Frontier ({split} contexts)", ["method", "setting", "achieved_C", "file_bytes", "mae_ref", "mae_truth", metric, "status"]))
    out.print(f"wrote {folder}/frontier.parquet, {md}, {page} and plots")


@app.command()
@user_errors
def engine(
    model: Path = typer.Argument(..., help="ONNX model, e.g. one exported with --target trt."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Engine file (default <stem>.plan)."),
    max_batch: int = typer.Option(64, "--max-batch", min=1, help="Largest batch of the optimisation profile."),
    opt_batch: int = typer.Option(8, "--opt-batch", min=1, help="Batch TensorRT tunes for."),
    fp16: bool = typer.Option(False, "--fp16", help="Allow FP16 kernels."),
):
    """Build a TensorRT engine from an ONNX model (needs a GPU and the gpu extra)."""
    from runtimes.trt import build_engine

    import graph_ops

    graph_ops.load_model(model)  # same input checks as everywhere
    path = build_engine(model, output or model.with_suffix(".plan"), max_batch=max_batch, opt_batch=opt_batch, fp16=fp16)
    out.print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


def _bounds_from_options(max_degradation, min_compression, max_size, per_output, min_cosine=None):
    from tqsdeploy.gate import Bounds, parse_percent, parse_size

    per = {}
    for item in per_output or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter("--max-degradation-output takes OUTPUT=PERCENT, e.g. y=2%")
        if name in per:
            raise typer.BadParameter(f"--max-degradation-output gives output '{name}' twice")
        per[name] = parse_percent(value, "--max-degradation-output")
    if min_compression is not None and not (math.isfinite(min_compression) and min_compression > 0):
        raise typer.BadParameter(f"--min-compression must be a positive finite number, not {min_compression}")
    if min_cosine is not None and not -1 <= min_cosine <= 1:
        raise typer.BadParameter(f"--min-cosine is a cosine similarity between -1 and 1, not {min_cosine}")
    return Bounds(
        min_cosine=min_cosine,
        max_degradation=parse_percent(max_degradation, "--max-degradation") if max_degradation else None,
        min_compression=min_compression,
        max_size=parse_size(max_size) if max_size else None,
        per_output=per,
    )


LATENCY_HELP = ("Skip timing candidate and reference (by default both are open at once and called in alternation at the eval's batch: "
                "3 warm-up calls each, then at least 10 paired rounds and 1 s; median, p10/p90 and memory in the report).")
BATCHES_HELP = "Windows per call to time, e.g. 1,8 (default: the eval's own batch, every window in one call)."


def _latency(off: bool, batches: Optional[str]):
    """The latency settings the options ask for (None: not measured)."""
    from tqsdeploy.latency import LatencySettings

    sizes = _csv_ints(batches, "--latency-batches")
    if sizes is not None and (not sizes or min(sizes) < 1):
        raise typer.BadParameter("--latency-batches takes positive window counts, e.g. 1,8")
    if off:
        if sizes is not None:
            raise typer.BadParameter("--latency-batches asks for the timing that --no-latency turns off")
        return None
    return LatencySettings(batches=sizes)


@app.command("eval")
@user_errors
def eval_command(
    candidate: Path = typer.Argument(..., help="The compressed ONNX model."),
    reference: Path = typer.Option(..., "--reference", "-r", help="The original ONNX model."),
    contexts: Path = typer.Option(..., "--contexts", "-c", help="Context windows: .npz (one array per input) or .csv (numeric columns, cut into --windows windows)."),
    truth: Optional[Path] = typer.Option(None, "--truth", help="Ground truth (.npz, one array per trajectory output, (windows, steps, *output)); CSV contexts default to the rows after each window."),
    windows: int = typer.Option(8, "--windows", min=1, help="Windows cut from a CSV."),
    zscore: bool = typer.Option(False, "--zscore", help="Standardise CSV columns before cutting windows."),
    columns: Optional[str] = typer.Option(None, "--columns", help=COLUMNS_HELP),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected when omitted."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Rollout steps."),
    exact: bool = typer.Option(False, "--exact", help="Exact dequantization instead of ONNX Runtime's default int8-activation MatMulNBits."),
    variable_axis: Optional[int] = typer.Option(None, "--variable-axis", help="Axis of each per-step output to report per variable."),
    cosine: Optional[bool] = typer.Option(None, "--cosine/--no-cosine", help="Cosine similarity and nearest-neighbour agreement of the output vectors (last axis): --cosine for every output, --no-cosine for none (default: outputs named like embeddings, e.g. embedding, pooled, sentence, last_hidden_state, shaped [batch, dim] or [batch, tokens, dim])."),
    provider: str = typer.Option("cpu", "--provider", metavar="cpu|cuda|tensorrt", help="cpu, cuda or tensorrt."),
    report: Optional[Path] = typer.Option(None, "--report", help="Report prefix (writes PREFIX.json and PREFIX.md; default <candidate stem>.eval)."),
    no_latency: bool = typer.Option(False, "--no-latency", help=LATENCY_HELP),
    latency_batches: Optional[str] = typer.Option(None, "--latency-batches", help=BATCHES_HELP),
):
    """Roll out candidate and reference from the same contexts and compare them (and the truth), and time both."""
    from tqsdeploy.evaluate import EvalSettings, evaluate, markdown, write_report
    from tqsdeploy.files import check_writable

    settings = EvalSettings(exact=exact, provider=provider, variable_axis=variable_axis, windows=windows, zscore=zscore, columns=_columns(columns), cosine=cosine,
                            latency=_latency(no_latency, latency_batches))
    report = report or candidate.with_suffix("").with_name(candidate.stem + ".eval")
    check_writable(report.parent)  # before the rollouts, so a bad --report throws no results away
    result = evaluate(candidate, reference, contexts, spec=spec, steps=steps, truth=truth, settings=settings)
    json_path, md_path = write_report(result, report)
    out.print(markdown(result), markup=False)
    out.print(f"wrote {json_path} and {md_path}")


@app.command()
@user_errors
def gate(
    candidate: Path = typer.Argument(..., help="The compressed ONNX model."),
    reference: Path = typer.Option(..., "--reference", "-r", help="The original ONNX model."),
    contexts: Path = typer.Option(..., "--contexts", "-c", help="Context windows: .npz (one array per input) or .csv (numeric columns, cut into --windows windows)."),
    truth: Optional[Path] = typer.Option(None, "--truth", help="Ground truth (.npz); CSV contexts default to the rows after each window; without any, degradation is the drift from the reference."),
    windows: int = typer.Option(8, "--windows", min=1, help="Windows cut from a CSV."),
    zscore: bool = typer.Option(False, "--zscore", help="Standardise CSV columns before cutting windows."),
    columns: Optional[str] = typer.Option(None, "--columns", help=COLUMNS_HELP),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Rollout steps."),
    max_degradation: Optional[str] = typer.Option(None, "--max-degradation", help="Largest allowed degradation on every output, e.g. 1%."),
    per_output: Optional[list[str]] = typer.Option(None, "--max-degradation-output", help="Per-output bound OUTPUT=PERCENT (repeatable)."),
    min_compression: Optional[float] = typer.Option(None, "--min-compression", help="Smallest allowed compression (reference / candidate weight bytes)."),
    max_size: Optional[str] = typer.Option(None, "--max-size", help="Largest allowed candidate file, e.g. 12MB."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Smallest allowed cosine similarity of any output vector to its reference (outputs with cosine metrics, see --cosine), e.g. 0.99."),
    cosine: Optional[bool] = typer.Option(None, "--cosine/--no-cosine", help="Cosine similarity and nearest-neighbour agreement of the output vectors (last axis): --cosine for every output, --no-cosine for none (default: outputs named like embeddings, e.g. embedding, pooled, sentence, last_hidden_state, shaped [batch, dim] or [batch, tokens, dim])."),
    exact: bool = typer.Option(False, "--exact", help="Exact dequantization instead of what ONNX Runtime runs by default."),
    provider: str = typer.Option("cpu", "--provider", metavar="cpu|cuda|tensorrt", help="cpu, cuda or tensorrt."),
    report_dir: Path = typer.Option(Path("gate-report"), "--report-dir", help="Where gate.json, gate.md and junit.xml go."),
    max_slowdown: Optional[float] = typer.Option(None, "--max-slowdown", help="Largest allowed candidate/reference median latency at every measured batch, e.g. 1.1."),
    no_latency: bool = typer.Option(False, "--no-latency", help=LATENCY_HELP),
    latency_batches: Optional[str] = typer.Option(None, "--latency-batches", help=BATCHES_HELP),
):
    """Exit 1 when the candidate violates any bound, 0 when it meets them all."""
    from tqsdeploy.evaluate import EvalSettings, evaluate
    from tqsdeploy.gate import check, gate_markdown, write_outputs

    from tqsdeploy.files import check_writable

    bounds = _bounds_from_options(max_degradation, min_compression, max_size, per_output, min_cosine)
    if max_slowdown is not None:
        if not (math.isfinite(max_slowdown) and max_slowdown > 0):
            raise typer.BadParameter(f"--max-slowdown must be a positive finite ratio, not {max_slowdown}")
        if no_latency:
            raise typer.BadParameter("--max-slowdown needs the latency measurement that --no-latency turns off")
        bounds.max_slowdown = max_slowdown
    settings = EvalSettings(exact=exact, provider=provider, windows=windows, zscore=zscore, columns=_columns(columns), cosine=cosine, latency=_latency(no_latency, latency_batches))
    check_writable(report_dir)  # before the rollouts
    result = evaluate(candidate, reference, contexts, spec=spec, steps=steps, truth=truth, settings=settings)
    checks = check(result, bounds)
    paths = write_outputs(result, checks, report_dir)
    out.print(gate_markdown(result, checks), markup=False)
    out.print(f"wrote {paths['json']}, {paths['markdown']}, {paths['junit']}")
    if not all(c.passed for c in checks):
        err.print("gate failed: " + "; ".join(f"{c.name} = {c.shown} violates {c.bound}" for c in checks if not c.passed), markup=False)
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
