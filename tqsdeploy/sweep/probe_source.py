"""Each task's perturbation, built ahead of the rollout that uses it."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, Sequence

import graph_ops
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.probes import Perturbation, UnitProbes
from tqsdeploy.sweep.tasks import Task, TaskResult

PROBE_DEPTH_MAX = 4
"""At most this many perturbations are built ahead of the rollout that will use them."""
PROBE_DEPTH_BYTES = 256 << 20
"""...and together they hold at most this many bytes (each is a copy of a unit's weights)."""


STALE_RTOL = {"quant": 1e-6, "gauss": 1e-3}
"""How far a finished task's recorded ||δθ||² may sit from what this version's probe gives before the task counts
as measured on another perturbation: the quantization residual is recomputed exactly (float32 rounding only);
a Gaussian draw's squared norm differs from its reference by float32 sums over the tensor."""


def stale_units(job: SweepJob, done: Mapping[str, TaskResult]) -> set[str]:
    """Units with a finished task whose recorded ||δθ||² is not what this version's probes give: a run folder
    an older version left (another probe grid, other rows perturbed) resumes only into what this version would
    have measured, so those units are measured again. Costs one probe quantization per finished unit."""
    recorded: dict[str, list[TaskResult]] = {}
    for result in done.values():
        recorded.setdefault(result.unit, []).append(result)
    stale = set()
    for name, results in recorded.items():
        unit = job.units.get(name)
        if unit is None:
            stale.add(name)
            continue
        probes = UnitProbes(unit, job.weights, job.probe_bits, job.rows)
        expected = {
            "quant": sum(probes.residual_sq(t) for t in probes.weights),
            "gauss": sum(probes.reference_norm(t) ** 2 for t in probes.weights),
        }
        if any(
            r.probe not in expected
            or abs(r.delta_sq - expected[r.probe]) > STALE_RTOL[r.probe] * max(expected[r.probe], 1e-30)
            for r in results
        ):
            stale.add(name)
        graph_ops.release_pages(job.weights, unit.tensor_names)
    return stale


class ProbeSource:
    """Each task's perturbation, built ahead on helper threads while the current rollout runs.

    Drawing Gaussian noise and quantizing a unit are numpy work that releases the GIL, so on a
    machine with a core to spare they cost no sweep time. On the CPU provider one build runs ahead
    (ONNX Runtime has the other cores). On a GPU a rollout of a small model is quicker than a draw
    over a large unit on one core, so `depth` builds run ahead at once, on that many threads: the
    sweep would otherwise wait on the CPU (docs/design-notes/sweep.md, 'Probes built ahead'). A unit's
    shared parts (`UnitProbes`) are made once, under a lock; `depth` + 1 perturbations are alive at a time.
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
        """Serve `lanes` runners at once: a build ahead for each (within `PROBE_DEPTH_BYTES`), and every unit a lane
        is on kept."""
        self.depth = max(self.depth, min(lanes, self.fitting))
        self._recent = deque(self._recent, maxlen=max(1, lanes))

    @property
    def fitting(self) -> int:
        """How many copies of the largest unit fit in `PROBE_DEPTH_BYTES` (at least one)."""
        largest = max(
            (sum(self.job.weights[n].nbytes for n in u.tensor_names) for u in self.job.units.values()), default=0
        )
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
                wanted = (
                    {t.unit for t in tuple(self._pending)} | set(tuple(self._recent)) | {name}
                )  # snapshots: lanes add and pop meanwhile
                for old in [
                    u for u in self._units if u not in wanted
                ]:  # a streamed model's weights live in the runtime: hand back the pages the probes read
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
                self._pool = ThreadPoolExecutor(
                    PROBE_DEPTH_MAX, thread_name_prefix="tqs-probes"
                )  # threads start only as builds need them
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
