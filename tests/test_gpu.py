"""GPU paths: ONNX Runtime CUDA / TensorRT providers and native TensorRT engines.

CI has no GPU: the tests that need one skip with the reason; what can be
checked without one (clear errors when the stack is missing) runs everywhere.
"""

import importlib.util

import numpy as np
import onnxruntime
import pytest
from typer.testing import CliRunner

from tqsdeploy import score
from tqsdeploy.cli import app

HAS_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("polygraphy") is not None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a CUDA device")
needs_trt = pytest.mark.skipif(not (HAS_CUDA and HAS_TRT), reason="needs a CUDA device with tensorrt and polygraphy")


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here")
def test_missing_tensorrt_is_an_input_error(two_branch, tmp_path):
    model, contexts = two_branch
    result = CliRunner().invoke(app, ["score", str(model), "-c", str(contexts), "--provider", "trt-engine", "-o", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "tensorrt and polygraphy" in result.output + (result.stderr or "")
    result = CliRunner().invoke(app, ["engine", str(model), "-o", str(tmp_path / "m.plan")])
    assert result.exit_code == 2


@pytest.mark.gpu
@needs_cuda
def test_cuda_scores_match_cpu(two_branch, tmp_path):
    from runtimes import OrtRuntime

    model, contexts = two_branch
    cpu = score(model, contexts, steps=6, out=tmp_path / "cpu").frame
    gpu = score(model, contexts, steps=6, out=tmp_path / "gpu", runtime=OrtRuntime(provider="cuda")).frame
    assert cpu["unit"].to_list() == gpu["unit"].to_list()
    np.testing.assert_allclose(cpu["gamma_quant"].to_numpy()[:2], gpu["gamma_quant"].to_numpy()[:2], atol=0.05)


@pytest.mark.gpu
@needs_trt
def test_tensorrt_refit_matches_rebuild(two_branch, tmp_path):
    from runtimes.trt import TrtRuntime

    model, contexts = two_branch
    feed = score(model, contexts, steps=6, out=tmp_path / "feed", runtime=TrtRuntime(), strategy="feed").frame
    rebuild = score(model, contexts, steps=6, out=tmp_path / "rebuild", runtime=TrtRuntime(), strategy="rebuild").frame
    np.testing.assert_allclose(feed["gamma_quant"].to_numpy()[:2], rebuild["gamma_quant"].to_numpy()[:2], atol=0.05)
    assert feed.filter(feed["unit"] == "Wdead")["dead"][0]
