"""The runner: a live strategy, its sessions and the nominal rollout; runs tasks one by one."""

from __future__ import annotations

import copy
import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np

from runtimes import Session
from tqsdeploy.errors import InternalError, RolloutError
from tqsdeploy.rollout import CheckedSpec
from tqsdeploy.rollout.engine import Drift, Nominal, RolloutEngine
from tqsdeploy.sweep.choice import Choice
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.nominal import SharedNominal
from tqsdeploy.sweep.probe_source import PROBE_DEPTH_MAX, ProbeSource
from tqsdeploy.sweep.rig import Rig
from tqsdeploy.sweep.strategies import AUTO, BY_NAME, Strategy
from tqsdeploy.sweep.tasks import Task, TaskResult


class SweepRunner:
    """Holds a live session and the nominal trajectory; runs tasks one by one (`lane` gives more
    runners over the same sessions, to run tasks side by side: `run_lanes`).

    How perturbed weights reach the runtime is the strategy's (`strategies`, one `Strategy` each); 'auto'
    times them (`choice.Choice`) and picks the cheapest sweep. The nominal rollout is made by the session
    the perturbed ones are compared with, so an inert unit diverges by exactly zero; it is compared, and
    early stopping decided, by the engine (`RolloutEngine.step_total`, `Divergence`). The job's spec and
    strategy were checked where they were made (`resolve_spec`, `SweepSettings`); what is checked here is
    what depends on the session and the strategy this runner opens.
    """

    def __init__(self, job: SweepJob, session: Session | None = None, nominal: Nominal | None = None):
        if not isinstance(job.spec, CheckedSpec):  # what a job's spec is typed as, so nothing checks it here again
            raise InternalError(
                "a sweep's job takes a CheckedSpec (rollout.resolve_spec), not an unchecked RolloutSpec"
            )
        self.job = job
        asked = BY_NAME.get(job.strategy)
        if asked is not None:
            asked.refuse(job)
        constant_only = (
            session is None and asked is not None and asked.needs_constant and job.rebuild_factory is not None
        )
        opened = job.rebuild_factory({}) if constant_only else (session or job.session_factory())
        inputs = [s for s in opened.inputs if s.name not in opened.weights]
        if not constant_only:
            missing = {n for u in job.units.values() for n in u.tensor_names} - opened.weights
            if missing:
                raise RolloutError(f"the session cannot override weight '{sorted(missing)[0]}'")
        engine = RolloutEngine(opened, job.contexts, job.spec, job.max_batch_windows)
        self.rig = Rig(
            job,
            engine,
            inputs,
            ProbeSource(job),
            overridable=None if constant_only else opened,
            constant=opened if constant_only else None,
        )
        self.engine, self.probes = engine, self.rig.probes
        self.choice: Choice | None = None
        """auto's timing (None when the strategy was named)."""
        self._lead: SweepRunner | None = None
        """Set on a `lane`: the runner whose sessions it shares."""
        self.chosen: Strategy = BY_NAME[job.strategy](self.rig) if constant_only else self._open_strategy()
        self.rig.nominal = self._nominal = SharedNominal(
            nominal if nominal is not None and self.chosen.adopt(nominal) else self._make_nominal
        )
        if not self._nominal.ready and (job.lanes <= 1 or not self.chosen.nominal_on_a_lane):
            self._nominal.get()  # nothing to run beside it (or the strategy needs it first): made now
        if job.strategy == self.strategy:
            self.chosen.check()
        self.probes.depth = self._probe_depth()

    def _open_strategy(self) -> Strategy:
        """The strategy asked for (or auto's pick), with the sessions it needs: the overridable session is
        closed unless it needs it (one model copy in memory, not two), the constant one built if it needs it."""
        job, rig = self.job, self.rig
        name = job.strategy
        if name == AUTO:
            self.choice = Choice(rig)
            name = self.choice.choose()
        if not BY_NAME[name].possible(job):
            name = (
                "feed"  # a model past protobuf's limit in one file, or swept from its files: nothing to cut or rebuild
            )
        chosen = BY_NAME[name]
        if not chosen.needs_constant and rig.constant is not None:
            rig.constant.close()
            rig.constant = None
        if not chosen.needs_overridable(job):
            rig.overridable.close()
            rig.overridable = None
        if chosen.needs_constant and rig.constant is None:
            rig.constant = job.rebuild_factory({})
        return chosen(rig)

    @property
    def strategy(self) -> str:
        """The name of the strategy this runner runs (what run.json records, and workers are told)."""
        return self.chosen.name

    @property
    def timings(self) -> dict[str, float]:
        """Per strategy: the sweep seconds auto estimated (empty unless auto chose)."""
        return self.choice.timings if self.choice is not None else {}

    @property
    def fallbacks(self) -> dict[str, str]:
        """'batch': the units run probe by probe instead, and why."""
        return self.chosen.fallbacks

    @property
    def cut_plan(self):
        """'prefix': which units share a cut, and the order to run them in."""
        return self.chosen.cut_plan

    @property
    def unit_order(self) -> list[str] | None:
        """The order this runner's tasks should come in, unit by unit (None: any)."""
        return self.cut_plan.order if self.cut_plan is not None else None

    def _probe_depth(self) -> int:
        """How many perturbations to build ahead: one, unless the rollouts run on a GPU (the CPU's cores are
        then free), and then as many copies of the largest unit as fit in `PROBE_DEPTH_BYTES`."""
        session = self.chosen.session or self.rig.overridable
        if getattr(session, "device", None) is None or not self.chosen.builds_ahead:
            return 1
        return max(1, min(PROBE_DEPTH_MAX, (os.cpu_count() or 1) - 1, self.probes.fitting))

    def _make_nominal(self) -> Nominal:
        return self.chosen.make_nominal()

    @property
    def nominal(self) -> Nominal:
        """The nominal rollout; on lanes it may still be in the making (`run_lanes` makes it on a lane while
        the others start on tasks): this waits for it, or makes it when no lane has."""
        return self._nominal.get()

    @property
    def nominal_made(self) -> bool:
        return self._nominal.ready

    def expect(self, tasks: Sequence[Task]) -> None:
        """The tasks come in this order: their perturbations start building ahead (unless the strategy builds them)."""
        if self.chosen.builds_ahead:
            self.probes.plan(tasks)

    def run(self, task: Task, following: Task | None = None) -> TaskResult:
        """Run `task`; `following`, the task that comes next, has its perturbation built meanwhile."""
        started = time.perf_counter()
        done = self.chosen.start(task)
        if done is not None:
            return done
        change = self.probes.get(task, following)
        with self._failing_as_the_nominal():
            totals = self.chosen.totals(self.job.units[task.unit], change.weights)
            div_sq, nonfinite = self.engine.divergence(totals, change.delta_sq, self.job.eps, self.job.early_stop)
        return TaskResult(
            unit=task.unit,
            probe=task.probe,
            draw=task.draw,
            delta_sq=change.delta_sq,
            div_sq=div_sq,
            nonfinite=nonfinite,
            seconds=time.perf_counter() - started,
        )

    def divergence(
        self, weights: dict[str, np.ndarray], delta_sq: float = 0.0, early_stop: bool = True
    ) -> tuple[list[float], bool]:
        """Per-step mean squared trajectory divergence of the model with `weights`
        replaced, against the nominal rollout; and whether it went non-finite.

        Early stopping (when the job asks for it and `early_stop`) needs `delta_sq`.
        """
        with self._failing_as_the_nominal():
            totals = self._nominal.totals(self.engine, self.chosen.steps(weights))
            return self.engine.divergence(totals, delta_sq, self.job.eps, self.job.early_stop if early_stop else None)

    def unit_divergence(self, unit: str, weights: dict[str, np.ndarray]) -> tuple[list[float], bool]:
        """`divergence` (no early stop) of weights that differ from the original only in `unit`'s tensors, rolled
        out the strategy's own way: a 'prefix' cut runs only the graph downstream of the unit."""
        with self._failing_as_the_nominal():
            totals = self.chosen.totals(self.job.units[unit], weights)
            return self.engine.divergence(totals, 0.0, self.job.eps, None)

    @contextmanager
    def _failing_as_the_nominal(self) -> Iterator[None]:
        """A rollout that fails waits for the nominal rollout's verdict first: a model that fails on the contexts
        fails its nominal rollout too, made on another lane meanwhile, and that error names the contexts, whichever
        lane failed first, so a failing model gives the same words every run (docs/design-notes/scoring.md)."""
        try:
            yield
        except RolloutError:
            self.nominal  # noqa: B018 - raises the nominal's error if it failed
            raise

    def drift(self, weights: dict[str, np.ndarray], session: Session | None = None) -> Drift:
        """Divergence of the model with `weights` replaced over the full rollout, in every unit reports use;
        with `session`, of the model that session runs (a candidate built apart, `weights` fed to it)."""
        steps = self.chosen.steps(weights) if session is None else self.engine.steps(weights or None, session=session)
        return self.engine.drift(self.nominal, steps)

    def relative_drift(self, weights: dict[str, np.ndarray]) -> float:
        """RMS trajectory divergence over all steps relative to the RMS nominal trajectory."""
        return self.drift(weights).relative_rms

    def lane(self) -> "SweepRunner":
        """Another runner over this one's sessions, nominal, cut plan and probe builds, with per-unit sessions
        of its own ('unit', 'batch', 'prefix' cuts): lanes run tasks at once on their own threads (ONNX
        Runtime's run is thread-safe, and on the CPU provider a session of one thread runs a call on the
        caller's thread). Closing a lane closes only what it built."""
        other = copy.copy(self)
        other.chosen = self.chosen.lane()
        other._lead = self
        return other

    def work_items(self, tasks: Sequence, unit_of: Callable[[object], str] = lambda task: task.unit) -> list[list]:
        """The tasks in the pieces lanes take one at a time, in order: a task each when weights are fed or
        baked per task; a unit's tasks together when a session is built per unit; a cut's units together."""
        items: dict[object, list] = {}
        for i, task in enumerate(tasks):
            key = self.chosen.work_key(unit_of(task))
            items.setdefault((i,) if key is None else (key,), []).append(task)
        return list(items.values())

    def close(self) -> None:
        if self._lead is not None:  # a lane: the sessions are the lead runner's
            self.chosen.close_own()
            return
        self.probes.close()
        self.chosen.close()
