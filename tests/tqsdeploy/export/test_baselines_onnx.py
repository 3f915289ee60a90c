"""Baselines on real ONNX models and real ONNX Runtime sessions."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import cli
from onnx import TensorProto, helper, numpy_helper

from graph_ops import read_weights, replace_weights, weight_layouts
from graph_ops.calibration import ConvGeometry, im2col, layer_inputs, waves
from runtimes.ort import OrtRuntime
from tiers import Layout, Rounding
from tiers.hessian import Hessian
from tqsdeploy.errors import InputError
from tqsdeploy.export.baselines import BaselineSettings, quantize_baseline

FLOAT = TensorProto.FLOAT


def _save(nodes, inputs, outputs, init, path: Path, opset=17) -> Path:
    graph = helper.make_graph(nodes, "t", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in init.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    return path


def _run(path: Path, feeds: dict) -> np.ndarray:
    session = OrtRuntime(optimization="disable").open(Path(path).read_bytes())
    return session.run(feeds)[session.outputs[0].name]


def _mlp(path: Path, seed=0) -> Path:
    """x [b,16] -MatMul W1[16,32]+b1, Relu- Gemm(W2[32,32], transB) +b2, Tanh- MatMul(Transpose(W3 [8,32]))."""
    rng = np.random.default_rng(seed)
    init = {
        "W1": (rng.standard_normal((16, 32)) / 4).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(32)).astype(np.float32),
        "W2": (rng.standard_normal((32, 32)) / 6).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(32)).astype(np.float32),
        "W3": (rng.standard_normal((8, 32)) / 6).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["a1"]),
        helper.make_node("Gemm", ["a1", "W2", "b2"], ["h3"], transB=1),
        helper.make_node("Tanh", ["h3"], ["a2"]),
        helper.make_node("Transpose", ["W3"], ["W3t"], perm=[1, 0]),
        helper.make_node("MatMul", ["a2", "W3t"], ["y"]),
    ]
    io = [helper.make_tensor_value_info("x", FLOAT, ["b", 16])], [helper.make_tensor_value_info("y", FLOAT, ["b", 8])]
    return _save(nodes, *io, init, path)


@pytest.fixture
def mlp(tmp_path):
    model = _mlp(tmp_path / "mlp.onnx")
    rng = np.random.default_rng(1)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=rng.standard_normal((48, 4, 16)).astype(np.float32))  # 48 windows x 4 rows
    test_x = rng.standard_normal((64, 16)).astype(np.float32)
    return model, calib, test_x


def _outputs(model, result, x):
    proto = onnx.load(str(model))
    return _run(model, {"x": x}), _run_proto(replace_weights(proto, result.weights), {"x": x})


def _run_proto(proto, feeds):
    session = OrtRuntime(optimization="disable").open(proto.SerializeToString())
    return session.run(feeds)[session.outputs[0].name]


def test_mlp_bindings_follow_transpose_and_gemm_layouts(mlp):
    model, _, _ = mlp
    layouts = weight_layouts(onnx.load(str(model)), ["W1", "W2", "W3"])
    tiers_layouts = {n: Layout(layout.shape, layout.perm, layout.row_groups) for n, layout in layouts.items()}
    assert [tiers_layouts[n].wt_shape for n in ("W1", "W2", "W3")] == [(32, 16), (32, 32), (8, 32)]
    assert layouts["W1"].perm == (1, 0) and layouts["W2"].perm == (0, 1) and layouts["W3"].perm == (0, 1)
    assert all(b.calibratable for b in layouts.values())
    w = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    np.testing.assert_array_equal(tiers_layouts["W1"].to_wt(w), w.T)
    np.testing.assert_array_equal(tiers_layouts["W1"].from_wt(w.T), w)


@pytest.mark.parametrize("method", ["gptq", "gptaq", "qep", "rtn"])
def test_eight_bit_round_trip_stays_close_and_encodings_match(mlp, method):
    model, calib, x = mlp
    result = quantize_baseline(model, BaselineSettings(method, 8, min_params=64), calib)
    assert sorted(result.weights) == ["W1", "W2", "W3"]
    reference, quantized = _outputs(model, result, x)
    assert np.max(np.abs(quantized - reference)) < 0.02 * np.max(np.abs(reference))
    original = read_weights(onnx.load(str(model)), ["W1", "W2", "W3"])
    for name, weight in result.weights.items():
        assert weight.shape == original[name].shape and weight.dtype == np.float32
        np.testing.assert_array_equal(result.encoded[name].dequantize(), weight)
        assert result.encoded[name].axis == {"W1": 1, "W2": 0, "W3": 0}[name]
    if method != "rtn":
        assert result.timings["calibration"] > 0
        assert set(result.errors) == {"W1", "W2", "W3"}


def test_groupwise_encoding_blocks_along_k_in_stored_layout(mlp):
    model, calib, _ = mlp
    result = quantize_baseline(
        model,
        BaselineSettings("gptq", 4, min_params=64, group_size=8, rounding=Rounding("gptq", act_order=True)),
        calib,
    )
    w1, w2 = result.encoded["W1"], result.encoded["W2"]  # W1 stored [K,N]; W2 stored [N,K] (transB)
    assert (w1.axis, w1.block_size, w1.scale.shape) == (0, 8, (2, 32))
    assert (w2.axis, w2.block_size, w2.scale.shape) == (1, 8, (32, 4))
    for name, weight in result.weights.items():
        np.testing.assert_array_equal(result.encoded[name].dequantize(), weight)


def test_gptq_reconstruction_error_not_above_rtn_per_layer(mlp):
    model, calib, _ = mlp
    result = quantize_baseline(model, BaselineSettings("gptq", 3, min_params=64), calib)
    assert set(result.errors) == {"W1", "W2", "W3"}
    for name, error in result.errors.items():
        assert error <= result.rtn_errors[name], name


def test_alpha_zero_reduces_gptaq_and_qep_to_gptq(mlp):
    model, calib, _ = mlp
    base = quantize_baseline(model, BaselineSettings("gptq", 3, min_params=64), calib)
    for method in ("gptaq", "qep"):
        other = quantize_baseline(
            model, BaselineSettings(method, 3, min_params=64, rounding=Rounding(method, alpha=0.0)), calib
        )
        for name in base.weights:
            np.testing.assert_array_equal(other.encoded[name].values, base.encoded[name].values)


def test_asymmetric_methods_see_the_quantized_prefix(mlp):
    """At 2 bits the prefix error is large: the FP and quantized inputs of later layers differ."""
    model, calib, x = mlp
    gptq = quantize_baseline(model, BaselineSettings("gptq", 2, min_params=64), calib)
    qep = quantize_baseline(model, BaselineSettings("qep", 2, min_params=64), calib)
    assert not np.array_equal(qep.weights["W3"], gptq.weights["W3"])
    np.testing.assert_array_equal(qep.weights["W1"], gptq.weights["W1"])  # first wave: no error to propagate yet


def test_non_finite_weight_is_reported_by_name(tmp_path):
    w = np.ones((16, 8), np.float32)
    w[0, 0] = np.inf
    model = _save(
        [helper.make_node("MatMul", ["x", "Wbad"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("y", FLOAT, ["b", 8])],
        {"Wbad": w},
        tmp_path / "bad.onnx",
    )
    with pytest.raises(InputError, match="'Wbad'.*NaN or Inf"):
        quantize_baseline(model, BaselineSettings("rtn", 4, min_params=1))


def _qkv(path: Path) -> Path:
    rng = np.random.default_rng(0)
    d = 8
    names = ["Wq", "Wk", "Wv", "Wo", "Wup", "Wgate", "Wdown"]
    init = {n: (rng.standard_normal((d, d)) / 3).astype(np.float32) for n in names}
    init["Wshared"] = (rng.standard_normal((d, d)) / 3).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", ["x", "Wk"], ["k"]),
        helper.make_node("MatMul", ["x", "Wv"], ["v"]),
        helper.make_node("Mul", ["q", "k"], ["qk"]),
        helper.make_node("Add", ["qk", "v"], ["att"]),
        helper.make_node("MatMul", ["att", "Wo"], ["o"]),
        helper.make_node("Add", ["o", "x"], ["r"]),
        helper.make_node("MatMul", ["r", "Wup"], ["up"]),
        helper.make_node("MatMul", ["r", "Wgate"], ["gate"]),
        helper.make_node("Relu", ["gate"], ["g"]),
        helper.make_node("Mul", ["g", "up"], ["m"]),
        helper.make_node("MatMul", ["m", "Wdown"], ["dn"]),
        helper.make_node("MatMul", ["x", "Wshared"], ["s1"]),  # shared: used at level 0 and level 4
        helper.make_node("Add", ["dn", "s1"], ["z"]),
        helper.make_node("MatMul", ["z", "Wshared"], ["y"]),
    ]
    io = [helper.make_tensor_value_info("x", FLOAT, ["b", d])], [helper.make_tensor_value_info("y", FLOAT, ["b", d])]
    return _save(nodes, *io, init, path)


def test_waves_group_siblings_like_true_sequential(tmp_path):
    model = _qkv(tmp_path / "qkv.onnx")
    proto = onnx.load(str(model))
    layouts = weight_layouts(proto)
    assert len(layouts["Wshared"].uses) == 2
    stages = [sorted(s) for s in waves(proto, layouts)]
    assert stages == [["Wk", "Wq", "Wv"], ["Wo"], ["Wgate", "Wup"], ["Wdown"], ["Wshared"]]
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.random.default_rng(2).standard_normal((32, 1, 8)).astype(np.float32))
    result = quantize_baseline(model, BaselineSettings("gptq", 8, min_params=1), calib)
    assert set(result.errors) == {n for stage in stages for n in stage}
    reference, quantized = _outputs(model, result, np.random.default_rng(3).standard_normal((16, 8)).astype(np.float32))
    assert np.max(np.abs(quantized - reference)) < 0.05 * np.max(np.abs(reference))


def test_gather_weights_are_rtn_only_and_an_lstm_reading_them_is_calibrated(tmp_path):
    rng = np.random.default_rng(0)
    hidden, width = 4, 6
    init = {
        "E": rng.standard_normal((10, width)).astype(np.float32),
        "W": rng.standard_normal((1, 4 * hidden, width)).astype(np.float32),
        "R": rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["e"]),
        helper.make_node("LSTM", ["e", "W", "R"], ["", "h"], hidden_size=hidden),
    ]
    io = (
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 1])],
        [helper.make_tensor_value_info("h", FLOAT, [1, 1, hidden])],
    )
    model = _save(nodes, *io, init, tmp_path / "lstm.onnx")
    layouts = weight_layouts(onnx.load(str(model)))
    assert [name for name, b in layouts.items() if b.calibratable] == ["W", "R"]
    assert layouts["W"].perm == (1, 0, 2) and layouts["E"].perm == (0, 1)
    windows = tmp_path / "ids.npz"
    np.savez(windows, ids=rng.integers(0, 10, (4, 3, 1)))
    result = quantize_baseline(model, BaselineSettings("gptq", 8, min_params=1), windows)
    assert set(result.rtn_only) == {"E"} and set(result.errors) == {"W", "R"}
    assert result.encoded["W"].axis == 1 and result.encoded["E"].axis == 0


GEOMETRIES = [
    dict(strides=[2, 1], pads=[1, 0, 1, 2], dilations=[1, 2], group=2),
    dict(strides=[2, 2], auto_pad="SAME_UPPER", group=1),
    dict(strides=[2, 4], auto_pad="SAME_LOWER", group=6),  # ORT has no dilation with SAME pads
]


def _conv(path: Path, attrs: dict, channels=6, out=12, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, channels // attrs["group"], 3, 3)) / 4).astype(np.float32)
    return _save(
        [helper.make_node("Conv", ["x", "Wc"], ["y"], kernel_shape=[3, 3], **attrs)],
        [helper.make_tensor_value_info("x", FLOAT, ["b", channels, 9, 10])],
        [helper.make_tensor_value_info("y", FLOAT, ["b", out, "h", "w"])],
        {"Wc": w},
        path,
    )


def _naive_unfold(x, geometry: ConvGeometry):
    """Windows gathered one output position at a time: the independent reference for im2col."""
    pads = geometry.resolved_pads(x.shape[2:])
    padded = np.pad(x, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    (kh, kw), (sh, sw), (dh, dw) = geometry.kernel, geometry.strides, geometry.dilations
    rows = []
    for b in range(x.shape[0]):
        for i in range(0, padded.shape[2] - dh * (kh - 1), sh):
            for j in range(0, padded.shape[3] - dw * (kw - 1), sw):
                rows.append(padded[b, :, i : i + dh * kh : dh, j : j + dw * kw : dw].reshape(-1))
    return np.array(rows)


@pytest.mark.parametrize("attrs", GEOMETRIES)
def test_conv_im2col_matches_onnx_runtime(tmp_path, attrs):
    model = _conv(tmp_path / "conv.onnx", attrs)
    proto = onnx.load(str(model))
    binding = weight_layouts(proto)["Wc"]
    layout = Layout(binding.shape, binding.perm, binding.row_groups)
    (use,) = binding.uses
    x = np.random.default_rng(1).standard_normal((2, 6, 9, 10)).astype(np.float32)
    y = _run(model, {"x": x})
    np.testing.assert_array_equal(im2col(x, use.conv), _naive_unfold(x, use.conv))
    wt = layout.to_wt(read_weights(proto, ["Wc"])["Wc"])
    groups, rows = binding.row_groups, wt.shape[0] // binding.row_groups
    xs = layer_inputs(use, x, groups)
    direct = np.concatenate([xs[g] @ wt[g * rows : (g + 1) * rows].T for g in range(groups)], axis=1)
    expected = y.transpose(0, 2, 3, 1).reshape(-1, y.shape[1])
    np.testing.assert_allclose(direct, expected, rtol=1e-4, atol=1e-5)
    stats = Hessian(xs[0].shape[1])
    stats.add(xs[0])
    np.testing.assert_allclose(stats.H, 2 / len(xs[0]) * xs[0].T.astype(np.float64) @ xs[0], rtol=1e-10)


def test_conv_model_quantizes_per_output_channel(tmp_path):
    model = _conv(tmp_path / "conv.onnx", GEOMETRIES[0])
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.random.default_rng(4).standard_normal((8, 1, 6, 9, 10)).astype(np.float32))
    with pytest.raises(InputError, match="--group-size 4 would change nothing"):  # blocks need a 2-D weight: none here
        quantize_baseline(model, BaselineSettings("gptaq", 8, min_params=1, group_size=4), calib)
    result = quantize_baseline(model, BaselineSettings("gptaq", 8, min_params=1), calib)
    encoded = result.encoded["Wc"]
    assert encoded.axis == 0 and encoded.block_size is None and encoded.scale.shape == (12,)
    np.testing.assert_array_equal(encoded.dequantize(), result.weights["Wc"])
    x = np.random.default_rng(5).standard_normal((2, 6, 9, 10)).astype(np.float32)
    reference, quantized = _outputs(model, result, x)
    assert np.max(np.abs(quantized - reference)) < 0.02 * np.max(np.abs(reference))
    assert result.errors["Wc"] <= result.rtn_errors["Wc"]


def _calibration_graph(model_path: Path, names: list[str], exposed: list[str]) -> onnx.ModelProto:
    """The mlp as a calibration builds it: scored weights as graph inputs, layer inputs as outputs."""
    from graph_ops.calibration import expose_tensors
    from graph_ops.io import weights_as_inputs

    return expose_tensors(weights_as_inputs(onnx.load(str(model_path)), lambda t: t.name not in names), exposed)


def test_fed_codes_model_rebuilds_quantized_weights_and_cuts_later_layers(mlp):
    """A wave's session reads the weights quantized so far as their codes (a byte per weight, not a float
    copy), computes exactly what the dequantized floats give, and runs nothing past the wave."""
    from graph_ops.fed_codes import fed_codes_model, fed_weight
    from tiers import TIERS, encode, split

    model, _, x = mlp
    proto = onnx.load(str(model))
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    layouts = weight_layouts(proto, ["W1", "W2", "W3"])
    graph = _calibration_graph(model, ["W1", "W2", "W3"], ["a1", "a2"])
    w1 = encode(
        weights["W1"], Layout(layouts["W1"].shape, layouts["W1"].perm), TIERS["int4-asym"]
    ).compact()  # codes packed, as cached
    w2_layout = Layout(layouts["W2"].shape, layouts["W2"].perm)
    halves = [
        encode(weights["W2"][:16], Layout((16, 32), (0, 1)), TIERS["int2"]),
        encode(weights["W2"][16:], Layout((16, 32), (0, 1)), TIERS["fp16"]),
    ]
    w2 = split(halves, w2_layout)  # Gemm transB: output channels on axis 0
    stored = {"W1": w1, "W2": w2}
    cut, feeds = fed_codes_model(graph, stored, ["a2"])
    inputs = {v.name for v in cut.graph.input}
    assert {"W1", "W2"}.isdisjoint(inputs)  # rebuilt from codes
    assert not any(
        n.op_type == "Transpose" or "y" in n.output for n in cut.graph.node
    )  # W3's layer comes after the wave
    assert [o.name for o in cut.graph.output] == ["a2"]
    codes = [a for a in feeds.values() if a.dtype.itemsize == 1]
    assert (
        sum(a.nbytes for a in codes) == weights["W1"].size // 2 + 16 * 32
    )  # W1's cached INT4 codes fed packed, two a byte; W2's INT2 half a byte each
    session = OrtRuntime().open(cut.SerializeToString())
    got = session.run({**feeds, "x": x, "W3": weights["W3"]}, ["a2"])["a2"]
    full = OrtRuntime().open(graph.SerializeToString())
    want = full.run({"x": x, "W1": w1.dequantize(), "W2": w2.dequantize(), "W3": weights["W3"]}, ["a2"])["a2"]
    np.testing.assert_array_equal(got, want)
    for form in (
        encode(weights["W1"], Layout((16, 32), (1, 0)), TIERS["fp8"]),
        encode(weights["W1"], Layout((16, 32), (1, 0)), TIERS["bf16"]),
        encode(weights["W1"], Layout((16, 32), (1, 0)), TIERS["int4-asym"], group_size=8),
        encode(weights["W1"], Layout((16, 32), (1, 0)), TIERS["fp32"]),
    ):
        assert fed_weight("W1", form) is None  # fed as floats instead


def test_calibration_statistics_see_the_quantized_prefix_exactly(mlp):
    """The Hessian of a later layer is (2/n)·X̂ᵀX̂ of the activations the quantized earlier layers
    give (computed here in numpy), whatever form the calibration session rebuilds them from."""
    from graph_ops.io import load_model
    from tiers import TIERS, encode
    from tqsdeploy.encoding.calibrator import CalibrationRollout, Calibrator
    from tqsdeploy.rollout import RolloutSpec
    from tqsdeploy.rollout.contexts import Contexts

    model_path, calib, _ = mlp
    model = load_model(model_path)
    names = ["W1", "W2", "W3"]
    layouts = weight_layouts(model.proto, names)
    weights = read_weights(model.proto, names)
    windows = np.load(calib)["x"]
    contexts = Contexts({"x": windows}, "test")
    calibrator = Calibrator(
        model.proto,
        layouts,
        CalibrationRollout(contexts, RolloutSpec.from_dict({"steps": 1, "trajectory": ["y"]})),
        weights=weights,
    )
    seen = {}

    def encode_one(name, stats):
        seen[name] = stats
        layout = Layout(layouts[name].shape, layouts[name].perm)
        return encode(weights[name], layout, TIERS["int4-asym"])

    encoded = calibrator.run(encode_one, cross=False)
    calibrator.close()
    x = windows.reshape(-1, 16).astype(np.float64)
    b1 = numpy_helper.to_array(next(t for t in model.proto.graph.initializer if t.name == "b1")).astype(np.float64)
    a1 = np.maximum(x @ encoded["W1"].dequantize().astype(np.float64) + b1, 0.0)
    np.testing.assert_allclose(seen["W2"][0].H, 2 / len(a1) * a1.T @ a1, rtol=1e-5, atol=1e-6)
    a1_fp = np.maximum(x @ weights["W1"].astype(np.float64) + b1, 0.0)
    assert not np.allclose(
        seen["W2"][0].H, 2 / len(a1_fp) * a1_fp.T @ a1_fp, rtol=1e-3, atol=1e-4
    )  # the original prefix would differ


def test_weights_as_graph_inputs_takes_initializers_and_constants_without_changing_results(tmp_path):
    """The graph every fed session runs: initializer and Constant-node weights alike become plain inputs
    (no data kept for them), the rest stays, and fed their values it computes what the model does."""
    import models

    import graph_ops

    path = models.assorted_ops(tmp_path / "m.onnx")
    proto = onnx.load(str(path))
    light = graph_ops.weights_as_graph_inputs(proto, ["const_w", "gemm_w", "conv_t"])
    assert {"const_w", "gemm_w", "conv_t"} <= {v.name for v in light.graph.input}
    assert {t.name for t in light.graph.initializer} == {"emb", "gemm_b"}
    assert not any(n.op_type == "Constant" for n in light.graph.node)
    assert len(proto.graph.node) == 6 and len(proto.graph.initializer) == 4  # the model itself untouched
    values = read_weights(proto, ["const_w", "gemm_w", "conv_t"])
    rng = np.random.default_rng(0)
    feeds = {"ids": np.array([3, 7]), "img": rng.standard_normal((2, 4, 8, 8)).astype(np.float32)}
    exact = OrtRuntime(
        optimization="disable"
    )  # constant weights would otherwise be pre-packed into other kernels (1e-7 apart)
    want = exact.open(proto.SerializeToString()).run(feeds)
    got = exact.open(light.SerializeToString()).run({**feeds, **values})
    for name in ("y", "z"):
        np.testing.assert_array_equal(got[name], want[name])
    with pytest.raises(Exception, match="no initializer or Constant named 'nope'"):
        graph_ops.weights_as_graph_inputs(proto, ["nope"])


@pytest.mark.parametrize("tier", ["int8", "int4", "int4-asym", "int2", "int2-asym"])
def test_a_float16_model_rebuilds_its_weights_from_codes_exactly(tmp_path, tier):
    """Codes rebuilt in float32 then cast to the model's float16 give exactly what `dequantize` stores
    (ONNX Runtime's float16 MatMul may still round a product 1 ulp apart for a computed weight)."""
    import models

    import graph_ops
    from graph_ops.fed_codes import fed_codes_model
    from tiers import TIERS, encode

    proto = onnx.load(str(models.fp16_mlp(tmp_path / "half.onnx")))
    weights = read_weights(proto, ["W1", "W2"])
    layouts = weight_layouts(proto, ["W1", "W2"])
    stored = {
        n: encode(w, Layout(layouts[n].shape, layouts[n].perm), TIERS[tier]).compact() for n, w in weights.items()
    }
    light = graph_ops.weights_as_graph_inputs(proto, ["W1", "W2"])
    model, feeds = fed_codes_model(light, stored)
    assert {"W1", "W2"}.isdisjoint(v.name for v in model.graph.input)
    per_byte = {"int8": 1, "int4": 2, "int4-asym": 2, "int2": 4, "int2-asym": 4}[
        tier
    ]  # cached codes are fed as they are packed
    assert (
        sum(a.nbytes for a in feeds.values() if a.dtype.itemsize == 1)
        == sum(w.size for w in weights.values()) // per_byte
    )
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in ("W1", "W2"))
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float16)
    got = OrtRuntime().open(model.SerializeToString()).run({**feeds, "x": x}, ["y", "W1", "W2"])
    for name, encoded in stored.items():
        assert got[name].dtype == np.float16
        np.testing.assert_array_equal(got[name], encoded.dequantize())
    want = (
        OrtRuntime()
        .open(light.SerializeToString())
        .run({"x": x, **{n: e.dequantize() for n, e in stored.items()}})["y"]
    )
    np.testing.assert_allclose(got["y"].astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_steps_without_a_spec_calibrates_on_the_detected_rollout(tmp_path):
    """`--steps` alone once left the calibration at the windows (one step) without a word."""
    import models

    from tqsdeploy.rollout import RolloutSpec

    model = models.mlp_forecaster(tmp_path / "mlp.onnx")
    ctx = tmp_path / "ctx.npz"
    np.savez(ctx, x=np.random.default_rng(3).standard_normal((4, 2, 32)).astype(np.float32))
    spec = RolloutSpec.from_dict({"steps": 4, "feedback": [{"output": "y", "input": "x", "mode": "replace"}]})

    def codes(result):
        return {n: e.values.tobytes() for n, e in result.encoded.items()}

    with_steps = codes(quantize_baseline(model, BaselineSettings("gptq", 2, steps=4), ctx))
    assert with_steps == codes(quantize_baseline(model, BaselineSettings("gptq", 2, spec=spec), ctx))
    assert with_steps != codes(quantize_baseline(model, BaselineSettings("gptq", 2), ctx))


def test_rtn_baseline_says_it_read_no_calibration_options(tmp_path):
    """`baseline --method rtn --calib c.npz --steps 3` used neither, without a word."""
    import models

    model = models.two_branch(tmp_path / "m.onnx")
    ctx = tmp_path / "missing-but-unread.npz"
    result = cli(
        "baseline", model, "--method", "rtn", "--bits", "4", "--calib", ctx, "--steps", "3", "-o", tmp_path / "q.onnx"
    )
    assert result.exit_code == 0, result.output
    assert "--calib, --steps not used" in " ".join(result.output.split())


def test_auto_grids_keep_the_grid_whose_model_drifts_less_on_the_calibration_windows(mlp):
    """`--grids auto` (the default) builds a calibrated method's model on both grids of a clip-searched tier,
    measures each on the calibration windows' rollout and keeps the one that drifts less: the same codes as
    asking for that grid outright. An 8-bit tier has one grid: nothing is measured."""
    from tiers import GRIDS
    from tqsdeploy.encoding.calibrator import CalibrationRollout, Calibrator

    model, calib, _ = mlp

    def codes(result):
        return {n: e.values.tobytes() for n, e in result.encoded.items()}

    chosen = quantize_baseline(model, BaselineSettings("qep", 2), calib)
    assert set(chosen.grid_drifts) == set(GRIDS) and chosen.grids in GRIDS
    assert chosen.grid_drifts[chosen.grids] == min(chosen.grid_drifts.values())
    each = {grids: quantize_baseline(model, BaselineSettings("qep", 2, grids=grids), calib) for grids in GRIDS}
    assert codes(chosen) == codes(each[chosen.grids]) and codes(each["per-channel"]) != codes(each["min-max"])
    assert all(not result.grid_drifts for result in each.values())
    assert chosen.errors == each[chosen.grids].errors  # the kept model's layer errors, not the last pass's
    # each grid's drift as measured on its own: the calibration windows, one step, against the original
    from tqsdeploy.rollout import RolloutSpec
    from tqsdeploy.rollout.contexts import Contexts

    proto = onnx.load(str(model))
    layouts = weight_layouts(proto, ["W1", "W2", "W3"])
    weights = read_weights(proto, ["W1", "W2", "W3"])
    calibrator = Calibrator(
        proto,
        layouts,
        CalibrationRollout(
            Contexts({"x": np.load(calib)["x"]}, "calib"), RolloutSpec(steps=1, feedback=(), trajectory=("y",))
        ),
        OrtRuntime(),
        weights=weights,
    )
    for grids, result in each.items():
        assert calibrator.drift(result.weights).worst_pct == pytest.approx(chosen.grid_drifts[grids], rel=1e-6)
    calibrator.close()
    assert (
        not quantize_baseline(model, BaselineSettings("qep", 8), calib).grid_drifts
        and not quantize_baseline(model, BaselineSettings("rtn", 2)).grid_drifts
    )
