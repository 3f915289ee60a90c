"""What a runner's strategy and auto's timing work with: the job, the engine, the sessions, the shared nominal."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtimes import IOSpec, Session
from tqsdeploy.rollout.engine import FirstRun, RolloutEngine
from tqsdeploy.sweep.batching import BatchCheck
from tqsdeploy.sweep.cuts import CutPlanning
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.nominal import SharedNominal
from tqsdeploy.sweep.probe_source import ProbeSource


@dataclass
class Rig:
    """One runner's parts, shared by its lanes (`SweepRunner.lane`): a strategy reads them, builds its own
    per-unit sessions beside them, and closes only those."""

    job: SweepJob
    engine: RolloutEngine
    inputs: list[IOSpec]
    """The inputs the contexts feed (the session's inputs that are not weights)."""
    probes: ProbeSource
    overridable: Session | None
    """The session whose scored weights are fed (None once closed: one model copy in memory, not two)."""
    constant: Session | None = None
    """The session of the model with its weights constant (auto's timing; the nominal session of 'rebuild', 'unit',
    'batch')."""
    constant_build_s: float = 0.0
    first_step: FirstRun | None = None
    """auto's timed run of one real step on a single-chunk sweep: the nominal's first step if its session makes the
    nominal."""
    nominal: SharedNominal | None = None
    batch: BatchCheck = field(init=False)
    cuts: CutPlanning = field(init=False)

    def __post_init__(self):
        self.batch = BatchCheck(self.job, self.inputs)
        self.cuts = CutPlanning(self.job)
