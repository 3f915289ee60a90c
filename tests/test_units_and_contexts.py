"""Which tensors become units, and how contexts are read."""

import numpy as np
import onnx
import pytest

import graph_ops
import models
from runtimes import IOSpec
from tqsdeploy.contexts import load_csv, load_npz
from tqsdeploy.errors import InputError
from tqsdeploy.units import UnitSelection, select_units


@pytest.fixture
def assorted(tmp_path):
    return graph_ops.load_model(models.assorted_ops(tmp_path / "assorted.onnx"))


def test_weight_operands_found_through_layout_ops(assorted):
    found = {t.name: t for t in graph_ops.find_weight_tensors(assorted.proto)}
    assert found["emb"].op_types == ("Gather",)
    assert found["gemm_w"].op_types == ("Gemm",) and found["gemm_w"].nodes == ("g",)  # unnamed node: its output names it
    assert found["conv_t"].op_types == ("Conv",)  # through Transpose
    assert found["const_w"].op_types == ("MatMul",) and found["const_w"].source == "constant"
    assert found["gemm_b"].op_types == ()  # a bias is no weight operand


def test_selection_threshold_include_exclude(assorted):
    tensors = graph_ops.find_weight_tensors(assorted.proto)
    names = lambda sel: sorted(u.name for u in select_units(tensors, sel))  # noqa: E731
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
