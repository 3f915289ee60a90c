"""GPU paths: ONNX Runtime CUDA / TensorRT providers and native TensorRT engines.

CI has no GPU: the tests that need one skip with the reason; what can be
checked without one (clear errors when the stack is missing) runs everywhere.
"""

import importlib.util

import numpy as np
import onnxruntime
import pytest
from conftest import REPO, cli

from tqsdeploy.scoring import score

HAS_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("polygraphy") is not None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a CUDA device")
needs_trt = pytest.mark.skipif(not (HAS_CUDA and HAS_TRT), reason="needs a CUDA device with tensorrt and polygraphy")


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here")
def test_missing_tensorrt_is_an_input_error(two_branch, tmp_path):
    model, contexts = two_branch
    result = cli("score", model, "-c", contexts, "--provider", "trt-engine", "-o", tmp_path / "run")
    assert result.exit_code == 2
    assert "tensorrt and polygraphy" in result.output + (result.stderr or "")
    result = cli("engine", model, "-o", tmp_path / "m.plan")
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
    from tqsdeploy.rollout import RolloutSpec, detect
    from tqsdeploy.rollout.contexts import load_npz
    from tqsdeploy.rollout.engine import RolloutEngine

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
        return OrtSession(
            ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), "cpu", device=device
        )

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
    assert not np.array_equal(
        RolloutEngine(plain, windows, spec).trajectories()["y"], want["y"]
    )  # the perturbation took effect

    defaults = WithDefaults(opened(fed_path, "cpu"), weights)
    assert defaults.device == "cpu" and all(isinstance(defaults._fill[n][n], ort.OrtValue) for n in names)
    for feeds in (None, perturbed):
        want = RolloutEngine(plain, windows, spec).trajectories(feeds)
        got = RolloutEngine(defaults, windows, spec).trajectories(feeds)
        assert all(np.array_equal(want[k], got[k]) for k in want)


EXAMPLES = REPO / "examples"
GAMMA_TOLERANCE = 0.02
"""Largest |γ_cuda − γ_cpu| (nats/step) allowed on a unit alive on both, with TF32 off."""


@pytest.mark.gpu
@needs_cuda
def test_cuda_keeps_fed_weights_on_the_device_and_runs_fp32_exactly(two_branch, tmp_path):
    import onnx

    import graph_ops
    from runtimes import OrtRuntime

    model, _ = two_branch
    proto = onnx.load(model)
    path = tmp_path / "overridable.onnx"
    onnx.save(graph_ops.make_weights_overridable(proto, ["Wmain"]), path)
    runtime = OrtRuntime(provider="cuda")
    session = runtime.open(path)
    assert session.providers[0] == "CUDAExecutionProvider" and session.device == "cuda"
    assert session._session.get_provider_options()["CUDAExecutionProvider"]["use_tf32"] == "0"
    weight = onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == "Wmain")) * 1.01
    kept = session.keep({"Wmain": weight})
    assert kept["Wmain"].device_name().lower() == "cuda"
    feeds = {
        i.name: np.random.default_rng(0)
        .standard_normal([d if isinstance(d, int) else 3 for d in i.shape])
        .astype(i.dtype)
        for i in session.inputs
        if i.name not in session.weights
    }
    cpu = OrtRuntime().open(path).run({**feeds, "Wmain": weight})
    gpu = session.run({**feeds, **kept})
    for name in cpu:
        np.testing.assert_allclose(gpu[name], cpu[name], rtol=1e-5, atol=1e-6)


def _alive_gammas(table):
    frame = table.frame
    return {u: g for u, g, d in zip(frame["unit"], frame["gamma_quant"], frame["dead"]) if not d}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "example",
    [
        "etth1_patchtst",
        "era5_emulator",
        "lorenz96",
        "timesfm_etth1",
        "pangu_lorenz96",
        "era5_downscale",
        "tied_mixer_etth1",
        "dwconv_mixer_etth1",
    ],
)
def test_cuda_scores_rank_units_as_cpu_does_on_every_example(example, tmp_path):
    from scipy.stats import spearmanr

    from runtimes import OrtRuntime
    from tqsdeploy import ScoreSettings

    folder = EXAMPLES / example
    settings = ScoreSettings(gauss_draws=1)
    run = dict(spec=folder / "rollout.toml", settings=settings, resume=False)
    cpu = score(folder / "model.onnx", folder / "contexts.npz", out=tmp_path / "cpu", **run)
    gpu = score(
        folder / "model.onnx", folder / "contexts.npz", out=tmp_path / "gpu", runtime=OrtRuntime(provider="cuda"), **run
    )
    assert dict(zip(cpu.frame["unit"], cpu.frame["dead"])) == dict(zip(gpu.frame["unit"], gpu.frame["dead"]))
    a, b = _alive_gammas(cpu), _alive_gammas(gpu)
    units = sorted(a)
    assert spearmanr([a[u] for u in units], [b[u] for u in units]).statistic >= 0.95
    assert max(abs(a[u] - b[u]) for u in units) <= GAMMA_TOLERANCE


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strategy", ["batch", "prefix", "unit", "rebuild"])
def test_cuda_strategies_give_feeds_gammas(strategy, two_branch, tmp_path):
    from runtimes import OrtRuntime

    model, contexts = two_branch
    cuda = OrtRuntime(provider="cuda")
    feed = score(model, contexts, steps=6, out=tmp_path / "feed", runtime=cuda, strategy="feed")
    other = score(model, contexts, steps=6, out=tmp_path / strategy, runtime=cuda, strategy=strategy)
    assert other.meta["strategy"] == strategy
    a, b = _alive_gammas(feed), _alive_gammas(other)
    assert a.keys() == b.keys() and all(abs(a[u] - b[u]) <= 1e-4 for u in a)
    assert (
        feed.frame.filter(feed.frame["unit"] == "Wdead")["dead"][0]
        and other.frame.filter(other.frame["unit"] == "Wdead")["dead"][0]
    )


def _loads(library: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(library)
        return True
    except OSError:
        return False


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(
    _loads("libnvinfer.so.10"), reason="TensorRT's libraries are present here, so the TensorRT provider loads"
)
def test_tensorrt_provider_that_fails_to_load_is_refused_not_run_on_cuda(two_branch, tmp_path):
    model, contexts = two_branch
    result = cli("score", model, "-c", contexts, "--provider", "tensorrt", "-o", tmp_path / "run")
    assert result.exit_code == 2, result.output
    message = result.output + (result.stderr or "")
    assert "'tensorrt' failed to load" in message and "Traceback" not in message


def _cupy_device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - not installed, no driver, no device
        return False


needs_cupy = pytest.mark.skipif(not _cupy_device(), reason="needs CuPy with a CUDA device (the gpu extra)")


def _solve_on(module: str, method: str, monkeypatch):
    """One solve with tiers.solver_backend's products on `module` (numpy or cupy), from the same statistics."""
    from tiers import solver_backend
    from tiers.gptq import gptaq, gptq, qep_correct
    from tiers.grid import GridSpec
    from tiers.hessian import Hessian

    monkeypatch.setenv("TQS_ARRAYS", "numpy" if module == "numpy" else "auto")
    monkeypatch.setattr(solver_backend, "_ARRAY_MODULE", None)
    monkeypatch.setattr(
        solver_backend, "DEVICE_FROM_ORDER", 0
    )  # every product, factor and loop on the device, whatever its size
    monkeypatch.setattr(solver_backend, "DEVICE_LOOP_FROM", 0)
    assert solver_backend.array_module().__name__ == module
    rng = np.random.default_rng(3)
    k, n = 256, 96
    x = rng.standard_normal((2048, k)) @ rng.standard_normal((k, k)) / np.sqrt(k)
    x_hat = x + 0.05 * rng.standard_normal(x.shape)
    stats = Hessian(k, cross=True)
    stats.add(x_hat, x)
    wt = rng.standard_normal((n, k))
    spec = GridSpec("int", 4, symmetric=False)
    if method == "gptq":
        return stats.H, gptq(wt, stats.H, spec).codes
    if method == "gptaq":
        return stats.H, gptaq(wt, stats.H, stats.G, spec).codes
    return stats.H, gptq(qep_correct(wt, stats.H, stats.G), stats.H, spec).codes


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("method", ["gptq", "gptaq", "qep"])
def test_device_statistics_and_factors_give_the_host_codes(method, monkeypatch):
    """The CuPy path (statistics' products, inverse Cholesky on the device) lands on the host's codes: the same
    float64 arithmetic in another order, so at most a handful of ties may round the other way."""
    h_host, codes_host = _solve_on("numpy", method, monkeypatch)
    h_device, codes_device = _solve_on("cupy", method, monkeypatch)
    np.testing.assert_allclose(h_device, h_host, rtol=1e-10, atol=1e-12)
    assert np.mean(codes_device == codes_host) >= 0.999
