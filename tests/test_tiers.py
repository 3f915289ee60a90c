"""Tiers: stored forms, honest costs, and the ONNX round trip of each."""

import numpy as np
import onnx
import pytest

import graph_ops
import models
from graph_ops.qdq import apply_storage
from runtimes import OrtRuntime
from tiers import TIERS, Layout, TierError, get_tiers

RNG = np.random.default_rng(0)
W = RNG.standard_normal((64, 48)).astype(np.float32)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("layout,group", [(Layout((64, 48), 1), None), (Layout((64, 48), 1), 16), (Layout((64, 48), 0), None), (Layout((64, 48), None), None)])
def test_cost_is_what_is_stored(tier, layout, group):
    stored = TIERS[tier].quantize(W, layout, group)
    assert stored.payload_bits == TIERS[tier].cost_bits(layout, group)
    assert stored.dequantized().shape == W.shape


@pytest.mark.parametrize("tier,limit", [("fp32", 0), ("bf16", 5e-3), ("fp16", 1e-3), ("fp8", 0.04), ("int8", 0.01), ("int4", 0.11), ("int2", 0.4), ("int1", 0.62)])
def test_error_shrinks_with_bits(tier, limit):
    stored = TIERS[tier].quantize(W, Layout(W.shape, 1))
    error = np.linalg.norm(stored.dequantized() - W) / np.linalg.norm(W)
    assert error <= limit


def test_int_codes_in_range():
    for name, low, high in (("int8", -127, 127), ("int4", -8, 7), ("int2", -2, 1)):
        codes = TIERS[name].quantize(W, Layout(W.shape, 1)).values.astype(np.int32)
        assert codes.min() >= low and codes.max() <= high
    assert set(np.unique(TIERS["int2"].quantize(W, Layout(W.shape, 1)).values.astype(np.int32))) == {-2, -1, 0, 1}


def test_blockwise_scales_follow_dequantizelinear_layout():
    stored = TIERS["int4"].quantize(W, Layout(W.shape, 1), 16)
    assert stored.axis == 0 and stored.block_size == 16 and stored.scale.shape == (4, 48)


def test_unknown_and_unsupported_tiers():
    with pytest.raises(TierError, match="unknown tier 'int3'"):
        get_tiers(["int3"])
    with pytest.raises(TierError, match="cannot run on target 'trt'"):
        get_tiers(["int2"], target="trt")
    with pytest.raises(TierError, match="blocks of 64 or 128"):
        get_tiers(["int4"], target="trt")
    assert [t.name for t in get_tiers(["int4", "fp32", "int8"], target="trt", group_size=64)] == ["fp32", "int8", "int4"]


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("group", [None, 16])
def test_every_tier_round_trips_through_onnx_runtime(tmp_path, tier, group):
    """The exported graph computes exactly what numpy says the tier stores."""
    model = graph_ops.load_model(models.mlp_forecaster(tmp_path / "mlp.onnx"))
    tensors = {t.name: t for t in graph_ops.find_weight_tensors(model.proto)}
    weights = graph_ops.read_weights(model.proto, ["W1", "Wshared", "W3"])
    stored = {n: TIERS[tier].quantize(weights[n], Layout(tensors[n].shape, tensors[n].channel_axis), group) for n in weights}
    exported = apply_storage(model.proto, stored)
    onnx.checker.check_model(exported)
    assert exported.ir_version <= 13 and all(o.version <= 26 for o in exported.opset_import)
    fake = graph_ops.replace_weights(model.proto, {n: s.dequantized() for n, s in stored.items()})
    x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    got = OrtRuntime(exact_qdq=True).open(graph_ops.model_bytes(exported)).run({"x": x})["y"]
    want = OrtRuntime().open(graph_ops.model_bytes(graph_ops.io.runtime_compatible(fake))).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the shared weight is stored once: one producer (or one initializer), read by both MatMuls
    producers = [n for n in exported.graph.node if "Wshared" in n.output]
    initializers = [t for t in exported.graph.initializer if t.name == "Wshared"]
    assert len(producers) + len(initializers) == 1
    assert sum("Wshared" in n.input for n in exported.graph.node) == 2
