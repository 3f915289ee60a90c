"""tqsdeploy: trajectory-based quantization sensitivity (TQS) and
mixed-precision post-training quantization for ONNX forecasting models.

Library entry points (the CLI is a thin layer over these):
    score(model, contexts, ...) -> ScoreRun
    ScoreRun.load(run_dir) -> ScoreRun
    inspect_model(model, ...) -> dict
"""

from tqsdeploy._version import __version__  # noqa: F401
from tqsdeploy.errors import InputError, RolloutError, TqsError
from tqsdeploy.rollout import Feedback, RolloutSpec
from tqsdeploy.scoring.gamma import SENTINEL_GAMMA, ScoreSettings
from tqsdeploy.scoring.inspect import inspect_model
from tqsdeploy.scoring.prepare import ContextOptions
from tqsdeploy.scoring.runs import ScoreRun
from tqsdeploy.scoring.score import score
from tqsdeploy.units import Unit, UnitSelection

__all__ = [
    "SENTINEL_GAMMA",
    "ContextOptions",
    "Feedback",
    "InputError",
    "RolloutError",
    "RolloutSpec",
    "ScoreRun",
    "ScoreSettings",
    "TqsError",
    "Unit",
    "UnitSelection",
    "inspect_model",
    "score",
]
