"""'rebuild': each perturbation baked into a fresh session of constant weights."""

from __future__ import annotations

from tqsdeploy.sweep.strategies.base import Strategy


class Rebuild(Strategy):
    """Fast (pre-packed) kernels everywhere, a session build per task. The nominal comes from a constant
    session too, so an inert unit diverges by exactly zero. The base class's rollouts are this strategy's."""

    name = "rebuild"
    help = "a session per perturbation, constant weights"
