"""The sweep strategies, one per module behind `Strategy`: how perturbed weights reach the runtime.

`BY_NAME` is the one list: the runner, `--strategy`'s choices and its help read it. A new strategy is a module
here and its entry below; 'auto' (`sweep.choice`) times the built-in ones and picks the cheapest sweep.
"""

from tqsdeploy.sweep.strategies.base import Strategy
from tqsdeploy.sweep.strategies.batch import Batch
from tqsdeploy.sweep.strategies.feed import Feed
from tqsdeploy.sweep.strategies.prefix import Prefix
from tqsdeploy.sweep.strategies.rebuild import Rebuild
from tqsdeploy.sweep.strategies.unit import PerUnit

BY_NAME: dict[str, type[Strategy]] = {cls.name: cls for cls in (Feed, Rebuild, PerUnit, Prefix, Batch)}
"""Strategies by name, in the order `--strategy` lists them."""

AUTO = "auto"
AUTO_HELP = "time them, pick the cheapest"
"""'auto' in the `--strategy` help."""


def strategy_names() -> tuple[str, ...]:
    """What `--strategy` takes: 'auto', then every strategy by name."""
    return (AUTO, *BY_NAME)


__all__ = [
    "AUTO",
    "AUTO_HELP",
    "BY_NAME",
    "Batch",
    "Feed",
    "PerUnit",
    "Prefix",
    "Rebuild",
    "Strategy",
    "strategy_names",
]
