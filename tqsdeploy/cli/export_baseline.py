"""`export` and `baseline`: mixed-precision and uniform models written from the library's planner and baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from runtimes import provider_names
from tiers import DEFAULT_TIERS, METHOD_LABELS, METHODS, TIERS, TRT_TIERS
from tqsdeploy.cli.app import (
    app,
    err,
    live_option,
    or_list,
    out,
    parse_floats,
    progress_bar,
    rounding_choices,
    split_list,
    user_errors,
)
from tqsdeploy.cli.outputs import (
    ExportDisplay,
    check_output_file,
    feeds_matmul_integer_codes,
    print_baseline,
    print_outcome,
    print_search,
    refuse_overwrite,
    say_trial,
)
from tqsdeploy.encoding.choices import GRID_CHOICES, GRIDS_HELP
from tqsdeploy.export.objectives import objective_names, objectives_help


@app.command()
@user_errors
def export(
    model: Optional[Path] = typer.Argument(None, help="The scored ONNX model (default: the model of the run)."),
    compression: Optional[str] = typer.Option(
        None,
        "--C",
        help="Target compression(s), e.g. 4 or 2,4,8,16 (reference stored bits / exported stored bits; see --basis).",
    ),
    uniform_tier: Optional[str] = typer.Option(
        None,
        "--uniform",
        metavar="TIER",
        help=f"Store every unit at this tier instead (a uniform baseline): {', '.join(TIERS)}.",
    ),
    run: Optional[Path] = typer.Option(
        None,
        "--run",
        help="Score run folder (default: the model's run in tqs-runs/; without a model, the only run there).",
    ),
    tiers: Optional[str] = typer.Option(
        None,
        "--tiers",
        help=f"Tiers to choose from ({', '.join(TIERS)}); default {','.join(DEFAULT_TIERS)} (--target trt: "
        f"{','.join(TRT_TIERS)}).",
    ),
    rounding: str = live_option(
        "qep",
        "--rounding",
        metavar=rounding_choices,
        help=lambda: (
            f"How codes are chosen on each tier's grid: {or_list(METHODS)} (calibrated on the run's contexts); auto: "
            "per tier the method whose uniform model drifts least on them."
        ),
    ),
    grids: str = typer.Option("auto", "--grids", metavar="|".join(GRID_CHOICES), help=GRIDS_HELP),
    target: str = typer.Option(
        "ort-cpu",
        "--target",
        metavar="ort-cpu|ort-cuda|trt[@RELEASE]",
        help="Runtime the model is for: ort-cpu (default; 'ort' too), ort-cuda or trt (restricts tiers, trt uses "
        "symmetric grids; decides --runtime-layout auto). ONNX Runtime targets take @RELEASE, the oldest release "
        "the file must load on (e.g. ort-cpu@1.20; default 1.24, the oldest tqsdeploy runs on): the file keeps "
        "within its IR version, opset, code types and kernels.",
    ),
    kernel_accuracy: str = typer.Option(
        "int8",
        "--kernel-accuracy",
        metavar="int8|exact",
        help="How ONNX Runtime's MatMulNBits kernels compute (native layout): int8 (default) quantizes activations "
        "inside the kernel, fast at every code width, about 1e-3 relative error per product; exact computes in "
        "float, 2- and 8-bit codes then run many times slower than a float MatMul.",
    ),
    runtime_layout: str = typer.Option(
        "auto",
        "--runtime-layout",
        metavar="auto|native|dequantized|fused",
        help="native: ONNX Runtime's own low-bit kernels where they take a weight (MatMulNBits for MatMul/Gemm "
        "weights, GatherBlockQuantized for embedding tables: small in memory, float speed), dequantized for the "
        "others; dequantized: codes rebuilt by plain ops ONNX Runtime folds into float weights at load (FP32 speed "
        "and memory, the small file); fused: DequantizeLinear (what TensorRT needs); auto (default): native for "
        "ort-cpu/ort-cuda, fused for trt.",
    ),
    group_size: Optional[int] = typer.Option(
        None, "--group-size", min=1, help="Blockwise integer quantization along the reduction axis (e.g. 32, 64, 128)."
    ),
    objective: str = live_option("measured", "--objective", metavar=objective_names, help=objectives_help),
    allocator: str = typer.Option(
        "mckp", "--allocator", metavar="mckp|greedy", help="mckp (pulp, HiGHS then CBC) or greedy."
    ),
    fp32_fraction: Optional[float] = typer.Option(
        None,
        "--fp32-fraction",
        min=0.0,
        max=1.0,
        help="Share of the units' FP32 size forced to FP32 for the most sensitive units (default 0.10 with "
        "--objective paper, else 0).",
    ),
    no_fallback: bool = typer.Option(
        False, "--no-fallback", help="Ship the mixed allocation even if a uniform baseline within budget drifts less."
    ),
    refine: int = typer.Option(
        0,
        "--refine",
        min=0,
        help="Rounds of joint re-pricing against interactions between units (2 joint rollouts per slot per round "
        "and a calibration pass per kept round; default 0: off).",
    ),
    lanes: Optional[int] = typer.Option(
        None,
        "--lanes",
        min=1,
        help="Rollouts priced side by side (CPU provider; default: one per core, up to 8 and 1 + 512 MiB / model "
        "size, sessions of cores/lanes threads).",
    ),
    split: float = typer.Option(
        0.02,
        "--split",
        min=0.0,
        max=0.99,
        help="Split units holding more than this share of the parameters into output-channel groups (0: never).",
    ),
    group_prices: str = typer.Option(
        "shared",
        "--group-prices",
        metavar="shared|exact",
        help="A channel group's price: shared (default), its unit's rollout times the group's share of the unit's "
        "layer-output error (a rollout per unit and tier however finely units are cut), or exact, a rollout of its "
        "own per tier.",
    ),
    basis: str = typer.Option(
        "file",
        "--basis",
        metavar="file|units",
        help="What --C counts: file (every stored tensor) or units (the scored units only).",
    ),
    output_given: Optional[str] = typer.Option(None, "-o", "--output", help="Output file (single target only)."),
    out_dir: Path = typer.Option(
        Path("."),
        "--out-dir",
        help="Folder for <stem>.C<C>.onnx files (a model named model.onnx adds its folder's name: "
        "<folder>_model.C<C>.onnx).",
    ),
    provider: str = live_option(
        "cpu",
        "--provider",
        metavar=lambda: "|".join(provider_names()),
        help="Execution provider for the measurement rollouts.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Overwrite existing output files (default: refuse before any work)."
    ),
    single_file: bool = typer.Option(
        False,
        "--single-file",
        help="Write every tensor inside the .onnx, no external-data file beside it (up to protobuf's 2 GiB; "
        "default: one file unless the input keeps its weights in external-data files "
        "or the output reaches 1 GiB).",
    ),
    max_drift: Optional[str] = typer.Option(
        None,
        "--max-drift",
        metavar="PCT",
        help="Largest drift (a percentage such as 1% or 0.5). Without --C: the most compressed model within it on the "
        "--validate windows (a search over C, prices reused; exit 1 when none meets it). With --C or --uniform: a "
        "model drifting more is not written and export exits 1, like a failed gate (on the --validate windows when "
        "given, else on the scoring contexts as eval --exact reports it).",
    ),
    max_memory: Optional[str] = typer.Option(
        None,
        "--max-memory",
        metavar="SIZE|RATIOx",
        help="Resident memory bound (as gate's: 64MB, or 0.5x the original's), a second knapsack constraint on each "
        "slot's bytes after load (kernel codes natively, the float a folded weight becomes). With memory measured "
        "(--memory) it bounds the session's peak: the original's non-weight memory is measured once and added; "
        "with --no-memory it covers the weights alone. Exit 1 when out of reach, or when the written model's "
        "measured peak exceeds it.",
    ),
    max_slowdown: Optional[float] = typer.Option(
        None,
        "--max-slowdown",
        metavar="X",
        help="Latency bound, e.g. 1.05: not priced (weights the kernels run slower than float are folded already); "
        "the written model is timed against the original as eval does, exit 1 when slower (the file is kept).",
    ),
    validate: Optional[Path] = typer.Option(
        None,
        "--validate",
        metavar="FILE",
        help="Validation windows (.npz with the model's input names, as the score's contexts, or a .csv) held out "
        "from pricing and calibration: they choose between the mixed and the uniform candidates, and judge "
        "--max-drift, each candidate measured as `tqsdeploy eval` does.",
    ),
    select: Optional[str] = typer.Option(
        None,
        "--select",
        metavar="scoring|validation|kfold[:K]",
        help="What chooses between the mixed and the uniform candidates of --C: scoring (the contexts they were "
        "priced and calibrated on), validation (the --validate windows, or the run's score --validation ones) or "
        "kfold[:K] (K folds of the scoring windows, default 3: per fold a score run of the other windows, kept in "
        "the run's folds/, judges every kind of candidate on the fold; the kind drifting least over the folds is "
        "built from every window and shipped). Default: validation when there are validation windows, else scoring.",
    ),
    judged_on: str = typer.Option(
        "upper",
        "--on",
        metavar="upper|point",
        help="What --max-drift judges on the --validate windows: upper (default, as gate's): the upper end of the "
        "drift's 95% interval over the windows; point: the estimate.",
    ),
    memory: bool = typer.Option(
        True,
        "--memory/--no-memory",
        envvar="TQS_MEMORY",
        help="Measure each written model's session memory (peak and steady, in a fresh process, on the first scoring "
        "window) beside the original's: in the summary and the allocation JSON's session_memory. A second or so "
        "per model; --no-memory skips it.",
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        help="Also print where each export's time went: solver, statistics, calibration and measurement rollouts, "
        "write (the allocation JSON's profile_s), and what it reused from the run's cache.",
    ),
    fresh: bool = typer.Option(
        False,
        "--fresh",
        help="Drop the run's export cache (export-cache/: encoded weights, drifts, grid choices) and its measured "
        "prices first: everything is made again.",
    ),
    cache_bytes: Optional[str] = typer.Option(
        None,
        "--cache-bytes",
        metavar="SIZE",
        help="Cap of the run's export cache, e.g. 512M or 2G (least recently used entries go first; default "
        "TQS_CACHE_BYTES, else 8 bytes per unit parameter, at least 64M).",
    ),
):
    """Allocate precision tiers under a compression target and write mixed-precision ONNX.

    Prints each model's drift from the original on the scoring contexts in percent (eval's unit) and warns above 5%.
    Exit codes: 0 written, 1 a model exceeded --max-drift or, without --C, no model met it (nothing written for it),
    or --max-memory/--max-slowdown cannot be or was not met, 2 bad input."""
    from runtimes import for_provider
    from tqsdeploy.encoding.run_cache import parse_bytes
    from tqsdeploy.evaluation.gate import parse_percent
    from tqsdeploy.export import CacheOptions, ExportSettings, Planner, find_run
    from tqsdeploy.export.bounds import unmet_after_writing

    output = Path(output_given) if output_given is not None else None  # the text kept: a trailing '/' means a folder
    max_drift_pct = (
        parse_percent(max_drift, "--max-drift") if max_drift is not None else None
    )  # '5%' as gate's bounds take it
    searching = compression is None and uniform_tier is None and max_drift_pct is not None
    if (compression is None) == (uniform_tier is None) and not searching:
        raise typer.BadParameter(
            "give exactly one of --C and --uniform (or --max-drift alone: the most compressed "
            "model within it on --validate windows)"
        )
    if judged_on not in ("upper", "point"):
        raise typer.BadParameter(f"--on takes upper or point, not {judged_on!r}")
    targets = parse_floats(compression, "--C") if compression is not None else [None]
    if output is not None and len(targets) > 1:
        raise typer.BadParameter("-o names one file; use --out-dir with several --C values")
    if output is not None and out_dir != Path("."):
        raise typer.BadParameter("give -o (one file) or --out-dir (a folder), not both")
    tier_names = tuple(split_list(tiers, "--tiers")) if tiers is not None else None
    if tiers is not None and uniform_tier is not None:
        raise typer.BadParameter(
            "--tiers is for --C (the tiers the allocation picks from); --uniform names its one tier"
        )
    settings = ExportSettings(
        tiers=tier_names,
        target=target,
        runtime_layout=runtime_layout,
        kernel_accuracy=kernel_accuracy,
        group_size=group_size,
        objective=objective,
        rounding=rounding,
        grids=grids,
        fp32_fraction=fp32_fraction,
        allocator=allocator,
        fallback=not no_fallback,
        refine=refine,
        split_fraction=split,
        group_prices=group_prices,
        basis=basis,
        lanes=lanes,
        single_file=single_file,
        max_memory=max_memory,
        max_slowdown=max_slowdown,
    )
    from tqsdeploy.files import check_writable

    check_writable(output.parent if output is not None else out_dir)  # before the work, not after it
    run_dir = find_run(model, run)
    from tqsdeploy.export.folds import FoldOptions, Selection

    held = validate is not None or (run_dir / "validation.npz").exists()
    selection = Selection.asked(select, held, validate is not None, compression is not None)
    if validate is None and (run_dir / "validation.npz").exists() and selection.how == "validation":
        validate = run_dir / "validation.npz"  # score --validation held them out
    if searching and validate is None:
        raise typer.BadParameter(
            "--max-drift without --C judges the drift on validation windows: pass --validate FILE (windows the score "
            "and calibration never saw, e.g. heldout.npz), score with --validation N, or pass --C to bound one model"
        )
    if judged_on != "upper" and validate is None:
        raise typer.BadParameter("--on says what --max-drift judges on the --validate windows: pass --validate FILE")
    check_writable(run_dir)  # its prices and checkpoints are written as the export goes
    display = ExportDisplay(verbose)
    cache = CacheOptions(parse_bytes(cache_bytes, "--cache-bytes") if cache_bytes is not None else None, fresh)
    from tqsdeploy.evaluation.evaluate import EvalSettings
    from tqsdeploy.export.validation import ValidationOptions

    checked = ValidationOptions(validate, judged_on, EvalSettings(provider=provider)) if validate else None
    if selection.folds:
        checked = FoldOptions(selection.folds, EvalSettings(provider=provider))
    planner = Planner(run_dir, model, settings, for_provider(provider), cache, display.progress(), memory, checked)
    if compression:
        planner.check_targets(targets)
    planner.check_memory(uniform_tier)
    if not searching:
        planner.check_single_file(targets, uniform_tier)
    from tqsdeploy.scoring.runs import model_label

    stem = model_label(planner.model.path)
    named = f"drift{max_drift_pct:g}pct" if searching else (uniform_tier or "").lower()  # C known only at the end
    paths = [output or out_dir / f"{stem}.{f'C{value:g}' if value is not None else named}.onnx" for value in targets]
    for path in paths:
        check_output_file(path, output_given, (planner.model.path, *planner.model.external_files))
    if not force:
        ours = (
            planner.interrupted_outputs()
        )  # an interrupted export of these settings wrote them: "run the same command again" resumes
        for path in paths:
            if path.resolve() not in ours:
                refuse_overwrite(path, *(f"{path.with_suffix('')}.allocation.{kind}" for kind in ("json", "parquet")))

    rows, found = [], None
    try:
        for index, (value, path) in enumerate(zip(targets, paths)):
            if searching:
                from tqsdeploy.export.budget import search

                found = search(planner, max_drift_pct, path, on_trial=say_trial)
                if found.outcome is None:
                    break
                value, outcome = found.chosen.target, found.outcome
            else:
                outcome = planner.export(
                    value, path, uniform_tier=uniform_tier, max_drift_pct=max_drift_pct, final=index == len(targets) - 1
                )
            fused = settings.layout == "fused" and feeds_matmul_integer_codes(outcome.encodings, planner.layouts)
            outcome.encodings = {}  # written: the table and the record are what is left to show
            rows.append((value, outcome, fused))
        planner.finished()  # every model is written (or refused by --max-drift): nothing left to resume
    finally:
        display.stop()
        planner.close()
    if found is not None:
        print_search(found)
    for value, outcome, fused in rows:
        if outcome.refused:
            err.print(f"[bold red]drift too large:[/] {escape(outcome.refused)}", soft_wrap=True)
            continue
        print_outcome(planner, settings, value, outcome, fused, verbose)
    if verbose and planner.cache is not None:
        held = planner.cache.note
        out.print(
            f"the run's export cache ({run_dir / 'export-cache'}) holds {held.get('entries', 0)} entries, "
            f"{held.get('bytes', 0) / 1e6:.3g} MB of its {planner.cache.cap / 1e6:.3g} MB cap (cache.json lists them)"
        )
    written = [o for _, o, _ in rows if not o.refused]
    sidecars = sum(len(o.files) > 1 for o in written)
    out.print(
        f"wrote {len(written)} model(s) with .allocation.parquet/.json beside each"
        + (f", {sidecars} of them with an external-data file (listed above)" if sidecars else "")
    )
    unmet = [e for o in written if o.bounds and (e := unmet_after_writing(o.bounds, o.path)) is not None]
    for problem in unmet:
        err.print(f"[bold red]bound not met:[/] {escape(str(problem))}", soft_wrap=True)
    if len(written) < len(rows) or (found is not None and found.outcome is None) or unmet:
        raise typer.Exit(1)


@app.command(
    help=f"Quantize every unit uniformly with {or_list(METHOD_LABELS.values())} (numpy, calibrated on ONNX Runtime)."
)
@user_errors
def baseline(
    model: Path = typer.Argument(..., help="ONNX model file (never modified)."),
    method: str = live_option(..., "--method", metavar=lambda: "|".join(METHODS), help=lambda: f"{or_list(METHODS)}."),
    bits: int = typer.Option(
        ...,
        "--bits",
        metavar="1|2|3|4|8",
        help="Bits per weight: 1, 2, 3, 4 or 8 (1 = sign(w)·mean|w|; 3-bit codes travel in 4-bit containers).",
    ),
    calib: Optional[Path] = typer.Option(
        None,
        "--calib",
        help="Calibration windows (.npz in the contexts format, or a .csv cut into 8 windows); not needed for rtn.",
    ),
    spec: Optional[Path] = typer.Option(
        None,
        "--spec",
        help="Rollout spec: calibrate on every step of the windows' nominal rollout (default: the windows alone).",
    ),
    steps: Optional[int] = typer.Option(
        None, "--steps", min=1, help="Rollout steps calibrated on (overrides the spec)."
    ),
    group_size: Optional[int] = typer.Option(
        None, "--group-size", min=1, help="Input features per quantization group (default: per channel)."
    ),
    symmetric: bool = typer.Option(
        False, "--symmetric", help="Symmetric grid (INT codes, no zero point) instead of the asymmetric default."
    ),
    act_order: bool = typer.Option(
        False, "--act-order", help="GPTQ column order by decreasing Hessian diagonal (static groups)."
    ),
    grids: str = typer.Option("auto", "--grids", metavar="|".join(GRID_CHOICES), help=GRIDS_HELP),
    min_params: int = typer.Option(1024, "--min-params", min=1, help="Smallest tensor that is quantized."),
    output_given: Optional[str] = typer.Option(
        None,
        "-o",
        "--output",
        help="Output ONNX (default <stem>.<method>-w<bits>.onnx; a model named model.onnx adds its folder's name).",
    ),
    runtime_layout: str = typer.Option(
        "native",
        "--runtime-layout",
        metavar="native|dequantized|fused",
        help="As export's: native (default, export's pick for ort-cpu: ONNX Runtime's low-bit kernels where they "
        "take a weight), dequantized (float weights rebuilt at load) or fused (DequantizeLinear).",
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
):
    from tiers import Rounding
    from tqsdeploy.export.baselines import BaselineProgress, BaselineSettings, quantize_baseline, write_baseline
    from tqsdeploy.files import check_writable, write_json

    if method not in METHODS:
        raise typer.BadParameter(f"--method must be one of {', '.join(METHODS)}")
    if bits not in (1, 2, 3, 4, 8):
        raise typer.BadParameter("--bits must be 1, 2, 3, 4 or 8")
    if runtime_layout not in ("native", "dequantized", "fused"):
        raise typer.BadParameter("--runtime-layout must be native, dequantized or fused")
    import graph_ops
    from tqsdeploy.scoring.runs import model_label

    path = Path(output_given) if output_given is not None else Path(f"{model_label(model)}.{method}-w{bits}.onnx")
    check_output_file(
        path,
        output_given,
        (model, *(graph_ops.load_model(model, load_external=False).external_files if path.exists() else ())),
    )
    check_writable(path.parent)  # before the calibration, not after it
    if not force:
        refuse_overwrite(path, str(path.with_suffix("")) + ".baseline.json", elsewhere="-o")
    with progress_bar(f"{method} W{bits}", "weights") as progress:
        settings = BaselineSettings(
            method,
            bits,
            spec=spec,
            steps=steps,
            group_size=group_size,
            symmetric=symmetric,
            rounding=Rounding(method, act_order=act_order),
            grids=grids,
            min_params=min_params,
        )
        reports = BaselineProgress(on_start=progress.start, on_weight=lambda name: progress.advance(detail=name[-40:]))
        result = quantize_baseline(model, settings, calib, progress=reports)
    summary = write_baseline(model, result, path, runtime_layout)
    write_json(str(path.with_suffix("")) + ".baseline.json", summary)
    print_baseline(summary, path, method, bits, {"--calib": calib, "--spec": spec, "--steps": steps})
