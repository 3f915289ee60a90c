"""tqsdeploy: trajectory-based quantization sensitivity (TQS) and
mixed-precision post-training quantization for ONNX forecasting models.

Library entry points (the CLI is a thin layer over these):
    score(model, contexts, ...) -> ScoreRun (also named ScoreTable)
    ScoreRun.load(run_dir) -> ScoreRun
    inspect_model(model, ...) -> dict
"""

from tqsdeploy._version import __version__  # noqa: E402,F401
from tqsdeploy.errors import InputError, RolloutError, TqsError  # noqa: E402
from tqsdeploy.rollout import Feedback, RolloutSpec  # noqa: E402
from tqsdeploy.scoring.gamma import SENTINEL_GAMMA, ScoreSettings  # noqa: E402
from tqsdeploy.scoring.inspect import inspect_model  # noqa: E402
from tqsdeploy.scoring.prepare import ContextOptions  # noqa: E402
from tqsdeploy.scoring.runs import ScoreRun, ScoreTable  # noqa: E402
from tqsdeploy.scoring.score import score  # noqa: E402
from tqsdeploy.units import Unit, UnitSelection  # noqa: E402

__all__ = [
    "SENTINEL_GAMMA",
    "ContextOptions",
    "Feedback",
    "InputError",
    "RolloutError",
    "RolloutSpec",
    "ScoreRun",
    "ScoreSettings",
    "ScoreTable",
    "TqsError",
    "Unit",
    "UnitSelection",
    "inspect_model",
    "score",
]
