"""Which tensors become units, and how contexts are read."""

import models
import numpy as np
import onnx
import pytest

import graph_ops
from runtimes import IOSpec
from tqsdeploy.errors import InputError
from tqsdeploy.rollout.contexts import load_csv, load_npz
from tqsdeploy.units import UnitSelection, select_units


@pytest.fixture
def assorted(tmp_path):
    return graph_ops.load_model(models.assorted_ops(tmp_path / "assorted.onnx"))


def test_weight_operands_found_through_layout_ops(assorted):
    found = {t.name: t for t in graph_ops.find_weight_tensors(assorted.proto)}
    assert found["emb"].op_types == ("Gather",)
    assert found["gemm_w"].op_types == ("Gemm",) and found["gemm_w"].nodes == (
        "g",
    )  # unnamed node: its output names it
    assert found["conv_t"].op_types == ("Conv",)  # through Transpose
    assert found["const_w"].op_types == ("MatMul",) and found["const_w"].source == "constant"
    assert found["gemm_b"].op_types == ()  # a bias is no weight operand


def test_selection_threshold_include_exclude(assorted):
    tensors = graph_ops.find_weight_tensors(assorted.proto)

    def names(sel):
        return sorted(u.name for u in select_units(tensors, sel))

    assert names(UnitSelection()) == ["const_w", "emb", "gemm_w"]  # conv_t has 288 params
    assert names(UnitSelection(min_params=1)) == ["const_w", "conv_t", "emb", "gemm_w"]
    assert names(UnitSelection(include="gemm_b")) == ["const_w", "emb", "gemm_b", "gemm_w"]
    assert names(UnitSelection(exclude="^emb$")) == ["const_w", "gemm_w"]


def test_block_granularity_groups_tensors(assorted):
    tensors = graph_ops.find_weight_tensors(assorted.proto)
    units = select_units(tensors, UnitSelection(min_params=1, granularity="block", block_pattern=r"^(gemm|const|conv)"))
    by_name = {u.name: u for u in units}
    assert set(by_name) == {"gemm", "const", "conv", "emb"}
    assert by_name["gemm"].tensor_names == ["gemm_w"]
    with pytest.raises(InputError, match="block-pattern"):
        select_units(tensors, UnitSelection(granularity="block"))


def test_overridable_copy_leaves_input_model_alone(assorted):
    before = assorted.proto.SerializeToString()
    lifted = graph_ops.make_weights_overridable(assorted.proto, ["const_w", "emb"])
    assert assorted.proto.SerializeToString() == before
    assert {"const_w", "emb"} <= {i.name for i in lifted.graph.input}
    assert not any(n.op_type == "Constant" for n in lifted.graph.node)
    onnx.checker.check_model(lifted)


def test_npz_accepts_rank_equal_arrays_as_windows(tmp_path):
    spec = IOSpec("x", ("batch", 8), np.dtype(np.float32))
    np.savez(tmp_path / "a.npz", x=np.ones((5, 8)))
    contexts = load_npz(tmp_path / "a.npz", [spec])
    assert contexts.arrays["x"].shape == (5, 1, 8) and contexts.arrays["x"].dtype == np.float32


def test_npz_rejects_nan(tmp_path):
    spec = IOSpec("x", ("batch", 8), np.dtype(np.float32))
    np.savez(tmp_path / "a.npz", x=np.full((5, 1, 8), np.nan))
    with pytest.raises(InputError, match="NaN"):
        load_npz(tmp_path / "a.npz", [spec])


def test_csv_univariate_and_multivariate(tmp_path):
    rows = np.arange(200, dtype=float)
    csv = tmp_path / "series.csv"
    csv.write_text("date,a,b,c\n" + "\n".join(f"2020-01-01,{r},{2 * r},{-r}" for r in rows))
    uni = load_csv(csv, [IOSpec("x", ("batch", 50), np.dtype(np.float32))], windows=4, zscore=False)
    assert uni.arrays["x"].shape == (4, 3, 50)  # each window: the 3 columns as a batch of series
    np.testing.assert_array_equal(uni.arrays["x"][0, 1], 2 * np.arange(50))
    np.testing.assert_array_equal(uni.arrays["x"][-1, 0], np.arange(150, 200))
    multi = load_csv(csv, [IOSpec("x", ("batch", 50, 3), np.dtype(np.float32))], windows=2, zscore=True)
    assert multi.arrays["x"].shape == (2, 1, 50, 3)
    assert abs(float(multi.arrays["x"][..., 0].mean())) < 2
    with pytest.raises(InputError, match="cannot cut CSV"):
        load_csv(csv, [IOSpec("x", ("batch", 50, 4), np.dtype(np.float32))], windows=2, zscore=False)


def test_weights_kept_as_inputs_are_scored_as_weights(tmp_path):
    """torch's keep_initializers_as_inputs lists every weight as a graph input too: the same γ as the
    plain model, and an exported model that no longer declares them (the input file untouched)."""
    from runtimes import OrtRuntime
    from tqsdeploy import ScoreSettings, score
    from tqsdeploy.export import ExportSettings, Planner

    plain = models.mlp_forecaster(tmp_path / "plain.onnx")
    proto = onnx.load(str(plain))
    proto.graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in proto.graph.initializer
    )
    kept = tmp_path / "kept.onnx"
    onnx.save(proto, str(kept))
    before = kept.read_bytes()
    loaded = graph_ops.load_model(kept)
    assert set(loaded.weights_declared_as_inputs) == {t.name for t in proto.graph.initializer}
    assert [v.name for v in loaded.proto.graph.input] == ["x"]
    contexts = tmp_path / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(1).standard_normal((3, 2, 32)).astype(np.float32))
    settings = ScoreSettings(gauss_draws=1)
    want = score(plain, contexts, steps=3, out=tmp_path / "plain-run", settings=settings)
    got = score(kept, contexts, steps=3, out=tmp_path / "kept-run", settings=settings)
    assert sorted(got.frame["unit"]) == sorted(want.frame["unit"]) == ["W1", "W3", "Wshared"]
    np.testing.assert_allclose(
        got.frame.sort("unit")["gamma_quant"].to_numpy(), want.frame.sort("unit")["gamma_quant"].to_numpy(), rtol=1e-6
    )
    assert any("listed as graph inputs" in w for w in got.meta["warnings"])
    planner = Planner(
        tmp_path / "kept-run", settings=ExportSettings(objective="paper", rounding="rtn", refine=0, fallback=False)
    )
    outcome = planner.export(4, tmp_path / "kept.C4.onnx")
    planner.close()
    exported = onnx.load(str(outcome.path))
    assert [v.name for v in exported.graph.input] == ["x"] and outcome.compression >= 4
    y = OrtRuntime().open(outcome.path).run({"x": np.ones((2, 32), np.float32)})["y"]
    assert y.shape == (2, 32) and np.all(np.isfinite(y))
    assert kept.read_bytes() == before


def test_weights_read_only_in_a_loop_body_are_named(tmp_path):
    """A weight a Scan body reads has no consumer in the main graph: it is no unit, and the user is told which."""
    from tqsdeploy.units import selection_notes

    rng = np.random.default_rng(0)
    h = onnx.helper
    body = h.make_graph(
        [
            h.make_node("MatMul", ["s_in", "W"], ["m"]),
            h.make_node("Tanh", ["m"], ["s_out"]),
            h.make_node("Identity", ["s_out"], ["scan_out"]),
        ],
        "body",
        [
            h.make_tensor_value_info("s_in", onnx.TensorProto.FLOAT, [1, 32]),
            h.make_tensor_value_info("x_t", onnx.TensorProto.FLOAT, [1, 32]),
        ],
        [
            h.make_tensor_value_info("s_out", onnx.TensorProto.FLOAT, [1, 32]),
            h.make_tensor_value_info("scan_out", onnx.TensorProto.FLOAT, [1, 32]),
        ],
    )
    nodes = [
        h.make_node("Scan", ["x0", "xs"], ["last", "all"], body=body, num_scan_inputs=1),
        h.make_node("MatMul", ["last", "W2"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "scan",
        [
            h.make_tensor_value_info("x0", onnx.TensorProto.FLOAT, [1, 32]),
            h.make_tensor_value_info("xs", onnx.TensorProto.FLOAT, [4, 1, 32]),
        ],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 32])],
        [onnx.numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), n) for n in ("W", "W2")],
    )
    path = tmp_path / "scan.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=9), str(path))
    loaded = graph_ops.load_model(path)
    tensors = graph_ops.find_weight_tensors(loaded.proto)
    units = select_units(tensors, UnitSelection())
    assert [u.name for u in units] == ["W2"]
    (note,) = selection_notes(loaded, tensors, units, UnitSelection())
    assert "(W; 1,024 params)" in note and "--include" in note
    assert selection_notes(loaded, tensors, select_units(tensors, UnitSelection(include="^W$")), UnitSelection()) == []


def test_bfloat16_weights_are_named_not_counted_as_missing(tmp_path):
    """bfloat16 weights cannot be fed from numpy: with nothing else to score the error says so; beside float32
    weights they are a note, not silently dropped."""
    from graph_ops.layout import unfed_float_tensors
    from tqsdeploy.units import selection_notes

    h, rng = onnx.helper, np.random.default_rng(0)
    bf16 = h.make_tensor("Wb", onnx.TensorProto.BFLOAT16, [32, 32], (rng.standard_normal(32 * 32) / 6).tolist())
    nodes = [
        h.make_node("Cast", ["Wb"], ["W"], to=onnx.TensorProto.FLOAT),
        h.make_node("MatMul", ["x", "W"], ["h"]),
        h.make_node("MatMul", ["h", "Wf"], ["y"]),
    ]
    io = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["b", 32]) for n in ("x", "y")]
    for with_float in (False, True):
        inits = [bf16] + (
            [onnx.numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "Wf")] if with_float else []
        )
        graph = h.make_graph(
            nodes if with_float else nodes[:2] + [h.make_node("Identity", ["h"], ["y"])], "bf", io[:1], io[1:], inits
        )
        path = tmp_path / f"bf16-{with_float}.onnx"
        onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=9), str(path))
        loaded = graph_ops.load_model(path)
        tensors, unfed = graph_ops.find_weight_tensors(loaded.proto), unfed_float_tensors(loaded.proto.graph)
        assert unfed == {"Wb": ("bfloat16", 1024)}
        if not with_float:
            with pytest.raises(InputError, match=r"bfloat16 \(Wb\)"):
                select_units(tensors, UnitSelection(), unfed)
            continue
        units = select_units(tensors, UnitSelection(), unfed)
        assert [u.name for u in units] == ["Wf"]
        assert any(
            "bfloat16 weight(s) are not units (Wb)" in n
            for n in selection_notes(loaded, tensors, units, UnitSelection(), unfed)
        )
