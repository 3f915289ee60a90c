"""Probe batching ('batch'): all of a unit's probes in one rollout give feed's scores, and models
whose batch rows are not independent are refused."""

import math

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graph_ops
from tqsdeploy import SENTINEL_GAMMA, ScoreSettings, score
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.scoring.prepare import prepare
from tqsdeploy.scoring.request import ScoreRequest
from tqsdeploy.sweep import SweepSettings
from tqsdeploy.units import UnitSelection

SETTINGS = ScoreSettings(gauss_draws=2)
ONE_LANE = SweepSettings(lanes=1)
STATE = RolloutSpec.from_dict({"steps": 3, "feedback": [{"output": "y", "input": "x"}]})


def _state(shape, seed=1):
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def _two_branch(tmp_path):
    """Dead, direct and contracting units; 8 steps, state fed back."""
    spec = RolloutSpec.from_dict({"steps": 8, "feedback": [{"output": "y", "input": "x"}]})
    return (
        models.two_branch(tmp_path / "two.onnx"),
        Contexts(_state((4, 2, 32), 3), source="test"),
        spec,
        UnitSelection(),
    )


def _shared(tmp_path):
    """A weight read by two MatMuls and a transB=1 Gemm; 4 steps."""
    return (*models.shared_weight_case(tmp_path), UnitSelection(min_params=100))


def _gemm(tmp_path):
    """Gemm with transB=1 and transB=0, alpha/beta, both biases scored."""
    return (
        models.gemm_pair(tmp_path / "gemm.onnx"),
        Contexts(_state((3, 2, 32)), source="test"),
        STATE,
        UnitSelection(min_params=32, include="^b[12]$"),
    )


def _gather(tmp_path):
    """An embedding table read by Gather (negative ids included) next to a fed-back state."""
    ids = np.array([[3, 97], [-3, 5], [0, 99]], np.int64)
    contexts = Contexts({**_state((3, 2, 32)), "ids": ids}, source="test")
    return models.gather_forecaster(tmp_path / "emb.onnx"), contexts, STATE, UnitSelection()


def _conv(tmp_path):
    """Conv weights and biases, group 1 and group 2."""
    return (
        models.conv_forecaster(tmp_path / "conv.onnx"),
        Contexts(_state((3, 2, 4, 6, 6)), source="test"),
        STATE,
        UnitSelection(min_params=4, include="^b[12]$"),
    )


def _assorted(tmp_path):
    """Gather, Gemm (transB=0), a Constant-node MatMul weight, and a Conv weight read through a Transpose (not
    batched)."""
    return (*models.assorted_case(tmp_path), UnitSelection(min_params=100))


@pytest.mark.parametrize("case", [_two_branch, _shared, _gemm, _gather, _conv, _assorted])
def test_batch_gives_feeds_scores(tmp_path, case):
    model, contexts, spec, selection = case(tmp_path)
    tables = {
        s: score(model, contexts, spec=spec, out=tmp_path / s, settings=SETTINGS, strategy=s, selection=selection)
        for s in ("feed", "batch")
    }
    assert tables["batch"].meta["strategy"] == "batch"
    feed, batch = (tables[s].frame.sort("unit") for s in ("feed", "batch"))
    assert batch["unit"].to_list() == feed["unit"].to_list() and feed.height >= 2
    assert batch["dead"].to_list() == feed["dead"].to_list()
    for column in ("gamma", "gamma_quant", "gamma_gauss", "probe_norm"):
        np.testing.assert_allclose(
            batch[column].to_numpy(), feed[column].to_numpy(), rtol=1e-4, atol=1e-5, err_msg=column
        )
    dead = batch.filter(batch["dead"])
    assert (dead["gamma"] == SENTINEL_GAMMA).all() and (dead["rel_divergence"] == 0.0).all()
    fallbacks = tables["batch"].meta.get("batch_fallbacks", {})
    if case is _assorted:  # the Conv weight goes through a Transpose: that unit ran probe by probe
        assert list(fallbacks) == ["conv_t"] and "Transpose" in fallbacks["conv_t"]
    else:
        assert not fallbacks
    if case is _two_branch:
        assert {"Wdead"} == set(dead["unit"])


@pytest.mark.parametrize("strategy", ["batch", "prefix"])
def test_early_stop_ends_each_probe_where_feed_does(tmp_path, strategy):
    q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((8, 8)))
    model = models.linear_map(tmp_path / "lin.onnx", 1.05 * q)
    contexts = Contexts(_state((3, 1, 8), 0), source="test")
    settings = ScoreSettings(gauss_draws=2, early_stop=True, early_stop_tol=0.02, early_stop_window=3)
    frames = [
        score(
            model,
            contexts,
            steps=64,
            out=tmp_path / s,
            selection=UnitSelection(min_params=1),
            settings=settings,
            strategy=s,
        ).frame
        for s in ("feed", strategy)
    ]
    assert 4 <= frames[1]["steps"][0] < 64 and frames[1]["steps"][0] == frames[0]["steps"][0]
    np.testing.assert_allclose(frames[1]["gamma"].to_numpy(), frames[0]["gamma"].to_numpy(), rtol=1e-4)


def test_rows_mixed_across_the_batch_refuse_batch_and_auto_skips_it(tmp_path):
    model = models.batch_mean(tmp_path / "mean.onnx")
    contexts = Contexts(_state((4, 2, 32)), source="test")
    with pytest.raises(
        RolloutError,
        match=r"strategy 'batch' cannot run this model: unit 'W': batched output 'y' at step 1 differs "
        r".* mixes rows across the batch",
    ):
        score(model, contexts, spec=STATE, out=tmp_path / "batch", strategy="batch")
    auto = score(model, contexts, spec=STATE, out=tmp_path / "auto", settings=SETTINGS)
    assert auto.meta["strategy"] != "batch"
    assert (
        _batch_estimate(model, contexts) is None
    )  # auto times no batch sweep for it, even when nothing else is cheaper


def _batch_estimate(model, contexts):
    """What auto estimates for 'batch' when no other strategy's estimate is in the way."""
    runner = prepare(ScoreRequest(model, contexts, STATE, settings=SETTINGS, sweep=ONE_LANE)).open_runner()
    try:
        return runner.choice.estimate_batch(0.0, 0.0, math.inf, 1.0, 1, 0.0)
    finally:
        if runner.rig.constant is not None and not runner.chosen.needs_constant:  # built for the check
            runner.rig.constant.close()
        runner.close()


def test_a_static_batch_is_refused(tmp_path):
    model = models.linear_map(tmp_path / "static.onnx", np.eye(8) * 0.5, batch=1)
    contexts = Contexts(_state((3, 1, 8)), source="test")
    with pytest.raises(RolloutError, match=r"input 'x' \[1, 8\] has no dynamic batch axis"):
        score(
            model, contexts, spec=STATE, out=tmp_path / "run", strategy="batch", selection=UnitSelection(min_params=1)
        )


def test_auto_estimates_batch_where_rows_are_independent(two_branch):
    assert _batch_estimate(*two_branch) > 0


def test_the_rewrite_runs_probe_p_with_weight_p(tmp_path):
    """Outside any sweep: each probe's rows of a batched run equal an unbatched run with that probe's weights."""
    proto = onnx.load(models.gemm_pair(tmp_path / "gemm.onnx"))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    rng = np.random.default_rng(0)
    stacked = {
        n: np.stack([weights[n] + rng.standard_normal(weights[n].shape).astype(np.float32) for _ in range(3)])
        for n in ("W1", "b2")
    }
    batched = graph_ops.batch.batch_probes(proto, ["W1", "b2"], 3)
    assert (
        batched.ir_version <= graph_ops.io.MAX_IR_VERSION
        and batched.opset_import[0].version == proto.opset_import[0].version
    )
    x = rng.standard_normal((5, 32)).astype(np.float32)
    session = ort.InferenceSession(batched.SerializeToString(), providers=["CPUExecutionProvider"])
    produced = session.run(["y"], {"x": np.concatenate([x] * 3), **stacked})[0].reshape(3, 5, 32)
    for p in range(3):
        one = graph_ops.replace_weights(proto, {n: v[p] for n, v in stacked.items()})
        expected = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            ["y"], {"x": x}
        )[0]
        np.testing.assert_allclose(produced[p], expected, rtol=1e-5, atol=1e-6)
    assert "Transpose" in graph_ops.batch.refusal(onnx.load(models.assorted_ops(tmp_path / "a.onnx")), ["conv_t"])


def test_an_interrupted_batch_sweep_resumes_mid_unit(two_branch, tmp_path):
    model, contexts = two_branch
    settings = ScoreSettings(gauss_draws=3)
    whole = score(model, contexts, steps=5, out=tmp_path / "whole", settings=settings, strategy="batch").frame

    with pytest.raises(models.Interrupt):
        score(
            model,
            contexts,
            steps=5,
            out=tmp_path / "cut",
            settings=settings,
            strategy="batch",
            on_result=models.interrupt_after(2, []),
        )
    resumed = score(model, contexts, steps=5, out=tmp_path / "cut", settings=settings)  # finishes the way it started
    assert resumed.meta["strategy"] == "batch"
    assert resumed.frame.drop("seconds").equals(whole.drop("seconds"))
