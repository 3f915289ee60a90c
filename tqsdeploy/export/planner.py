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
   is lower and, calibrated as itself (what ships), lower too;
4. compares, by measured drift on the scoring contexts, the mixed model (as
   priced, and calibrated as itself; near the lowest tier's size also one
   allocated with the int1 tier below it) with the uniform allocations at the
   finest tier that fits, rounded by every method, and ships the best;
5. writes the model and its allocation record.

Every encoding comes from one `Encoder`, so what is measured is what is written. Steps 1-2 (planning) are
this module, 3-4 `export_candidates`, 5 `export_writing`; the settings are `export_settings`, and what C
means in bits is `tqsdeploy.size`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl
from filelock import FileLock

import graph_ops
from graph_ops.qdq import default_opset
from runtimes import DEFAULT_RUNTIME, Runtime, release_freed_memory
from tiers import TIERS, Encoded, Rounding, Tier, get_tiers
from tiers.solver_backend import solver_dtype
from tqsdeploy.encoding import checkpoints
from tqsdeploy.export.allocate import Allocation, Choice, allocate, paper_weights
from tqsdeploy.encoding.calibrator import Calibrator, original_nominal
from tqsdeploy.errors import USER_ERRORS, InfeasibleError, InputError
from tqsdeploy.export.candidates import Candidate, CandidateBuilding
from tqsdeploy.export.fitting import Fitting
from tqsdeploy.export.measuring import Measuring
from tqsdeploy.export.sizing import Sizing
from tqsdeploy.export.settings import AUTO_LAYOUT, RUNTIME_LAYOUTS, TARGETS, ExportSettings
from tqsdeploy.export.writing import BASIS_GAP, WARN_DRIFT_PCT, Outcome, Writing
from tqsdeploy.files import RunFolderShare
from tqsdeploy.encoding.encoder import AnyRounding, Encoder, Slot, check_group_size, grid_options, make_slots, plain_rounding, rounding_at
from tqsdeploy.scoring.prepare import Prepared
from tqsdeploy.scoring.runs import ScoreRun, current_versions, default_run_dir, score_runs
from tqsdeploy.size import ModelSize
from tqsdeploy.sweep import Drift, Lanes, ResultLog, SweepRunner, Task, TaskResult
from tqsdeploy.units import Unit

__all__ = ["AUTO_LAYOUT", "BASIS_GAP", "RUNTIME_LAYOUTS", "TARGETS", "WARN_DRIFT_PCT", "Candidate", "ExportSettings", "Outcome", "Planner", "find_run"]

LAZY_BITS = 16
"""Tiers of at least this many bits (float copies: bf16, fp16) are priced only when an allocation picks them (`Planner.allocate`)."""

FED_FLOATS_BYTES = 1 << 30
"""A model measured on sessions of its own (`ONE_SESSION_BYTES`) up to this many bytes of weights has its
joint candidates (refinement's trials) fed as float weights to one session with every unit overridable,
one float copy of its weights held beside it: a session built per candidate with its codes rebuilt in the
graph on every call cost the 22M BERT 0.26 s per trial, 3.5x the rollout itself. Past this size a float copy
is what a byte per weight avoids, and candidates keep their sessions of codes."""
ONE_SESSION_BYTES = 64 << 20
"""Models with this many bytes of weights or more keep one ONNX Runtime session of themselves at a
time: measuring and calibrating take turns (a session build and a nominal rollout per turn, on
a model this size far cheaper than holding a second copy of it)."""


def find_run(model: Path | None, run: Path | None) -> Path:
    """The run folder: given, else the model's default run folder, else the only run in tqs-runs/.

    With several runs and no model, guessing (say, the newest) could export another model: refused."""
    if run is not None:
        return run
    if model is not None:
        return default_run_dir(model)
    runs = score_runs(Path("tqs-runs"))
    if not runs:
        raise InputError("no score run found in tqs-runs/", hint="run `tqsdeploy score MODEL` first or pass --run DIR")
    if len(runs) > 1:
        shown = ", ".join(str(r) for r in runs[:4]) + (", ..." if len(runs) > 4 else "")
        raise InputError(f"tqs-runs/ holds {len(runs)} score runs ({shown}); which model?", hint="name the model (tqsdeploy export MODEL ...) or pass --run DIR")
    return runs[0]


class Planner(CandidateBuilding, Fitting, Measuring, Sizing, Writing):
    """Everything needed to allocate and export for one score run: this module prices and allocates,
    `export_candidates` compares the candidates for a target, `export_measuring` measures them, `export_writing`
    writes the chosen one."""

    def __init__(self, run_dir: Path | str, model: Path | str | None = None, settings: ExportSettings = ExportSettings(), runtime: Runtime = DEFAULT_RUNTIME,
                 resumable: bool = False):
        """`resumable`: checkpoint every weight a calibration pass finishes in the run folder, and read back
        those an interrupted export left (`tqsdeploy.encoding.checkpoints`; the command line's export and frontier);
        `discard_checkpoints` once the export is done. Holds the run folder (`RunFolderShare`) until `close`."""
        self.run_dir = Path(run_dir)
        self._share = RunFolderShare(self.run_dir)
        try:
            self._load(model, settings, runtime, resumable)
        except BaseException:
            self._share.release()
            raise

    def _load(self, model: Path | str | None, settings: ExportSettings, runtime: Runtime, resumable: bool) -> None:
        self.scores = run = ScoreRun.load(self.run_dir)
        if not run.complete:
            raise InputError(f"the score run in {self.run_dir} did not finish", hint="run the same score command again to resume it")
        model = Path(model) if model is not None else run.model.path
        self.settings = settings
        self.tiers: list[Tier] = get_tiers(list(settings.tier_names), settings.runtime, settings.group_size)
        measures = settings.rounding == "auto" or any(len(grid_options(t, settings.rounding, settings.grids)) > 1 for t in self.tiers)
        self._rounding: AnyRounding | None = None if measures else plain_rounding(settings.rounding, settings.grids)
        self.rounding_choice: dict[str, dict[str, float]] = {}
        """Per calibratable tier measured to choose its rounding (--rounding auto, --grids auto): each rounding's
        uniform drift (percent) on the scoring contexts, by its label ('qep', 'qep/min-max')."""
        self._grid_choice: dict[tuple[str, str], Rounding] = {}
        """(tier, method) -> that method's rounding on the grids measured best there (`measured_rounding`)."""
        self._uniform_drifts: dict[tuple[str, Rounding], Drift] = {}
        """Uniform candidates' drifts already measured (a uniform model is measured once per export)."""
        try:
            self.prepared: Prepared = run.prepare(
                model,
                runtime,
                strategy={"prefix": "unit"}.get(run.strategy, run.strategy),  # candidates are whole models: no cuts
                runtime_keeps_weights=False,  # candidates run in sessions beside this one: it holds no copy of the weights
                # a model whose candidates run as sessions of their codes (past FED_FLOATS_BYTES) runs one lane: its sessions keep every thread
                lanes=settings.lanes if settings.lanes is not None or run.model.bytes < FED_FLOATS_BYTES else 1,
                opset=self.output_opset,
            )
        except USER_ERRORS:  # another model's shapes or weights fail first ('y' is not an output, no units): say which is wrong
            run.check_model(model, graph_ops.load_model(model, load_external=False).sha256)
            raise
        run.check_model(model, self.prepared.model.sha256)
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
        check_group_size(settings.group_size, self.layouts, self.tiers)
        self.slots: list[Slot] = []
        self.slots_of: dict[str, list[Slot]] = {}
        self.split_fraction = settings.split_fraction
        """The share the slots are cut at now (`use_split`): the setting's, or finer near the lowest tier's size."""
        self.use_split(settings.split_fraction)
        self.encoder = Encoder(
            self.units,
            self.layouts,
            self.weights,
            settings.group_size,
            calibrator=lambda: Calibrator(proto, self.layouts, self.prepared.contexts, self.prepared.spec, runtime, workdir=self.run_dir, data_dir=self.prepared.data_dir,
                                          weights=self.weights, opset=self.opset),
            checkpoints=(self.run_dir / checkpoints.FOLDER, self._checkpoint_identity(runtime)) if resumable else None,
        )
        self.sizes = ModelSize.of(proto, names)
        self.reference_bits, self.unit_reference_bits = self.sizes.reference_bits, self.sizes.unit_reference_bits
        self.model_opset = default_opset(proto)
        self.opset = self.prepared.opset
        """The opset every file of this export is written at, and its candidates measured at (`output_opset`)."""
        self._overhead: dict[int, int] = {}
        self._costs: dict[tuple[float, str, str], int] = {}
        """(cut, slot, tier) -> bits (`cost`): a slot's share of its unit's bits depends on the other slots of the cut."""
        self._stretch_bits: dict[tuple[str, str, tuple[int, int]], int] = {}
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
        self.feeds_floats = not self.one_session or self.reference_bits // 8 < FED_FLOATS_BYTES
        """Joint candidates are fed as float weights (`FED_FLOATS_BYTES`), not as codes rebuilt in the graph."""
        self.resident = self.one_session and self.feeds_floats
        """The unit weights are held in memory and every measuring run feeds all of them: a one-session model is
        read from its file (a single .onnx as a skeleton, its tensors at unaligned offsets), and each run that
        left a weight to its default copied it from there: 80 ms of every 22M-BERT rollout and calibration run."""
        if self.resident:
            self.weights = self.encoder.weights = {name: np.array(self.weights[name]) for name in names}
        self._fed_session = None
        """A one-session model's session with every unit overridable, for joint candidates fed as floats."""
        self._base_floats: dict[str, tuple[tuple, np.ndarray | None]] = {}
        """Per unit tensor: its channel runs in the allocation refinement starts a round from, and its float values."""
        self._calibrated_drifts: dict[tuple[tuple[str, str], ...], Drift] = {}
        """Allocations calibrated as themselves already measured, by their tiers (`calibrated_drift`)."""
        self._joint_drifts: dict[tuple[tuple[str, str], ...], Drift] = {}
        """Allocations (as priced) already measured, by their tiers: each distinct one is rolled out once."""
        self.runtime = runtime
        self._choices: dict[str, list[Choice]] = {}
        self._unpriced: set[tuple[str, str]] = set()
        """(slot, tier) pairs the measured prices bound by 0, not measured yet (`allocate`)."""
        self._price_keys: dict[tuple[str, str], Task] = {}
        """(slot, tier) -> its entry in the price list (`price_task`): its codes are this export's, fixed once made."""
        self.prices_cut = run.strategy == "prefix" and self.feeds_floats
        """A slot's price rolls out only the graph downstream of its unit, as the score's sweep did (it timed its
        strategies and found the cuts fastest); whole candidates still run whole. The 22M BERT's 228 pricing
        rollouts took 11.0 s on its 2 lanes against 15.9 s whole. Only up to `FED_FLOATS_BYTES`: each lane's cut
        session holds the weights downstream of its cut, up to a float copy of the model."""
        self._price_identity = json.dumps({"run": run.identity, "runtime": repr(runtime), "onnxruntime": current_versions()["onnxruntime"], **({"rollout": "prefix"} if self.prices_cut else {}),
                                           **({"opset": self.opset} if self.opset > self.model_opset else {})})
        self.timings: dict[str, float] = {"rounding": 0.0, "pricing": 0.0, "refine": 0.0, "compare": 0.0}
        self.on_measuring: Callable[[int], None] | None = None
        """Told how many rollouts a batch of reported measurements (`measured` with `on_result`) is about to run:
        the count is known only then (near the lowest tier's size the slots are cut finer first)."""

    def use_split(self, fraction: float) -> None:
        """Cut the units into slots at `fraction` (`make_slots`); what was priced stays cached by slot name."""
        self.split_fraction = fraction
        self.slots = make_slots(self.units, self.layouts, fraction)
        self.slots_of = {}
        for slot in self.slots:
            self.slots_of.setdefault(slot.unit, []).append(slot)
        self._choices = {}
        self._unpriced = set()

    @property
    def rounding(self) -> AnyRounding:
        """The rounding every encoding of this export uses: the one asked for, or with 'auto' one method per
        tier, chosen by measurement the first time it is needed (`choose_roundings`)."""
        if self._rounding is None:
            self._rounding = self.choose_roundings()
        return self._rounding

    def rounding_at(self, tier: str) -> Rounding:
        """The method that rounds `tier`'s codes in this export."""
        return rounding_at(self.rounding, tier)

    def _checkpoint_identity(self, runtime: Runtime) -> str:
        """What every calibration pass of this export depends on besides its tiers and rounding: the score
        run's fingerprint (model, contexts, rollout, settings), the model's hash, the target, the runtime
        computing the statistics and the versions computing the codes."""
        run = self.scores
        return json.dumps({"fingerprint": run.identity, "model": run.model.sha256, "contexts": run.contexts_sha256,
                           "rollout": run.spec.to_dict(), "target": self.settings.target, "runtime": repr(runtime), "solver_dtype": solver_dtype(),
                           "versions": {k: v for k, v in current_versions().items() if k != "platform"}, "code": checkpoints.code_hash()}, sort_keys=True, default=str)

    def interrupted_outputs(self) -> set[Path]:
        """Output files an interrupted export of this run with these settings began writing: its rerun overwrites them."""
        return checkpoints.interrupted_outputs(self.run_dir, self.outputs_identity()) if self.encoder.checkpoints else set()

    def outputs_identity(self) -> str:
        return self.encoder.checkpoints[1] + json.dumps(asdict(self.settings), sort_keys=True, default=str)

    def discard_checkpoints(self) -> None:
        """The export finished: its calibration checkpoints have nothing left to resume."""
        checkpoints.discard(self.run_dir)

    # -- pricing -----------------------------------------------------------------

    @property
    def runner(self) -> SweepRunner:
        if self._runner is None:
            if self.one_session:
                self.encoder.release_calibrator()
            if self._nominal is None and self.opset > self.model_opset:  # drift from the original as it runs, not as converted
                self._nominal = original_nominal(self.model.proto, self.layouts, self.weights, (self.prepared.contexts, self.prepared.spec, self.prepared.job.max_batch_windows),
                                                 self.runtime, self.run_dir, self.prepared.data_dir)
            self._runner = self.prepared.open_runner(self._nominal)  # reopened: the original is not rolled out again
            self._nominal = self._runner.nominal
        return self._runner

    @property
    def lanes(self) -> list[SweepRunner]:
        """The runners that roll out independent candidates side by side: the measuring runner and its
        `SweepRunner.lane`s (`prepared.lanes` in all; one for a model whose candidates run as sessions of their
        codes). A one-session model fed as floats runs lanes too: the 22M BERT's rollouts on 2 lanes of 1 thread
        each ran 1.75x the throughput of one lane of 2 threads on the 2-core machine."""
        if not self._lanes:
            count = self.prepared.lanes if self.feeds_floats else 1
            self._lanes = [self.runner] + [self.runner.lane() for _ in range(count - 1)]
        return self._lanes

    def _cut_lanes(self) -> list[SweepRunner]:
        """Runners that price a slot the way the score swept its units (`prices_cut`): each rollout runs only the
        part of the graph downstream of the slot's unit, fed the original's activations at the cut (`Prefix`)."""
        lanes = [SweepRunner(replace(self.prepared.job, strategy="prefix"))]
        try:
            lanes += [lanes[0].lane() for _ in range(self.prepared.lanes - 1)]
        except BaseException:
            lanes[0].close()
            raise
        return lanes

    def _release_runner(self) -> None:
        """Close the measuring session for a calibration pass; it opens again the way it ran."""
        if self._fed_session is not None:
            self._fed_session.close()
            self._fed_session = None
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
        method = self.rounding_at(tier.name).label if tier.calibratable else "rtn"
        narrow = f"/{solver_dtype()}" if tier.calibratable and method != "rtn" and solver_dtype() != "float64" else ""  # its own prices in the run's cache
        return f"tier:{tier.name}{group}/{method}{narrow}"

    def price_task(self, slot: Slot, tier: Tier) -> Task:
        """The price list's entry of (slot, tier): its label and a digest of the values its rollout feeds (the slot's
        codes at the tier, dequantized), of the runtime and of the score run (`ScoreRun.identity`: 4-step prices once
        stood for the 40-step run that replaced theirs). A price is reused only for the same values: the label alone
        let a run folder's prices from an older version, whose QEP made other codes, stand for today's (lorenz96 at
        the W4 size: 3.62% held-out drift from such a folder, 3.12% from a fresh one)."""
        key = (slot.name, tier.name)
        if key not in self._price_keys:
            digest = hashlib.blake2b(self._price_identity.encode(), digest_size=10)
            for name, encoded in sorted(self.encoder.slot(slot, tier, self.rounding).items()):
                values = np.ascontiguousarray(encoded.dequantize())
                digest.update(f"{name} {values.dtype} {values.shape}".encode())
                digest.update(values.tobytes())
            self._price_keys[key] = Task(slot.name, f"{self._probe(tier)}#{digest.hexdigest()}")
        return self._price_keys[key]

    def measured_tasks(self) -> list[tuple[Slot, Tier]]:
        """(slot, tier) pairs the measured objective rolls out: live slots at every tier that changes the weight."""
        return [(s, t) for s in self.slots if s.unit not in self.dead for t in self.tiers if t.name != "fp32"]

    def eager_tasks(self) -> list[tuple[Slot, Tier]]:
        """The (slot, tier) pairs priced before the first allocation: all but float copies (`LAZY_BITS`)."""
        return [(s, t) for s, t in self.measured_tasks() if t.bits < LAZY_BITS]

    def measured(self, on_result=None, tasks: list[tuple[Slot, Tier]] | None = None) -> dict[str, TaskResult]:
        """Per slot and tier, the rollout divergence with only that slot at that tier: of every (slot, tier) of
        `tasks` (default all, `measured_tasks`), and whatever else was measured before. Cached in the run
        folder, so every C and every export reuses it."""
        tasks = self.measured_tasks() if tasks is None else tasks
        started = time.perf_counter()
        for tier in {tier.name: tier for _, tier in tasks if tier.calibratable}.values():  # each tier's encoding pass first, so the rollouts' ETA is theirs
            if any((slot.name, tier.name) not in self._price_keys for slot, t in tasks if t.name == tier.name):
                self.encoder.uniform(tier, self.rounding_at(tier.name))
        keys = {(slot.name, tier.name): self.price_task(slot, tier).key for slot, tier in tasks}
        if self._measured is not None and all(key in self._measured for key in keys.values()):
            return self._measured
        log = ResultLog(self.run_dir / "measured.jsonl")
        lock = FileLock(str(self.run_dir / ".measured.lock"))
        lock.acquire()  # another export of this run prices the same slots: wait, then reuse what it measured
        cut_lanes: list[SweepRunner] = []
        try:
            self.scores.check_unchanged()  # and before each price: none goes into a run that replaced this one
            done = log.load()
            pending = [(slot, tier) for slot, tier in tasks if keys[(slot.name, tier.name)] not in done]
            if on_result and pending and self.on_measuring:
                self.on_measuring(len(pending))

            def price(lane: SweepRunner, item):
                for slot, tier in item:
                    weights = self.encoder.slot_weights(slot, tier, self.rounding)
                    tick = time.perf_counter()
                    div_sq, nonfinite = lane.unit_divergence(slot.unit, weights) if cut_lanes else lane.divergence(self.fed(weights), early_stop=False)
                    yield TaskResult(slot.name, self.price_task(slot, tier).probe, 0, 0.0, div_sq, nonfinite, time.perf_counter() - tick)

            if self.prices_cut and pending:
                cut_lanes = self._cut_lanes()
            lanes = cut_lanes or self.lanes
            with self.encoder.profile.section("measurement_rollouts"), Lanes(lanes, lanes[0].work_items(pending, lambda task: task[0].unit), price) as results:
                for result in results:
                    self.scores.check_unchanged()
                    log.append(result)
                    done[result.key] = result
                    if on_result:
                        on_result(result)
        finally:
            for lane in reversed(cut_lanes):  # the lanes' own cut sessions, then the lead's
                lane.close()
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
        measured = self.measured(on_result, self.eager_tasks()) if objective == "measured" else None
        costs = self.costs()
        choices = []
        if objective == "measured":
            self._unpriced = set()
            labelled = {(r.unit, r.probe.split("#")[0]) for r in measured.values()}  # a float copy never measured is unpriced:
            # known without its digest, which encodes the slot at the tier (fp16 of the 22M BERT's every slot: 3.5 s)
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
                    lazy = tier.bits >= LAZY_BITS and (slot.name, self._probe(tier)) not in labelled
                    result = None if lazy else measured.get(self.price_task(slot, tier).key)
                    if result is None:  # a float copy not priced yet: 0 bounds its loss from below (`allocate`)
                        self._unpriced.add((slot.name, tier.name))
                        loss[tier.name] = 0.0
                    else:
                        loss[tier.name] = math.inf if result.nonfinite else float(sum(result.div_sq))
            choices.append(Choice(slot.name, slot.params, self.gamma.get(slot.unit, 0.0), dead, costs[slot.name], loss))
        return self._unread_as_read(choices) if objective != "paper" else choices

    def _unread_as_read(self, choices: list[Choice]) -> list[Choice]:
        """A Gather table's slots holding only rows the scoring contexts never read change no rollout, so they priced
        at 0 and went to the lowest tier for free: era5_downscale's hours 2, 7, 12 and 17 went to INT2 at the W8 size,
        and held-out windows starting at those hours drifted 5.6x the uniform INT8 model. They take the price per
        parameter of the table's read slots instead: rows no context tested are stored as an average read row would be."""
        by_slot = {c.unit: c for c in choices}
        for unit, slots in self.slots_of.items():
            names = self.units_by_name[unit].tensor_names
            touched = self.prepared.job.rows.get(names[0]) if len(names) == 1 else None
            if touched is None:
                continue
            touched = set(np.asarray(touched).tolist())
            unread = [s for s in slots if s.rows is not None and not touched.intersection(range(*s.rows))]
            read = [s for s in slots if s not in unread]
            params = sum(s.params for s in read)
            for slot in unread if read and params else ():
                choice = by_slot[slot.name]
                by_slot[slot.name] = replace(choice, loss={t: sum(by_slot[r.name].loss[t] for r in read) * slot.params / params for t in choice.loss})
        return [by_slot[c.unit] for c in choices]

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
        return Allocation(dict(tiers), self.written_costs(tiers), self.budget, target, solver, objective)

    def uniform(self, tier: str) -> Allocation:
        return self._allocation({s.name: tier for s in self.slots}, None, "uniform", "uniform")

    def encodings(self, allocation: Allocation, calibrated: bool = False, rounding: AnyRounding | None = None) -> dict[str, Encoded]:
        rounding = rounding or self.rounding
        if calibrated:
            return self.encoder.calibrated(self.slots, allocation.tiers, rounding)
        return self.encoder.assemble(self.slots, allocation.tiers, rounding)

    def fake_quantized(self, allocation: Allocation) -> dict[str, np.ndarray]:
        """The weights the runtime computes from the allocation's stored forms (as priced)."""
        return {name: e.dequantize() for name, e in self.encodings(allocation).items()}

    def drift(self, allocation: Allocation) -> float:
        """Relative RMS trajectory drift of the allocation (as priced) on the scoring contexts."""
        return self.measure_tiers(allocation.tiers).relative_rms

    def allocate(self, target: float, on_result=None) -> Allocation:
        """Algorithm 1 on the additive prices, priced as written and meeting `target` (`fitted`).

        Float copies (bf16, fp16) are priced lazily: solved with a loss of 0 (a lower bound) where not yet
        measured, and when the allocation picks one, that one is measured and the allocation solved again.
        An allocation that picks none is optimal for the true losses too (each pick's loss is exact, and no
        other allocation's true loss is below its bounded one), and at C 4 it is the usual case: every example
        priced a float copy of each slot (a quarter of the pricing rollouts) that no allocation took."""
        objective = self.settings.objective
        while True:
            choices = self.choices(objective, on_result)
            allocation = self.fitted(lambda options, fixed_bits: allocate(options, self.tiers, target, self.budget.basis_bits, fixed_bits, objective=objective,
                                                                          fp32_fraction=self.settings.fp32_share, solver=self.settings.allocator), choices, target)
            picked = [(slot, TIERS[allocation.tiers[slot.name]]) for slot in self.slots if (slot.name, allocation.tiers[slot.name]) in self._unpriced]
            if objective != "measured" or not picked:
                return allocation
            self.measured(None, picked)
            del self._choices[objective]

    def close(self) -> None:
        """Sessions, solver threads and the hold on the run folder released (a score may then replace the run)."""
        self._release_runner()
        self.encoder.close()
        self._share.release()

    def __enter__(self) -> "Planner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
