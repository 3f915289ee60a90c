"""What the model-writing commands (`export`, `baseline`) check of their output files before any work, and say
about the files they wrote."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from rich.markup import escape

from tqsdeploy.cli.app import err, frame_table, out, progress_bar
from tqsdeploy.errors import InputError


def say_sidecar(files, size: int, alternative: str | None = None) -> None:
    """Name a model's external-data file: shipped without it, the .onnx does not load."""
    if len(files) > 1:
        out.print(
            f"  [yellow]external data:[/] {escape(' + '.join(str(f) for f in files))}: "
            "the .onnx reads its weights from the .data file, so ship and keep both together in one folder"
            + (f" ({alternative})" if alternative and size < 2**31 else ""),
            soft_wrap=True,
        )


def refuse_overwrite(*paths, elsewhere: str = "-o / --out-dir") -> None:
    """Fail before any work when an output exists (--force overwrites)."""
    for path in paths:
        if Path(path).exists():
            raise InputError(
                f"{path} already exists", hint=f"pass --force to overwrite it, or choose another name with {elsewhere}"
            )


def feeds_matmul_integer_codes(encodings, layouts) -> bool:
    """Whether an export stores integer codes (DequantizeLinear) for a weight a MatMul reads: what ONNX
    Runtime fuses into MatMulNBits with int8 activations."""

    def integer(encoded) -> bool:
        if encoded.form == "split":
            return any(integer(part) for part in encoded.parts)
        # packed codes keep their type: no unpacking
        return encoded.form == "dequantize" and not np.dtype(encoded.values.dtype).name.startswith("float")

    return any(
        "MatMul" in layouts[name].op_types and integer(encoded)
        for name, encoded in encodings.items()
        if name in layouts
    )


def memory_line(outcome) -> str | None:
    """The written model's session memory beside the original's, measured in a fresh process; None when not."""
    found = outcome.session_memory
    if not found:
        return None
    return (
        f"session memory: peak {found['peak_bytes'] / 1e6:.1f} MB, steady {found['steady_bytes'] / 1e6:.1f} MB; "
        f"the original's {found['original_peak_bytes'] / 1e6:.1f} / {found['original_steady_bytes'] / 1e6:.1f} MB "
        f"({found['peak_ratio']:.2f}x its peak; {found['basis']})"
    )


def bounds_lines(outcome) -> list[str]:
    """`--max-memory` and `--max-slowdown`: each bound against what was priced and measured, and whether it held."""
    found = outcome.bounds or {}
    lines = []
    if memory := found.get("memory"):
        peak = memory["measured_peak_bytes"]
        measured = f", measured peak {peak / 1e6:.2f} MB" if peak is not None else ", not measured"
        lines.append(
            f"--max-memory {memory['asked']} ({memory['bound_bytes'] / 1e6:.2f} MB; {memory['covers']}): priced "
            f"{memory['priced_bytes'] / 1e6:.2f} MB{measured}: {'met' if memory['met'] else 'NOT MET'}"
        )
    if slowdown := found.get("slowdown"):
        seen = f"{slowdown['measured']:.3f}x" if slowdown["measured"] is not None else "not measured"
        lines.append(
            f"--max-slowdown {slowdown['asked']:g}: measured {seen} against the original: "
            f"{'met' if slowdown['met'] else 'NOT MET'}"
        )
    return lines


def layout_cost(outcome, settings) -> str:
    """What the written layout costs at run time, in one line."""
    memory = f"about {outcome.memory_bytes / 1e6:.3f} MB of weights in memory after load"
    chosen = f"{outcome.layout}" + (
        f" (auto for --target {settings.target})" if settings.runtime_layout == "auto" else ""
    )
    loads = f"; loads on ONNX Runtime {outcome.oldest_release}" if outcome.oldest_release else ""
    if outcome.layout == "native":
        counts: dict[str, int] = {}
        for form in outcome.runs_as.values():
            counts[form] = counts.get(form, 0) + 1
        forms = ", ".join(f"{n} as {form}" for form, n in sorted(counts.items(), key=lambda item: -item[1]))
        return (
            f"{chosen}: of {len(outcome.runs_as)} unit tensors ONNX Runtime runs {forms} "
            f"(the allocation JSON's runs_as names each); {memory}{loads}"
        )
    if outcome.layout == "dequantized":
        model, file = outcome.opsets
        speed = (
            "runs the original's kernels at its speed, exactly"
            if file <= model
            else f"runs the original's kernels exactly, at opset {file} "
            f"(converted from {model} for the codes' types: a kernel can change speed with the opset, "
            "ONNX Runtime's AveragePool from 19 on ran 2.7x slower; `tqsdeploy eval` times both)"
        )
        return (
            f"{chosen}: ONNX Runtime rebuilds the float weights once when the session is created "
            f"and {speed} (no dequantization per call); "
            f"{memory} (the original's float size; the file stays {outcome.file_bytes / 1e6:.3f} MB){loads}"
        )
    return (
        f"{chosen}: DequantizeLinear nodes; ONNX Runtime runs those before a MatMul as MatMulNBits (fast for few rows, "
        f"slower than float for batched calls) and the others on every call; {memory}{loads}"
    )


def name_limit(folder: Path) -> int:
    """Longest file name (bytes) the file system of `folder` (or of its nearest existing parent) takes."""
    existing = next((p for p in (folder, *folder.absolute().parents) if p.is_dir()), Path("/"))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_output_file(path: Path, given: str | None, inputs) -> None:
    """An output must be a file name, and never one of the input model's files, --force or not."""
    if (given or "").endswith(("/", os.sep)) or path.is_dir():
        raise InputError(
            f"output {given or path} is a folder; name the file (or use --out-dir where the command has it)"
        )
    longest = len(f".{path.name}.12345678.data.12345678.partial".encode())  # the writer's temporary beside the data
    limit = name_limit(path.parent)
    if longest > limit:
        raise InputError(
            f"output name {path.name} is too long: its files' names reach {longest} bytes, "
            f"this file system takes {limit}",
            hint=f"use a name of at most {limit - (longest - len(path.name.encode()))} bytes",
        )
    # else an ONNX model would be written under any name (-o q.npz), its records beside it as q.allocation.json
    if path.suffix.lower() != ".onnx":
        raise InputError(
            f"output {path} does not end in .onnx: the command writes an ONNX model",
            hint=f"name it {path.with_suffix('.onnx').name}",
        )
    for source in inputs:
        if source is not None and Path(source).exists() and path.exists() and os.path.samefile(path, source):
            raise InputError(
                f"output {path} is the input model's own file {source}; the input is never overwritten",
                hint="choose another name",
            )


def size_line(outcome, reference_bytes: int) -> str:
    """Both sizes, each named: the stored tensor bits --C counts, and the bytes on disk (graph and framing too)."""
    disk = reference_bytes / max(outcome.file_bytes, 1)
    return (
        f"stored tensor bits {outcome.compression:.3f}x smaller than the original's (what --C counts; "
        f"{outcome.unit_compression:.3f}x on the scored units alone); bytes on disk {reference_bytes:,} → "
        f"{outcome.file_bytes:,} ({disk:.2f}x, the files with their graph and framing)"
    )


def slots_line(table, units) -> str:
    """What the tier table counts: slots, and which units were cut into channel groups to become them."""
    import polars as pl

    per_unit = table.group_by("unit", maintain_order=True).agg(pl.len().alias("slots"))
    cut = per_unit.filter(pl.col("slots") > 1)
    labels = {u.name: u.label for u in units}
    line = (
        f"the table counts slots, what one tier is given to: a whole unit (a weight tensor that was scored), or a "
        f"group of output channels of a unit that holds a large share of the parameters (cut so the budget is spent "
        f"finely; --split sets the share, 0 never cuts); here {per_unit.height} units as {table.height} slots"
    )
    if cut.height:
        named = ", ".join(f"'{labels.get(u, u)}' in {n}" for u, n in cut.head(3).iter_rows())
        line += f" ({named}{', ...' if cut.height > 3 else ''})"
    return line + "; the .allocation.parquet lists each slot and its tier"


def drift_lines(outcome, windows: int) -> list[str]:
    """The drift, naming its windows (the scoring ones: in-sample), and every candidate compared, each explained."""
    from tqsdeploy.export.candidates import explain
    from tqsdeploy.progress import counted

    lines = [
        f"drift from the original (exact dequantization): {outcome.drift_pct:.4g}% on the "
        f"{counted(windows, 'scoring window')}, in-sample (the score and the calibration saw them): held-out "
        "windows usually drift more; measure them with `tqsdeploy eval`"
    ]
    if len(outcome.compared) > 1:
        cells = "; ".join(
            f"{c['label']} {c['drift_pct']:.4g}%" + (" (shipped)" if c["label"] == outcome.shipped else "")
            for c in outcome.compared
        )
        lines.append(f"candidates, drift on the same windows: {cells}")
        lines.append(f"  ({explain([c['label'] for c in outcome.compared])})")
    return lines


CACHED = {
    "weights": "encoded weights",
    "drift": "drifts",
    "choice": "grid choices",
    "share": "channel-group shares",
    "prices": "tier prices",
}
"""What `export --verbose` counts of the run's cache, by kind (`RunCache.since`)."""


def cache_use(cache: dict) -> str:
    """One line: what an export read from the run's cache and what it added."""

    def counts(way: str) -> str:
        return ", ".join(f"{cache[way].get(kind, 0)} {words}" for kind, words in CACHED.items())

    return f"reused {counts('read')}; made {counts('made')}"


class ExportDisplay:
    """An export's progress bars, one at a time: a bar per batch of tier measurements and per encoding pass (a bar
    left running would print its line every interval for the rest of the process)."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.measuring: list = []
        self.encoding: list = []

    def progress(self):
        from tqsdeploy.export import ExportProgress

        return ExportProgress(
            on_pass=self.on_pass, on_weight=self.on_weight, on_measuring=self.on_measuring, on_price=self.on_result
        )

    def on_measuring(self, count: int) -> None:
        """A batch of tier measurements begins: one display per batch, its own ETA."""
        self.stop()
        self.measuring[:] = [progress_bar("measuring tiers", "rollouts")]
        self.measuring[0].start(count)

    def on_result(self, result) -> None:
        self.measuring[0].advance(detail=result.unit[-40:])

    def on_pass(self, label: str, count: int, done: int, cached: int) -> None:
        self.stop()
        if cached and self.verbose:
            err.print(f"encoding ({label}): {cached} of {count} weights read from the run's cache")
        self.encoding[:] = [progress_bar(f"encoding ({label})", "weights")]
        self.encoding[0].start(count, done)
        if done >= count:
            self.encoding[0].stop()

    def on_weight(self, name: str) -> None:
        self.encoding[0].advance(detail=name[-40:])
        if self.encoding[0].done >= self.encoding[0].total:
            self.encoding[0].stop()

    def stop(self) -> None:
        for bar in self.measuring + self.encoding:
            bar.stop()


def print_outcome(planner, settings, value, outcome, fused: bool, verbose: bool) -> None:
    """One written model's summary: what was asked and shipped, its size both ways, the tiers and what a slot is,
    the runtime layout, the drift and on which windows, the candidates and what each is, the notes."""
    import polars as pl

    from tqsdeploy.export.writing import WARN_DRIFT_PCT

    wanted = "uniform" if value is None else f"{value:g}x of the {settings.basis}"
    out.print(escape(f"{outcome.path}: target {wanted}; shipped {outcome.shipped!r}"), soft_wrap=True)
    out.print(f"  size: {escape(size_line(outcome, planner.model.file_bytes))}", soft_wrap=True)
    say_sidecar(outcome.files, outcome.file_bytes, "--single-file writes one file")
    summary = outcome.table.group_by("tier").agg(pl.len().alias("slots"), pl.col("params").sum(), pl.col("bytes").sum())
    out.print(frame_table(summary.sort("bytes", descending=True), "", ["tier", "slots", "params", "bytes"]))
    out.print(f"  slots: {escape(slots_line(outcome.table, planner.scored.units))}", soft_wrap=True)
    out.print(f"  runtime layout: {layout_cost(outcome, settings)}")
    if (line := memory_line(outcome)) is not None:
        out.print(f"  {escape(line)}", soft_wrap=True)
    for line in bounds_lines(outcome):
        out.print(f"  {escape(line)}", soft_wrap=True)
    if (
        planner.roundings.choice
    ):  # what was measured so far, read as it is (asking for a tier's rounding could measure more)
        measured = "; ".join(
            f"{tier}: " + ", ".join(f"{m} {d:.4g}%" for m, d in drifts.items())
            for tier, drifts in planner.roundings.choice.items()
        )
        used = ", ".join(f"{tier} {label}" for tier, label in outcome.rounding.items())
        asked = " and ".join(
            f"--{option} auto"
            for option, value in (("rounding", settings.rounding), ("grids", settings.grids))
            if value == "auto"
        )
        out.print(
            f"  {asked}: each tier rounded as its uniform model drifted least on the scoring contexts "
            f"({escape(used)}; measured {escape(measured)})"
        )
    if outcome.drift is not None:
        for line in drift_lines(outcome, planner.scored.prepared.contexts.count):
            out.print(f"  {escape(line)}", soft_wrap=True)
        chosen_on = outcome.chosen_on or {}
        if chosen_on.get("windows") == "validation":
            mine = next((c for c in chosen_on["candidates"] if c["label"] == outcome.shipped), {})
            if mine.get("drift_pct") is not None:
                low, high = mine["drift_ci95"]
                out.print(
                    f"  on the {chosen_on['count']} validation windows ({escape(chosen_on['source'])}, as eval "
                    f"measures): {mine['drift_pct']:.4g}% (95% interval {low:.4g}-{high:.4g}%)",
                    soft_wrap=True,
                )
        if fused:
            out.print(
                "  note: ONNX Runtime runs its DequantizeLinear→MatMul pairs as MatMulNBits with int8 "
                "activations by default, which can drift more: "
                "`tqsdeploy eval` measures what it runs (`--exact` for this number)"
            )
    for note in outcome.notes:
        out.print(f"  [yellow]note:[/] {escape(note)}")
    if verbose and outcome.profile:
        from tqsdeploy.encoding.profiling import describe

        out.print(f"  time: {describe(outcome.profile)}")
    if verbose and outcome.cache:
        out.print(f"  cache: {cache_use(outcome.cache)}")
    if outcome.drift_pct is not None and not outcome.drift_pct <= WARN_DRIFT_PCT:
        err.print(
            f"[bold yellow]warning:[/] {escape(str(outcome.path))} drifts {outcome.drift_pct:.4g}% "
            f"from the original on the scoring contexts (above {WARN_DRIFT_PCT:g}%): it may be badly damaged; "
            "check it with `tqsdeploy eval`, or pass --max-drift PCT to fail instead",
            soft_wrap=True,
        )


def say_trial(trial) -> None:
    """A target the budget search tried, as it lands (on stderr: the progress, not the result)."""
    verdict = "meets the budget" if trial.meets else "over the budget"
    err.print(
        escape(
            f"budget search: C {trial.target:.4g} ({trial.compression:.4g}x, {trial.shipped}): {trial.drift.text()}"
            f" on the validation windows, {verdict}"
        ),
        soft_wrap=True,
    )


def print_search(found) -> None:
    """`export --max-drift` without --C: every target tried with its drift on the validation windows, then what was
    chosen (or, on stderr, that nothing met the budget)."""
    judged = "the upper end of the 95% interval" if found.on == "upper" else "the estimate"
    out.print(
        f"search for the most compressed model within {found.budget_pct:g}% on the validation windows ({judged} "
        "judged; drift from the original as eval reports it):"
    )
    for trial in sorted(found.trials, key=lambda t: t.target):
        verdict = "meets the budget" if trial.meets else "over the budget"
        out.print(
            escape(
                f"  C {trial.target:.4g}: {trial.shipped} at {trial.compression:.4g}x, drift {trial.drift.text()} "
                f"({trial.drift.output}), {verdict}"
            ),
            soft_wrap=True,
        )
    if found.chosen is None:
        least = min(found.trials, key=lambda t: t.target)
        err.print(
            escape(
                f"no model meets --max-drift {found.budget_pct:g}% on the validation windows: the least compressed "
                f"tried, C {least.target:.4g} ({least.compression:.4g}x), drifts {least.drift.text()}; nothing written"
            ),
            soft_wrap=True,
        )
        return
    chosen = found.chosen
    out.print(
        escape(
            f"chose C {chosen.target:.4g} ({chosen.compression:.4g}x, {chosen.shipped}): drift {chosen.drift.text()} "
            f"on the validation windows, within {found.budget_pct:g}% ({len(found.trials)} targets tried, one planner: "
            "prices and encoded passes reused)"
        ),
        soft_wrap=True,
    )


def print_baseline(summary: dict, path, method: str, bits: int, given_inputs: dict) -> None:
    """`baseline`'s summary: the file, its size and calibration time, the layer errors, grids and notes;
    `given_inputs`: the calibration options given (named, to say when the method reads none of them)."""
    from tiers import METHODS

    timings = summary["timings_s"]
    out.print(
        f"{path}: {method} W{bits} ({summary['tier']}), {summary['tensors']} tensors, "
        f"stored tensor bits {summary['compression']:.3f}x smaller than the original's "
        f"({summary['unit_compression']:.3f}x on the quantized units), {summary['file_bytes']:,} bytes on disk; "
        f"calibration {timings['calibration']:.2f} s"
    )
    say_sidecar(summary["files"], summary["file_bytes"])
    if summary["layer_error"]:
        ratio = [
            summary["layer_error"][k] / summary["rtn_layer_error"][k]
            for k in summary["layer_error"]
            if summary["rtn_layer_error"].get(k)
        ]
        if ratio:
            out.print(
                "  layer reconstruction error vs round to nearest on the calibration data: median "
                f"{float(np.median(ratio)):.3f}x"
            )
    if summary["grid_drifts_pct"]:
        drifts = ", ".join(f"{grids} {drift:.4g}%" for grids, drift in summary["grid_drifts_pct"].items())
        out.print(
            f"  grids: {summary['grids']}, whose model drifted less on the calibration rollout ({drifts}; --grids auto)"
        )
    for name, reason in summary["rtn_only"].items():
        out.print(f"  note: '{escape(name)}' is rounded to nearest whatever the method: {escape(reason)}")
    for note in summary["notes"]:
        out.print(f"  note: {escape(note)}")
    unused = [option for option, given in given_inputs.items() if given is not None]
    if not METHODS[method].stats and unused:  # a script looping over methods passes them to all: said, not refused
        out.print(
            f"  note: {method} rounds each weight to nearest and reads no calibration data: "
            f"{', '.join(unused)} not used"
        )
