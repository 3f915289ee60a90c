"""auto: each strategy's sweep estimated from one step of one window and one build; the cheapest picked."""

from __future__ import annotations

import heapq
import math
import time
from typing import Callable, Sequence

import numpy as np

from runtimes import DerivedFeeds, Session
from tqsdeploy.rollout.engine import FirstRun
from tqsdeploy.sweep.batching import tiled
from tqsdeploy.sweep.rig import Rig
from tqsdeploy.sweep.strategies import Prefix
from tqsdeploy.units import Unit

CONSTANT_BUILD_BYTES_PER_S = 1e9
"""How fast ONNX Runtime builds a session of constant weights read from a model's files: it reads and
pre-packs every weight of the ops in `PRE_PACKED` (a session whose weights are overridable packs none as it
builds). What 'auto' prices a cut of a model swept from its files with, without building one
(docs/design-notes/sweep.md, 'Session builds')."""
PRE_PACKED = {"MatMul", "Gemm", "Conv", "ConvTranspose", "LSTM", "GRU", "RNN"}

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


class Choice:
    """Times what tells the strategies apart on this model and machine and picks one (`choose`); the sessions
    and runs it makes on the way are kept in the rig for the sweep that follows (the constant session, the
    first step, the cut plan's graph work, the batch check's reference rollout)."""

    def __init__(self, rig: Rig):
        self.rig, self.job, self.engine = rig, rig.job, rig.engine
        self.timings: dict[str, float] = {}
        """Per strategy: the sweep seconds auto estimated (only feed's bound when the sweep is small)."""
        self._prefix_pieces: tuple[float, list[float]] | None = None
        """The 'prefix' estimate split: the serial set-up, then the seconds of each cut (a lane's piece of work)."""

    def choose(self) -> str:
        """Estimate each strategy's sweep from one step of one window and one build; pick the cheapest.

        The one-window times are scaled to the real chunks by one real step of
        the fed session (the batching decision's run, kept as the nominal's first
        step if feed wins); a strategy other than 'feed' must beat it by 5%
        (timing noise). A sweep 'feed' would finish within `SMALL_SWEEP_S` runs
        on feed untimed.
        """
        job = self.job
        prefix = Prefix.possible(job)
        if job.rebuild_factory is None:
            return self._choose_streamed() if prefix else "feed"
        names = job.spec.run_outputs
        unit = max(job.units.values(), key=lambda u: u.params)
        weights = {n: job.weights[n] for n in unit.tensor_names}
        try:
            one = next(iter(job.contexts.chunks(self.rig.inputs, False, 1)))[1]
            t_feed = _best_time(lambda: self.rig.overridable.run({**one, **weights}, names))
        except Exception:
            return "feed"  # let the nominal rollout report what is wrong
        # every window its own call bounds the feed sweep from above (a batched call costs at most its windows' calls)
        bound = len(job.units) * max(1, job.tasks_per_unit) * job.spec.steps * job.contexts.count * t_feed
        if self._small(bound):
            return "feed"
        # the fed session decides the batching: its run is the scale run, and the nominal's first step if feed wins
        try:
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
            step = len(chunks) * self._first_step_seconds(self.rig.overridable, chunks)  # one step of every chunk
        except Exception:
            return "feed"  # let the nominal rollout report what is wrong
        estimates = {"feed": len(job.units) * max(1, job.tasks_per_unit) * job.spec.steps * step}
        if self._small(estimates["feed"]):
            return "feed"
        packed = sum(
            t.params * np.dtype(t.dtype).itemsize
            for u in job.units.values()
            for t in u.tensors
            if set(t.op_types) & PRE_PACKED
        )
        build_s = (
            job.session_build_s + packed / CONSTANT_BUILD_BYTES_PER_S
        )  # the fed session packs no weight as it builds
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
            self.rig.first_step = made
        return made.seconds

    def _estimate_rebuilt(
        self, unit: Unit, one: dict[str, np.ndarray], chunks, t_feed: float, prefix: bool
    ) -> dict[str, float]:
        """Every strategy's sweep seconds for a model held in memory (its sessions can be rebuilt): the
        constant session is built and timed (kept as the nominal session of every strategy but feed and
        prefix), a unit session and a rebuild only when a lower bound says they could win. A fed session that
        runs the constant session's kernels (`SweepJob.fed_keeps_kernels`) stands in for it: no rebuilt
        session can then beat feed, and none is built."""
        job, names = self.job, self.job.spec.run_outputs
        tasks_per_unit, units = max(1, job.tasks_per_unit), len(job.units)
        estimates = {}
        if job.fed_keeps_kernels:  # the constant session's kernels already: its times stand in
            t_const, constant_build = t_feed, job.session_build_s
        else:
            constant, constant_build = self.constant_session(), self.rig.constant_build_s
            t_const = _best_time(lambda: constant.run(one, names))
        # a real chunk over one window
        scale = self._first_step_seconds(self.rig.overridable, chunks) / max(t_feed, 1e-9)
        step = len(chunks) * scale  # one step of every chunk, in one-window calls
        calls = job.spec.steps * step
        estimates["feed"] = units * tasks_per_unit * calls * t_feed
        # A unit session costs at least a plain build per unit and a rebuild one per task, and
        # neither runs faster than the constant session: each is timed only when that bound could be picked.

        def to_beat() -> float:
            return min(PICK_MARGIN * estimates["feed"], *estimates.values())

        if job.unit_factory is not None:
            estimates["unit"] = self._estimate_unit(unit, one, calls, t_const, constant_build, to_beat())
        estimates["rebuild"] = self._estimate_rebuild(unit, calls, t_const, constant_build, to_beat())
        if prefix:
            try:
                # the cuts feed their weights as stored: the fed session's slowdown says what that costs, unless
                # it is the runtime's optimized graph (as fast as a constant one), when the planner's default does
                slowdown = None if isinstance(self.rig.overridable, DerivedFeeds) else t_feed / max(t_const, 1e-9)
                estimates["prefix"] = self._estimate_prefix(
                    step * t_const, constant_build, chunks[0][1], slowdown, (job.spec.steps - 1) * step * t_feed
                )
            except Exception:  # a graph the cut cannot handle (e.g. untyped activations): no prefix
                pass
        if self.rig.batch.refusal() is None:
            try:
                batch = self.estimate_batch(
                    constant_build,
                    estimates.get("unit", estimates["rebuild"]) / units,
                    to_beat(),
                    scale,
                    chunks[0][0],
                    t_const,
                )
            except Exception:  # a rewritten graph the runtime cannot run: no batch
                batch = None
            if batch is not None:
                estimates["batch"] = batch
        return estimates

    def _estimate_unit(
        self, unit: Unit, one: dict[str, np.ndarray], calls: float, t_const: float, constant_build: float, best: float
    ) -> float:
        """Sweep seconds of 'unit': `unit`'s session built and timed, or only the lower bound (a plain build per
        unit, the constant session's calls) where that is already no better than `best`."""
        job = self.job
        tasks_per_unit, units = max(1, job.tasks_per_unit), len(job.units)
        bound = units * (constant_build + tasks_per_unit * calls * t_const)
        if not bound < best:
            return bound  # a lower bound, already too slow
        weights = {n: job.weights[n] for n in unit.tensor_names}
        started = time.perf_counter()
        grouped = job.unit_factory(unit.tensor_names)
        unit_build = time.perf_counter() - started
        t_unit = _best_time(lambda: grouped.run({**one, **weights}, job.spec.run_outputs))
        grouped.close()
        return units * (unit_build + tasks_per_unit * calls * t_unit)

    def _estimate_rebuild(self, unit: Unit, calls: float, t_const: float, constant_build: float, best: float) -> float:
        """Sweep seconds of 'rebuild': one rebuild of `unit` timed, or only the lower bound (a plain build per
        task, the constant session's calls) where that is already no better than `best`."""
        job = self.job
        tasks = len(job.units) * max(1, job.tasks_per_unit)
        bound = tasks * (constant_build + calls * t_const)
        if not bound < best:
            return bound  # a lower bound, already too slow
        started = time.perf_counter()
        job.rebuild_factory({n: job.weights[n] for n in unit.tensor_names}).close()
        return tasks * (time.perf_counter() - started + calls * t_const)

    def constant_session(self) -> Session:
        """The session of the model with its weights constant, built once (auto's timing; the nominal session
        of every strategy but feed and prefix)."""
        if self.rig.constant is None:
            started = time.perf_counter()
            self.rig.constant = self.job.rebuild_factory({})
            self.rig.constant_build_s = time.perf_counter() - started
        return self.rig.constant

    def estimate_batch(
        self, constant_build: float, fallback: float, best: float, scale: float, chunk_windows: int, t_const: float
    ) -> float | None:
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
        probes = self.rig.batch.width
        per_call = min(job.contexts.count, max(1, job.max_batch_windows // probes))
        calls = job.spec.steps * math.ceil(job.contexts.count / per_call)
        per_window = t_const * max(0.0, scale - 1) / max(1, chunk_windows - 1)  # what a window more adds to a call
        per_unit = constant_build + calls * (t_const + per_window * (probes * per_call - 1))
        if (
            len(units) * min(fallback, per_unit) >= best
        ):  # however many it can batch, already too slow: no rewrite tried
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
            if self.rig.batch.mismatch(unit, session, self.constant_session()) is not None:
                return None
            check = time.perf_counter() - started
            feeds = tiled(self.rig.batch.reference[0], probes)  # the check's one window
            weights = {n: np.stack([job.weights[n]] * probes) for n in unit.tensor_names}
            t_one = _best_time(
                lambda: session.run({**feeds, **weights}, job.spec.run_outputs), 2
            )  # the first call of a shape allocates
        finally:
            session.close()
        t_call = t_one * max(1.0, scale * per_call / max(1, chunk_windows))
        return refused + len(batchable) * (build + check + calls * t_call)

    def _estimate_prefix(
        self,
        call_s: float,
        build_s: float,
        feeds: dict[str, np.ndarray],
        fed_slowdown: float | None = None,
        rest_s: float = 0.0,
    ) -> float:
        """Sweep seconds of 'prefix': the whole model's session with its activations as outputs (a build and
        a first step), then the planned cuts (`_plan_cuts`); with more steps, `rest_s` (steps 2..T on the
        overridable session) once for the nominal and once per task."""
        tasks_per_unit = max(1, self.job.tasks_per_unit)
        plan = self.rig.cuts.plan(call_s, build_s, feeds, fed_slowdown)
        serial = build_s + call_s + rest_s  # the whole model's session, its first step and the nominal's later steps
        pieces = [
            seconds + len(group) * tasks_per_unit * rest_s for group, seconds in zip(plan.groups, plan.group_seconds)
        ]
        self._prefix_pieces = (serial, pieces)
        return serial + sum(pieces)
