import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_branch(tmp_path):
    """(model path, contexts path) for the dead / direct / contracting test model."""
    model = models.two_branch(tmp_path / "two.onnx")
    contexts = tmp_path / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(3).standard_normal((4, 2, 32)).astype(np.float32))
    return model, contexts
