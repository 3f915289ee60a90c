"""The command's frame: the typer app, one-line errors and exit codes, the consoles, and what several commands
share (value parsers, tables, progress, option definitions). Each command lives in its own module of this package.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

try:  # typer >= 0.29 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions
from runtimes import RUNTIMES, provider_names
from tiers import METHODS
from tqsdeploy.errors import USER_ERRORS, BoundUnmet
from tqsdeploy.sweep.strategies import AUTO, AUTO_HELP, BY_NAME, strategy_names

ABORT = getattr(click_exceptions, "Abort", None) or typer.Abort  # typer 0.29's click copy keeps Abort in typer itself


def _flags_without_types(params: list) -> list:
    """Boolean flags with no type beside them in --help: typer shows `<bool>` after `--no-latency`, which reads as a
    flag that takes a value (`--no-latency true`: 'unexpected extra argument')."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # shown as nothing; a flag reads no value, so nothing else uses it
    return params


class _Command(typer.core.TyperCommand):
    """Every command's class: its flags read as flags in --help (`_flags_without_types`)."""

    def get_params(self, ctx):
        return _flags_without_types(super().get_params(ctx))


class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a wrong option, a bad value) as one line on stderr and exit 2, like every other input error."""

    def get_params(self, ctx):
        return _flags_without_types(super().get_params(ctx))

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
            err.print(
                f"[bold red]error:[/] {escape(exc.format_message())}{escape(where)}", highlight=False, soft_wrap=True
            )
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
        single = {
            flag: param
            for param in command.params
            if getattr(param, "opts", None) and not getattr(param, "multiple", False)
            for flag in (*param.opts, *getattr(param, "secondary_opts", ()))
        }
        seen: dict[str, int] = {}
        for arg in args[args.index(name) + 1 :]:
            if arg == "--":
                break
            param = single.get(arg.split("=", 1)[0])
            if param is not None and param.param_type_name == "option":
                flag = max(param.opts, key=len)
                seen[flag] = seen.get(flag, 0) + 1
        repeated = [flag for flag, count in seen.items() if count > 1]
        if repeated:
            raise click_exceptions.UsageError(
                f"{', '.join(repeated)} given more than once; give {'it' if len(repeated) == 1 else 'each'} once"
            )


class _App(typer.Typer):
    """The typer app whose commands are `_Command`s."""

    def command(self, *args, cls=None, **settings):
        return super().command(*args, cls=cls or _Command, **settings)


app = _App(
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
        from tqsdeploy._version import __version__

        out.print(f"tqsdeploy {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Trajectory-based quantization sensitivity (TQS) and mixed-precision PTQ for ONNX forecasting models."""
    from runtimes import return_large_allocations

    return_large_allocations()  # weight-sized arrays go back to the OS when freed, not into a heap that only grows


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


INTERRUPTED = {
    "score": "finished rollouts are saved in the run folder (sweep.jsonl); run the same command again to resume",
    "export": "the run folder keeps the measured tier prices (measured.jsonl) "
    "and every weight a pass finished (export-cache/); "
    "run the same command again to resume from them",
    "frontier": "it keeps every finished export and evaluation (frontier-progress.jsonl), "
    "and its score run the finished rollouts, the measured tier prices and every weight a calibration pass finished; "
    "run the same command again to resume from them",
}
"""What an interrupted command kept, by command; the others write each output whole or not at all."""


def user_errors(command):
    """Turn user errors into one line + exit 2, bugs (an `InternalError`, or any exception nothing expects) into
    one line + exit 3 (TQS_DEBUG=1 raises them, traceback and all), Ctrl-C into what it kept and exit 130."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from tiers.solver_backend import environment_problem

        if problem := environment_problem():
            fail(problem)
        try:
            return command(*args, **kwargs)
        except (typer.Exit, click_exceptions.ClickException):
            raise
        except BoundUnmet as exc:  # before USER_ERRORS: a bound out of reach fails like a gate
            fail(str(exc), code=1)
        except USER_ERRORS as exc:
            fail(str(exc))
        except OSError as exc:  # disk full, permissions, a vanished folder: the machine's state, not a bug
            where = f" {exc.filename}" if exc.filename else ""
            fail(f"cannot use{where}: {exc.strerror or exc}")
        except KeyboardInterrupt:
            kept = INTERRUPTED.get(
                command.__name__, "no partial output was left (every file is written whole or not at all)"
            )
            err.print(f"interrupted: {kept}", soft_wrap=True)
            raise typer.Exit(130)
        except Exception as exc:  # a bug: an `InternalError` (an invariant broke) or what nothing above expects
            if os.environ.get("TQS_DEBUG"):
                raise
            fail(
                f"internal error ({type(exc).__name__}: {exc}); "
                "rerun with TQS_DEBUG=1 for a traceback and please report it",
                code=3,
            )

    return wrapper


def split_list(text: str, option: str) -> list[str]:
    """A comma-separated option's items, stripped; an empty item ('4,,8', '4,') is refused: a typo
    there would otherwise drop a value silently."""
    items = [item.strip() for item in text.split(",")]
    if "" in items:
        raise typer.BadParameter(f"{option} has an empty item in {text!r} (a doubled, leading or trailing comma)")
    return items


def parse_ints(text: Optional[str], option: str) -> Optional[tuple[int, ...]]:
    if not text:
        return None
    items = split_list(text, option)
    try:
        return tuple(int(v) for v in items)
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated integers, e.g. 1,2,4,8") from None


def parse_columns(text: Optional[str]) -> Optional[tuple[str, ...]]:
    """--columns a,b,c as a tuple of CSV column names, each once."""
    if text is None:
        return None
    names = tuple(split_list(text, "--columns"))
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise typer.BadParameter(f"--columns names '{repeated[0]}' more than once")
    return names


def print_warnings(warnings) -> None:
    """What the contexts (or the sweep) warned about, one line each on stderr: score, eval and gate say them alike."""
    for warning in warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)


def csv_windows(windows: Optional[int], contexts: Optional[Path]) -> int:
    """--windows as given, else 8; refused with an .npz, which holds its own windows (and would ignore it without
    a word)."""
    if windows is not None and contexts is not None and Path(contexts).suffix.lower() == ".npz":
        raise typer.BadParameter(
            "--windows cuts windows from a CSV (or sizes random contexts); "
            f"{contexts} holds its own windows, all of which are used"
        )
    return 8 if windows is None else windows


def parse_dims(items: Optional[list[str]]) -> tuple[tuple[str, int], ...]:
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


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def progress_bar(description: str, unit: str, total: int | None = None):
    """The one progress display (tqsdeploy.progress): a bar on a terminal, periodic lines with ETA elsewhere; on
    stderr."""
    from tqsdeploy.progress import Progress

    return Progress(err, description, total, unit)


LABELS = {"gamma": "γ", "gamma_quant": "γ quant", "gamma_gauss": "γ gauss", "a_max": "A max", "params": "params"}
ONNX_NAME = "onnx name"
"""The column beside a unit's or slot's label that keeps its ONNX name (`labelled`)."""


def labelled(frame, key: str = "unit"):
    """A table whose `key` column reads as users know their model: the label (the module path where the exporter
    generated the ONNX name, `graph_ops.names`), with the ONNX name in an `onnx name` column beside it when any
    label differs from it."""
    import polars as pl

    if "label" not in frame.columns:
        return frame
    label = pl.col("label").fill_null(pl.col(key))
    if frame.filter(label != pl.col(key)).height == 0:
        return frame
    return frame.with_columns(pl.col(key).alias(ONNX_NAME), label.alias(key))


def name_columns(frame, key: str = "unit") -> list[str]:
    """The name columns of a `labelled` table: the label, and the ONNX name where it differs."""
    return [key, ONNX_NAME] if ONNX_NAME in frame.columns else [key]


def frame_table(frame, title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        text = column in ("unit", "slot", ONNX_NAME, "shape", "op_types", "nodes")
        table.add_column(
            LABELS.get(column, column),
            justify="left" if text else "right",
            overflow="fold" if text else "ellipsis",
            no_wrap=not text,
        )
    for row in frame.iter_rows(named=True):
        table.add_row(*[fmt(row.get(c)) for c in columns])
    return table


def parse_floats(text: str, option: str) -> list[float]:
    items = split_list(text, option) if text.strip() else []
    try:
        values = [float(v) for v in items]
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated numbers, e.g. 2,4,8") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise typer.BadParameter(f"{option} needs positive finite numbers, not {text!r}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise typer.BadParameter(f"{option} lists {', '.join(f'{v:g}' for v in repeated)} more than once")
    return values


class _Live:
    """An option's setting that may be a function, called whenever typer reads it: typer builds a command's options
    anew on every invocation, so choices read off a registry are the registry's entries as they are then."""

    def __set_name__(self, owner, name: str) -> None:
        self.key = f"_live_{name}"

    def __get__(self, info, owner=None):
        if info is None:
            return self
        value = info.__dict__.get(self.key)
        return value() if callable(value) else value

    def __set__(self, info, value) -> None:
        info.__dict__[self.key] = value


class _LiveOption(typer.models.OptionInfo):
    default, metavar, help = _Live(), _Live(), _Live()


def live_option(
    default,
    *decls: str,
    metavar: Callable[[], str] | str | None = None,
    help: Callable[[], str] | str | None = None,
    **settings,
) -> typer.models.OptionInfo:
    """`typer.Option` whose default, metavar and help may be functions, read off a registry when the command is
    built."""
    return _LiveOption(default=default, param_decls=decls, metavar=metavar, help=help, **settings)


def or_list(names) -> str:
    """'a, b or c', as help text lists choices."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def rounding_choices() -> str:
    """`--rounding`'s metavar: every method of `tiers.METHODS`, then auto."""
    return "|".join((*METHODS, "auto"))


def provider_help(sweep: bool) -> str:
    """The providers a command offers (`runtimes.provider_names`), grouped by engine where a sweep offers several."""
    if not sweep:
        return f"{or_list(provider_names())}."
    engines: dict[str, list[str]] = {}
    for name in provider_names(sweep=True):
        engines.setdefault(RUNTIMES[name].engine, []).append(name)
    return ", or ".join(f"{or_list(names)} ({engine})" for engine, names in engines.items()) + "."


def strategy_help() -> str:
    """`--strategy`'s help: each strategy of `sweep.strategies.BY_NAME` with its line, then auto."""
    return or_list([*(f"{name} ({cls.help})" for name, cls in BY_NAME.items()), f"{AUTO} ({AUTO_HELP})"]) + "."


def strategy_choices() -> str:
    return "|".join(strategy_names())


LATENCY_HELP = (
    "Skip timing candidate and reference "
    "(by default both are open at once and called in alternation at the eval's batch: "
    "3 warm-up calls each, then at least 10 paired rounds and 1 s; median, p10/p90 and memory in the report)."
)
BATCHES_HELP = "Windows per call to time, e.g. 1,8 (default: the eval's own batch, every window in one call)."
COSINE_HELP = (
    "Cosine similarity and nearest-neighbour agreement of the output vectors (last axis): "
    "--cosine for every output, --no-cosine for none "
    "(default: outputs named like embeddings, e.g. embedding, pooled, sentence, last_hidden_state, "
    "shaped \\[batch, dim] or \\[batch, tokens, dim])."
)

# Options several commands share, defined once (typer reads each as a description, so one may serve many commands).
COLUMNS = typer.Option(None, "--columns", help=COLUMNS_HELP)
ZSCORE = typer.Option(False, "--zscore", help="Standardise CSV columns before cutting windows.")
CSV_WINDOWS = typer.Option(None, "--windows", min=1, help="Windows cut from a CSV (default 8).")
CANDIDATE = typer.Argument(..., help="The compressed ONNX model.")
REFERENCE = typer.Option(..., "--reference", "-r", help="The original ONNX model.")
EVAL_CONTEXTS = typer.Option(
    ...,
    "--contexts",
    "-c",
    help="Context windows: .npz (one array per input) or .csv (numeric columns, cut into --windows windows).",
)
COSINE = typer.Option(None, "--cosine/--no-cosine", help=COSINE_HELP)
EVAL_PROVIDER = live_option(
    "cpu", "--provider", metavar=lambda: "|".join(provider_names()), help=lambda: provider_help(sweep=False)
)
NO_LATENCY = typer.Option(False, "--no-latency", help=LATENCY_HELP)
LATENCY_BATCHES = typer.Option(None, "--latency-batches", help=BATCHES_HELP)


def latency_settings(off: bool, batches: Optional[str]):
    """The latency settings the options ask for (None: not measured)."""
    from tqsdeploy.evaluation.latency import LatencySettings

    sizes = parse_ints(batches, "--latency-batches")
    if sizes is not None and (not sizes or min(sizes) < 1):
        raise typer.BadParameter("--latency-batches takes positive window counts, e.g. 1,8")
    if off:
        if sizes is not None:
            raise typer.BadParameter("--latency-batches asks for the timing that --no-latency turns off")
        return None
    return LatencySettings(batches=sizes)
