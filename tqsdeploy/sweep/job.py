"""What a sweep runs: the job every runner, lane, worker process or Ray actor is opened from (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from runtimes import Session, SessionFactory
from tqsdeploy.rollout import CheckedSpec
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.rollout.engine import EarlyStop
from tqsdeploy.units import Unit


@dataclass
class SweepJob:
    """Everything a worker needs to run tasks; picklable by design. Made by `scoring.prepare` from checked
    parts (`spec` fits the model, `strategy` is known), which its runners take as they are.

    `session_factory` opens the session whose scored weights are overridable
    feeds; `rebuild_factory(weights)` opens a session with those weights baked
    in as constants (all nominal when empty); `unit_factory(names)` opens one
    in which only `names` are overridable.
    """

    session_factory: SessionFactory
    contexts: Contexts
    spec: CheckedSpec
    """Checked against the model where it was resolved (`rollout.resolve_spec`): runners do not check it again."""
    units: dict[str, Unit]
    weights: dict[str, np.ndarray]
    probe_bits: int
    seed: int
    eps: float
    max_batch_windows: int = 64
    early_stop: EarlyStop | None = None
    rebuild_factory: Callable[[dict[str, np.ndarray]], Session] | None = None
    strategy: str = "auto"
    """How perturbed weights reach the runtime: a name of `strategies.BY_NAME`, or 'auto' (`choice`)."""
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    """Gather tables' rows the contexts read: the probes perturb only these (`units.gather_rows`)."""
    unit_factory: Callable[[Sequence[str]], Session] | None = None
    tasks_per_unit: int = 5
    """Probe draws per unit (what 'auto' weighs a unit session's build against)."""
    quant_probe: bool = True
    """Whether a unit's tasks include the quant probe (the rest are Gaussian draws), for 'batch'."""
    cut_factory: object | None = None
    """Opens the sessions 'prefix' runs (`runtimes.factories.CutSessions`: of the model in memory, or read from its
    files)."""
    session_build_s: float = 0.0
    """Seconds the overridable session took to build (what 'auto' weighs cut builds against when it has no other)."""
    lanes: int = 1
    """Tasks the sweep will run at once (`run_local`): auto weighs each strategy's pieces of work on that many lanes."""
    fed_keeps_kernels: bool = False
    """The overridable session runs every scored weight on the kernels a constant session would (`score.fed_as_fast`,
    `graph_ops.derived.WeightMap.keeps_kernels`): no rebuilt session can beat it, and auto builds none to time."""
