"""What one export shares: the score run as export reads it, the cut into slots, and the job that bundles them.

`ScoredModel` is the plain data every part of an export reads; `load_scored` is the one place it is made, so the
checks (a finished run, the same model, the same units) happen once. `SlotCut` is the one piece of state that
changes during an export (near the lowest tier's size the slots are cut finer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import polars as pl

import graph_ops
from graph_ops.layout import WeightLayout
from graph_ops.qdq import default_opset
from runtimes import Runtime
from tiers import Tier
from tiers.solver_backend import solver_dtype
from tqsdeploy.encoding import checkpoints
from tqsdeploy.encoding.encoder import Encoder
from tqsdeploy.encoding.run_cache import RunCache
from tqsdeploy.encoding.slots import Slot, make_slots
from tqsdeploy.errors import USER_ERRORS, InputError
from tqsdeploy.export.allocate import MemoryCap
from tqsdeploy.export.bounds import MemoryBound
from tqsdeploy.export.forms import WeightForms
from tqsdeploy.export.settings import ExportSettings
from tqsdeploy.scoring.prepare import Prepared
from tqsdeploy.scoring.runs import ScoreRun, current_versions
from tqsdeploy.size import ModelSize
from tqsdeploy.units import Unit

FED_FLOATS_BYTES = 1 << 30
"""Up to this many bytes of weights, a one-session model's joint candidates are fed as float weights to one
session with every unit overridable; past it, a float copy is what a byte per weight avoids, and candidates run
on sessions of their codes (docs/export.md, "Large models")."""
ONE_SESSION_BYTES = 64 << 20
"""Models with this many bytes of weights or more keep one ONNX Runtime session of themselves at a time:
measuring and calibrating take turns rather than hold two copies."""


@dataclass
class ScoredModel:
    """What an export knows of its score run: read once, shared by sizing, pricing, measuring and writing."""

    run_dir: Path
    scores: ScoreRun
    prepared: Prepared
    runtime: Runtime
    gamma: dict[str, float]
    dead: set[str]
    layouts: dict[str, WeightLayout]
    sizes: ModelSize
    weights: dict[str, np.ndarray]
    """The unit weights: the prepared job's, or a resident copy of them (`resident`)."""
    one_session: bool
    """One ONNX Runtime session of the model at a time (`ONE_SESSION_BYTES`)."""
    feeds_floats: bool
    """Joint candidates are fed as float weights (`FED_FLOATS_BYTES`), not as codes rebuilt in the graph."""
    prices_cut: bool
    """A slot's price rolls out only the graph downstream of its unit, as the score's sweep did."""

    @property
    def model(self) -> graph_ops.LoadedModel:
        return self.prepared.model

    @property
    def units(self) -> list[Unit]:
        return self.prepared.units

    @property
    def steps(self) -> int:
        return self.prepared.spec.steps

    @property
    def opset(self) -> int:
        """The opset every file of this export is written at, and its candidates measured at."""
        return self.prepared.opset

    @property
    def model_opset(self) -> int:
        return default_opset(self.model.proto)

    @property
    def resident(self) -> bool:
        """The unit weights are held in memory and every measuring run feeds all of them (a one-session model
        read from its file would otherwise copy each weight from there on every run)."""
        return self.one_session and self.feeds_floats

    @property
    def reference_bits(self) -> int:
        return self.sizes.reference_bits

    @cached_property
    def units_by_name(self) -> dict[str, Unit]:
        return {u.name: u for u in self.units}

    def price_identity(self) -> str:
        """What every price of this export depends on besides the slot's codes (`PriceList.task`)."""
        extra = {"rollout": "prefix"} if self.prices_cut else {}
        extra |= {"opset": self.opset} if self.opset > self.model_opset else {}
        return json.dumps(
            {
                "run": self.scores.identity,
                "runtime": repr(self.runtime),
                "onnxruntime": current_versions()["onnxruntime"],
                **extra,
            }
        )

    def checkpoint_identity(self, settings: ExportSettings) -> str:
        """What every calibration pass depends on besides its tiers and rounding: the score run (model, contexts,
        rollout, settings), the model's hash, the target, the runtime and the versions computing the codes."""
        run = self.scores
        versions = {k: v for k, v in current_versions().items() if k != "platform"}
        return json.dumps(
            {
                "fingerprint": run.identity,
                "model": run.model.sha256,
                "contexts": run.contexts_sha256,
                "rollout": run.spec.to_dict(),
                "target": settings.target,
                "runtime": repr(self.runtime),
                "opset": self.opset,
                "solver_dtype": solver_dtype(),
                "versions": versions,
                "code": checkpoints.code_hash(),
            },
            sort_keys=True,
            default=str,
        )

    def measure_identity(self, settings: ExportSettings) -> str:
        """What a candidate's drift depends on besides the codes it feeds (`Measuring.measure`): the score run and
        its contexts, the runtime, its version and threads (lanes), the opset, how candidates are fed, the code."""
        return json.dumps(
            {
                "codes": self.checkpoint_identity(settings),
                "prices": self.price_identity(),
                "lanes": self.prepared.lanes,
                "one_session": self.one_session,
                "feeds_floats": self.feeds_floats,
            },
            sort_keys=True,
        )


def load_scored(
    run_dir: Path,
    model: Path | str | None,
    settings: ExportSettings,
    runtime: Runtime,
    opset: Callable[[object, list[Unit]], int],
) -> ScoredModel:
    """The score run in `run_dir` made ready on `model` (default: the one it scored) and `runtime`, refusing an
    unfinished run, another model, or other units; `opset(proto, units)`: the opset the files are written at."""
    run = ScoreRun.load(run_dir)
    if not run.complete:
        raise InputError(
            f"the score run in {run_dir} did not finish", hint="run the same score command again to resume it"
        )
    model = Path(model) if model is not None else run.model.path
    prepared = _prepare(run, model, settings, runtime, opset)
    run.check_model(model, prepared.model.sha256)
    runtime = runtime.for_model(prepared.model.proto)
    gamma = dict(zip(run.frame["unit"], run.frame["gamma"]))
    if set(gamma) != {u.name for u in prepared.units}:
        raise InputError(f"the score run in {run_dir} scored other units than this model has now")
    names = [n for u in prepared.units for n in u.tensor_names]
    proto = prepared.model.proto
    layouts = graph_ops.weight_layouts(proto, names)
    sizes = ModelSize.of(proto, names)
    one_session = sizes.reference_bits // 8 >= ONE_SESSION_BYTES
    feeds_floats = not one_session or sizes.reference_bits // 8 < FED_FLOATS_BYTES
    weights = prepared.job.weights
    if one_session and feeds_floats:  # resident: read once from the file, not per run
        weights = {name: np.array(weights[name]) for name in names}
    return ScoredModel(
        Path(run_dir),
        run,
        prepared,
        runtime,
        gamma,
        set(run.frame.filter(pl.col("dead"))["unit"]),
        layouts,
        sizes,
        weights,
        one_session,
        feeds_floats,
        run.strategy == "prefix" and feeds_floats,
    )


def _prepare(run: ScoreRun, model: Path, settings: ExportSettings, runtime: Runtime, opset) -> Prepared:
    """The run's sweep made ready again for whole-model candidates; a failure on another model says so."""
    try:
        return run.prepare(
            model,
            runtime,
            strategy={"prefix": "unit"}.get(run.strategy, run.strategy),  # candidates are whole models: no cuts
            runtime_keeps_weights=False,  # candidates run in sessions beside this one: it holds no copy of the weights
            # a model whose candidates run as sessions of their codes runs one lane: its sessions keep every thread
            lanes=settings.lanes if settings.lanes is not None or run.model.bytes < FED_FLOATS_BYTES else 1,
            opset=opset,
        )
    except (
        USER_ERRORS
    ):  # another model's shapes or weights fail first ('y' is not an output, no units): say which is wrong
        run.check_model(model, graph_ops.load_model(model, load_external=False).sha256)
        raise


class SlotCut:
    """The slots the allocator assigns one tier each: units, large ones cut into channel groups of `fraction`."""

    def __init__(self, units: Sequence[Unit], layouts: dict[str, WeightLayout], fraction: float):
        self._units, self._layouts = units, layouts
        self.fraction = fraction
        self.slots: list[Slot] = []
        self.slots_of: dict[str, list[Slot]] = {}
        self.use(fraction)

    def use(self, fraction: float) -> None:
        """Cut the units at `fraction` (`make_slots`)."""
        self.fraction = fraction
        self.slots = make_slots(self._units, self._layouts, fraction)
        self.slots_of = {}
        for slot in self.slots:
            self.slots_of.setdefault(slot.unit, []).append(slot)


@dataclass(frozen=True)
class ExportJob:
    """What every part of one export shares: the scored model, the settings, the tier set, the one encoder, the
    current cut into slots and the clock (`timings`: seconds by stage, for the allocation record)."""

    scored: ScoredModel
    settings: ExportSettings
    tiers: list[Tier]
    encoder: Encoder
    cut: SlotCut
    timings: dict[str, float]
    forms: WeightForms
    """How each weight is written for the target (priced and written alike)."""
    cache: RunCache | None = None
    """The run's cache of drifts and choices (the encoder keeps its codes there), or None: measured every time."""
    memory: MemoryBound | None = None
    """`export --max-memory`: the bound every allocation keeps its resident bytes within; None: no bound."""

    def knapsack_memory(self) -> MemoryCap | None:
        """What the knapsack reads of the memory bound (None: none)."""
        return self.memory.cap() if self.memory is not None else None
