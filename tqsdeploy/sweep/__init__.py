"""The sweep: independent (unit, probe, draw) tasks run against one session.

Every task is self-describing and deterministic, so the same list can be run in one process (on one lane or
several side by side), split across processes or machines (a distributed executor only needs `SweepJob`,
which pickles), and resumed: results are appended to a JSON-lines table as each task finishes, and tasks
already in the table are never run again.

Modules, each importing only those above it: `tasks` (Task, TaskResult, ResultLog), `job` (SweepJob),
`settings` (SweepSettings: what the user asks), `probe_source`, `nominal`, `cuts` and `batching` (what auto
and a strategy share), `rig` (one runner's parts), `strategies/` (one `Strategy` per way of applying perturbed
weights), `choice` (auto), `runner` (SweepRunner) and `executors` (lanes, worker processes, Ray).
"""

from tqsdeploy.rollout.engine import Drift, EarlyStop, Nominal
from tqsdeploy.sweep.executors import (
    LANE_EXTRA_BYTES,
    LANES_MAX,
    Lanes,
    interleaved,
    run_lanes,
    run_local,
    run_parallel,
    run_ray,
    sweep_lanes,
    usable_cores,
)
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.probe_source import ProbeSource, stale_units
from tqsdeploy.sweep.runner import SweepRunner
from tqsdeploy.sweep.settings import SweepSettings
from tqsdeploy.sweep.tasks import ResultLog, Task, TaskResult, plan_tasks

__all__ = [
    "Drift",
    "EarlyStop",
    "LANES_MAX",
    "LANE_EXTRA_BYTES",
    "Lanes",
    "Nominal",
    "ProbeSource",
    "ResultLog",
    "SweepJob",
    "SweepRunner",
    "SweepSettings",
    "Task",
    "TaskResult",
    "interleaved",
    "plan_tasks",
    "run_lanes",
    "run_local",
    "run_parallel",
    "run_ray",
    "stale_units",
    "sweep_lanes",
    "usable_cores",
]
