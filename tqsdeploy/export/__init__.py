"""Export: from a score run and a target to a written mixed-precision model (see `planner` for the parts).

with Planner(run_dir, settings=ExportSettings(rounding="qep")) as planner:
    outcome = planner.export(4, "model.C4.onnx")
"""

from tqsdeploy.encoding.run_cache import CacheOptions
from tqsdeploy.export.baselines import BaselineProgress, BaselineSettings, quantize_baseline, write_baseline
from tqsdeploy.export.planner import ExportProgress, Planner, find_run
from tqsdeploy.export.settings import ExportSettings
from tqsdeploy.export.writing import Outcome

__all__ = [
    "BaselineProgress",
    "BaselineSettings",
    "CacheOptions",
    "ExportProgress",
    "ExportSettings",
    "Outcome",
    "Planner",
    "find_run",
    "quantize_baseline",
    "write_baseline",
]
