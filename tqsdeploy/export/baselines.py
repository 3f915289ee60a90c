"""Uniform baselines: every unit at one integer tier, codes chosen by RTN, GPTQ, GPTAQ or QEP.

A baseline is a uniform allocation exported with a rounding method, through
the same `Encoder` and writer `export` uses, so the two cannot drift apart:
`baseline --method gptq --bits 4` equals `export --uniform int4-asym
--rounding gptq` on the same calibration windows. This module only adds the
entry point for users without a score run: it selects the same units a score
run would, and calibrates on the given windows (and, with a rollout spec and
`steps` > 1, on every step of their nominal rollout).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from time import perf_counter
from typing import Callable

import numpy as np

import graph_ops
from graph_ops.qdq import computes_in_half, default_opset, write_storage
from runtimes import DEFAULT_RUNTIME, Runtime
from tiers import Encoded, Rounding, Tier, TierError, ladder_opset, tier_for_bits
from tqsdeploy.encoding.calibrator import CalibrationRollout, Calibrator
from tqsdeploy.encoding.choices import check_grids, grid_options
from tqsdeploy.encoding.encoder import Encoder, EncodingProgress
from tqsdeploy.encoding.logs import thin_note
from tqsdeploy.encoding.sessions import open_graph
from tqsdeploy.encoding.slots import checked_layouts
from tqsdeploy.errors import InputError
from tqsdeploy.export.forms import FormPolicy, WeightForms
from tqsdeploy.rollout import RolloutSpec, resolve_spec
from tqsdeploy.rollout.contexts import ContextOptions, Contexts, load_contexts
from tqsdeploy.size import ModelSize
from tqsdeploy.units import check_finite


@dataclass
class BaselineResult:
    """Quantized weights of one baseline run, in the model's stored layout."""

    method: str
    bits: int
    tier: str
    encoded: dict[str, Encoded]
    """What the file stores per weight; `.dequantize()` == `weights[name]`."""
    timings: dict[str, float]
    """Seconds per stage: load, calibration (runs + statistics + the method's math), total."""
    errors: dict[str, float] = field(default_factory=dict)
    """‖X̂W − X̂Q‖_F per calibrated weight, X̂ being the inputs of its wave."""
    rtn_errors: dict[str, float] = field(default_factory=dict)
    """The same error for round to nearest on the same X̂ and grid, for comparison."""
    rtn_only: dict[str, str] = field(default_factory=dict)
    """Weights rounded to nearest whatever the method, and why."""
    notes: list[str] = field(default_factory=list)
    grids: str = "per-channel"
    """The grids the codes are on (`tiers.GRIDS`)."""
    grid_drifts: dict[str, float] = field(default_factory=dict)
    """With --grids auto where they differ: each grid's uniform model's drift (percent) on the calibration rollout."""
    opset: int = 1
    """The opset its drifts are measured at and the file written at least at: a graph computing in 16-bit floats at
    what the
    tier's form needs (`graph_ops.qdq.computes_in_half`), others at their own (the file raised as its form needs)."""

    @cached_property
    def weights(self) -> dict[str, np.ndarray]:
        """Fake-quantized weights, stored layout and dtype, ready for replace_weights or feeds: made
        when first read (a float copy of every weight, which writing the baseline does not need)."""
        return {name: e.dequantize() for name, e in self.encoded.items()}


@dataclass(frozen=True)
class BaselineSettings:
    """One uniform baseline: the rounding method and bits, and what it calibrates on."""

    method: str
    bits: int
    spec: RolloutSpec | str | Path | None = None
    """Calibrate on every step of the windows' nominal rollout; None with `steps` None: the windows alone."""
    steps: int | None = None
    group_size: int | None = None
    symmetric: bool = False
    rounding: Rounding | None = None
    """The method's options (default `Rounding(method)`); its grids are not used with `grids` 'auto'."""
    grids: str = "auto"
    min_params: int = 1024
    max_batch_windows: int = 32


@dataclass(frozen=True)
class BaselineProgress:
    on_start: Callable[[int], None] | None = None
    """Told how many weight encodings the baseline will make (one pass per grid measured)."""
    on_weight: Callable[[str], None] | None = None


def quantize_baseline(
    model_path: str | Path,
    settings: BaselineSettings,
    calib: Contexts | str | Path | None = None,
    runtime: Runtime = DEFAULT_RUNTIME,
    progress: BaselineProgress = BaselineProgress(),
) -> BaselineResult:
    """Quantize a model's units uniformly at `settings.bits` with one rounding method.

    Defaults follow the official code (asymmetric per channel, percdamp 0.01, block 128, α = 0.25 for GPTAQ and 0.5
    with percdampqep 1.0 for QEP on GPTQ); the grid is the tier's (`tiers.grid`). RTN needs no calibration; the
    others take windows in the contexts format. With `grids` 'auto' a calibrated method's model is built on both
    grids of a clip-searched tier and the one that drifts less on the calibration rollout is kept."""
    started = perf_counter()
    rounding, tier = _method(settings)
    runtime.check()
    loaded, data_dir = _load(model_path)
    runtime = runtime.for_model(loaded.proto)
    units, names, layouts = checked_layouts(loaded.proto, settings.min_params, settings.group_size, [tier])
    half = (
        ladder_opset([tier], {layouts[n].dtype for n in names}, bool(settings.group_size))
        if computes_in_half(loaded.proto)
        else 1
    )
    opset = max(default_opset(loaded.proto), half)
    weights = graph_ops.model_weights(loaded.proto, names, data_dir)
    check_finite(weights)
    graph_ops.release_pages(weights)  # the check read every weight; the encoder reads each again in turn
    source = _CalibrationSource(loaded, data_dir, layouts, names, weights, opset, runtime, settings, calib)
    encoder = Encoder(
        units,
        layouts,
        weights,
        settings.group_size,
        source.calibrator if rounding.needs_stats else None,
        track_errors=rounding.needs_stats,
        progress=EncodingProgress(on_weight=progress.on_weight),
    )
    load_s = perf_counter() - started
    if progress.on_start:  # one pass per grid measured
        progress.on_start(len(layouts) * len(grid_options(tier, rounding.method, settings.grids)))
    rounding, grid_drifts, errors = _grids_measured(encoder, tier, rounding, settings.grids)
    encoded = {name: e.expand() for name, e in encoder.uniform(tier, rounding).items()}  # a result's codes are arrays
    result = BaselineResult(
        method=settings.method,
        bits=settings.bits,
        tier=tier.name,
        encoded=encoded,
        timings={"load": load_s, "calibration": encoder.log.calibration_s + encoder.log.encode_s},
        errors=errors,
        rtn_errors=dict(encoder.log.rtn_errors),
        rtn_only=dict(encoder.log.rtn_only) if rounding.needs_stats else {},
        grids=rounding.grids,
        grid_drifts=grid_drifts,
        opset=opset,
    )
    result.notes.extend(_notes(encoder, settings))
    encoder.close()
    result.timings["total"] = perf_counter() - started
    return result


def _method(settings: BaselineSettings) -> tuple[Rounding, Tier]:
    """The rounding and the tier the settings ask for, refused with one line when they don't fit."""
    try:
        rounding = settings.rounding or Rounding(settings.method)
        tier = tier_for_bits(settings.bits, settings.symmetric)
    except (ValueError, TierError) as exc:
        raise InputError(str(exc)) from None
    if rounding.method != settings.method:
        raise InputError(f"rounding settings are for '{rounding.method}', not '{settings.method}'")
    check_grids(settings.grids)
    return rounding, tier


def _notes(encoder: Encoder, settings: BaselineSettings) -> list[str]:
    notes = []
    thin = thin_note(
        encoder.log.thin,
        settings.method,
        f"give --calib more windows (or a longer --steps rollout): {', '.join(sorted(encoder.log.thin))}",
    )
    if thin:
        notes.append(thin)
    if settings.bits == 3:
        notes.append("3-bit codes travel in 4-bit containers: W3 is no smaller on disk than W4")
    return notes


@dataclass
class _CalibrationSource:
    """Where a calibrated baseline's statistics come from: the calibration windows rolled out as asked."""

    loaded: graph_ops.LoadedModel
    data_dir: Path | None
    layouts: dict
    names: list[str]
    weights: dict[str, np.ndarray]
    opset: int
    runtime: Runtime
    settings: BaselineSettings
    calib: Contexts | str | Path | None

    def calibrator(self) -> Calibrator:
        settings = self.settings
        if self.calib is None:
            raise InputError(
                f"{settings.method} needs calibration windows", hint="pass a contexts .npz (or use method 'rtn')"
            )
        graph = graph_ops.weights_as_graph_inputs(
            self.loaded.proto, self.names
        )  # the signature, without loading the weights into the runtime
        session = open_graph(self.runtime, graph_ops.io.session_source(graph), self.data_dir, str(self.loaded.path))
        del graph
        inputs, outputs = [i for i in session.inputs if i.name not in self.layouts], list(session.outputs)
        session.close()
        calib = self.calib
        contexts = calib if isinstance(calib, Contexts) else load_contexts(Path(calib), inputs, ContextOptions())
        if settings.spec is None and settings.steps is None:  # the windows themselves, one step
            resolved = RolloutSpec(
                steps=1, feedback=(), trajectory=tuple(o.name for o in outputs if o.dtype.kind == "f")
            )
        else:
            resolved = resolve_spec(settings.spec, settings.steps, inputs, outputs)
        return Calibrator(
            self.loaded.proto,
            self.layouts,
            CalibrationRollout(contexts, resolved, settings.max_batch_windows),
            self.runtime,
            data_dir=self.data_dir,
            weights=self.weights,
            opset=self.opset,
        )


def _grids_measured(
    encoder: Encoder, tier, rounding: Rounding, grids: str
) -> tuple[Rounding, dict[str, float], dict[str, float]]:
    """The rounding on the grids `grids` asks for, encoded: with 'auto', where the grids differ (`grid_options`),
    the uniform model on each grid measured on the calibration rollout (`Calibrator.drift`) and the one that drifts
    less kept, as `export` keeps it on the scoring contexts. Returns (that rounding, each grid's drift in percent
    where measured, its layer errors)."""
    options = [replace(rounding, grids=option.grids) for option in grid_options(tier, rounding.method, grids)]
    errors = {}

    def measure(option: Rounding):
        encodings = encoder.uniform(tier, option)
        errors[option] = dict(encoder.log.errors)  # each pass logs its own over the last
        return encoder.calibrator.drift({name: e.dequantize() for name, e in encodings.items()})

    if len(options) == 1:
        encoder.uniform(tier, options[0])
        return options[0], {}, dict(encoder.log.errors)
    chosen, measured = encoder.least_drifting(tier, options, measure)
    return chosen, {option.grids: drift.worst_pct for option, drift in measured.items()}, errors[chosen]


def write_baseline(model_path: str | Path, result: BaselineResult, output: str | Path, layout: str = "native") -> dict:
    """Write the baseline as the same deployable ONNX that `export` emits, in runtime `layout` (`graph_ops.qdq.LAYOUTS`;
    export's default for ort-cpu)."""
    loaded, data_dir = _load(model_path)
    started = perf_counter()
    forms = WeightForms(loaded.proto, graph_ops.weight_layouts(loaded.proto, list(result.encoded)), FormPolicy(layout))
    written = write_storage(
        loaded.proto,
        result.encoded,
        output,
        source=data_dir,
        layout={name: forms.layout_of(e) for name, e in result.encoded.items()},
        opset=result.opset,
        native=forms.plans(result.encoded),
    )  # kept tensors read from the input's files
    unit_bits = sum(forms.bits(name, e) for name, e in result.encoded.items())
    return {
        "method": result.method,
        "bits": result.bits,
        "tier": result.tier,
        **ModelSize.of(loaded.proto, result.encoded).record(written, unit_bits, layout),
        "runs_as": {name: forms.runs_as(name, e) for name, e in sorted(result.encoded.items())},
        "timings_s": {
            **{k: round(v, 4) for k, v in result.timings.items()},
            "write": round(perf_counter() - started, 4),
        },
        "tensors": len(result.encoded),
        "rtn_only": result.rtn_only,
        "layer_error": result.errors,
        "rtn_layer_error": result.rtn_errors,
        "grids": result.grids,
        "grid_drifts_pct": result.grid_drifts,
        "notes": result.notes,
    }


def _load(model_path: str | Path) -> tuple[graph_ops.LoadedModel, Path | None]:
    """The model without its external data (or, for a large single file, as a skeleton), and the folder
    its tensors point into (None when the proto holds them): weights are read from the files on
    demand, as `score` and `export` read them, never copied whole into memory."""
    loaded = graph_ops.load_model(model_path, load_external=False)
    data_dir = loaded.path.parent.resolve() if graph_ops.io.has_external_data(loaded.proto) else None
    return loaded, data_dir
