"""`export`: from a score run to deployable mixed-precision ONNX models.

`Planner` opens a score run folder (model path and hash, rollout spec,
contexts, unit selection, scores) and, for each requested compression:

1. prices every slot (a unit, or a group of a large unit's output channels)
   at every tier: its cost is the bits its stored form puts in the file, its
   loss (objective `measured`) the rollout divergence with only that slot at
   that tier, quantized by the chosen rounding method;
2. solves the multiple-choice knapsack (Algorithm 1);
3. refines the allocation against interactions: single-slot divergences do
   not add up when units interact, so each round re-prices moving every slot
   one tier up or down *with all other slots at their allocated tiers* (joint
   rollouts) and re-solves, keeping the new allocation only if its joint drift
   is lower;
4. compares, by measured drift on the scoring contexts, the mixed model (as
   priced, and calibrated as itself) with the uniform allocations at the
   finest tier that fits, rounded by every method, and ships the best;
5. writes the model and its allocation record.

Every encoding comes from one `Encoder`, so what is measured is what is written.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from filelock import FileLock

import graph_ops
from graph_ops.qdq import Written, conversion_overhead_bits, emitted_bits, fed_codes_model, write_storage
from runtimes import OrtRuntime, WithDefaults, release_freed_memory
from tiers import DEFAULT_TIERS, METHODS, TIERS, TRT_TIERS, Encoded, Rounding, Tier, get_tiers
from tqsdeploy import checkpoints
from tqsdeploy.allocate import OBJECTIVES, Allocation, Choice, allocate, check_allocator, paper_weights
from tqsdeploy.calibrate import Calibrator, open_graph, thin_note
from tqsdeploy.errors import USER_ERRORS, InputError
from tqsdeploy.files import write_json, write_table
from tqsdeploy.quantization import Encoder, Slot, make_slots
from tqsdeploy.score import Prepared, ScoreTable, default_run_dir, prepare
from tqsdeploy.scoring import ScoreSettings
from tqsdeploy.size import ModelSize, SizeBudget, check_basis, split_bits
from tqsdeploy.sweep import Drift, Lanes, ResultLog, SweepRunner, Task, TaskResult
from tqsdeploy.units import Unit, UnitSelection

TARGETS = ("ort-cpu", "ort-cuda", "trt")
"""Where the exported model will run (`--target`); 'ort' is read as 'ort-cpu'."""
RUNTIME_LAYOUTS = ("auto", "dequantized", "fused")
AUTO_LAYOUT = {"ort-cpu": "dequantized", "ort-cuda": "dequantized", "trt": "fused"}
"""What `--runtime-layout auto` writes for each target. ONNX Runtime runs float weights with its fastest kernels
on CPU and CUDA, while its MatMulNBits (what DequantizeLinear→MatMul becomes) pays only for few rows: the
examples' batched windows ran 1.4-2.5x slower than FP32 on CPU and 1.1-1.8x on CUDA (issue 33), so ORT targets
dequantize once at load. TensorRT builds its INT8/INT4 kernels from DequantizeLinear nodes: 'fused' keeps them."""
WARN_DRIFT_PCT = 5.0
"""Drift (percent, as `eval` reports it) above which export warns that the model it wrote may be damaged."""
BASIS_GAP = 1.5
"""Export notes when the units are compressed more than this many times as much as the file (see `Planner._basis_note`)."""
ONE_SESSION_BYTES = 64 << 20
"""Models with this many bytes of weights or more keep one ONNX Runtime session of themselves at a
time: measuring and calibrating take turns (a session build and a nominal rollout per turn, on
a model this size far cheaper than holding a second copy of it)."""


@dataclass(frozen=True)
class ExportSettings:
    """How to allocate, round and store."""

    tiers: tuple[str, ...] | None = None
    """Tier names; None: the default ladder of the target (asymmetric grids for ort, symmetric for trt)."""
    target: str = "ort-cpu"
    """ort-cpu, ort-cuda or trt ('ort': ort-cpu): the runtime the model is written for (tiers, `runtime_layout`)."""
    runtime_layout: str = "auto"
    """How codes reach their consumers (`graph_ops.qdq.LAYOUTS`); 'auto': `AUTO_LAYOUT` of the target."""
    group_size: int | None = None
    objective: str = "measured"
    rounding: str = "qep"
    """How codes are chosen on each tier's grid: rtn, gptq, gptaq or qep."""
    fp32_fraction: float | None = None
    """Share of the units' FP32 size forced to FP32 (Algorithm 1); None: 0.10 for the paper objective, 0 otherwise."""
    allocator: str = "mckp"
    fallback: bool = True
    refine: int = 2
    """Rounds of joint re-pricing (2 joint rollouts per live slot per round); 0 turns it off."""
    split_fraction: float = 0.02
    """Units holding more than this share of the unit parameters are split into channel groups of about this share."""
    basis: str = "file"
    """What --C divides: 'file' (every stored tensor) or 'units' (the scored units only)."""
    single_file: bool = False
    """Write every tensor inside the .onnx (refused past protobuf's 2 GiB); False: one file unless the input keeps
    its weights in external-data files or the output reaches 1 GiB (`graph_ops.qdq.write_storage`)."""
    lanes: int | None = None
    """Rollouts that do not depend on each other (pricing, refinement's trials) run this many at once
    (`sweep.Lanes`); None: as `score` decides (`sweep.sweep_lanes`), the sessions' threads split between them,
    except for a model of `ONE_SESSION_BYTES` or more, whose candidates run one at a time on sessions of their own."""

    def __post_init__(self):
        if self.target == "ort":
            object.__setattr__(self, "target", "ort-cpu")
        if self.target not in TARGETS:
            raise InputError(f"unknown target '{self.target}'; choose one of {', '.join(TARGETS)}")
        if self.runtime_layout not in RUNTIME_LAYOUTS:
            raise InputError(f"unknown runtime layout '{self.runtime_layout}'; choose one of {', '.join(RUNTIME_LAYOUTS)}")
        if self.objective not in OBJECTIVES:
            raise InputError(f"unknown objective '{self.objective}'; choose one of {', '.join(OBJECTIVES)}")
        if self.rounding not in METHODS:
            raise InputError(f"unknown rounding '{self.rounding}'; choose one of {', '.join(METHODS)}")
        check_basis(self.basis)
        check_allocator(self.allocator)
        if self.refine < 0:
            raise InputError(f"--refine takes a number of rounds >= 0, not {self.refine}")
        if not 0 <= self.split_fraction < 1:
            raise InputError(f"--split takes a fraction in [0, 1), not {self.split_fraction}")

    @property
    def layout(self) -> str:
        """The runtime layout written: the one asked for, or the target's (`AUTO_LAYOUT`)."""
        return AUTO_LAYOUT[self.target] if self.runtime_layout == "auto" else self.runtime_layout

    @property
    def runtime(self) -> str:
        """The tier registry's name for the target's runtime ('ort' or 'trt')."""
        return "trt" if self.target == "trt" else "ort"

    @property
    def tier_names(self) -> tuple[str, ...]:
        if self.tiers:
            return tuple(self.tiers)
        return TRT_TIERS if self.target == "trt" else DEFAULT_TIERS

    @property
    def fp32_share(self) -> float:
        if self.fp32_fraction is not None:
            return self.fp32_fraction
        return 0.10 if self.objective == "paper" else 0.0


def _rank(candidate: "Candidate") -> tuple[float, float]:
    return candidate.drift.worst_pct, candidate.drift.relative_rms


@dataclass
class Candidate:
    """One model export considered for a target: its encodings, size and measured drift."""

    label: str
    allocation: Allocation
    encodings: dict[str, Encoded]
    drift: Drift | None = None
    cached: tuple[str, Rounding] | None = None
    """For a uniform baseline: the encoder's (tier, rounding) cache its encodings are."""
    calibrated: bool = False
    """The mixed allocation calibrated as itself (its encodings are the encoder's mixed cache)."""

    def record(self) -> dict:
        return {
            "label": self.label,
            "compression": round(self.allocation.compression, 6),
            "drift_pct": None if self.drift is None else self.drift.worst_pct,
            "relative_rms": None if self.drift is None else self.drift.relative_rms,
        }


@dataclass
class Outcome:
    """One exported model and how it was chosen."""

    allocation: Allocation
    path: Path
    file_bytes: int
    compression: float
    """Reference stored-tensor bits / exported stored-tensor bits, counted on the file (what eval and gate report)."""
    unit_compression: float
    """The same over the scored units only (the paper's C)."""
    drift: Drift | None
    shipped: str
    compared: list[dict]
    table: pl.DataFrame
    encodings: dict[str, Encoded] = field(default_factory=dict)
    """What the file stores per unit tensor."""
    notes: list[str] = field(default_factory=list)
    files: tuple[Path, ...] = ()
    """What was written: the model, then its external-data file when it has one (ship them together)."""
    refused: str | None = None
    """Why nothing was written (the drift exceeded `max_drift_pct`); None when the model was written."""
    layout: str = "fused"
    """The runtime layout written (`ExportSettings.layout`)."""
    memory_bytes: int | None = None
    """About the weight bytes a session holds after loading the file (`Planner.loaded_weight_bytes`)."""

    def fake_quantized(self) -> dict[str, np.ndarray]:
        """The weights the runtime computes from the file (exact dequantization)."""
        return {name: e.dequantize() for name, e in self.encodings.items()}

    @property
    def drift_pct(self) -> float | None:
        return None if self.drift is None else self.drift.worst_pct


def find_run(model: Path | None, run: Path | None) -> Path:
    """The run folder: given, else the model's default run folder, else the only run in tqs-runs/.

    With several runs and no model, guessing (say, the newest) could export another model: refused."""
    if run is not None:
        return run
    if model is not None:
        return default_run_dir(model)
    runs = sorted(p.parent for p in Path("tqs-runs").glob("*/run.json"))
    if not runs:
        raise InputError("no score run found in tqs-runs/", hint="run `tqsdeploy score MODEL` first or pass --run DIR")
    if len(runs) > 1:
        shown = ", ".join(str(r) for r in runs[:4]) + (", ..." if len(runs) > 4 else "")
        raise InputError(f"tqs-runs/ holds {len(runs)} score runs ({shown}); which model?", hint="name the model (tqsdeploy export MODEL ...) or pass --run DIR")
    return runs[0]


def _same_model(model: Path, sha256: str, run_dir: Path, meta: dict) -> None:
    """Refuse a model other than the one the run scored (run.json keeps its SHA-256)."""
    if sha256 != meta["model"]["sha256"]:
        raise InputError(
            f"{model} is not the model the run in {run_dir} was scored on: that run was made for a different model ({meta['model']['path']}), "
            "their SHA-256 differ",
            hint="score this model first, or pass --run DIR of its own run",
        )


class Planner:
    """Everything needed to allocate and export for one score run."""

    def __init__(self, run_dir: Path | str, model: Path | str | None = None, settings: ExportSettings = ExportSettings(), runtime: OrtRuntime = OrtRuntime(),
                 resumable: bool = False):
        """`resumable`: checkpoint every weight a calibration pass finishes in the run folder, and read back
        those an interrupted export left (`tqsdeploy.checkpoints`; the command line's export and frontier);
        `discard_checkpoints` once the export is done."""
        self.run_dir = Path(run_dir)
        self.scores = ScoreTable.load(self.run_dir)
        if not self.scores.complete:
            raise InputError(f"the score run in {self.run_dir} did not finish", hint="run the same score command again to resume it")
        meta = self.scores.meta
        model = Path(model) if model is not None else Path(meta["model"]["path"])
        self.settings = settings
        self.tiers: list[Tier] = get_tiers(list(settings.tier_names), settings.runtime, settings.group_size)
        self.rounding = Rounding(settings.rounding)
        probe = dict(meta["probe"])
        probe["horizons"] = tuple(probe["horizons"]) if probe.get("horizons") else None
        try:
            self.prepared: Prepared = prepare(
                model,
                self.run_dir / "contexts.npz",
                self.run_dir / "rollout.toml",
                selection=UnitSelection(**meta["selection"]),
                settings=ScoreSettings(**probe),
                runtime=runtime,
                strategy={"prefix": "unit"}.get(meta.get("strategy", "auto"), meta.get("strategy", "auto")),  # candidates are whole models: no cuts
                workdir=self.run_dir,
                stream=True,
                runtime_keeps_weights=False,  # candidates run in sessions beside this one: it holds no copy of the weights
                # a model measured on sessions of its own (one_session) runs one lane: its sessions keep every thread
                lanes=settings.lanes if settings.lanes is not None or meta["model"].get("bytes", 0) < ONE_SESSION_BYTES else 1,
            )
        except USER_ERRORS:  # another model's shapes or weights fail first ('y' is not an output, no units): say which is wrong
            _same_model(model, graph_ops.load_model(model, load_external=False).sha256, self.run_dir, meta)
            raise
        _same_model(model, self.prepared.model.sha256, self.run_dir, meta)
        runtime = runtime.for_model(self.prepared.model.proto)
        self.model = self.prepared.model
        self.units: list[Unit] = self.prepared.units
        self.units_by_name = {u.name: u for u in self.units}
        self.weights = self.prepared.job.weights
        self.steps = self.prepared.spec.steps
        self.frame = self.scores.frame
        self.gamma = dict(zip(self.frame["unit"], self.frame["gamma"]))
        self.dead = set(self.frame.filter(pl.col("dead"))["unit"])
        if set(self.gamma) != {u.name for u in self.units}:
            raise InputError(f"the score run in {self.run_dir} scored other units than this model has now")
        names = [n for u in self.units for n in u.tensor_names]
        proto = self.model.proto
        self.layouts = graph_ops.weight_layouts(proto, names)
        self.slots: list[Slot] = make_slots(self.units, self.layouts, settings.split_fraction)
        self.slots_of: dict[str, list[Slot]] = {}
        for slot in self.slots:
            self.slots_of.setdefault(slot.unit, []).append(slot)
        self.encoder = Encoder(
            self.units,
            self.layouts,
            self.weights,
            settings.group_size,
            calibrator=lambda: Calibrator(proto, self.layouts, self.prepared.contexts, self.prepared.spec, runtime, workdir=self.run_dir, data_dir=self.prepared.data_dir,
                                          weights=self.weights),
            checkpoints=(self.run_dir / checkpoints.FOLDER, self._checkpoint_identity(runtime)) if resumable else None,
        )
        self.sizes = ModelSize.of(proto, names)
        self.reference_bits, self.unit_reference_bits = self.sizes.reference_bits, self.sizes.unit_reference_bits
        self.model_opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
        self._overhead: dict[int, int] = {}
        self._costs: dict[tuple[str, str], int] = {}
        self._runner: SweepRunner | None = None
        self._lanes: list[SweepRunner] = []
        self._nominal = None
        """The original's rollout the first runner made: a large model's runner is closed for each
        calibration pass, and opening it again must not read every weight of the model once more."""
        self.one_session = self.reference_bits // 8 >= ONE_SESSION_BYTES
        if self.one_session:
            self.encoder.before_calibration = self._release_runner
        self._measured: dict[str, TaskResult] | None = None
        self._fed_graph = None
        """The model with its unit weights as plain inputs (no weight data): what large candidates run on."""
        self.runtime = runtime
        self._choices: dict[str, list[Choice]] = {}
        self.timings: dict[str, float] = {"pricing": 0.0, "refine": 0.0, "compare": 0.0}

    def _checkpoint_identity(self, runtime: OrtRuntime) -> str:
        """What every calibration pass of this export depends on besides its tiers and rounding: the score
        run's fingerprint (model, contexts, rollout, settings), the model's hash, the target, the runtime
        computing the statistics and the versions computing the codes."""
        from tqsdeploy.score import _versions

        meta = self.scores.meta
        return json.dumps({"fingerprint": meta.get("fingerprint"), "model": meta["model"]["sha256"], "contexts": meta["contexts"].get("sha256"),
                           "rollout": meta.get("rollout"), "target": self.settings.target, "runtime": repr(runtime),
                           "versions": {k: v for k, v in _versions().items() if k != "platform"}, "code": checkpoints.code_hash()}, sort_keys=True, default=str)

    def discard_checkpoints(self) -> None:
        """The export finished: its calibration checkpoints have nothing left to resume."""
        checkpoints.discard(self.run_dir)

    # -- sizes ------------------------------------------------------------------

    def overhead_bits(self, opset: int) -> int:
        """Bits the opset conversion adds (attributes that become constant inputs)."""
        if opset <= self.model_opset:
            return 0
        if opset not in self._overhead:
            self._overhead[opset] = conversion_overhead_bits(self.model.proto, opset)
        return self._overhead[opset]

    @property
    def budget(self) -> SizeBudget:
        """C on the --C basis: the stored bits outside the units count at their size plus what the opset
        conversion adds (worst case over the tier set's opsets)."""
        opset = max([self.model_opset] + [t.opset for t in self.tiers])
        return self.sizes.budget(self.settings.basis, self.overhead_bits(opset))

    def cost(self, slot: Slot, tier: Tier | str) -> int:
        """Bits the slot's stored form puts in the file at `tier` (the same for every rounding method).

        A slot pays its own codes, scales and zero points, and its share (by channels) of what the form
        emits once per stored run beside them (INT1's unpack constants: 65 bytes). The writer joins a
        tensor's neighbouring slots of one tier into one run, so the slots' prices are scaled to sum to
        exactly what the unit at one tier writes (`size.split_bits`): charging each slot the whole overhead
        priced a split INT1 unit 15% above its file, and channel groups of a blockwise grid priced 20 bits
        above it, which made the largest reachable C smaller than the uniform file of the lowest tier."""
        tier = TIERS[tier] if isinstance(tier, str) else tier
        key = (slot.name, tier.name)
        if key not in self._costs:  # every slot of the unit at once: one stored form per tensor
            forms = self.encoder.stored_forms(slot.unit, tier)
            written = {n: emitted_bits(n, e, self.settings.layout) for n, e in forms.items()}
            slots = self.slots_of[slot.unit]
            shares = []
            for other in slots:
                bits = 0.0
                for name, encoded in forms.items():
                    part = self.encoder.channels(name, encoded, other.rows)
                    share = 1.0 if other.rows is None else (other.rows[1] - other.rows[0]) / self.encoder.layouts[name].channels
                    bits += part.payload_bits + (written[name] - encoded.payload_bits) * share
                shares.append(bits)
            for other, bits in zip(slots, split_bits(shares, sum(written.values()))):
                self._costs[(other.name, tier.name)] = bits
        return self._costs[key]

    def costs(self) -> dict[str, dict[str, int]]:
        """Every slot's cost at every tier of the set."""
        return {slot.name: {tier.name: self.cost(slot, tier) for tier in self.tiers} for slot in self.slots}

    def floor_bits(self) -> int:
        """The slots' bits with every slot at its cheapest tier: the uniform file of the lowest tier's units."""
        return sum(min(c.values()) for c in self.costs().values())

    def max_compression(self) -> float:
        """The largest compression reachable with these tiers (every slot at its cheapest)."""
        return self.budget.compression(self.floor_bits())

    def reachable(self, target: float) -> bool:
        return self.budget.reachable(self.floor_bits(), target)

    def check_targets(self, targets: list[float]) -> None:
        """Fail before any work when a target cannot be met."""
        budget, floor = self.budget, self.floor_bits()
        hint = "lower --C or add a cheaper tier"
        if budget.fixed_bits > 0 and budget.basis_bits / floor > 1.25 * budget.compression(floor):  # the tensors outside the units bind
            min_params = self.scores.meta.get("selection", {}).get("min_params")
            hint += (
                f"; {budget.fixed_bits / budget.basis_bits:.1%} of the stored bits are in tensors that are not units (smaller than --min-params {min_params} "
                f"or not weight operands), which alone caps C at {budget.basis_bits / budget.fixed_bits:.3g}: score with a lower --min-params (or --include) to quantize them, or use --basis units"
            )
        for target in targets:
            budget.check(target, floor, [t.name for t in self.tiers], hint)

    # -- pricing -----------------------------------------------------------------

    @property
    def runner(self) -> SweepRunner:
        if self._runner is None:
            if self.one_session:
                self.encoder.release_calibrator()
            self._runner = self.prepared.open_runner(self._nominal)  # reopened: the original is not rolled out again
            self._nominal = self._runner.nominal
        return self._runner

    @property
    def lanes(self) -> list[SweepRunner]:
        """The runners that roll out independent candidates side by side: the measuring runner and its
        `SweepRunner.lane`s (`prepared.lanes` in all; one for a model measured on its own sessions)."""
        if not self._lanes:
            count = 1 if self.one_session else self.prepared.lanes
            self._lanes = [self.runner] + [self.runner.lane() for _ in range(count - 1)]
        return self._lanes

    def _release_runner(self) -> None:
        """Close the measuring session for a calibration pass; it opens again the way it ran."""
        if self._runner is not None:
            for lane in self._lanes[1:]:
                lane.close()
            self._lanes = []
            self.prepared.job.strategy = self._runner.strategy
            self._runner.close()
            self._runner = None
            release_freed_memory()

    def _probe(self, tier: Tier) -> str:
        group = f"/g{self.settings.group_size}" if self.settings.group_size else ""
        method = self.rounding.method if tier.calibratable else "rtn"
        return f"tier:{tier.name}{group}/{method}"

    def measured_tasks(self) -> list[tuple[Slot, Tier]]:
        """(slot, tier) pairs the measured objective rolls out: live slots at every tier that changes the weight."""
        return [(s, t) for s in self.slots if s.unit not in self.dead for t in self.tiers if t.name != "fp32"]

    def pending_measurements(self) -> int:
        """Measured-objective rollouts not yet in the run's cache (what a progress bar counts)."""
        if self.settings.objective != "measured" or self._measured is not None:
            return 0
        done = set()
        path = self.run_dir / "measured.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                    done.add(Task(record["unit"], record["probe"], record["draw"]).key)
                except (ValueError, KeyError, TypeError):
                    break
        return sum(Task(s.name, self._probe(t)).key not in done for s, t in self.measured_tasks())

    def measured(self, on_result=None) -> dict[str, TaskResult]:
        """Per slot and tier, the rollout divergence with only that slot at that tier.
        Cached in the run folder, so every C and every export reuses it."""
        if self._measured is not None:
            return self._measured
        started = time.perf_counter()
        log = ResultLog(self.run_dir / "measured.jsonl")
        lock = FileLock(str(self.run_dir / ".measured.lock"))
        lock.acquire()  # another export of this run prices the same slots: wait, then reuse what it measured
        done = log.load()
        try:
            for tier in {tier.name: tier for slot, tier in self.measured_tasks() if Task(slot.name, self._probe(tier)).key not in done}.values():
                if tier.calibratable:  # each tier's encoding pass before the first rollout, so the rollouts' ETA is theirs
                    self.encoder.uniform(tier, self.rounding)
            pending = [(slot, tier) for slot, tier in self.measured_tasks() if Task(slot.name, self._probe(tier)).key not in done]

            def price(lane: SweepRunner, item):
                for slot, tier in item:
                    weights = self.encoder.slot_weights(slot, tier, self.rounding)
                    tick = time.perf_counter()
                    div_sq, nonfinite = lane.divergence(weights, early_stop=False)
                    yield TaskResult(slot.name, self._probe(tier), 0, 0.0, div_sq, nonfinite, time.perf_counter() - tick)

            lanes = self.lanes
            with Lanes(lanes, lanes[0].work_items(pending, lambda task: task[0].unit), price) as results:
                for result in results:
                    log.append(result)
                    done[result.key] = result
                    if on_result:
                        on_result(result)
        finally:
            log.close()
            lock.release()
        self._measured = done
        self.timings["pricing"] += time.perf_counter() - started
        return done

    def choices(self, objective: str | None = None, on_result=None) -> list[Choice]:
        """Cost and loss of every slot at every tier; computed once per objective."""
        objective = objective or self.settings.objective
        if objective not in self._choices:
            self._choices[objective] = self._price(objective, on_result)
        return self._choices[objective]

    def _price(self, objective: str, on_result=None) -> list[Choice]:
        weights = paper_weights(self.gamma, self.dead)
        measured = self.measured(on_result) if objective == "measured" else None
        costs = self.costs()
        choices = []
        for slot in self.slots:
            dead = slot.unit in self.dead
            loss = {}
            for tier in self.tiers:
                if objective == "paper":
                    loss[tier.name] = weights[slot.unit] * 2.0 ** (-tier.bits)
                elif dead or tier.name == "fp32":
                    loss[tier.name] = 0.0
                elif objective == "response":
                    gain = math.exp(min(self.steps * self.gamma[slot.unit], 700.0))
                    change = self.encoder.slot(slot, tier, self.rounding)
                    loss[tier.name] = gain * sum(self._read_sq(n, slot, e.dequantize().astype(np.float64) - self._original(n, slot)) for n, e in change.items())
                else:
                    result = measured.get(Task(slot.name, self._probe(tier)).key)
                    loss[tier.name] = math.inf if result.nonfinite else float(sum(result.div_sq))
            choices.append(Choice(slot.name, slot.params, self.gamma.get(slot.unit, 0.0), dead, costs[slot.name], loss))
        return choices

    def _read_sq(self, name: str, slot: Slot, error: np.ndarray) -> float:
        """||error||² over the rows the contexts read (a Gather table's, like γ's denominator), else all of it."""
        rows = self.prepared.job.rows.get(name)
        if rows is not None and slot.rows is None:
            error = error[rows]
        return float(np.sum(np.square(error)))

    def _original(self, name: str, slot: Slot) -> np.ndarray:
        weight = np.asarray(self.weights[name], np.float64)
        if slot.rows is None:
            return weight
        return self.encoder.layouts[name].take_rows(weight, *slot.rows)

    # -- allocation ----------------------------------------------------------------

    def _allocation(self, tiers: dict[str, str], target: float | None, solver: str, objective: str) -> Allocation:
        slots = {s.name: s for s in self.slots}
        return Allocation(dict(tiers), {s: self.cost(slots[s], t) for s, t in tiers.items()}, self.budget, target, solver, objective)

    def uniform(self, tier: str) -> Allocation:
        return self._allocation({s.name: tier for s in self.slots}, None, "uniform", "uniform")

    def encodings(self, allocation: Allocation, calibrated: bool = False, rounding: Rounding | None = None) -> dict[str, Encoded]:
        rounding = rounding or self.rounding
        if calibrated:
            return self.encoder.calibrated(self.slots, allocation.tiers, rounding)
        return self.encoder.assemble(self.slots, allocation.tiers, rounding)

    def weights_of(self, encodings: dict[str, Encoded]) -> dict[str, np.ndarray]:
        return {name: e.dequantize() for name, e in encodings.items() if e.form != "raw"}

    def measure(self, encodings: dict[str, Encoded], runner: SweepRunner | None = None) -> Drift:
        """Joint drift of the model with these encodings on the scoring contexts (on `runner`, one of the
        `lanes`, when given). A large model's candidate runs on a session that rebuilds each quantized weight
        from its codes just before it is used (`graph_ops.qdq.fed_codes_model`): a byte per weight fed
        instead of a float copy of the whole model, the same values computed."""
        runner = runner or self.runner  # opening it rolls out the original, reading every weight
        graph_ops.release_pages(self.weights)  # the originals of what is fed are not read by this run
        if not self.one_session:
            return runner.drift(self.weights_of(encodings))
        if self._fed_graph is None:
            self._fed_graph = graph_ops.weights_as_graph_inputs(self.model.proto, list(self.layouts))
        proto, feeds = fed_codes_model(self._fed_graph, encodings)
        source = graph_ops.io.session_source(proto, self.run_dir)
        del proto
        session = WithDefaults(open_graph(self.runtime, source, self.prepared.data_dir, "the quantized candidate"), feeds, self.weights)
        try:
            return runner.drift({}, session=session)
        finally:
            session.close()

    def fake_quantized(self, allocation: Allocation) -> dict[str, np.ndarray]:
        """The weights the runtime computes from the allocation's stored forms (as priced)."""
        return {name: e.dequantize() for name, e in self.encodings(allocation).items()}

    def drift(self, allocation: Allocation) -> float:
        """Relative RMS trajectory drift of the allocation (as priced) on the scoring contexts."""
        return self.measure(self.encodings(allocation)).relative_rms

    def allocate(self, target: float, on_result=None) -> Allocation:
        """Algorithm 1 on the additive prices."""
        return allocate(
            self.choices(self.settings.objective, on_result),
            self.tiers,
            target,
            self.budget.basis_bits,
            self.budget.fixed_bits,
            objective=self.settings.objective,
            fp32_fraction=self.settings.fp32_share,
            solver=self.settings.allocator,
        )

    def refine(self, allocation: Allocation, rounds: int | None = None) -> tuple[Allocation, Drift]:
        """Re-price every live slot one tier up and one down in the context of the whole
        allocation (joint rollouts), re-solve, keep the result only if its joint drift drops."""
        rounds = self.settings.refine if rounds is None else rounds
        started = time.perf_counter()
        order = [t.name for t in self.tiers]
        costs = self.costs()
        best, best_drift = allocation, self.measure(self.encodings(allocation))
        for _ in range(rounds):
            base = sum(best_drift.div_sq)
            trials = [
                (slot.name, order[other])
                for slot in self.slots if slot.unit not in self.dead
                for other in (order.index(best.tiers[slot.name]) - 1, order.index(best.tiers[slot.name]) + 1) if 0 <= other < len(order)
            ]

            for tier in {tier for _, tier in trials} | set(best.tiers.values()):
                if TIERS[tier].calibratable:  # each tier's pass before the lanes start: they only read encodings
                    self.encoder.uniform(TIERS[tier], self.rounding)

            def trial(lane: SweepRunner, item, tiers=best.tiers, base=base):
                for name, tier in item:
                    drift = self.measure(self.encoder.assemble(self.slots, {**tiers, name: tier}, self.rounding), lane)
                    yield (name, tier), sum(drift.div_sq) - base if math.isfinite(drift.relative_rms) else math.inf

            with Lanes(self.lanes, [[t] for t in trials], trial) as results:  # every trial changes the whole model: one each
                losses = dict(results)
            choices = []
            for slot in self.slots:
                options = {best.tiers[slot.name]: 0.0} | {tier: losses[(name, tier)] for name, tier in trials if name == slot.name}
                choices.append(Choice(slot.name, slot.params, 0.0, False, {t: costs[slot.name][t] for t in options}, options))
            step = allocate(choices, self.tiers, best.target, self.budget.basis_bits, self.budget.fixed_bits, objective="measured", fp32_fraction=0.0,
                            solver=self.settings.allocator)
            if step.tiers == best.tiers:
                break
            drift = self.measure(self.encodings(step))
            if sum(drift.div_sq) >= base:
                break
            step.solver, step.objective = best.solver + "+refine", best.objective
            best, best_drift = step, drift
        self.timings["refine"] += time.perf_counter() - started
        return best, best_drift

    def candidates(self, target: float, on_result=None, final: bool = False) -> list[Candidate]:
        """Every model considered for `target`, each with its measured drift, best first.
        `final`: no other target follows, so a large model's price list is not kept for one."""
        allocation = self.allocate(target, on_result)
        drift = None
        if self.settings.refine:
            allocation, drift = self.refine(allocation)
        label = f"TQS-PTQ {self.settings.objective}/{self.rounding.method}"
        mixed = self.encodings(allocation)
        fitting = [t for t in self.tiers if self.budget.fits(sum(self.uniform(t.name).cost_bits.values()), target)] if self.settings.fallback else []
        if self.one_session:  # the mixed model holds what it uses; the rest of the price list can be rebuilt (the fallback's tier is next)
            self.encoder.forget_uniform(keep=fitting[0].name if fitting else None, calibrated=final)
        found = [Candidate(label, allocation, mixed, drift if drift is not None else self.measure(mixed))]
        del mixed
        started = time.perf_counter()
        if self.rounding.needs_stats and any(TIERS[t].calibratable for t in allocation.tiers.values()):
            encodings = self.encodings(allocation, calibrated=True)
            found.append(Candidate(label + ", calibrated as allocated", allocation, encodings, self.measure(encodings), calibrated=True))
            del encodings
            self._keep_best(found)
        if self.settings.fallback:
            if fitting:
                tier = fitting[0]
                methods = METHODS if tier.calibratable else ("rtn",)
                for method in methods:
                    rounding = Rounding(method)
                    uniform = self.uniform(tier.name)
                    uniform.target, uniform.solver = target, f"uniform {tier.name} {method}"
                    encodings = self.encoder.uniform(tier, rounding)
                    found.append(Candidate(f"uniform {tier.name} {method}", uniform, encodings, self.measure(encodings), (tier.name, rounding)))
                    del encodings
                    self._keep_best(found)
        self.timings["compare"] += time.perf_counter() - started
        return sorted(found, key=_rank)

    def _keep_best(self, found: list[Candidate]) -> None:
        """Only the best candidate is ever written: for a large model, drop the others' codes as soon as
        they are beaten (up to a byte per weight each) before the next calibration pass runs."""
        if not self.one_session:
            return
        best = min(found, key=_rank)
        for candidate in found:
            if candidate is not best and candidate.encodings:
                candidate.encodings = {}
                if candidate.cached and (candidate.cached[1] != self.rounding or not candidate.cached[1].needs_stats):
                    self.encoder.forget(*candidate.cached)  # cheap to make again, or not this export's own rounding
                if candidate.calibrated:
                    self.encoder.forget_mixed()

    def _overshoot(self, chosen: Candidate, target: float) -> str:
        """Why the shipped model is more than 5% smaller than asked."""
        achieved = f"achieved {chosen.allocation.compression:.3g}x, more than 5% above the target {target:g}x"
        order = [t.name for t in self.tiers]
        if chosen.allocation.solver.startswith("uniform"):
            tier = chosen.label.split()[1]
            finer = order[order.index(tier) - 1] if order.index(tier) > 0 else None
            if finer is None:
                return f"{achieved}: {chosen.label} is the finest tier in the set"
            return f"{achieved}: the next finer uniform tier ({finer}) reaches only {self.uniform(finer).compression:.3g}x, and {chosen.label} drifted least of the candidates"
        spare = self.budget.slot_bits(target) - sum(chosen.allocation.cost_bits.values())
        slots = {s.name: s for s in self.slots}
        steps = [self.cost(slots[name], order[order.index(tier) - 1]) - self.cost(slots[name], tier)
                 for name, tier in chosen.allocation.tiers.items() if order.index(tier) > 0]
        cheapest = min(steps, default=None)
        if cheapest is None:
            return f"{achieved}: every slot is already at the finest tier"
        if cheapest > spare:
            return f"{achieved}: no finer tier fits: the cheapest one-tier promotion costs {cheapest / 8:,.0f} bytes and {max(spare, 0) / 8:,.0f} bytes of budget are left"
        return f"{achieved}: the promotions that fit the budget did not lower the measured loss"

    def _basis_note(self, target: float, compression: float, unit_compression: float, allocation: Allocation) -> str:
        """Why C of the file pushed the units much further: the tensors that are not units stay at full
        size and take the budget; what they cost and what `--basis units` gives at the same C."""
        names = {n for u in self.units for n in u.tensor_names}
        others = [n for n in graph_ops.io.tensor_sizes(self.model.proto) if n not in names]
        fixed = self.sizes.outside_bits
        min_params = self.scores.meta.get("selection", {}).get("min_params")
        lowest = min(allocation.tiers.values(), key=lambda tier: TIERS[tier].bits)
        count = sum(t == lowest for t in allocation.tiers.values())
        units_file = self.sizes.file_compression(self.sizes.file_bits(target, "units"))
        return (
            f"compression {compression:.3g}x of the file took the units to {unit_compression:.3g}x ({lowest} on {count} of {len(allocation.tiers)} slots): "
            f"{fixed / self.reference_bits:.1%} of the stored bits ({fixed / 8:,.0f} bytes in {len(others)} tensors smaller than --min-params {min_params} "
            f"or not weight operands) are not units and stay at full size; --basis units --C {target:g} compresses the units {target:g}x "
            f"and the file about {units_file:.3g}x (check the drift of both), or score with a lower --min-params (or --include) to quantize those tensors"
        )

    # -- writing ---------------------------------------------------------------

    def table(self, allocation: Allocation) -> pl.DataFrame:
        rows = []
        for slot in self.slots:
            tier = allocation.tiers[slot.name]
            rows.append(
                {
                    "slot": slot.name,
                    "unit": slot.unit,
                    "channels": None if slot.rows is None else f"{slot.rows[0]}:{slot.rows[1]}",
                    "tier": tier,
                    "bits": TIERS[tier].bits,
                    "params": slot.params,
                    "bytes": -(-allocation.cost_bits[slot.name] // 8),
                    "gamma": self.gamma.get(slot.unit),
                    "dead": slot.unit in self.dead,
                }
            )
        return pl.DataFrame(rows)

    def write(self, encodings: dict[str, Encoded], path: Path, external_data: bool | None = None) -> Written:
        """Write the model atomically (large ones stream into external data)."""
        stored = {name: e for name, e in encodings.items() if not (e.form == "raw" and e.values is self.weights.get(name))}
        if external_data is None and self.settings.single_file:
            external_data = False
        return write_storage(self.model.proto, stored, path, external_data=external_data, source=self.prepared.data_dir, layout=self.settings.layout)

    def check_single_file(self, targets: list[float | None], uniform_tier: str | None = None) -> None:
        """With `single_file`, refuse before any work an output that cannot fit one file (protobuf's 2 GiB):
        its size estimated from the budget, or for a uniform tier from the tier's bits."""
        if not self.settings.single_file:
            return
        for target in targets:
            if target is None:
                bits = self.sizes.outside_bits + sum(u.params for u in self.units) * get_tiers([uniform_tier], self.settings.runtime, self.settings.group_size)[0].bits
            else:
                bits = min(self.reference_bits, self.sizes.file_bits(target, self.settings.basis))
            if bits / 8 >= graph_ops.io.PROTOBUF_LIMIT:
                raise InputError(f"--single-file: the model would hold about {bits / 8 / 2**30:.2f} GiB, past protobuf's 2 GiB limit for one .onnx file",
                                 hint="drop --single-file: the weights then go to an external-data file beside it")

    def export(self, target: float | None, path: Path | str, uniform_tier: str | None = None, rounding: str | None = None, on_result=None,
               max_drift_pct: float | None = None, final: bool = False) -> Outcome:
        """Write the model for `target` (or every unit at `uniform_tier`, codes chosen by `rounding`,
        default the planner's) and its allocation record beside it; write nothing when its drift on the
        scoring contexts exceeds `max_drift_pct` (percent, as `eval` reports drift). `final`: no other
        target follows (see `candidates`)."""
        started = time.perf_counter()
        path = Path(path)
        notes: list[str] = []
        if uniform_tier is not None:
            tier = get_tiers([uniform_tier], self.settings.runtime, self.settings.group_size)[0]
            method = Rounding(rounding) if rounding else self.rounding
            allocation = self.uniform(tier.name)
            allocation.target = target
            label = f"uniform {tier.name} {method.method if tier.calibratable else 'rtn'}"
            encodings = self.encoder.uniform(tier, method)
            compared = [Candidate(label, allocation, encodings, self.measure(encodings))]
        else:
            compared = self.candidates(target, on_result, final)
        chosen = compared[0]
        if not chosen.label.startswith("TQS-PTQ") and uniform_tier is None:
            mixed = next(c for c in compared if c.label.startswith("TQS-PTQ"))
            notes.append(
                f"shipped {chosen.label} instead of the mixed allocation: at this budget it drifts less on the scoring contexts "
                f"({chosen.drift.worst_pct:.4g}% vs {mixed.drift.worst_pct:.4g}% for the mixed one at {mixed.allocation.compression:.3g}x); --no-fallback ships the mixed one"
            )
        if target is not None and uniform_tier is None and chosen.allocation.compression > 1.05 * target:
            notes.append(self._overshoot(chosen, target))
        for name, touched in sorted(self.prepared.job.rows.items()):
            tier = next((chosen.allocation.tiers[s.name] for s in self.slots if name in self.units_by_name[s.unit].tensor_names), None)
            notes.append(
                f"'{name}': the scoring contexts read {len(touched)} of its {self.weights[name].shape[0]} rows; it was scored and measured on those, "
                f"and the other rows are stored at the same tier ({tier}) untested: rows a deployment reads that the contexts never did may be hurt more"
            )
        for name, reason in sorted(self.encoder.log.rtn_only.items()):
            if self.rounding.needs_stats:
                notes.append(f"'{name}' is rounded to nearest whatever the method: {reason}")
        thin = thin_note(self.encoder.log.thin, self.settings.rounding, "score with more context windows (or more --steps) to give it more, or export with --rounding rtn, which needs none")
        if thin and self.rounding.needs_stats:
            notes.append(thin)
        if max_drift_pct is not None and chosen.drift is not None and not chosen.drift.worst_pct <= max_drift_pct:
            refused = f"{path} not written: it drifts {chosen.drift.worst_pct:.4g}% from the original on the scoring contexts, above --max-drift {max_drift_pct:g}%"
            return Outcome(chosen.allocation, path, 0, math.nan, math.nan, chosen.drift, chosen.label, [c.record() for c in compared], self.table(chosen.allocation),
                           chosen.encodings, notes, refused=refused)
        stem = path.with_suffix("")
        for record in (Path(f"{stem}.allocation.json"), Path(f"{stem}.allocation.parquet")):
            record.unlink(missing_ok=True)  # a kill before the new record lands leaves a model without one, never a mismatched pair
        written = self.write(chosen.encodings, path)
        size, bits = written.bytes, written.weight_bits
        compression, unit_compression = self.sizes.written(bits, chosen.encodings, self.settings.layout)
        if target is not None and uniform_tier is None and self.settings.basis == "file" and unit_compression > BASIS_GAP * compression:
            notes.insert(0, self._basis_note(target, compression, unit_compression, chosen.allocation))
        table = self.table(chosen.allocation)
        summary = {
            "model": str(self.model.path),
            "run": str(self.run_dir),
            "output": str(path),
            "target_compression": target,
            "basis": self.settings.basis,
            "compression": compression,
            "unit_compression": unit_compression,
            "reference_bits": self.reference_bits,
            "weight_bits": bits,
            "file_bytes": size,
            "files": [str(f) for f in written.files],
            "external_data": str(written.files[1]) if len(written.files) > 1 else None,
            "runtime_layout": self.settings.layout,
            "target": self.settings.target,
            "weights_in_memory_bytes": self.loaded_weight_bytes(chosen.encodings),
            "objective": chosen.allocation.objective,
            "rounding": chosen.label.split()[-1] if uniform_tier is not None else self.rounding.method,
            "solver": chosen.allocation.solver,
            "shipped": chosen.label,
            "settings": asdict(self.settings),
            "drift_pct": chosen.drift.worst_pct if chosen.drift else None,
            "drift_pct_by_output": chosen.drift.pct if chosen.drift else None,
            "relative_rms_drift": chosen.drift.relative_rms if chosen.drift else None,
            "compared": [c.record() for c in compared],
            "notes": notes,
            "checkpointed_weights_reused": self.encoder.log.reused,
            "timings_s": {**{k: round(v, 3) for k, v in self.timings.items()}, "calibration": round(self.encoder.log.calibration_s, 3), "total": round(time.perf_counter() - started, 3)},
            "tiers": table.rows(named=True),
        }
        write_table(table, f"{stem}.allocation.parquet")
        write_json(f"{stem}.allocation.json", summary)
        return Outcome(chosen.allocation, path, size, compression, unit_compression, chosen.drift, chosen.label, [c.record() for c in compared], table, chosen.encodings, notes,
                       written.files, layout=self.settings.layout, memory_bytes=summary["weights_in_memory_bytes"])

    def loaded_weight_bytes(self, encodings: dict[str, Encoded]) -> int:
        """About how many bytes of weights an ONNX Runtime session of the written model holds after load: it
        folds fp16/bf16 Casts, INT1's unpacking and, in the 'dequantized' layout, every dequantization into a
        float weight of the original's type; 'fused' keeps DequantizeLinear's codes (MatMulNBits repacks them)."""
        def held(encoded: Encoded) -> int:
            if encoded.form == "split":
                return sum(held(part) for part in encoded.parts)
            if encoded.form == "dequantize" and self.settings.layout == "fused":
                return encoded.payload_bits // 8
            return math.prod(encoded.shape) * np.dtype(encoded.dtype).itemsize

        return self.sizes.outside_bits // 8 + sum(held(e) for e in encodings.values())

    def close(self) -> None:
        self._release_runner()
        self.encoder.close()
