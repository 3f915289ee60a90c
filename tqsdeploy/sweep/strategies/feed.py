"""'feed': one session with every scored weight overridable; each perturbation is fed to it."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.strategies.base import Strategy


class Feed(Strategy):
    """No session build per perturbation, but no fed weight is pre-packed (ONNX Runtime's CPU MatMul/Gemm/Conv
    kernels cannot pre-pack fed weights), so every call runs slower kernels. The nominal comes from the same
    session, nothing fed, so an inert unit diverges by exactly zero."""

    name = "feed"
    help = "one session, weights fed per run"
    needs_constant = False

    @classmethod
    def possible(cls, job: SweepJob) -> bool:
        return True

    @classmethod
    def needs_overridable(cls, job: SweepJob) -> bool:
        return True

    def steps(self, weights: dict[str, np.ndarray] | None = None) -> Iterator[list[dict[str, np.ndarray]]]:
        return self.engine.steps(weights or None)
