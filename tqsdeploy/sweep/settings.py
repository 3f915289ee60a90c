"""How a sweep runs, as the user asks for it: checked once here, so the jobs and runners made from it trust it."""

from __future__ import annotations

from dataclasses import dataclass

from tqsdeploy.errors import InputError
from tqsdeploy.sweep.strategies import strategy_names


@dataclass(frozen=True)
class SweepSettings:
    """Which strategy feeds the perturbed weights, and how many tasks run at once. None of it moves a score, so
    none of it is part of a run's identity (`runs.run_fingerprint`)."""

    strategy: str = "auto"
    """One of `sweep.strategies.BY_NAME`, or 'auto' (times them and picks the cheapest sweep)."""
    workers: int = 1
    """Processes (or Ray actors) running the sweep, one session each."""
    ray_address: str | None = None
    """Run on Ray: 'local' starts a local cluster, 'auto' or an address joins one (None: no Ray)."""
    lanes: int | None = None
    """Tasks run side by side in this process (None: as many as pay, `executors.sweep_lanes`)."""

    def __post_init__(self) -> None:
        check_strategy(self.strategy)

    def processes(self, cores: int) -> int:
        """The worker processes (or Ray actors) the sweep runs on: no more local ones than `cores`, where more
        would only add contention."""
        return self.workers if self.ray_address is not None else min(self.workers, cores)


def check_strategy(name: str) -> None:
    """Refuse a strategy this version does not have, before anything is loaded."""
    if name not in strategy_names():
        raise InputError(f"unknown strategy '{name}'; choose one of {', '.join(strategy_names())}")
