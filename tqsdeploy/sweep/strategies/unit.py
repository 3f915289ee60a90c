"""'unit': one session per unit in which only that unit's weights are overridable."""

from __future__ import annotations

from typing import Hashable, Iterator

import numpy as np

from runtimes import Session
from tqsdeploy.sweep.rig import Rig
from tqsdeploy.sweep.strategies.base import Strategy


class PerUnit(Strategy):
    """All of a unit's probes run on one session built for the unit (one build per unit, fast kernels
    everywhere else); the nominal comes from the constant session. The unit's own kernels then run unpacked
    in the perturbed runs, a float32 rounding difference (~1e-7 relative at that node) far below any probe;
    an inert unit still diverges by exactly zero since nothing of it reaches the outputs. Weights that span
    several units (a whole candidate model) are baked into a constant session instead."""

    name = "unit"
    help = "a session per unit, only its weights fed"

    def __init__(self, rig: Rig):
        super().__init__(rig)
        self._unit_of = {n: u for u in self.job.units.values() for n in u.tensor_names}
        self._group: tuple[frozenset[str], Session] | None = None

    def steps(self, weights: dict[str, np.ndarray] | None = None) -> Iterator[list[dict[str, np.ndarray]]]:
        if weights:
            session = self._session_for(frozenset(weights))
            if session is not None:
                return self.engine.steps(weights, session=session)
        return super().steps(weights)

    def work_key(self, unit: str) -> Hashable | None:
        return unit

    def _session_for(self, names: frozenset[str]) -> Session | None:
        """The unit session whose overridable weights cover `names` (one kept at a time), or
        None when they span several units (then the perturbation is baked into a constant session)."""
        if self._group is not None and names <= self._group[0]:
            return self._group[1]
        owners = {self._unit_of[n].name for n in names if n in self._unit_of}
        if len(owners) != 1 or not names <= set(self.job.units[next(iter(owners))].tensor_names):
            return None
        self.drop_sessions()
        unit = self.job.units[next(iter(owners))]
        self._group = (frozenset(unit.tensor_names), self.job.unit_factory(unit.tensor_names))
        return self._group[1]

    def forget(self) -> None:
        self._group = None

    def drop_sessions(self) -> None:
        """Close the per-unit session before building the next unit's."""
        if self._group is not None:
            self._group[1].close()
        self._group = None

    def close_own(self) -> None:
        self.drop_sessions()
