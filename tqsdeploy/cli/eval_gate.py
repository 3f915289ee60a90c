"""`engine`, `eval` and `gate`: a TensorRT engine from a model, and a candidate measured against its reference."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import typer

from tqsdeploy.cli.app import (
    CANDIDATE,
    COLUMNS,
    COSINE,
    CSV_WINDOWS,
    EVAL_CONTEXTS,
    EVAL_PROVIDER,
    LATENCY_BATCHES,
    NO_LATENCY,
    REFERENCE,
    ZSCORE,
    app,
    csv_windows,
    err,
    latency_settings,
    out,
    parse_columns,
    print_warnings,
    user_errors,
)


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
    import graph_ops
    from runtimes import build_engine

    graph_ops.load_model(model)  # same input checks as everywhere
    path = build_engine(
        model, output or model.with_suffix(".plan"), max_batch=max_batch, opt_batch=opt_batch, fp16=fp16
    )
    out.print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


def _bounds_from_options(
    max_degradation,
    min_compression,
    max_size,
    per_output,
    min_cosine,
    max_slowdown,
    no_latency,
    on,
    max_drift_std,
    max_memory=None,
):
    """gate's bounds, each option checked in turn (the first wrong one is the one reported)."""
    from tqsdeploy.evaluation.gate import JUDGED, Bounds, parse_memory, parse_percent, parse_size

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
    degradation = parse_percent(max_degradation, "--max-degradation") if max_degradation else None
    drift_std = parse_percent(max_drift_std, "--max-drift-std") if max_drift_std else None
    if on not in JUDGED:
        raise typer.BadParameter(f"--on takes {', '.join(JUDGED)}, not '{on}'")
    size = parse_size(max_size) if max_size else None
    if max_slowdown is not None:
        if not (math.isfinite(max_slowdown) and max_slowdown > 0):
            raise typer.BadParameter(f"--max-slowdown must be a positive finite ratio, not {max_slowdown}")
        if no_latency:
            raise typer.BadParameter("--max-slowdown needs the latency measurement that --no-latency turns off")
    memory = parse_memory(max_memory) if max_memory else (None, None)
    if max_memory and no_latency:
        raise typer.BadParameter("--max-memory needs the memory measurement that --no-latency turns off")
    return Bounds(
        max_memory=memory,
        max_degradation=degradation,
        min_compression=min_compression,
        max_size=size,
        per_output=per,
        min_cosine=min_cosine,
        max_slowdown=max_slowdown,
        on=on,
        max_drift_std=drift_std,
    )


def _report_prefix(candidate: Path, report: Optional[str]) -> Path:
    """eval's --report: a prefix, or a folder (an existing one, or a path ending in /) for the default names."""
    name = candidate.stem + ".eval"
    if report is None:
        return candidate.with_name(name)
    if (
        report.endswith(("/", os.sep)) or Path(report).is_dir()
    ):  # a folder: the default names inside it, as its reader expects
        return Path(report) / name
    return Path(report)


@app.command("eval")
@user_errors
def eval_command(
    candidate: Path = CANDIDATE,
    reference: Path = REFERENCE,
    contexts: Path = EVAL_CONTEXTS,
    truth: Optional[Path] = typer.Option(
        None,
        "--truth",
        help="Ground truth (.npz, one array per trajectory output, (windows, steps, *output)); "
        "CSV contexts default to the rows after each window.",
    ),
    windows: Optional[int] = CSV_WINDOWS,
    zscore: bool = ZSCORE,
    columns: Optional[str] = COLUMNS,
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected when omitted."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Rollout steps."),
    exact: bool = typer.Option(
        False, "--exact", help="Exact dequantization instead of ONNX Runtime's default int8-activation MatMulNBits."
    ),
    variable_axis: Optional[int] = typer.Option(
        None, "--variable-axis", help="Axis of each per-step output to report per variable."
    ),
    cosine: Optional[bool] = COSINE,
    provider: str = EVAL_PROVIDER,
    report: Optional[str] = typer.Option(
        None,
        "--report",
        metavar="PATH",
        help="Report prefix: writes PREFIX.json and PREFIX.md (default <candidate stem>.eval beside the candidate); "
        "an existing folder or a path ending in / gets <candidate stem>.eval.json and .md inside it.",
    ),
    no_latency: bool = NO_LATENCY,
    latency_batches: Optional[str] = LATENCY_BATCHES,
):
    """Roll out candidate and reference from the same contexts and compare them (and the truth), and time both."""
    from graph_ops.io import OutputError
    from tqsdeploy.errors import InputError
    from tqsdeploy.evaluation.eval_report import markdown
    from tqsdeploy.evaluation.evaluate import EvalRequest, EvalSettings, run_eval
    from tqsdeploy.files import check_writable

    settings = EvalSettings(
        exact=exact,
        provider=provider,
        variable_axis=variable_axis,
        windows=csv_windows(windows, contexts),
        zscore=zscore,
        columns=parse_columns(columns),
        cosine=cosine,
        latency=latency_settings(no_latency, latency_batches),
        memory=not no_latency,
    )
    prefix = _report_prefix(candidate, report)
    try:
        check_writable(prefix.parent)  # before the rollouts, so a bad --report throws no results away
    except OutputError as exc:
        if report is not None:
            raise
        raise InputError(str(exc), hint="write the report elsewhere with --report FOLDER/ or --report PREFIX") from None
    request = EvalRequest(candidate, reference, contexts, spec=spec, steps=steps, truth=truth, settings=settings)
    result, json_path, md_path = run_eval(request, prefix, warn=print_warnings)
    out.print(markdown(result), markup=False)
    out.print(f"wrote {json_path} and {md_path}")


@app.command()
@user_errors
def gate(
    candidate: Path = CANDIDATE,
    reference: Path = REFERENCE,
    contexts: Path = EVAL_CONTEXTS,
    truth: Optional[Path] = typer.Option(
        None,
        "--truth",
        help="Ground truth (.npz); CSV contexts default to the rows after each window; "
        "without any, degradation is the drift from the reference.",
    ),
    windows: Optional[int] = CSV_WINDOWS,
    zscore: bool = ZSCORE,
    columns: Optional[str] = COLUMNS,
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Rollout steps."),
    max_degradation: Optional[str] = typer.Option(
        None,
        "--max-degradation",
        help="Largest allowed degradation on every output, e.g. 1%: against the truth when there is one, else the "
        "drift from the reference as % of its mean |value| (judged as --on says).",
    ),
    on: str = typer.Option(
        "upper",
        "--on",
        metavar="upper|point|lower",
        help="What the degradation and drift bounds judge: upper (default), the upper end of the 95% interval over "
        "the windows, so a model passes only when the windows show it within the bound; point, the estimate alone "
        "(exactly as asked); lower, the lower end, so a model fails only when the bound is exceeded beyond the "
        "windows' noise.",
    ),
    max_drift_std: Optional[str] = typer.Option(
        None,
        "--max-drift-std",
        metavar="PCT",
        help="Largest allowed drift from the reference as % of the reference's standard deviation on every output, "
        "e.g. 5% (offset-free: a constant added to the series leaves it as it is; judged as --on says).",
    ),
    per_output: Optional[list[str]] = typer.Option(
        None, "--max-degradation-output", help="Per-output bound OUTPUT=PERCENT (repeatable)."
    ),
    min_compression: Optional[float] = typer.Option(
        None, "--min-compression", help="Smallest allowed compression (reference / candidate weight bytes)."
    ),
    max_size: Optional[str] = typer.Option(None, "--max-size", help="Largest allowed candidate file, e.g. 12MB."),
    min_cosine: Optional[float] = typer.Option(
        None,
        "--min-cosine",
        help="Smallest allowed cosine similarity of any output vector to its reference "
        "(outputs with cosine metrics, see --cosine), e.g. 0.99.",
    ),
    cosine: Optional[bool] = COSINE,
    exact: bool = typer.Option(
        False, "--exact", help="Exact dequantization instead of what ONNX Runtime runs by default."
    ),
    provider: str = EVAL_PROVIDER,
    report_dir: Path = typer.Option(
        Path("gate-report"), "--report-dir", help="Where gate.json, gate.md and junit.xml go."
    ),
    max_slowdown: Optional[float] = typer.Option(
        None,
        "--max-slowdown",
        help="Largest allowed candidate/reference median latency at every measured batch, e.g. 1.1.",
    ),
    max_memory: Optional[str] = typer.Option(
        None,
        "--max-memory",
        metavar="SIZE|RATIOx",
        help="Largest allowed peak memory of the candidate's session (resident-set growth of a fresh process while "
        "it is created and called): a size such as 64MB, or a ratio to the reference's such as 0.5x.",
    ),
    no_latency: bool = NO_LATENCY,
    latency_batches: Optional[str] = LATENCY_BATCHES,
):
    """Exit 1 when the candidate violates any bound, 0 when it meets them all."""
    from tqsdeploy.evaluation.evaluate import EvalRequest, EvalSettings
    from tqsdeploy.evaluation.gate import GateRequest, gate_markdown, run_gate
    from tqsdeploy.files import check_writable

    bounds = _bounds_from_options(
        max_degradation,
        min_compression,
        max_size,
        per_output,
        min_cosine,
        max_slowdown,
        no_latency,
        on,
        max_drift_std,
        max_memory,
    )
    settings = EvalSettings(
        exact=exact,
        provider=provider,
        windows=csv_windows(windows, contexts),
        zscore=zscore,
        columns=parse_columns(columns),
        cosine=cosine,
        latency=latency_settings(no_latency, latency_batches),
        memory=not no_latency,
    )
    check_writable(report_dir)  # before the rollouts
    evaluation = EvalRequest(candidate, reference, contexts, spec=spec, steps=steps, truth=truth, settings=settings)
    result = run_gate(GateRequest(evaluation, bounds, report_dir), warn=print_warnings)
    out.print(gate_markdown(result.report, result.checks), markup=False)
    out.print(f"wrote {result.paths['json']}, {result.paths['markdown']}, {result.paths['junit']}")
    if not result.passed:
        failed = "; ".join(f"{c.name} = {c.shown} violates {c.bound}" for c in result.checks if not c.passed)
        err.print("gate failed: " + failed, markup=False)
        raise typer.Exit(1)
