"""'batch': all of a unit's probes in one rollout of a session whose batch is tiled once per probe."""

from __future__ import annotations

import time

import numpy as np

from graph_ops.io import GraphError
from runtimes import Session
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import rollout
from tqsdeploy.sweep.batching import tiled
from tqsdeploy.sweep.rig import Rig
from tqsdeploy.sweep.strategies.unit import PerUnit
from tqsdeploy.sweep.tasks import Task, TaskResult, plan_tasks
from tqsdeploy.units import Unit


class Batch(PerUnit):
    """One session per unit in which the unit's weights carry a leading probe axis and the inputs are tiled
    once per probe (`graph_ops.batch`). The calls carry one slot more than the unit has probes: slot 0 holds
    the nominal weights, and each probe is compared with slot 0's rows of the same call (same kernels, so
    inert units diverge by exactly zero; one batched rollout per unit, not a batched nominal beside it).
    A unit it cannot batch runs as with 'unit' (`fallbacks` says why)."""

    name = "batch"
    help = "all of a unit's probes in one rollout, the batch tiled per probe; dynamic-batch models"
    builds_ahead = False
    nominal_on_a_lane = False

    def __init__(self, rig: Rig):
        super().__init__(rig)
        self._batched: tuple[str, Session | None] | None = None
        self._results: tuple[str, dict[str, TaskResult]] = ("", {})

    def check(self) -> None:
        """Refuse a model it cannot run (static batch, or batched outputs that differ from unbatched ones on
        the first unit it can batch) with one line naming the cause."""
        reason = self.rig.batch.refusal()
        if reason is None:
            factory = self.job.rebuild_factory
            first = next((u for u in self.job.units.values() if factory.batch_refusal(u.tensor_names) is None), None)
            if first is not None and self._batched_session(first) is None:
                reason = self.fallbacks[first.name]
        if reason is not None:
            raise RolloutError(f"strategy 'batch' cannot run this model: {reason}", hint="use --strategy unit or auto")

    def start(self, task: Task) -> TaskResult | None:
        """A unit's first task runs all its probes; a unit run probe by probe gives None."""
        if self._results[0] != task.unit:
            self._results = (task.unit, self._batch_unit(self.job.units[task.unit]))
        return self._results[1].get(task.key)

    def _batched_session(self, unit: Unit) -> Session | None:
        """The unit's batched session (one kept at a time), or None when it runs probe by probe
        (the rewrite refuses its weights, or its batched outputs differ from unbatched ones; see `fallbacks`)."""
        if self._batched is not None and self._batched[0] == unit.name:
            return self._batched[1]
        self.drop_sessions()
        session, reason = None, None
        try:
            session = self.job.rebuild_factory.batched(unit.tensor_names, self.rig.batch.width)
            reason = self.rig.batch.mismatch(unit, session, self.session)
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

    def _batch_unit(self, unit: Unit) -> dict[str, TaskResult]:
        """All the unit's tasks from one batched rollout, by task key (empty when it runs probe by probe)."""
        job = self.job
        session = self._batched_session(unit)
        if session is None:
            return {}
        started = time.perf_counter()
        tasks = plan_tasks([unit], job.quant_probe, job.tasks_per_unit - int(job.quant_probe))
        width = self.rig.batch.width
        stacked = {n: np.empty((width, *job.weights[n].shape), job.weights[n].dtype) for n in unit.tensor_names}
        for name, value in stacked.items():
            value[0] = job.weights[name]  # slot 0: the nominal weights, the probes' reference
        deltas = []
        for p, task in enumerate(tasks, start=1):  # filled one probe at a time: no second copy of every probe's weights
            change = self.rig.probes.unit(unit.name).perturb(task.probe, task.draw, job.seed)
            for name, value in change.weights.items():
                stacked[name][p] = value
            deltas.append(change.delta_sq)
        outcomes = self._batched_divergence(session, stacked, deltas)
        seconds = (time.perf_counter() - started) / len(tasks)
        return {
            t.key: TaskResult(
                unit=t.unit,
                probe=t.probe,
                draw=t.draw,
                delta_sq=delta_sq,
                div_sq=div_sq,
                nonfinite=nonfinite,
                seconds=seconds,
            )
            for t, delta_sq, (div_sq, nonfinite) in zip(tasks, deltas, outcomes)
        }

    def _batched_divergence(
        self, session: Session, stacked: dict[str, np.ndarray], deltas: list[float]
    ) -> list[tuple[list[float], bool]]:
        """Per probe, what the engine's `divergence` gives: the rows of probe slot p + 1 of one batched rollout
        against those of slot 0, which holds the nominal weights (same call, so an inert unit diverges by exactly zero).

        Chunks hold at most max_batch_windows / (P + 1) windows, so a call holds no more rows than an
        unbatched one; early stopping applies per probe, and the rollout ends when every probe has stopped.
        """
        job, width = self.job, self.rig.batch.width
        chunks = list(job.contexts.chunks(self.rig.inputs, True, max(1, job.max_batch_windows // width)))
        runs = [rollout(session, tiled(feeds, width), job.spec, stacked) for _, feeds in chunks]
        series = [self.engine.series(delta_sq, job.eps, job.early_stop) for delta_sq in deltas]
        live = set(range(len(deltas)))
        try:
            for steps in zip(*runs):
                total = np.zeros(len(deltas))
                for outs in steps:
                    for name in job.spec.trajectory:
                        slots = np.asarray(outs[name], np.float64).reshape(width, -1)
                        total += np.square(slots[1:] - slots[0]).sum(axis=1)
                for p in sorted(live):
                    if series[p].add(total[p]):
                        live.discard(p)
                if not live:
                    break
        except RolloutError:
            raise
        except Exception as exc:
            raise RolloutError(
                f"{session.name} failed to run the batched rollout: {str(exc).splitlines()[0]}"
            ) from None
        return [(s.div_sq, s.nonfinite) for s in series]

    def forget(self) -> None:
        super().forget()
        self._batched = None
        self._results = ("", {})

    def drop_sessions(self) -> None:
        """Close the per-unit sessions (probe by probe and batched) before building the next unit's."""
        super().drop_sessions()
        if self._batched is not None and self._batched[1] is not None:
            self._batched[1].close()
        self._batched = None
