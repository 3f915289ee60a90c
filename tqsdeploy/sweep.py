"""The sweep: independent (unit, probe, draw) tasks run against one session.

Every task is self-describing and deterministic, so the same list can be run
in one process (here, on one lane or several side by side), split across
processes or machines (a distributed executor only needs `SweepJob`, which
pickles), and resumed: results are appended to a JSON-lines table as each
task finishes, and tasks already in the table are never run again.
"""

from __future__ import annotations

import copy
import heapq
import json
import math
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from onnx import helper

import graph_ops
from graph_ops.io import GraphError, OutputError
from runtimes import DerivedFeeds, Session, SessionFactory, kept
from tqsdeploy.contexts import Contexts
from tqsdeploy.engine import FirstRun, RolloutEngine
from tqsdeploy.errors import InputError, RolloutError
from tqsdeploy.probes import Perturbation, UnitProbes
from tqsdeploy.rollout import RolloutSpec, next_feeds, rollout
from tqsdeploy.units import Unit


@dataclass(frozen=True)
class Task:
    """Perturb one unit with one probe draw and roll out."""

    unit: str
    probe: str
    draw: int = 0

    @property
    def key(self) -> str:
        return f"{self.unit}\x1f{self.probe}\x1f{self.draw}"


@dataclass(frozen=True)
class EarlyStop:
    """Stop a rollout once gamma(t) varies by at most `tol` over `window` consecutive steps."""

    tol: float = 0.01
    window: int = 3


@dataclass
class TaskResult:
    """What one task measured: enough to recompute every score offline."""

    unit: str
    probe: str
    draw: int
    delta_sq: float
    div_sq: list[float]
    """Per step: mean over context windows of ||Y_pert(t) - Y_nom(t)||^2."""
    nonfinite: bool = False
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return Task(self.unit, self.probe, self.draw).key

    @property
    def steps(self) -> int:
        return len(self.div_sq)


def plan_tasks(units: Sequence[Unit], quant: bool, gauss_draws: int) -> list[Task]:
    tasks = []
    for unit in units:
        if quant:
            tasks.append(Task(unit.name, "quant", 0))
        tasks.extend(Task(unit.name, "gauss", d) for d in range(gauss_draws))
    return tasks


FLUSH_EVERY_S = 0.1
"""How often the result log hands its lines to the OS: a kill -9 loses at most this much finished work
(an interrupt, an error or the end of the sweep closes the log, which writes everything)."""


class ResultLog:
    """Append-only JSON-lines table of task results; the resumable part of a run."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = None
        self._last_sync = self._last_flush = 0.0

    def load(self) -> dict[str, TaskResult]:
        """Results written so far; a half-written last line (a killed run) is dropped."""
        results: dict[str, TaskResult] = {}
        if not self.path.exists():
            return results
        valid_bytes = 0
        with open(self.path, "rb") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                    record["div_sq"] = [math.inf if v is None else float(v) for v in record["div_sq"]]
                    result = TaskResult(**record)
                except (ValueError, TypeError):
                    break
                results[result.key] = result
                valid_bytes += len(line)
        if valid_bytes < self.path.stat().st_size:
            with open(self.path, "r+b") as handle:
                handle.truncate(valid_bytes)
        return results

    def append(self, result: TaskResult) -> None:
        record = dict(vars(result))  # flat fields: dataclasses.asdict's deep copy cost the BERT's sweep 10 ms
        record["div_sq"] = [v if math.isfinite(v) else None for v in result.div_sq]
        try:  # a full disk names this file (load drops a half-written last line on resume)
            if self._handle is None:
                self._handle = open(self.path, "a", encoding="utf-8")
            self._handle.write(json.dumps(record) + "\n")
            now = time.monotonic()
            if now - self._last_flush > FLUSH_EVERY_S:  # a line per task would cost a write call each (BERT: 0.3 ms)
                self._handle.flush()
                self._last_flush = now
            if now - self._last_sync > 1.0:
                self._handle.flush()
                os.fsync(self._handle.fileno())
                self._last_sync = now
        except OSError as exc:
            handle, self._handle = self._handle, None
            try:
                handle and handle.close()
            except OSError:
                pass  # the buffered line is lost with the disk; the error below says why
            raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None


STRATEGIES = ("auto", "feed", "rebuild", "unit", "prefix", "batch")
"""How perturbed weights reach the runtime: fed to one session with every scored
weight overridable ('feed'), baked into a fresh session per perturbation
('rebuild'), or fed to a session per unit in which only that unit's weights are
overridable ('unit'), or, for the first step, fed to a session of just
the part of the graph downstream of the unit ('prefix'), or all of a unit's
probes run in one rollout of a session per unit with the batch tiled per probe
('batch'); 'auto' times them and picks the cheapest sweep."""


@dataclass
class SweepJob:
    """Everything a worker needs to run tasks; picklable by design.

    `session_factory` opens the session whose scored weights are overridable
    feeds; `rebuild_factory(weights)` opens a session with those weights baked
    in as constants (all nominal when empty); `unit_factory(names)` opens one
    in which only `names` are overridable.
    """

    session_factory: SessionFactory
    contexts: Contexts
    spec: RolloutSpec
    units: dict[str, Unit]
    weights: dict[str, np.ndarray]
    probe_bits: int
    seed: int
    eps: float
    max_batch_windows: int = 64
    early_stop: EarlyStop | None = None
    rebuild_factory: Callable[[dict[str, np.ndarray]], Session] | None = None
    strategy: str = "auto"
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    """Gather tables' rows the contexts read: the probes perturb only these (`units.gather_rows`)."""
    unit_factory: Callable[[Sequence[str]], Session] | None = None
    tasks_per_unit: int = 5
    """Probe draws per unit (what 'auto' weighs a unit session's build against)."""
    quant_probe: bool = True
    """Whether a unit's tasks include the quant probe (the rest are Gaussian draws), for 'batch'."""
    cut_factory: object | None = None
    """Opens the sessions 'prefix' runs (`score.CutSessions`: of the model in memory, or read from its files)."""
    session_build_s: float = 0.0
    """Seconds the overridable session took to build (what 'auto' weighs cut builds against when it has no other)."""
    lanes: int = 1
    """Tasks the sweep will run at once (`run_local`): auto weighs each strategy's pieces of work on that many lanes."""
    fed_keeps_kernels: bool = False
    """The overridable session runs every scored weight on the kernels a constant session would (`score.fed_as_fast`,
    `graph_ops.derived.WeightMap.keeps_kernels`): no rebuilt session can beat it, and auto builds none to time."""

    def open(self, session: Session | None = None, nominal: "Nominal | None" = None) -> "SweepRunner":
        """A runner; `session` is an already open overridable session to reuse, `nominal` the nominal
        rollout an earlier runner of this job made with the same strategy (not made again)."""
        return SweepRunner(self, session, nominal)


class Made:
    """A value made once, by the first thread that asks (or given made): the others wait for it, and an
    error in the making is raised to each of them."""

    def __init__(self, value):
        self._make = value if callable(value) else None
        self._value = None if callable(value) else value
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self._value is not None

    def get(self):
        if self._value is None:
            with self._lock:
                if self._value is None and self._error is None:
                    try:
                        self._value = self._make()
                    except BaseException as exc:
                        self._error = exc
                if self._error is not None:
                    raise self._error
        return self._value


HOLD_BYTES = 64 << 20
"""A lane holds at most this much of a task's outputs while the nominal it is compared with is being made."""


@dataclass
class Nominal:
    """The unperturbed rollout every task is compared with."""

    trajectory: list[list[dict[str, np.ndarray]]]
    """[step][chunk] -> trajectory outputs."""
    norm_sq: list[float] = field(default_factory=list)
    """Per step: mean over windows of ||Y_nom(t)||^2."""
    abs_sum: dict[str, float] = field(default_factory=dict)
    """Per trajectory output: sum of |Y_nom| over windows and steps (the scale of drift %)."""
    batched: bool = False
    _stacked: dict[int, dict[str, np.ndarray] | None] = field(default_factory=dict, repr=False)

    def stacked(self, t: int) -> dict[str, np.ndarray] | None:
        """Step t's trajectory outputs of every chunk stacked into one array per output (made once), or None
        when they are too large to copy for so little (`STACK_BYTES`) or differ in shape."""
        if t not in self._stacked:
            outs, stacked = self.trajectory[t], None
            if sum(np.asarray(v).nbytes for o in outs for v in o.values()) <= STACK_BYTES:
                try:
                    stacked = {name: np.stack([o[name] for o in outs]) for name in outs[0]}
                except ValueError:  # windows whose outputs differ in shape
                    pass
            self._stacked[t] = stacked
        return self._stacked[t]


STACK_BYTES = 1 << 20
"""A model run window by window has its step's divergence taken over all windows at once when the step's
outputs hold at most this much: numpy's per-call cost, not the arithmetic, is then what a window costs
(pangu_lorenz96: 64 small calls per rollout), and it holds the GIL the other lanes wait for."""


@dataclass(frozen=True)
class Drift:
    """How far a perturbed model's rollout strays from the nominal one."""

    relative_rms: float
    """RMS trajectory divergence over all steps relative to the RMS nominal trajectory."""
    pct: dict[str, float]
    """Per trajectory output: mean |divergence| / mean |nominal| in percent (what `eval` reports as drift)."""
    div_sq: list[float]
    """Per step: mean over windows of ||Y(t) - Y_nom(t)||^2 (additive, what the knapsack prices)."""

    @property
    def worst_pct(self) -> float:
        return max(self.pct.values()) if self.pct else 0.0


def _settled(stop: EarlyStop | None, gammas: list[float], cumulative: float, delta_sq: float, eps: float, t: int) -> bool:
    """Early stopping: records step t's gamma; True once the last `window` + 1 of them vary by at most `tol`."""
    if stop is None or delta_sq <= 0:
        return False
    gammas.append(math.log(max(cumulative, 1e-300) / (delta_sq + eps)) / t)
    window = gammas[-(stop.window + 1):]
    return len(window) == stop.window + 1 and max(window) - min(window) <= stop.tol


def _tiled(feeds: dict[str, np.ndarray], probes: int) -> dict[str, np.ndarray]:
    """Every input repeated `probes` times along its batch axis, probe-major (what `graph_ops.batch` expects)."""
    return {name: np.concatenate([value] * probes) for name, value in feeds.items()}


CONSTANT_BUILD_BYTES_PER_S = 1e9
"""How fast ONNX Runtime builds a session of constant weights read from a model's files: it reads and
pre-packs every weight of the ops in `PRE_PACKED` (a session whose weights are overridable packs none as it
builds): 0.27-0.34 s for a 0.3 GB MatMul chain, 1.2-2.9 s for 1.2 GB, 35 ms for the BERT-size model's
43 MB of MatMul weights on a 2-core x86 machine. What 'auto' prices a cut of a model swept from its files
with, without building one."""
PRE_PACKED = {"MatMul", "Gemm", "Conv", "ConvTranspose", "LSTM", "GRU", "RNN"}

BATCH_RTOL = 1e-4
"""How far (relative to the output's scale) a probe-batched run may stray from the unbatched one (float32)."""


def _moved(nominal: np.ndarray, produced: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The whole model's nominal output moved by what a cut's run changed against the cut's own nominal run
    (the two nominal runs differ by float rounding: the cut's fed weights are not pre-packed)."""
    if np.issubdtype(nominal.dtype, np.floating):
        return nominal + (produced - reference)
    return produced  # integers and booleans: no rounding to carry


PICK_MARGIN = 0.95
"""auto picks a strategy other than 'feed' only when its estimate is below this share of feed's (timing noise)."""

SMALL_SWEEP_S = 0.1
"""auto runs a sweep that 'feed' would finish within this many seconds (on its lanes, at most) as 'feed' without
timing the others: a session build and a dozen calls would cost a tenth of it or more, more than they could save."""


def _makespan(pieces: Sequence[float], lanes: int) -> float:
    """When the last of `lanes` lanes finishes, each taking the next piece (in order) as it frees."""
    free = [0.0] * max(1, lanes)
    for seconds in pieces:
        heapq.heapreplace(free, free[0] + seconds)
    return max(free)


def _best_time(call: Callable[[], object], repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


PROBE_DEPTH_MAX = 4
"""At most this many perturbations are built ahead of the rollout that will use them."""
PROBE_DEPTH_BYTES = 256 << 20
"""...and together they hold at most this many bytes (each is a copy of a unit's weights)."""


class ProbeSource:
    """Each task's perturbation, built ahead on helper threads while the current rollout runs.

    Drawing Gaussian noise and quantizing a unit are numpy work that releases the GIL, so on a
    machine with a core to spare they cost no sweep time (a fifth of a BERT-size sweep otherwise).
    On the CPU provider one build runs ahead (ONNX Runtime has the other cores). On a GPU a
    rollout of a small model takes a millisecond or two while a draw over a 1M-weight unit takes
    several on one core, so `depth` builds run ahead at once, on that many threads (measured on an
    H100: the sweep otherwise waits on the CPU). A unit's shared parts (`UnitProbes`) are made once,
    under a lock; `depth` + 1 perturbations are alive at a time.
    """

    def __init__(self, job: SweepJob, depth: int = 1):
        self.job = job
        self.depth = depth
        self._units: dict[str, UnitProbes] = {}
        self._lock = threading.Lock()
        self._pending: dict[Task, Future] = {}
        self._upcoming: deque[Task] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._queue_lock = threading.Lock()
        """Guards `_pending` and `_upcoming`: lanes (`run_local`) ask for perturbations from several threads."""
        self._recent: deque[str] = deque(maxlen=1)
        """The units of the last tasks handed out, one per lane: their shared parts stay while lanes use them."""

    def share(self, lanes: int) -> None:
        """Serve `lanes` runners at once: a build ahead for each (within `PROBE_DEPTH_BYTES`), and every unit a lane is on kept."""
        self.depth = max(self.depth, min(lanes, self.fitting))
        self._recent = deque(self._recent, maxlen=max(1, lanes))

    @property
    def fitting(self) -> int:
        """How many copies of the largest unit fit in `PROBE_DEPTH_BYTES` (at least one)."""
        largest = max((sum(self.job.weights[n].nbytes for n in u.tensor_names) for u in self.job.units.values()), default=0)
        return max(1, PROBE_DEPTH_BYTES // max(largest, 1))

    def plan(self, tasks: Sequence[Task]) -> None:
        """The tasks in the order they will be asked for: builds start `depth` ahead of them. A build started
        before the plan came (prefix's guess at the first task) is kept if the plan has its task, and not
        queued again; otherwise (a resumed run that finished it) it is dropped once done, so that it does
        not hold a place among the `depth` builds for the whole sweep."""
        planned = set(tasks)
        with self._queue_lock:
            for stray in [t for t in self._pending if t not in planned]:
                self._pending.pop(stray).exception()
            self._upcoming = deque(t for t in tasks if t not in self._pending)
            self._top_up()

    def unit(self, name: str) -> UnitProbes:
        """The shared parts of unit `name`'s probes (tasks come unit by unit: earlier units' are dropped)."""
        self._settle()
        return self._unit(name)

    def _unit(self, name: str) -> UnitProbes:
        job = self.job
        with self._lock:
            if name not in self._units:
                wanted = {t.unit for t in tuple(self._pending)} | set(tuple(self._recent)) | {name}  # snapshots: lanes add and pop meanwhile
                for old in [u for u in self._units if u not in wanted]:  # a streamed model's weights live in the runtime: hand back the pages the probes read
                    graph_ops.release_pages(job.weights, self._units.pop(old).unit.tensor_names)
                probes = UnitProbes(job.units[name], job.weights, job.probe_bits, job.rows)
                if self.depth > 1:  # the parts every draw shares, once, before several threads read them
                    for tensor in probes.weights:
                        probes.reference_norm(tensor)
                self._units[name] = probes
            return self._units[name]

    def _build(self, task: Task) -> Perturbation:
        return self._unit(task.unit).perturb(task.probe, task.draw, self.job.seed)

    def _settle(self) -> None:
        """Wait for every build under way; a failed build is raised by whoever asks for it."""
        for future in list(self._pending.values()):
            future.exception()

    def get(self, task: Task, following: Task | None = None) -> Perturbation:
        """`task`'s perturbation; with `following` (and no plan), start building that one in the background.
        A planned task asked for before its build started (lanes took units out of plan order) is built here
        and struck from the plan."""
        with self._queue_lock:
            future = self._pending.pop(task, None)
            if future is None and task in self._upcoming:
                self._upcoming.remove(task)
            self._recent.append(task.unit)
        change = future.result() if future is not None else self._build(task)
        with self._queue_lock:
            if self._upcoming:  # once it is built, so that no more than `depth` builds ever run at once
                self._top_up()
            elif following is not None:
                self._prefetch(following)
        return change

    def prefetch(self, task: Task) -> None:
        """Start building `task`'s perturbation in the background (unless `depth` builds are under way)."""
        with self._queue_lock:
            self._prefetch(task)

    def _prefetch(self, task: Task) -> None:
        if len(self._pending) < self.depth and task not in self._pending:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PROBE_DEPTH_MAX, thread_name_prefix="tqs-probes")  # threads start only as builds need them
            self._pending[task] = self._pool.submit(self._build, task)

    def _top_up(self) -> None:
        while self._upcoming and len(self._pending) < self.depth:
            self._prefetch(self._upcoming.popleft())

    def close(self) -> None:
        self._settle()
        self._pending.clear()
        self._upcoming.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class SweepRunner:
    """Holds a live session and the nominal trajectory; runs tasks one by one (`lane` gives more
    runners over the same sessions, to run tasks side by side: `run_lanes`).

    'feed' runs everything on one session with every scored weight
    overridable: no session build per perturbation, but no fed weight is
    pre-packed (ONNX Runtime's CPU MatMul/Gemm/Conv kernels cannot pre-pack
    fed weights), so every call runs slower kernels. 'rebuild' bakes each
    perturbation into a fresh constant session (fast kernels, a build per
    task). 'unit' builds one session per unit with only that unit's weights
    overridable and runs all the unit's probes on it (one build per unit,
    fast kernels everywhere else). 'batch' builds one session per unit in
    which the unit's weights carry a leading probe axis and the inputs are
    tiled once per probe (`graph_ops.batch`), and runs all the unit's probes
    in one rollout; a unit it cannot batch runs as with 'unit'. 'auto' times
    one step of one window each way and one build, and picks the cheapest sweep.

    The nominal rollout is made by the same session as the perturbed ones
    ('feed': the overridable session, nothing fed; 'rebuild': a constant
    session), so an inert unit diverges by exactly zero. With 'unit' the
    nominal comes from the constant session: the unit's own kernels then run
    unpacked in the perturbed runs, a float32 rounding difference (~1e-7
    relative at that node) far below any probe; an inert unit still diverges
    by exactly zero since nothing of it reaches the outputs. With 'batch' the
    calls carry one slot more than the unit has probes: slot 0 holds the
    nominal weights, and each probe is compared with slot 0's rows of the same
    call (same kernels, so inert units diverge by exactly zero too; one
    batched rollout per unit, not a batched nominal rollout beside it).
    """

    def __init__(self, job: SweepJob, session: Session | None = None, nominal: Nominal | None = None):
        self.job = job
        if job.strategy not in STRATEGIES:
            raise RolloutError(f"unknown strategy '{job.strategy}'; choose one of {', '.join(STRATEGIES)}")
        if job.strategy == "prefix" and job.spec.steps != 1 and job.rebuild_factory is None:
            raise RolloutError(
                f"strategy 'prefix' on a model streamed from its files needs a single-step rollout; this one has {job.spec.steps} steps",
                hint="use --steps 1 or --strategy feed",
            )
        constant_only = session is None and job.strategy in ("rebuild", "unit", "batch") and job.rebuild_factory is not None
        self.overridable: Session | None = job.rebuild_factory({}) if constant_only else (session or job.session_factory())
        self.inputs = [s for s in self.overridable.inputs if s.name not in self.overridable.weights]
        if not constant_only:
            missing = {n for u in job.units.values() for n in u.tensor_names} - self.overridable.weights
            if missing:
                raise RolloutError(f"the session cannot override weight '{sorted(missing)[0]}'")
        job.spec.check(self.inputs, self.overridable.outputs)
        self.engine = RolloutEngine(self.overridable, job.contexts, job.spec, job.max_batch_windows)
        self.probes = ProbeSource(job)
        self._group: tuple[frozenset[str], Session] | None = None
        self._unit_of = {n: u for u in job.units.values() for n in u.tensor_names}
        self.timings: dict[str, float] = {}
        """Per strategy: the sweep seconds auto estimated (empty unless auto chose)."""
        self.fallbacks: dict[str, str] = {}
        """'batch': the units run probe by probe instead, and why."""
        self.cut_plan: graph_ops.prefix.CutPlan | None = None
        """'prefix': which units share a cut, and the order to run them in."""
        self._node_costs: list[float] | None = None
        self._cut_planner: graph_ops.prefix.CutPlanner | None = None
        self._walk: graph_ops.prefix.GraphWalk | None = None
        self._fed_penalty = graph_ops.prefix.FED_PENALTY
        self._batched: tuple[str, Session | None] | None = None
        self._batch_results: tuple[str, dict[str, TaskResult]] = ("", {})
        self._reference: tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]] | None = None
        self._constant: Session | None = None
        self._constant_build = 0.0
        self._prefix_pieces: tuple[float, list[float]] | None = None
        """auto's 'prefix' estimate split: the serial set-up, then the seconds of each cut (a lane's piece of work)."""
        self._first_step: FirstRun | None = None
        """auto's timed run of one real step on a single-chunk sweep: the nominal's first step if its session makes the nominal."""
        self._cut = None
        self._activations: list[dict[str, np.ndarray]] | None = None
        self._first: list[dict[str, np.ndarray]] = []
        """'prefix': every run output of the whole model's first step, per chunk."""
        self._lead: SweepRunner | None = None
        """Set on a `lane`: the runner whose sessions it shares."""
        if constant_only:
            self.strategy, self.session, self.overridable = job.strategy, self.overridable, None
        else:
            self.strategy = job.strategy if job.strategy != "auto" else self._choose()
            if self.strategy == "prefix" and not self._prefix_possible:
                self.strategy = "feed"  # a model past protobuf's limit in one file: nothing to cut it from
            if self.strategy not in ("feed", "prefix") and (job.rebuild_factory is None or job.unit_factory is None):
                self.strategy = "feed"
            if self.strategy in ("feed", "prefix") and self._constant is not None:
                self._constant.close()
                self._constant = None
            if self.strategy == "feed":
                self.session = self.overridable
            elif self.strategy == "prefix" and job.spec.steps > 1:
                self.session = None  # prefix opens its own; the overridable session runs steps 2..T
            else:
                self.overridable.close()  # one model copy in memory, not two
                self.overridable = None
                self.session = None if self.strategy == "prefix" else (self._constant or job.rebuild_factory({}))  # prefix opens its own
                self._constant = None
        if self.strategy == "prefix":
            self._nominal = Made(self._start_prefix())
        elif nominal is not None:  # the same job and strategy made it: same sessions, same values
            self.engine.session = self.session
            self.engine.assume(nominal.batched)
            self._nominal = Made(nominal)
        else:
            self.engine.session = self.session
            self._nominal = Made(self._make_nominal)
            if job.lanes <= 1 or self.strategy == "batch":
                self._nominal.get()  # nothing to run beside it (or 'batch' checks against it): made now
        if self.strategy == "batch" and job.strategy == "batch":
            self._check_batch()
        self.probes.depth = self._probe_depth()

    def _probe_depth(self) -> int:
        """How many perturbations to build ahead: one, unless the rollouts run on a GPU (the CPU's cores are
        then free), and then as many copies of the largest unit as fit in `PROBE_DEPTH_BYTES`."""
        session = self.session or self.overridable
        if getattr(session, "device", None) is None or self.strategy == "batch":
            return 1
        return max(1, min(PROBE_DEPTH_MAX, (os.cpu_count() or 1) - 1, self.probes.fitting))

    @property
    def _prefix_possible(self) -> bool:
        """Whether 'prefix' can run: a model to cut, and either one step or a model held in memory (steps 2..T
        then run on the overridable session beside the cuts; a streamed model keeps one session at a time)."""
        return self.job.cut_factory is not None and (self.job.spec.steps == 1 or self.job.rebuild_factory is not None)

    @property
    def unit_order(self) -> list[str] | None:
        """The order this runner's tasks should come in, unit by unit (None: any)."""
        return self.cut_plan.order if self.cut_plan is not None else None

    def _choose(self) -> str:
        """Estimate each strategy's sweep from one step of one window and one build; pick the cheapest.

        The one-window times are scaled to the real chunks by one real step of
        the fed session (the batching decision's run, kept as the nominal's first
        step if feed wins); a strategy other than 'feed' must beat it by 5%
        (timing noise). A sweep 'feed' would finish within `SMALL_SWEEP_S` runs
        on feed untimed.
        """
        job = self.job
        prefix = self._prefix_possible
        if job.rebuild_factory is None:
            return self._choose_streamed() if prefix else "feed"
        names = job.spec.run_outputs
        unit = max(job.units.values(), key=lambda u: u.params)
        weights = {n: job.weights[n] for n in unit.tensor_names}
        try:
            one = next(iter(job.contexts.chunks(self.inputs, False, 1)))[1]
            t_feed = _best_time(lambda: self.overridable.run({**one, **weights}, names))
        except Exception:
            return "feed"  # let the nominal rollout report what is wrong
        # every window its own call bounds the feed sweep from above (a batched call costs at most its windows' calls)
        bound = len(job.units) * max(1, job.tasks_per_unit) * job.spec.steps * job.contexts.count * t_feed
        if self._small(bound):
            return "feed"
        try:  # the fed session decides the batching: its run is the scale run, and the nominal's first step if feed wins
            chunks = self.engine.chunks
        except Exception:
            return "feed"  # let the nominal rollout report what is wrong
        try:
            estimates = self._estimate_rebuilt(unit, one, chunks, t_feed, prefix)
        except Exception:
            return "feed"
        return self._pick(estimates)

    def _choose_streamed(self) -> str:
        """auto for a model swept from its files: feed, or cuts read from the files. Both are priced from one real
        step on the fed session (the batching decision's run): no one-window timing."""
        job = self.job
        try:
            chunks = self.engine.chunks
            step = len(chunks) * self._first_step_seconds(self.overridable, chunks)  # one step of every chunk
        except Exception:
            return "feed"  # let the nominal rollout report what is wrong
        estimates = {"feed": len(job.units) * max(1, job.tasks_per_unit) * job.spec.steps * step}
        if self._small(estimates["feed"]):
            return "feed"
        packed = sum(t.params * np.dtype(t.dtype).itemsize for u in job.units.values() for t in u.tensors if set(t.op_types) & PRE_PACKED)
        build_s = job.session_build_s + packed / CONSTANT_BUILD_BYTES_PER_S  # the fed session packs no weight as it builds
        try:  # the fed session's calls bound the constant ones
            estimates["prefix"] = self._estimate_prefix(job.spec.steps * step, build_s, chunks[0][1])
        except Exception:  # a graph the cut cannot handle (e.g. untyped activations): no prefix
            pass
        return self._pick(estimates)

    def _small(self, feed_s: float) -> bool:
        """Whether a 'feed' sweep of `feed_s` seconds (one lane) finishes within `SMALL_SWEEP_S` on the sweep's lanes:
        then it runs untimed, that estimate its only one."""
        if feed_s / max(1, self.job.lanes) >= SMALL_SWEEP_S:
            return False
        self.timings = {"feed": round(feed_s, 4)}
        return True

    def _pick(self, estimates: dict[str, float]) -> str:
        """The cheapest strategy on the sweep's lanes (recorded in `timings`); another than feed must win by 5%."""
        estimates = self._on_lanes(estimates)
        self.timings = {k: round(v, 4) for k, v in estimates.items()}
        best = min(estimates, key=estimates.get)
        return best if estimates[best] < PICK_MARGIN * estimates["feed"] else "feed"

    def _on_lanes(self, estimates: dict[str, float]) -> dict[str, float]:
        """Each strategy's sweep seconds on `job.lanes` lanes: the pieces lanes take (`work_items`: a task, a unit,
        or a cut's units) scheduled in order on the lane that frees first. Coarse pieces finish unevenly: a
        plan of one cut runs on one lane however many there are."""
        job = self.job
        if job.lanes <= 1:
            return estimates
        units, tasks = len(job.units), len(job.units) * max(1, job.tasks_per_unit)
        walls = {}
        for name, seconds in estimates.items():
            if name == "prefix" and self._prefix_pieces is not None:
                serial, pieces = self._prefix_pieces
                walls[name] = serial + _makespan(pieces, job.lanes)
            else:
                count = tasks if name in ("feed", "rebuild") else units
                walls[name] = _makespan([seconds / count] * count, job.lanes)
        return walls

    def _first_step_seconds(self, session: Session, chunks) -> float:
        """Seconds of one real step (the first chunk) on `session`: the batching decision's run when that session
        made it, else a run made now. A single-chunk sweep keeps its outputs as the nominal's first step
        (`_continued`), used when `session` goes on to make the nominal."""
        made = self.engine.first_run
        if made is None or made.session is not session:
            started = time.perf_counter()
            outputs = session.run(chunks[0][1], self.job.spec.run_outputs)
            made = FirstRun(session, outputs, time.perf_counter() - started)
        if len(chunks) == 1:
            self._first_step = made
        return made.seconds

    def _estimate_rebuilt(self, unit: Unit, one: dict[str, np.ndarray], chunks, t_feed: float, prefix: bool) -> dict[str, float]:
        """Every strategy's sweep seconds for a model held in memory (its sessions can be rebuilt): the
        constant session is built and timed (kept as the nominal session of every strategy but feed and
        prefix), a unit session and a rebuild only when a lower bound says they could win. A fed session that
        runs the constant session's kernels (`SweepJob.fed_keeps_kernels`) stands in for it: no rebuilt
        session can then beat feed, and none is built."""
        job, names = self.job, self.job.spec.run_outputs
        weights = {n: job.weights[n] for n in unit.tensor_names}
        tasks_per_unit, units = max(1, job.tasks_per_unit), len(job.units)
        estimates = {}
        if job.fed_keeps_kernels:  # the constant session's kernels already: its times stand in
            t_const, constant_build = t_feed, job.session_build_s
        else:
            constant, constant_build = self._constant_session(), self._constant_build
            t_const = _best_time(lambda: constant.run(one, names))
        scale = self._first_step_seconds(self.overridable, chunks) / max(t_feed, 1e-9)  # a real chunk over one window
        step = len(chunks) * scale  # one step of every chunk, in one-window calls
        calls = job.spec.steps * step
        estimates["feed"] = units * tasks_per_unit * calls * t_feed
        # A unit session costs at least a plain build per unit and a rebuild one per task, and
        # neither runs faster than the constant session: each is timed only when that bound could be picked.
        to_beat = lambda: min(PICK_MARGIN * estimates["feed"], *estimates.values())  # noqa: E731
        if job.unit_factory is not None and units * (constant_build + tasks_per_unit * calls * t_const) < to_beat():
            started = time.perf_counter()
            grouped = job.unit_factory(unit.tensor_names)
            unit_build = time.perf_counter() - started
            t_unit = _best_time(lambda: grouped.run({**one, **weights}, names))
            grouped.close()
            estimates["unit"] = units * (unit_build + tasks_per_unit * calls * t_unit)
        elif job.unit_factory is not None:
            estimates["unit"] = units * (constant_build + tasks_per_unit * calls * t_const)  # a lower bound, already too slow
        if units * tasks_per_unit * (constant_build + calls * t_const) < to_beat():
            started = time.perf_counter()
            job.rebuild_factory(weights).close()
            estimates["rebuild"] = units * tasks_per_unit * (time.perf_counter() - started + calls * t_const)
        else:
            estimates["rebuild"] = units * tasks_per_unit * (constant_build + calls * t_const)  # a lower bound, already too slow
        if prefix:
            try:
                # the cuts feed their weights as stored: the fed session's slowdown says what that costs, unless
                # it is the runtime's optimized graph (as fast as a constant one), when the planner's default does
                slowdown = None if isinstance(self.overridable, DerivedFeeds) else t_feed / max(t_const, 1e-9)
                estimates["prefix"] = self._estimate_prefix(step * t_const, constant_build, chunks[0][1], slowdown, (job.spec.steps - 1) * step * t_feed)
            except Exception:  # a graph the cut cannot handle (e.g. untyped activations): no prefix
                pass
        if self._batch_refusal() is None:
            try:
                batch = self._estimate_batch(constant_build, estimates.get("unit", estimates["rebuild"]) / units, to_beat(), scale, chunks[0][0], t_const)
            except Exception:  # a rewritten graph the runtime cannot run: no batch
                batch = None
            if batch is not None:
                estimates["batch"] = batch
        return estimates

    def _constant_session(self) -> Session:
        """The session of the model with its weights constant, built once (auto's timing; the nominal session
        of every strategy but feed and prefix)."""
        if self._constant is None:
            started = time.perf_counter()
            self._constant = self.job.rebuild_factory({})
            self._constant_build = time.perf_counter() - started
        return self._constant

    def _estimate_batch(self, constant_build: float, fallback: float, best: float, scale: float, chunk_windows: int, t_const: float) -> float | None:
        """Sweep seconds of 'batch': per unit it can batch, a batched build, its check and one batched
        rollout (the nominal slot and the probes), timed on the largest such unit with a batched call of
        one window, scaled to a real call's windows as the constant session scales from one window to its
        first chunk (`scale`, over `chunk_windows`); `fallback` per unit it cannot. None when the model's
        batched outputs differ from unbatched ones. A real-size batched call is not timed: on a small
        model it would cost more than the sweep could gain. Nothing is built when the constant session's
        own calls, a fixed cost plus one per window (`t_const` for one window, `scale` times that for
        `chunk_windows`), already put batch behind `best`: then that estimate is returned."""
        job, factory = self.job, self.job.rebuild_factory
        units = list(job.units.values())
        probes = self._batch_width
        per_call = min(job.contexts.count, max(1, job.max_batch_windows // probes))
        calls = job.spec.steps * math.ceil(job.contexts.count / per_call)
        per_window = t_const * max(0.0, scale - 1) / max(1, chunk_windows - 1)  # what a window more adds to a call
        per_unit = constant_build + calls * (t_const + per_window * (probes * per_call - 1))
        if len(units) * min(fallback, per_unit) >= best:  # however many it can batch, already too slow: no rewrite tried
            return len(units) * min(fallback, per_unit)
        batchable = [u for u in units if factory.batch_refusal(u.tensor_names) is None]
        if not batchable:
            return None
        refused = (len(units) - len(batchable)) * fallback
        if refused + len(batchable) * constant_build >= best:  # a lower bound, already too slow
            return refused + len(batchable) * constant_build
        modelled = refused + len(batchable) * per_unit
        if modelled >= best:  # compute-bound: a call of P + 1 slots costs about P + 1 calls
            return modelled
        unit = max(batchable, key=lambda u: u.params)
        started = time.perf_counter()
        session = factory.batched(unit.tensor_names, probes)
        build = time.perf_counter() - started
        try:
            started = time.perf_counter()
            if self._batch_mismatch(unit, session, self._constant_session()) is not None:
                return None
            check = time.perf_counter() - started
            feeds = _tiled(self._reference[0], probes)  # the check's one window
            weights = {n: np.stack([job.weights[n]] * probes) for n in unit.tensor_names}
            t_one = _best_time(lambda: session.run({**feeds, **weights}, job.spec.run_outputs), 2)  # the first call of a shape allocates
        finally:
            session.close()
        t_call = t_one * max(1.0, scale * per_call / max(1, chunk_windows))
        return refused + len(batchable) * (build + check + calls * t_call)

    def _plan_cuts(self, call_s: float, build_s: float, feeds: dict[str, np.ndarray], fed_slowdown: float | None = None) -> "graph_ops.prefix.CutPlan":
        """Which units share a cut ('prefix'), for a whole-model rollout of `call_s` seconds and build of
        `build_s`; `fed_slowdown`, when measured, is the fed session's time over the constant one's."""
        job, graph = self.job, self.job.cut_factory.graph()
        if self._node_costs is None:
            self._node_costs = graph_ops.prefix.node_costs(graph, {n: v.shape for n, v in feeds.items()})
        if fed_slowdown is not None:  # the nodes reading unit weights account for all of the slowdown
            share = graph_ops.prefix.reading_share(graph, set(self._unit_of), self._node_costs)
            self._fed_penalty = max(0.0, fed_slowdown - 1) / max(share, 1e-3)
        if self._cut_planner is None:  # the graph's part of planning, once for auto's estimate and the sweep's plan
            units = {u.name: list(u.tensor_names) for u in job.units.values()}
            self._cut_planner = graph_ops.prefix.CutPlanner(graph, units, self._node_costs, self._graph_walk)
        return self._cut_planner.plan(call_s, build_s, max(1, job.tasks_per_unit), self._fed_penalty)

    def _estimate_prefix(self, call_s: float, build_s: float, feeds: dict[str, np.ndarray], fed_slowdown: float | None = None, rest_s: float = 0.0) -> float:
        """Sweep seconds of 'prefix': the whole model's session with its activations as outputs (a build and
        a first step), then the planned cuts (`_plan_cuts`); with more steps, `rest_s` (steps 2..T on the
        overridable session) once for the nominal and once per task."""
        tasks_per_unit = max(1, self.job.tasks_per_unit)
        plan = self._plan_cuts(call_s, build_s, feeds, fed_slowdown)
        serial = build_s + call_s + rest_s  # the whole model's session, its first step and the nominal's later steps
        pieces = [seconds + len(group) * tasks_per_unit * rest_s for group, seconds in zip(plan.groups, plan.group_seconds)]
        self._prefix_pieces = (serial, pieces)
        return serial + sum(pieces)

    def _start_prefix(self) -> Nominal:
        """'prefix': one step of the whole model gives the nominal's first step and the activations at every
        unit's cut; the cuts are planned from its build and run times, and the whole model's session is closed
        (at T = 1, one model in memory at a time). Units sharing a cut run on one session of the part downstream
        of all of them. With more steps, the overridable session (kept open: a model held in memory, under
        64 MiB) makes the nominal's steps 2..T from there."""
        job, cuts = self.job, self.job.cut_factory
        names = job.spec.run_outputs
        outputs = list(self._cut_outputs)
        walk = self._graph_walk
        first = graph_ops.prefix.cut_order(walk, {u.name: u.tensor_names for u in job.units.values()})[0]
        self.probes.prefetch(Task(first, "quant" if job.quant_probe else "gauss", 0))  # the sweep's first task, most likely
        boundary = set()
        for unit in job.units.values():
            boundary.update(walk.boundary(unit.tensor_names, outputs))
        extra = sorted(boundary - {s.name for s in self.inputs} - set(names))
        started = time.perf_counter()
        session = cuts.activations(extra)
        build_s = time.perf_counter() - started
        self.session = self.engine.session = session
        try:
            chunks = self.engine.chunks
            started = time.perf_counter()
            runs = [session.run(feeds, names + extra) for _, feeds in chunks]
            call_s = time.perf_counter() - started
        except RolloutError:
            raise
        except Exception as exc:
            raise RolloutError(f"the model failed to run on the contexts: {str(exc).splitlines()[0]}") from None
        self._first = [{n: run[n] for n in names} for run in runs]
        steps = [[{n: run[n] for n in job.spec.trajectory} for run in runs]]
        if job.spec.steps > 1:
            starts = [next_feeds(feeds, run, job.spec) for (_, feeds), run in zip(chunks, self._first)]
            steps += [list(outs) for outs in self.engine.steps(None, job.spec.steps - 1, self.overridable, starts)]
        nominal = self._make_nominal(steps)
        self.cut_plan = self._plan_cuts(call_s, build_s, chunks[0][1])
        needed = set()
        for group in self.cut_plan.groups:
            needed.update(walk.boundary(self._group_weights(group), outputs))
        self._activations = [{**feeds, **{n: run[n] for n in needed if n in run}} for (_, feeds), run in zip(chunks, runs)]
        session.close()
        return nominal

    @property
    def _graph_walk(self) -> "graph_ops.prefix.GraphWalk":
        """The cut graph's walk, one for the plan and the cuts' boundaries (it keeps each unit's downstream part)."""
        if self._walk is None:
            self._walk = graph_ops.prefix.GraphWalk(self.job.cut_factory.graph().graph)
        return self._walk

    def _group_weights(self, group) -> list[str]:
        return [n for name in group for n in self.job.units[name].tensor_names]

    @property
    def _cut_outputs(self) -> tuple[str, ...]:
        """What a cut must produce: the trajectory, and with more steps whatever the next step is fed."""
        return self.job.spec.trajectory if self.job.spec.steps == 1 else self.job.spec.run_outputs

    def _cut_for(self, unit: Unit) -> tuple[Session | None, "graph_ops.prefix.Cut", list, list]:
        """The session of the cut `unit` shares (one kept at a time; None when no output depends on it),
        the cut, its own nominal run per chunk, and per chunk the activations it is fed (on the session's
        device: every probe of the cut's units reads the same ones)."""
        group = self.cut_plan.group_of(unit.name)
        if self._cut is None or self._cut[0] != group:
            self._cut = None  # drop the previous cut before building the next
            types = {n: onnx_type(v) for n, v in self._activations[0].items()}
            types.update({n: onnx_type(v) for n, v in self._first[0].items()})
            weights = self._group_weights(self.cut_plan.groups[group])
            session, cut = self.job.cut_factory.downstream(weights, list(self._cut_outputs), types)
            fed = [kept(session, {b: acts[b] for b in cut.boundary}) for acts in self._activations] if session else []
            reference = [session.run(feeds, cut.outputs) for feeds in fed] if session else []
            self._cut = (group, session, cut, reference, fed)
        return self._cut[1:]

    def _prefix_totals(self, unit: Unit, weights: dict[str, np.ndarray]) -> Iterator[float]:
        """Per step, the squared divergence summed over windows. The first step runs only the part of the
        graph downstream of `unit` and the units that share its cut, fed the nominal activations at the cut,
        and is compared with the cut's own nominal run. Later steps run the whole model on the overridable
        session from the nominal's state moved by exactly what the cut changed (an output the cut leaves
        equal keeps its nominal value to the bit, so an inert unit diverges by exactly zero)."""
        job = self.job
        session, cut, reference, fed = self._cut_for(unit)
        if session is None:  # nothing the rollout produces or feeds back depends on the unit
            yield from [0.0] * job.spec.steps
            return
        total, starts = 0.0, []
        cut_weights = kept(session, weights)  # once for every chunk
        for c, feeds in enumerate(fed):
            produced = session.run({**feeds, **cut_weights}, cut.outputs)
            nominal = self.nominal.trajectory[0][c]
            total += self.engine.window_sq(c, {**nominal, **produced}, {**nominal, **reference[c]}).sum()
            if job.spec.steps > 1:
                moved = {n: _moved(self._first[c][n], produced[n], reference[c][n]) for n in cut.outputs}
                starts.append(next_feeds(self.engine.chunks[c][1], {**self._first[c], **moved}, job.spec))
        yield total
        if job.spec.steps > 1:
            for t, outs in enumerate(self.engine.steps(weights, job.spec.steps - 1, self.overridable, starts), start=1):
                yield self._step_total(t, outs)

    @property
    def _batch_width(self) -> int:
        """Slots of a probe-batched call: the nominal weights, then each of a unit's probes."""
        return max(1, self.job.tasks_per_unit) + 1

    def _batch_refusal(self) -> str | None:
        """Why this model's probes cannot be batched at all, or None."""
        if not hasattr(self.job.rebuild_factory, "batched"):
            return "the model is swept from a file, not rebuilt in memory"
        static = next((s for s in self.inputs if s.rank == 0 or not s.is_dynamic(0)), None)
        if static is not None:
            return f"input '{static.name}' {list(static.shape)} has no dynamic batch axis to tile the probes along"
        return None

    def _check_batch(self) -> None:
        """Asked for 'batch': refuse a model it cannot run (static batch, or batched outputs that differ
        from unbatched ones on the first unit it can batch) with one line naming the cause."""
        reason = self._batch_refusal()
        if reason is None:
            factory = self.job.rebuild_factory
            first = next((u for u in self.job.units.values() if factory.batch_refusal(u.tensor_names) is None), None)
            if first is not None and self._batched_session(first) is None:
                reason = self.fallbacks[first.name]
        if reason is not None:
            raise RolloutError(f"strategy 'batch' cannot run this model: {reason}", hint="use --strategy unit or auto")

    def _batched_session(self, unit: Unit) -> Session | None:
        """The unit's batched session (one kept at a time), or None when it runs probe by probe
        (the rewrite refuses its weights, or its batched outputs differ from unbatched ones; see `fallbacks`)."""
        if self._batched is not None and self._batched[0] == unit.name:
            return self._batched[1]
        self._drop_unit_sessions()
        session, reason = None, None
        try:
            session = self.job.rebuild_factory.batched(unit.tensor_names, self._batch_width)
            reason = self._batch_mismatch(unit, session, self.session)
        except GraphError as exc:
            reason = str(exc)
        except Exception as exc:  # the runtime cannot load the rewritten graph
            reason = f"unit '{unit.name}': the batched model does not load: {str(exc).splitlines()[0]}"
        if reason is not None:
            if session is not None:
                session.close()
                session = None
            self.fallbacks[unit.name] = reason
        self._batched = (unit.name, session)
        return session

    def _batch_mismatch(self, unit: Unit, session: Session, constant: Session) -> str | None:
        """Why batching this unit's probes would change its results, or None.

        One window, tiled once per probe, rolled out a few steps with probe 0 nominal and the others
        perturbed as strongly as the weights are large: probe 0's rows must match the constant
        session's unbatched run. An op that mixes rows across the batch (a reduction over it, a
        reshape folding it into another axis) leaks the other probes into probe 0 and fails this.
        """
        job, probes = self.job, self._batch_width
        if self._reference is None:
            feeds = next(iter(job.contexts.chunks(self.inputs, True, 1)))[1]
            self._reference = (feeds, list(rollout(constant, feeds, job.spec, steps=min(job.spec.steps, 3))))
        feeds, reference = self._reference
        rng = np.random.default_rng(0)
        weights = {}
        for name in unit.tensor_names:
            w = job.weights[name]
            rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64)))) or 1.0
            noise = rng.standard_normal((probes - 1, *w.shape), dtype=np.float32) * np.float32(rms)
            weights[name] = np.concatenate([w[None], (w[None] + noise).astype(w.dtype)])
        try:
            produced = list(rollout(session, _tiled(feeds, probes), job.spec, weights, steps=len(reference)))
        except Exception as exc:
            return f"unit '{unit.name}': the batched model fails to run: {str(exc).splitlines()[0]}"
        for t, (outs, expected) in enumerate(zip(produced, reference), start=1):
            for name in job.spec.trajectory:
                got, want = np.asarray(outs[name]), np.asarray(expected[name], np.float64)
                if got.ndim == 0 or got.shape[0] % probes or got.size != probes * want.size:
                    return f"unit '{unit.name}': batched output '{name}' {list(got.shape)} does not keep the probes' batch"
                got = got.reshape(probes, -1)[0].astype(np.float64)
                scale = float(np.abs(want).max(initial=0.0))
                rtol = max(BATCH_RTOL, 10 * float(np.finfo(outs[name].dtype).eps)) if np.issubdtype(outs[name].dtype, np.floating) else 0.0
                error = float(np.abs(got - want.reshape(-1)).max(initial=0.0))
                if not error <= rtol * max(scale, 1e-30):
                    return (
                        f"unit '{unit.name}': batched output '{name}' at step {t} differs from the unbatched run by {error:.3g} "
                        f"(output scale {scale:.3g}): an op mixes rows across the batch"
                    )
        return None

    def _batch_unit(self, unit: Unit) -> dict[str, TaskResult]:
        """All the unit's tasks from one batched rollout, by task key (empty when it runs probe by probe)."""
        job = self.job
        session = self._batched_session(unit)
        if session is None:
            return {}
        started = time.perf_counter()
        tasks = plan_tasks([unit], job.quant_probe, job.tasks_per_unit - int(job.quant_probe))
        stacked = {n: np.empty((self._batch_width, *job.weights[n].shape), job.weights[n].dtype) for n in unit.tensor_names}
        for name, value in stacked.items():
            value[0] = job.weights[name]  # slot 0: the nominal weights, the probes' reference
        deltas = []
        for p, task in enumerate(tasks, start=1):  # filled one probe at a time: no second copy of every probe's weights
            change = self.probes.unit(unit.name).perturb(task.probe, task.draw, job.seed)
            for name, value in change.weights.items():
                stacked[name][p] = value
            deltas.append(change.delta_sq)
        outcomes = self._batched_divergence(session, stacked, deltas)
        seconds = (time.perf_counter() - started) / len(tasks)
        return {
            t.key: TaskResult(unit=t.unit, probe=t.probe, draw=t.draw, delta_sq=delta_sq, div_sq=div_sq, nonfinite=nonfinite, seconds=seconds)
            for t, delta_sq, (div_sq, nonfinite) in zip(tasks, deltas, outcomes)
        }

    def _batched_divergence(self, session: Session, stacked: dict[str, np.ndarray], deltas: list[float]) -> list[tuple[list[float], bool]]:
        """Per probe, what `divergence` returns: the rows of probe slot p + 1 of one batched rollout against
        those of slot 0, which holds the nominal weights (same call, so an inert unit diverges by exactly zero).

        Chunks hold at most max_batch_windows / (P + 1) windows, so a call holds no more rows than an
        unbatched one; early stopping applies per probe, and the rollout ends when every probe has stopped.
        """
        job, probes, width = self.job, len(deltas), self._batch_width
        chunks = list(job.contexts.chunks(self.inputs, True, max(1, job.max_batch_windows // width)))
        runs = [rollout(session, _tiled(feeds, width), job.spec, stacked) for _, feeds in chunks]
        div_sq: list[list[float]] = [[] for _ in range(probes)]
        nonfinite, gammas, cumulative = [False] * probes, [[] for _ in range(probes)], [0.0] * probes
        live = set(range(probes))
        try:
            for t, steps in enumerate(zip(*runs), start=1):
                total = np.zeros(probes)
                for outs in steps:
                    for name in job.spec.trajectory:
                        slots = np.asarray(outs[name], np.float64).reshape(width, -1)
                        total += np.square(slots[1:] - slots[0]).sum(axis=1)
                for p in sorted(live):
                    value = float(total[p] / job.contexts.count)
                    if not math.isfinite(value):
                        div_sq[p].extend([math.inf] * (job.spec.steps - t + 1))
                        nonfinite[p] = True
                        live.discard(p)
                        continue
                    div_sq[p].append(value)
                    cumulative[p] += value
                    if _settled(job.early_stop, gammas[p], cumulative[p], deltas[p], job.eps, t):
                        live.discard(p)
                if not live:
                    break
        except RolloutError:
            raise
        except Exception as exc:
            raise RolloutError(f"{session.name} failed to run the batched rollout: {str(exc).splitlines()[0]}") from None
        return list(zip(div_sq, nonfinite))

    def _drop_unit_sessions(self) -> None:
        """Close the per-unit sessions ('unit' and 'batch') before building the next unit's."""
        for held in (self._group, self._batched):
            if held is not None and held[1] is not None:
                held[1].close()
        self._group = self._batched = None

    def _session_for(self, names: frozenset[str]) -> Session | None:
        """The 'unit' session whose overridable weights cover `names` (one kept at a time), or
        None when they span several units (then the perturbation is baked into a constant session)."""
        if self._group is not None and names <= self._group[0]:
            return self._group[1]
        owners = {self._unit_of[n].name for n in names if n in self._unit_of}
        if len(owners) != 1 or not names <= set(self.job.units[next(iter(owners))].tensor_names):
            return None
        self._drop_unit_sessions()
        unit = self.job.units[next(iter(owners))]
        self._group = (frozenset(unit.tensor_names), self.job.unit_factory(unit.tensor_names))
        return self._group[1]

    def _steps(self, weights=None, steps=None):
        """Step-major rollout with `weights` replaced, the way this runner's strategy applies them."""
        if not weights or self.strategy == "feed":
            return self.engine.steps(weights or None, steps)
        if self.strategy in ("unit", "prefix", "batch"):
            session = self._session_for(frozenset(weights))
            if session is not None:
                return self.engine.steps(weights, steps, session=session)
        return self.engine.steps(None, steps, session=self.job.rebuild_factory(weights))

    def _continued(self, first: dict[str, np.ndarray]) -> list[list[dict[str, np.ndarray]]]:
        """The nominal rollout's steps ([step][chunk]) of a single-chunk sweep whose first step `first` already ran
        on the engine's session (the same call the rollout would make: the same values)."""
        job = self.job
        steps = [[{n: first[n] for n in job.spec.trajectory}]]
        if job.spec.steps > 1:
            start = next_feeds(self.engine.chunks[0][1], first, job.spec)
            steps += [list(outs) for outs in self.engine.steps(None, job.spec.steps - 1, starts=[start])]
        return steps

    @property
    def nominal(self) -> Nominal:
        """The nominal rollout; on lanes it may still be in the making (`run_lanes` makes it on a lane while
        the others start on tasks): this waits for it, or makes it when no lane has."""
        return self._nominal.get()

    @property
    def nominal_made(self) -> bool:
        return self._nominal.ready

    def _past_nominal(self, steps: Iterable[list[dict[str, np.ndarray]]]) -> Iterator[list[dict[str, np.ndarray]]]:
        """`steps` as they come once the nominal is made; before that they are held (up to `HOLD_BYTES`,
        then this waits for it), so a lane's first task runs while another lane makes the nominal."""
        held: list[list[dict[str, np.ndarray]]] = []
        size = 0
        for outs in steps:
            if not self._nominal.ready and size < HOLD_BYTES:
                held.append(outs)
                size += sum(np.asarray(v).nbytes for chunk_out in outs for v in chunk_out.values())
                continue
            self._nominal.get()
            yield from held
            held = []
            yield outs
        self._nominal.get()
        yield from held

    def _make_nominal(self, steps: list[list[dict[str, np.ndarray]]] | None = None) -> Nominal:
        """The nominal rollout's summary: of `steps` ([step][chunk] outputs) when given, else of a rollout made now
        (on a single chunk, from the first step the batching decision or auto's timing already ran on the same session)."""
        try:
            if steps is None:
                chunks = self.engine.chunks  # the batching decision (a run of the first chunk), unless made
                made = next((r for r in (self._first_step, self.engine.first_run) if r is not None and r.session is self.engine.session), None)
                steps = self._continued(made.outputs) if made is not None and len(chunks) == 1 else [list(outs) for outs in self._steps()]
        except RolloutError as exc:
            raise RolloutError(f"the model failed to run on the contexts: {exc}") from None
        norm_sq, abs_sum = [], {name: 0.0 for name in self.job.spec.trajectory}
        for t, outs in enumerate(steps):
            for name in self.job.spec.trajectory:
                for chunk_out in outs:
                    if not np.all(np.isfinite(chunk_out[name])):
                        raise RolloutError(f"the nominal rollout produced NaN or Inf in output '{name}' at step {t + 1}")
                    abs_sum[name] += float(np.abs(chunk_out[name].astype(np.float64)).sum())
            total = sum(self.engine.window_sq(c, outs[c]).sum() for c in range(len(outs)))
            norm_sq.append(float(total / self.job.contexts.count))
        return Nominal(trajectory=steps, norm_sq=norm_sq, abs_sum=abs_sum, batched=self.engine.batched)

    def expect(self, tasks: Sequence[Task]) -> None:
        """The tasks come in this order: their perturbations start building ahead ('batch' builds a unit's probes together)."""
        if self.strategy != "batch":
            self.probes.plan(tasks)

    def run(self, task: Task, following: Task | None = None) -> TaskResult:
        """Run `task`; `following`, the task that comes next, has its perturbation built meanwhile."""
        job = self.job
        started = time.perf_counter()
        if self.strategy == "batch":
            if self._batch_results[0] != task.unit:  # a unit's first task runs all its probes
                self._batch_results = (task.unit, self._batch_unit(job.units[task.unit]))
            if task.key in self._batch_results[1]:
                return self._batch_results[1][task.key]
        if self.strategy == "prefix":
            self._cut_for(job.units[task.unit])  # built while the task's perturbation is (see run_local)
        change = self.probes.get(task, following)
        if self.strategy == "prefix":
            div_sq, nonfinite = self._accumulate(self._prefix_totals(job.units[task.unit], change.weights), change.delta_sq, True)
        else:
            div_sq, nonfinite = self.divergence(change.weights, change.delta_sq)
        return TaskResult(
            unit=task.unit,
            probe=task.probe,
            draw=task.draw,
            delta_sq=change.delta_sq,
            div_sq=div_sq,
            nonfinite=nonfinite,
            seconds=time.perf_counter() - started,
        )

    def divergence(self, weights: dict[str, np.ndarray], delta_sq: float = 0.0, early_stop: bool = True) -> tuple[list[float], bool]:
        """Per-step mean squared trajectory divergence of the model with `weights`
        replaced, against the nominal rollout; and whether it went non-finite.

        Early stopping (when the job asks for it and `early_stop`) needs `delta_sq`.
        """
        steps = self._steps(weights)
        if not self.nominal_made:
            steps = self._past_nominal(steps)
        return self._accumulate((self._step_total(t, outs) for t, outs in enumerate(steps)), delta_sq, early_stop)

    def _step_total(self, t: int, outs: list[dict[str, np.ndarray]]) -> float:
        """Squared divergence of step `t` (from 0), summed over every window of every chunk."""
        nominal = self.nominal
        stacked = nominal.stacked(t) if len(outs) > 1 and not self.engine.batched else None
        if stacked is not None:  # window by window: one difference over all the step's windows
            try:
                return self.engine.total_sq({name: np.stack([o[name] for o in outs]) for name in stacked}, stacked)
            except ValueError:  # this rollout's windows differ in shape from the nominal's
                pass
        return sum(self.engine.total_sq(outs[c], nominal.trajectory[t][c]) for c in range(len(outs)))

    def _accumulate(self, totals: Iterable[float], delta_sq: float, early_stop: bool) -> tuple[list[float], bool]:
        """Per-step mean divergence from per-step totals over windows, stopped early once γ settles
        (when asked) or at the first non-finite step."""
        job = self.job
        stop = job.early_stop if early_stop else None
        div_sq: list[float] = []
        gammas: list[float] = []
        cumulative = 0.0
        for t, total in enumerate(totals, start=1):
            value = float(total / job.contexts.count)
            if not math.isfinite(value):
                div_sq.extend([math.inf] * (job.spec.steps - t + 1))
                return div_sq, True
            div_sq.append(value)
            cumulative += value
            if _settled(stop, gammas, cumulative, delta_sq, job.eps, t):
                break
        return div_sq, False

    def drift(self, weights: dict[str, np.ndarray], session: Session | None = None) -> Drift:
        """Divergence of the model with `weights` replaced over the full rollout, in every unit reports use;
        with `session`, of the model that session runs (a candidate built apart, `weights` fed to it)."""
        div_sq: list[float] = []
        abs_diff = {name: 0.0 for name in self.job.spec.trajectory}
        steps = self._steps(weights) if session is None else self.engine.steps(weights or None, session=session)
        for t, outs in enumerate(steps, start=1):
            reference = self.nominal.trajectory[t - 1]
            total = 0.0
            for c, chunk_out in enumerate(outs):
                total += self.engine.window_sq(c, chunk_out, reference[c]).sum()
                for name in abs_diff:
                    abs_diff[name] += float(np.abs(chunk_out[name].astype(np.float64) - reference[c][name]).sum())
            div_sq.append(float(total / self.job.contexts.count))
        if not all(math.isfinite(v) for v in div_sq):
            return Drift(math.inf, {name: math.inf for name in abs_diff}, div_sq)
        relative = math.sqrt(sum(div_sq) / max(sum(self.nominal.norm_sq), 1e-300))
        pct = {name: 100 * value / max(self.nominal.abs_sum[name], 1e-300) for name, value in abs_diff.items()}
        return Drift(relative, pct, div_sq)

    def relative_drift(self, weights: dict[str, np.ndarray]) -> float:
        """RMS trajectory divergence over all steps relative to the RMS nominal trajectory."""
        return self.drift(weights).relative_rms

    def lane(self) -> "SweepRunner":
        """Another runner over this one's sessions, nominal, cut plan and probe builds, with per-unit sessions
        of its own ('unit', 'batch', 'prefix' cuts): lanes run tasks at once on their own threads (ONNX
        Runtime's run is thread-safe, and on the CPU provider a session of one thread runs a call on the
        caller's thread). Closing a lane closes only what it built."""
        other = copy.copy(self)
        other._group = other._batched = other._cut = None
        other._batch_results = ("", {})
        other._lead = self
        return other

    def work_items(self, tasks: Sequence, unit_of: Callable[[object], str] = lambda task: task.unit) -> list[list]:
        """The tasks in the pieces lanes take one at a time, in order: a task each when weights are fed or
        baked per task; a unit's tasks together when a session is built per unit; a cut's units together."""
        if self.strategy in ("feed", "rebuild"):
            return [[task] for task in tasks]
        key = (lambda t: self.cut_plan.group_of(unit_of(t))) if self.strategy == "prefix" else unit_of
        items: dict[object, list] = {}
        for task in tasks:
            items.setdefault(key(task), []).append(task)
        return list(items.values())

    def close(self) -> None:
        if self._lead is not None:  # a lane: the sessions are the lead runner's
            self._drop_unit_sessions()
            self._cut = None
            return
        self.probes.close()
        self.session.close()
        if self.overridable is not None:
            self.overridable.close()
        self._drop_unit_sessions()
        self._cut = None


def onnx_type(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)


def run_local(
    job: SweepJob,
    tasks: Sequence[Task],
    log: ResultLog,
    on_result: Callable[[TaskResult], None] | None = None,
    runner: SweepRunner | None = None,
    lanes: int = 1,
) -> int:
    """Run the tasks in this process, appending each result as it lands; with `lanes` > 1, up to that
    many tasks at once (`run_lanes`: no more lanes than work items). Returns the lanes it ran."""
    runner = runner or job.open()
    try:
        items = runner.work_items(tasks)
        lanes = max(1, min(lanes, len(items) + (not runner.nominal_made)))  # the nominal is a lane's work too
        if lanes > 1:
            run_lanes(runner, items, lanes, log, on_result)
        else:
            runner.expect(tasks)
            for i, task in enumerate(tasks):
                result = runner.run(task, tasks[i + 1] if i + 1 < len(tasks) else None)
                log.append(result)
                if on_result:
                    on_result(result)
        runner.nominal  # noqa: B018 - made even when no task was left to run (a resumed, finished sweep)
        return lanes
    finally:
        log.close()


LANES_MAX = 8
"""At most this many lanes by default: each holds a rollout's activations (and per-unit sessions)."""
LANE_EXTRA_BYTES = 512 << 20
"""By default the lanes after the first may hold this much between them: a lane's own sessions ('unit',
'batch', 'prefix' cuts) are up to a model copy each, so a model of M bytes gets at most 1 + this / M lanes
(one from 512 MiB on: its calls are large enough for ONNX Runtime's own threads anyway), and a run stays
within the memory the benchmarks hold score to (1.5 x model + 0.5 GB)."""


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def sweep_lanes(lanes: int | None, provider: str, threads: int | None, model_bytes: int) -> int:
    """How many tasks a sweep runs at once in this process.

    `lanes` None (auto): on the CPU provider one per core (or per `threads` cores when those are fixed), at
    most `LANES_MAX` and 1 + `LANE_EXTRA_BYTES` / `model_bytes`; one on a GPU, where one lane's calls
    keep it busy. An explicit number is taken as given (more lanes than cores only share them, and each
    lane holds its own per-unit sessions); more than one on a GPU provider is refused.
    """
    if lanes is not None and lanes < 1:
        raise InputError(f"--lanes must be 1 or more, not {lanes}")
    if provider != "cpu":
        if lanes not in (None, 1):
            raise InputError(f"--lanes {lanes} runs tasks side by side on the CPU provider only; on '{provider}' the sweep runs one lane", hint="drop --lanes")
        return 1
    if lanes is None:
        return max(1, min(LANES_MAX, usable_cores() // (threads or 1), 1 + LANE_EXTRA_BYTES // max(model_bytes, 1)))
    return lanes


def interleaved(items: Sequence[Sequence[Task]], lanes: int) -> list[Task]:
    """The order `lanes` lanes ask for the tasks of `items` when each takes the next item as it finishes
    one and tasks cost alike: the first tasks of `lanes` items, then their second ones, and so on."""
    order: list[Task] = []
    for start in range(0, len(items), lanes):
        batch = items[start:start + lanes]
        for depth in range(max(len(item) for item in batch)):
            order.extend(item[depth] for item in batch if depth < len(item))
    return order


def run_lanes(runner: SweepRunner, items: Sequence[Sequence[Task]], lanes: int, log: ResultLog, on_result: Callable[[TaskResult], None] | None) -> None:
    """Run the work items on `lanes` threads (`Lanes`): `runner` and `lanes` - 1 of its `SweepRunner.lane`s.

    On the CPU provider a small model's call gains little from ONNX Runtime's intra-op threads (on 2
    cores, 2 threads ran the bundled examples' rollouts 0.4-1.9x as fast as 1), while independent tasks
    on one thread each run ~2x as fast: the sweep's tasks are independent, so they run side by side in one
    process, sharing the session (feed), the nominal and the probe builds. Only this thread writes the
    log and reports progress, so an interruption leaves a resumable table as a one-lane run does.
    """
    runner.probes.share(lanes)
    runner.expect(interleaved(items, lanes))

    def work(lane: SweepRunner, item: Sequence[Task]) -> Iterator[TaskResult]:
        if item is _NOMINAL:
            lane.nominal  # noqa: B018 - made here, on the first lane free, while the others run tasks
            return
        for i, task in enumerate(item):
            yield lane.run(task, item[i + 1] if i + 1 < len(item) else None)

    runners = [runner] + [runner.lane() for _ in range(lanes - 1)]
    try:
        with Lanes(runners, ([_NOMINAL] if not runner.nominal_made else []) + list(items), work) as results:
            for result in results:
                log.append(result)
                if on_result:
                    on_result(result)
    finally:
        for lane in runners[1:]:
            lane.close()


_NOMINAL = object()
"""The work item that makes the nominal rollout on a lane (`run_lanes`)."""
_LANE_DONE = object()
"""What a lane puts on the result queue as it ends."""


class Lanes:
    """Runs `work(lane, item)` for every item, one thread per runner in `runners`, each taking the next item
    as it frees; iterating gives what the work yields, in the iterating thread, as it lands. The first
    error a lane raises is raised there; leaving the `with` block (finished, an error, Ctrl-C) stops every
    lane once the result in hand is done. ONNX Runtime's `run` is thread-safe and releases the GIL, and on
    the CPU provider a one-thread session runs a call on the caller's thread: lanes over sessions of one
    thread each use one core each."""

    def __init__(self, runners: Sequence[SweepRunner], items: Sequence[object], work: Callable[[SweepRunner, object], Iterable[object]]):
        self._runners, self._work = list(runners), work
        self._pending = deque(items)
        self._taken = threading.Lock()
        self._stop = threading.Event()
        self._results: queue.Queue = queue.Queue()
        self._pool: ThreadPoolExecutor | None = None

    def _lane(self, runner: SweepRunner) -> None:
        try:
            while not self._stop.is_set():
                with self._taken:
                    if not self._pending:
                        return
                    item = self._pending.popleft()
                for result in self._work(runner, item):
                    self._results.put((None, result))
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001 - handed to the iterating thread, which raises it
            self._results.put((exc, None))
        finally:
            self._results.put((_LANE_DONE, None))  # the iterator ends the moment the last lane does, not at a poll

    def __enter__(self) -> "Lanes":
        self._pool = ThreadPoolExecutor(len(self._runners), thread_name_prefix="tqs-lane")
        for runner in self._runners:
            self._pool.submit(self._lane, runner)  # a lane reports its end and its errors on the result queue
        return self

    def __iter__(self) -> Iterator[object]:
        running = len(self._runners)
        while running:
            try:
                error, result = self._results.get(timeout=0.5)  # a timeout keeps Ctrl-C prompt on every platform
            except queue.Empty:
                continue
            if error is _LANE_DONE:
                running -= 1
            elif error is not None:
                raise error  # the first lane's error ends the run; the others stop after their result
            else:
                yield result

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


_WORKER: SweepRunner | None = None
"""The runner of a worker process (one session per process)."""


def _start_worker(job: SweepJob, strategy: str) -> None:
    global _WORKER
    job.strategy = strategy  # every worker runs the way the main process chose
    _WORKER = job.open()


def _run_in_worker(task: Task) -> TaskResult:
    return _WORKER.run(task)


def run_parallel(
    job: SweepJob,
    tasks: Sequence[Task],
    log: ResultLog,
    workers: int,
    strategy: str,
    on_result: Callable[[TaskResult], None] | None = None,
) -> None:
    """Run the tasks in `workers` processes, each with its own session.

    The job travels by pickling, as it would to other machines; only this
    process writes the result log, in task order, so an interruption leaves
    the same resumable table as a local run.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # forking a process that runs ONNX Runtime threads is unsafe
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(job, strategy)) as pool:
            # Sessions and probes are built per unit: keep a unit's tasks on one worker unless weights are fed.
            chunk = 1 if strategy == "feed" else max(1, job.tasks_per_unit)
            for result in pool.map(_run_in_worker, tasks, chunksize=chunk):
                log.append(result)
                if on_result:
                    on_result(result)
    finally:
        log.close()


class _RayWorker:
    """A Ray actor holding one session (see `run_ray`)."""

    def __init__(self, job: SweepJob, strategy: str):
        job.strategy = strategy
        self.runner = job.open()

    def run(self, task: Task) -> TaskResult:
        return self.runner.run(task)


def run_ray(
    job: SweepJob,
    tasks: Sequence[Task],
    log: ResultLog,
    workers: int,
    strategy: str,
    address: str | None = None,
    on_result: Callable[[TaskResult], None] | None = None,
) -> None:
    """Run the tasks on `workers` Ray actors, on this machine or a cluster.

    `address` is passed to `ray.init` ('auto' joins a running cluster, None
    starts a local one). The job is put in the object store once; each actor
    opens its own session and keeps two tasks in flight, and results are
    appended to the log here, as they complete.
    """
    try:
        import ray
    except ImportError:
        raise RolloutError("Ray is not installed", hint="pip install 'tqsdeploy[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    actor = ray.remote(_RayWorker)
    shared = ray.put(job)
    actors = [actor.remote(shared, strategy) for _ in range(workers)]
    waiting = list(tasks)[::-1]
    in_flight: dict = {}
    try:
        for worker in actors:
            for _ in range(2):
                if waiting:
                    in_flight[worker.run.remote(waiting.pop())] = worker
        while in_flight:
            done, _ = ray.wait(list(in_flight), num_returns=1)
            worker = in_flight.pop(done[0])
            result = ray.get(done[0])
            log.append(result)
            if on_result:
                on_result(result)
            if waiting:
                in_flight[worker.run.remote(waiting.pop())] = worker
    finally:
        log.close()
        for worker in actors:
            ray.kill(worker)
