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


def test_device_binding_path_runs_rollouts_as_plain_runs_do(two_branch, tmp_path):
    """The GPU path (IOBinding: kept weights bound once per rollout, states from the host, outputs
    back to the host), run on CPU OrtValues: the same rollouts, bit for bit, as plain `run` calls,
    for fed perturbations and for a model whose weights are all graph inputs fed from defaults."""
    import onnx
    import onnxruntime as ort

    import graph_ops
    from runtimes import OrtSession, WithDefaults
    from tqsdeploy.contexts import load_npz
    from tqsdeploy.engine import RolloutEngine
    from tqsdeploy.rollout import RolloutSpec, detect

    model, contexts = two_branch
    proto = onnx.load(model)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    names = ["Wmain", "Wsmall", "Wdead"]
    overridable_path, fed_path = tmp_path / "overridable.onnx", tmp_path / "fed.onnx"
    onnx.save(graph_ops.make_weights_overridable(proto, names), overridable_path)
    onnx.save(graph_ops.weights_as_graph_inputs(onnx.load(model), names), fed_path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1

    def opened(path, device):
        return OrtSession(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), "cpu", device=device)

    plain, bound = opened(overridable_path, None), opened(overridable_path, "cpu")
    spec = detect(plain.inputs, plain.outputs, steps=5)
    assert isinstance(spec, RolloutSpec) and spec.steps == 5
    windows = load_npz(contexts, [s for s in plain.inputs if s.name not in plain.weights])
    perturbed = {"Wmain": weights["Wmain"] * 1.01, "Wsmall": -weights["Wsmall"]}
    assert all(isinstance(v, ort.OrtValue) for v in bound.keep(perturbed).values())
    assert all(isinstance(v, np.ndarray) for v in plain.keep(perturbed).values())
    for feeds in (None, perturbed):
        want = RolloutEngine(plain, windows, spec).trajectories(feeds)
        got = RolloutEngine(bound, windows, spec).trajectories(feeds)
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    assert not np.array_equal(RolloutEngine(plain, windows, spec).trajectories()["y"], want["y"])  # the perturbation took effect

    defaults = WithDefaults(opened(fed_path, "cpu"), weights)
    assert defaults.device == "cpu" and all(isinstance(defaults._fill[n][n], ort.OrtValue) for n in names)
    for feeds in (None, perturbed):
        want = RolloutEngine(plain, windows, spec).trajectories(feeds)
        got = RolloutEngine(defaults, windows, spec).trajectories(feeds)
        assert all(np.array_equal(want[k], got[k]) for k in want)
