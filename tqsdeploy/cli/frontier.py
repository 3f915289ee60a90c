"""`frontier`: TQS-PTQ and the uniform baselines on one chart (`tqsdeploy.evaluation.frontier`), then the report."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from tiers import DEFAULT_TIERS, METHODS
from tqsdeploy.cli.app import (
    COLUMNS,
    CSV_WINDOWS,
    ZSCORE,
    app,
    csv_windows,
    err,
    frame_table,
    latency_settings,
    live_option,
    out,
    parse_columns,
    parse_floats,
    progress_bar,
    rounding_choices,
    split_list,
    user_errors,
)
from tqsdeploy.encoding.choices import GRID_CHOICES, GRIDS_HELP
from tqsdeploy.export.objectives import objective_names


@app.command()
@user_errors
def frontier(
    model: Path = typer.Argument(..., help="ONNX model file (never modified)."),
    contexts: Path = typer.Option(
        ..., "--contexts", "-c", help="Scoring contexts (.npz or .csv): TQS scores and calibration both use them."
    ),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Rollout spec (TOML); detected when omitted."),
    steps: Optional[int] = typer.Option(None, "--steps", "-T", min=1, help="Rollout steps."),
    truth: Optional[Path] = typer.Option(
        None,
        "--truth",
        help="Ground truth for the contexts (.npz); CSV contexts default to the rows after each window.",
    ),
    eval_contexts: Optional[Path] = typer.Option(
        None,
        "--eval-contexts",
        help="Held-out contexts: the report leads with them (scores on the scoring contexts flatter).",
    ),
    eval_truth: Optional[Path] = typer.Option(None, "--eval-truth", help="Ground truth for the held-out contexts."),
    targets: str = typer.Option(
        "2,4,8,12,16", "--C", help="TQS-PTQ compression targets (points matched to every baseline are added)."
    ),
    baselines: str = live_option(lambda: ",".join(METHODS), "--baselines", help="Uniform baselines ('' for none)."),
    bits: str = typer.Option("2,4,8", "--bits", help="Baseline bit widths."),
    tiers: Optional[str] = typer.Option(
        None,
        "--tiers",
        help=f"TQS-PTQ tiers (default: export's, {','.join(DEFAULT_TIERS)}, with int1 added near the INT2 size).",
    ),
    rounding: str = live_option(
        "qep",
        "--rounding",
        metavar=rounding_choices,
        help="TQS-PTQ's rounding method (auto: chosen per tier by measurement).",
    ),
    grids: str = typer.Option(
        "auto",
        "--grids",
        metavar="|".join(GRID_CHOICES),
        help=GRIDS_HELP + " TQS-PTQ's and the uniform baselines' alike.",
    ),
    objective: str = live_option(
        "measured", "--objective", metavar=objective_names, help="TQS-PTQ's allocation objective."
    ),
    also: Optional[str] = typer.Option(
        None, "--also", help="Extra TQS-PTQ lines as objective/rounding, e.g. paper/rtn,measured/gptq."
    ),
    group_size: Optional[int] = typer.Option(None, "--group-size", min=1, help="Blockwise integer tiers."),
    variable_axis: Optional[int] = typer.Option(
        None, "--variable-axis", help="Per-step output axis to report per variable (win counts)."
    ),
    min_params: int = typer.Option(
        1024, "--min-params", min=1, help="Smallest tensor quantized (by every method alike)."
    ),
    buckets: Optional[str] = typer.Option(
        None,
        "--buckets",
        help="Role buckets by name, e.g. 'input=embed|patch,output=head' (default: from the graph structure).",
    ),
    exact: bool = typer.Option(False, "--exact", help="Evaluate with exact dequantization."),
    columns: Optional[str] = COLUMNS,
    windows: Optional[int] = CSV_WINDOWS,
    zscore: bool = ZSCORE,
    latency: bool = typer.Option(
        False,
        "--latency",
        help="Also time every model against the original (as eval does, on the first split's windows): "
        "latency_ms, reference_latency_ms and slowdown columns; about 1 s and two sessions per point.",
    ),
    budget: Optional[str] = typer.Option(
        None,
        "--budget",
        metavar="PCT",
        help="A drift budget (e.g. 1%): frontier.csv's meets_budget marks the points within it on the first split "
        "(held-out when given) and the report names the most compressed one, judged as export --max-drift judges.",
    ),
    budget_on: str = typer.Option(
        "upper",
        "--budget-on",
        metavar="upper|point",
        help="What --budget judges: upper (default): the upper end of the drift's 95% interval over windows; point: "
        "the estimate.",
    ),
    out_dir: Path = typer.Option(
        None,
        "--out",
        "-o",
        help="Output folder (default tqs-frontier/<model stem>; <folder>_model for a file named model.onnx); "
        "an earlier frontier's folder is resumed, one holding other files is refused.",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Write into an --out folder that holds other files "
        "(report.md, frontier.csv and the like there are overwritten).",
    ),
):
    """Score once, export TQS-PTQ at every C, run the uniform baselines, evaluate all, and report."""
    import polars as pl

    from tqsdeploy.evaluation.evaluate import EvalSettings
    from tqsdeploy.evaluation.frontier import FrontierRequest, FrontierSettings, run_frontier
    from tqsdeploy.evaluation.gate import parse_percent
    from tqsdeploy.export import ExportSettings
    from tqsdeploy.scoring.runs import model_label

    patterns = _bucket_patterns(buckets)
    if budget_on not in ("upper", "point"):
        raise typer.BadParameter(f"--budget-on takes upper or point, not {budget_on!r}")
    budgeted = (parse_percent(budget, "--budget"), budget_on) if budget is not None else None
    tier_names = _checked_tiers(model, tiers, group_size, min_params)
    if baselines.strip() and any(b not in (1, 2, 3, 4, 8) for b in parse_floats(bits, "--bits")):
        raise typer.BadParameter(f"--bits takes 1, 2, 3, 4 and 8, not {bits!r}")
    base = ExportSettings(tiers=tier_names, group_size=group_size, rounding=rounding, grids=grids, objective=objective)
    variants = _variants(also, tier_names, group_size, rounding, grids)
    settings = FrontierSettings(
        targets=tuple(parse_floats(targets, "--C")),
        baselines=tuple(split_list(baselines, "--baselines")) if baselines.strip() else (),
        bits=tuple(int(b) for b in parse_floats(bits, "--bits")) if baselines.strip() else (),
        export=base,
        variants=variants,
        evaluation=EvalSettings(
            exact=exact,
            variable_axis=variable_axis,
            columns=parse_columns(columns),
            windows=csv_windows(windows, contexts),
            zscore=zscore,
            latency=latency_settings(not latency, None),
        ),
        min_params=min_params,
    )
    _check_points(settings)
    folder = out_dir or Path("tqs-frontier") / model_label(model)
    request = FrontierRequest(
        model,
        contexts,
        folder,
        spec=spec,
        steps=steps,
        truth=truth,
        eval_contexts=eval_contexts,
        eval_truth=eval_truth,
        settings=settings,
        force=force,
        buckets=patterns,
        budget=budgeted,
    )
    with progress_bar("frontier", "steps") as progress:
        result = run_frontier(
            request, progress=progress, notice=lambda message: err.print(f"note: {escape(message)}", soft_wrap=True)
        )
    split = "held-out" if eval_contexts else "scoring"
    shown = result.frame.filter((pl.col("variable") == "all") | pl.col("variable").is_null()).filter(
        pl.col("split") == split
    )
    metric = "degradation_pct"
    out.print(
        frame_table(
            shown.sort(["family", "method", "achieved_C"]),
            f"Frontier ({split} contexts)",
            ["method", "setting", "achieved_C", "file_bytes", "mae_ref", "mae_truth", metric, "status"]
            + (["meets_budget"] if budgeted is not None else []),
        )
    )
    if budgeted is not None:
        from tqsdeploy.evaluation.report import budget_line

        meta = json.loads((folder / "frontier.json").read_text())
        out.print(escape(budget_line(meta["budget"]).replace("**", "")), soft_wrap=True)
    out.print(f"wrote {folder}/frontier.parquet, {result.report}, {result.page} and plots")


def _bucket_patterns(buckets: Optional[str]) -> tuple[tuple[str, str], ...]:
    """--buckets ROLE=REGEX,... as (role, regex) pairs, each regex compiled now, not after the frontier has run."""
    if not buckets:
        return ()
    items = [item.strip() for item in buckets.split(",") if item.strip()]
    if not items or any("=" not in item for item in items):
        raise typer.BadParameter(
            f"--buckets takes ROLE=REGEX items, e.g. 'input=embed|patch,output=head', not {buckets!r}"
        )
    patterns = dict(item.split("=", 1) for item in items)
    for role, pattern in patterns.items():
        try:
            re.compile(pattern)
        except re.error as exc:
            raise typer.BadParameter(f"--buckets: {role}={pattern!r} is not a regular expression ({exc})") from None
    return tuple(patterns.items())


def _checked_tiers(
    model: Path, tiers: Optional[str], group_size: Optional[int], min_params: int
) -> Optional[tuple[str, ...]]:
    """--tiers as names (None: export's defaults, int1 near INT2 included); unknown names, and a --group-size no
    tensor of the model can take, fail now rather than after the score."""
    from tiers import get_tiers

    tier_names = tuple(split_list(tiers, "--tiers")) if tiers is not None else None
    tier_set = get_tiers(tier_names or DEFAULT_TIERS, "ort", group_size)
    if group_size:
        import graph_ops
        from tqsdeploy.encoding.slots import checked_layouts

        checked_layouts(graph_ops.load_model(model, load_external=False).proto, min_params, group_size, tier_set)
    return tier_names


def _variants(also: Optional[str], tier_names, group_size: Optional[int], rounding: str, grids: str) -> tuple:
    """--also objective/rounding,... as extra TQS-PTQ lines: (label, ExportSettings)."""
    from tqsdeploy.export import ExportSettings

    variants = []
    for item in (also or "").split(","):
        if item.strip():
            chosen_objective, _, chosen_rounding = item.strip().partition("/")
            variant = ExportSettings(
                tiers=tier_names,
                group_size=group_size,
                objective=chosen_objective,
                rounding=chosen_rounding or rounding,
                grids=grids,
            )
            variants.append((f"TQS-PTQ {variant.objective}/{variant.rounding}", variant))
    return tuple(variants)


def _check_points(settings) -> None:
    """Every target and baseline method, before the score and every baseline (not when the first export reaches it)."""
    from tqsdeploy.size import check_target

    for target in settings.targets:
        check_target(target)
    for method in settings.baselines:
        if method not in METHODS:
            raise typer.BadParameter(f"--baselines takes {', '.join(METHODS)}, not '{method}'")
