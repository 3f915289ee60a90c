"""The sweep strategies, one per module behind `Strategy`; a new one is a module here plus its entry below."""

from tqsdeploy.sweep.strategies.base import Strategy
from tqsdeploy.sweep.strategies.batch import Batch
from tqsdeploy.sweep.strategies.feed import Feed
from tqsdeploy.sweep.strategies.prefix import Prefix
from tqsdeploy.sweep.strategies.rebuild import Rebuild
from tqsdeploy.sweep.strategies.unit import PerUnit

BY_NAME: dict[str, type[Strategy]] = {cls.name: cls for cls in (Feed, Rebuild, PerUnit, Prefix, Batch)}

__all__ = ["BY_NAME", "Batch", "Feed", "PerUnit", "Prefix", "Rebuild", "Strategy"]
