"""Which units share a cut ('prefix'), planned once for auto's estimate and the sweep that follows it."""

from __future__ import annotations

from typing import Sequence

import numpy as np

import graph_ops
from tqsdeploy.sweep.job import SweepJob


class CutPlanning:
    """The graph's part of planning cuts (node costs, the walk, the planner), made once per runner."""

    def __init__(self, job: SweepJob):
        self.job = job
        self._node_costs: list[float] | None = None
        self._planner: graph_ops.prefix.CutPlanner | None = None
        self._walk: graph_ops.prefix.GraphWalk | None = None
        self._fed_penalty = graph_ops.prefix.FED_PENALTY

    def plan(
        self, call_s: float, build_s: float, feeds: dict[str, np.ndarray], fed_slowdown: float | None = None
    ) -> graph_ops.prefix.CutPlan:
        """Which units share a cut, for a whole-model rollout of `call_s` seconds and build of `build_s`;
        `fed_slowdown`, when measured, is the fed session's time over the constant one's."""
        job, graph = self.job, self.job.cut_factory.graph()
        if self._node_costs is None:
            self._node_costs = graph_ops.prefix.node_costs(graph, {n: v.shape for n, v in feeds.items()})
        if fed_slowdown is not None:  # the nodes reading unit weights account for all of the slowdown
            weights = {n for u in job.units.values() for n in u.tensor_names}
            share = graph_ops.prefix.reading_share(graph, weights, self._node_costs)
            self._fed_penalty = max(0.0, fed_slowdown - 1) / max(share, 1e-3)
        if self._planner is None:  # the graph's part of planning, once for auto's estimate and the sweep's plan
            units = {u.name: list(u.tensor_names) for u in job.units.values()}
            self._planner = graph_ops.prefix.CutPlanner(graph, units, self._node_costs, self.walk)
        return self._planner.plan(call_s, build_s, max(1, job.tasks_per_unit), self._fed_penalty)

    @property
    def walk(self) -> graph_ops.prefix.GraphWalk:
        """The cut graph's walk, one for the plan and the cuts' boundaries (it keeps each unit's downstream part)."""
        if self._walk is None:
            self._walk = graph_ops.prefix.GraphWalk(self.job.cut_factory.graph().graph)
        return self._walk

    def weights_of(self, group: Sequence[str]) -> list[str]:
        """The weights of a cut's units."""
        return [n for name in group for n in self.job.units[name].tensor_names]
