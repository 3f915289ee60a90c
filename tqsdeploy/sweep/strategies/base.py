"""The one interface every sweep strategy implements: how perturbed weights reach the runtime."""

from __future__ import annotations

import copy
from typing import ClassVar, Hashable, Iterable, Iterator

import numpy as np

from runtimes import Session
from tqsdeploy.rollout.engine import Nominal
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.rig import Rig
from tqsdeploy.sweep.tasks import Task, TaskResult
from tqsdeploy.units import Unit


class Strategy:
    """How a runner rolls out a model with some weights replaced, and what a task measures.

    The runner asks a strategy for four things: the nominal rollout (`make_nominal`), a rollout with weights
    replaced (`steps`), a task's per-step divergence totals (`totals`, by default `steps` compared with the
    nominal by the engine) and which tasks lanes take together (`work_key`). The rest are hooks with
    defaults: a task measured ahead (`start`), checks (`refuse`, `check`), and the sessions it needs.
    This base bakes the weights into a fresh constant session per rollout ('rebuild').
    """

    name: ClassVar[str]
    help: ClassVar[str]
    """What it does, in a few words: the `--strategy` help's line for it."""
    needs_constant: ClassVar[bool] = True
    """Its nominal runs on the session of constant weights (`Rig.constant`), not the overridable one."""
    builds_ahead: ClassVar[bool] = True
    """Perturbations are built ahead in the order tasks come ('batch' builds a unit's together, as it runs it)."""
    nominal_on_a_lane: ClassVar[bool] = True
    """On lanes, the nominal may be made on a lane beside the first tasks (else it is made as the runner opens)."""

    def __init__(self, rig: Rig):
        self.rig, self.job, self.engine = rig, rig.job, rig.engine
        self.session: Session | None = rig.constant if self.needs_constant else rig.overridable
        """The session the nominal is made on."""
        self.fallbacks: dict[str, str] = {}
        """Units run another way than this strategy's, and why ('batch': probe by probe)."""
        self.cut_plan = None
        """'prefix': which units share a cut, and the order to run them in."""
        if self.session is not None:
            self.engine.session = self.session

    @classmethod
    def possible(cls, job: SweepJob) -> bool:
        """Whether this job has what the strategy needs (else the runner runs 'feed')."""
        return job.rebuild_factory is not None and job.unit_factory is not None

    @classmethod
    def needs_overridable(cls, job: SweepJob) -> bool:
        """Whether the overridable session stays open beside this strategy's own."""
        return False

    @classmethod
    def refuse(cls, job: SweepJob) -> None:
        """Asked for by name: raise, before any session is built, when this job cannot run this way."""

    def check(self) -> None:
        """Asked for by name: raise, once the nominal is there, when this model cannot run this way."""

    def make_nominal(self) -> Nominal:
        return self.engine.nominal((self.rig.first_step,))

    def adopt(self, nominal: Nominal) -> bool:
        """Take the nominal an earlier runner of the same job and strategy made (same sessions, same values);
        False when this strategy must make its own."""
        self.engine.assume(nominal.batched)
        return True

    def start(self, task: Task) -> TaskResult | None:
        """What this strategy measured for `task` already, else None (then the runner builds its perturbation)."""
        return None

    def totals(self, unit: Unit, weights: dict[str, np.ndarray]) -> Iterable[float]:
        """Per step, a task's squared divergence from the nominal summed over windows (read lazily: early stopping)."""
        return self.rig.nominal.totals(self.engine, self.steps(weights))

    def steps(self, weights: dict[str, np.ndarray] | None = None) -> Iterator[list[dict[str, np.ndarray]]]:
        """Step-major rollout ([chunk] outputs per step) with `weights` replaced, the way this strategy applies them."""
        if not weights:
            return self.engine.steps(None)
        return self.engine.steps(None, session=self.job.rebuild_factory(weights))

    def work_key(self, unit: str) -> Hashable | None:
        """Tasks lanes take together share a key (a session built per unit: the unit); None: one task at a time."""
        return None

    def lane(self) -> "Strategy":
        """This strategy for another lane: the same shared sessions, none of its own yet."""
        other = copy.copy(self)
        other.forget()
        return other

    def forget(self) -> None:
        """Drop the per-lane state (without closing: it belongs to the lane it was copied from)."""

    def close_own(self) -> None:
        """Close what this strategy built for itself (per-unit sessions, cuts)."""

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.rig.overridable is not None:
            self.rig.overridable.close()
        self.close_own()
