"""'prefix': the first step of each perturbation runs only the part of the graph downstream of its unit."""

from __future__ import annotations

import time
from typing import Hashable, Iterable

import numpy as np
from onnx import helper

import graph_ops
from runtimes import Session, kept
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import next_feeds
from tqsdeploy.rollout.engine import Nominal
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.rig import Rig
from tqsdeploy.sweep.strategies.unit import PerUnit
from tqsdeploy.sweep.tasks import Task
from tqsdeploy.units import Unit


def onnx_type(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)


def _moved(nominal: np.ndarray, produced: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The whole model's nominal output moved by what a cut's run changed against the cut's own nominal run
    (the two nominal runs differ by float rounding: the cut's fed weights are not pre-packed)."""
    if np.issubdtype(nominal.dtype, np.floating):
        return nominal + (produced - reference)
    return produced  # integers and booleans: no rounding to carry


class Prefix(PerUnit):
    """Fed the nominal activations at the cut, a session of the part downstream of a unit (and of the units
    planned to share its cut, `CutPlanning`) runs the first step; later steps run the whole model on the
    overridable session. The nominal's first step comes from one run of the whole model that also gives
    every cut's activations."""

    name = "prefix"
    help = "the first step runs only the graph downstream of the unit"
    needs_constant = False
    nominal_on_a_lane = False

    def __init__(self, rig: Rig):
        super().__init__(rig)
        self.session = None  # its own: the whole model with its activations as outputs, opened for the nominal
        self._cut = None
        self._activations: list[dict[str, np.ndarray]] | None = None
        self._first: list[dict[str, np.ndarray]] = []
        """Every run output of the whole model's first step, per chunk."""

    @classmethod
    def possible(cls, job: SweepJob) -> bool:
        """A model to cut, and either one step or a model held in memory (steps 2..T then run on the overridable
        session beside the cuts; a streamed model keeps one session at a time)."""
        return job.cut_factory is not None and (job.spec.steps == 1 or job.rebuild_factory is not None)

    @classmethod
    def needs_overridable(cls, job: SweepJob) -> bool:
        return job.spec.steps > 1

    @classmethod
    def refuse(cls, job: SweepJob) -> None:
        if job.spec.steps != 1 and job.rebuild_factory is None:
            raise RolloutError(
                "strategy 'prefix' on a model streamed from its files needs a single-step rollout; "
                f"this one has {job.spec.steps} steps",
                hint="use --steps 1 or --strategy feed",
            )

    def adopt(self, nominal: Nominal) -> bool:
        return False  # the run that makes the nominal also gives the cuts' activations

    def make_nominal(self) -> Nominal:
        """One step of the whole model gives the nominal's first step and the activations at every unit's cut;
        the cuts are planned from its build and run times, and the whole model's session is closed (at T = 1,
        one model in memory at a time). With more steps, the overridable session (kept open: a model held in
        memory) makes the nominal's steps 2..T from there."""
        job, cuts, planning = self.job, self.job.cut_factory, self.rig.cuts
        names = job.spec.run_outputs
        outputs = list(self._cut_outputs)
        walk = planning.walk
        first = graph_ops.prefix.cut_order(walk, {u.name: u.tensor_names for u in job.units.values()})[0]
        self.rig.probes.prefetch(
            Task(first, "quant" if job.quant_probe else "gauss", 0)
        )  # the sweep's first task, most likely
        boundary = set()
        for unit in job.units.values():
            boundary.update(walk.boundary(unit.tensor_names, outputs))
        extra = sorted(boundary - {s.name for s in self.rig.inputs} - set(names))
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
            steps += [list(outs) for outs in self.engine.steps(None, job.spec.steps - 1, self.rig.overridable, starts)]
        nominal = self.engine.summarize(steps)
        self.cut_plan = planning.plan(call_s, build_s, chunks[0][1])
        needed = set()
        for group in self.cut_plan.groups:
            needed.update(walk.boundary(planning.weights_of(group), outputs))
        self._activations = [
            {**feeds, **{n: run[n] for n in needed if n in run}} for (_, feeds), run in zip(chunks, runs)
        ]
        session.close()
        return nominal

    @property
    def _cut_outputs(self) -> tuple[str, ...]:
        """What a cut must produce: the trajectory, and with more steps whatever the next step is fed."""
        return self.job.spec.trajectory if self.job.spec.steps == 1 else self.job.spec.run_outputs

    def start(self, task: Task) -> None:
        self._cut_for(self.job.units[task.unit])  # built while the task's perturbation is (see run_local)
        return None

    def work_key(self, unit: str) -> Hashable | None:
        return self.cut_plan.group_of(unit)

    def _cut_for(self, unit: Unit) -> tuple[Session | None, "graph_ops.prefix.Cut", list, list]:
        """The session of the cut `unit` shares (one kept at a time; None when no output depends on it),
        the cut, its own nominal run per chunk, and per chunk the activations it is fed (on the session's
        device: every probe of the cut's units reads the same ones)."""
        group = self.cut_plan.group_of(unit.name)
        if self._cut is None or self._cut[0] != group:
            self._cut = None  # drop the previous cut before building the next
            types = {n: onnx_type(v) for n, v in self._activations[0].items()}
            types.update({n: onnx_type(v) for n, v in self._first[0].items()})
            weights = self.rig.cuts.weights_of(self.cut_plan.groups[group])
            session, cut = self.job.cut_factory.downstream(weights, list(self._cut_outputs), types)
            fed = [kept(session, {b: acts[b] for b in cut.boundary}) for acts in self._activations] if session else []
            reference = [session.run(feeds, cut.outputs) for feeds in fed] if session else []
            self._cut = (group, session, cut, reference, fed)
        return self._cut[1:]

    def totals(self, unit: Unit, weights: dict[str, np.ndarray]) -> Iterable[float]:
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
        nominal = self.rig.nominal.get()
        total, starts = 0.0, []
        cut_weights = kept(session, weights)  # once for every chunk
        for c, feeds in enumerate(fed):
            produced = session.run({**feeds, **cut_weights}, cut.outputs)
            first = nominal.trajectory[0][c]
            total += self.engine.window_sq(c, {**first, **produced}, {**first, **reference[c]}).sum()
            if job.spec.steps > 1:
                moved = {n: _moved(self._first[c][n], produced[n], reference[c][n]) for n in cut.outputs}
                starts.append(next_feeds(self.engine.chunks[c][1], {**self._first[c], **moved}, job.spec))
        yield total
        if job.spec.steps > 1:
            for t, outs in enumerate(
                self.engine.steps(weights, job.spec.steps - 1, self.rig.overridable, starts), start=1
            ):
                yield self.engine.step_total(nominal, t, outs)

    def forget(self) -> None:
        super().forget()
        self._cut = None

    def close_own(self) -> None:
        super().close_own()
        self._cut = None
