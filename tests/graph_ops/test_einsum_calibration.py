"""Einsum weights that are matrix products (JAX and einsum-style exports write them so) are calibrated: the
other operand's axes moved so the summed letters come last, in Wt's column order, give rows whose product with
Wt is the Einsum's output. Checked against ONNX Runtime for the weight on either side and the summed letters
anywhere in the activation."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graph_ops import weight_layouts
from graph_ops.calibration import layer_inputs
from runtimes.ort import OrtRuntime

SIZES = {"b": 2, "n": 3, "d": 4, "e": 5, "h": 2, "t": 3}

PRODUCTS = [
    ("bnd,de->bne", 1),
    ("ed,bnd->bne", 0),
    ("bdn,de->bne", 1),  # the summed letter is not the activation's last
    ("bnhd,hde->bne", 1),  # two summed letters (heads folded into the output projection)
    ("bnhd,ehd->ben", 1),  # summed letters in another order in the weight than in the activation
]


def _model(path, equation: str, position: int, sizes: dict = SIZES):
    terms = equation.split("->")[0].split(",")
    weight = np.random.default_rng(0).standard_normal([sizes[c] for c in terms[position]]).astype(np.float32)
    other = terms[1 - position]
    inputs = ["x", "W"] if position == 1 else ["W", "x"]
    graph = helper.make_graph(
        [helper.make_node("Einsum", inputs, ["y"], equation=equation)],
        "einsum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [sizes[c] for c in other])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [sizes[c] for c in equation.split("->")[1]])],
        [numpy_helper.from_array(weight, "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path, weight, other


@pytest.mark.parametrize("equation,position", PRODUCTS)
def test_an_einsum_weights_rows_times_wt_are_its_output(tmp_path, equation, position):
    path, weight, other = _model(tmp_path / "e.onnx", equation, position)
    x = np.random.default_rng(1).standard_normal([SIZES[c] for c in other]).astype(np.float32)
    y = OrtRuntime().open(path).run({"x": x})["y"]
    layout = weight_layouts(onnx.load(str(path)))["W"]
    assert layout.calibratable, layout.rtn_reason
    (use,) = layout.uses
    (rows,) = layer_inputs(use, x)
    ((operands, output),) = [equation.split("->")]
    channel = operands.split(",")[position][layout.perm[0]]  # the weight's output-channel letter
    kept = [c for c in other if c in output]  # the activation's letters the output keeps, in the activation's order
    expected = np.einsum(f"{output}->{''.join(kept)}{channel}", y).reshape(-1, SIZES[channel])
    np.testing.assert_allclose(rows @ layout.to_wt(weight).T, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation", ["bhnd,hde->bhne", "bnd,dd->bnd", "bnd,de->be", "bnd,det->bnet"])
def test_einsums_that_are_no_plain_product_stay_rounded_to_nearest(tmp_path, equation):
    """A letter shared by weight, activation and output (per-head weights), a repeated letter, a letter the
    activation sums on its own, or two output letters in the weight: no rows of the activation multiply Wt."""
    terms = equation.split("->")[0].split(",")
    weight = np.ones([SIZES[c] for c in terms[1]], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Einsum", ["x", "W"], ["y"], equation=equation)],
        "einsum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SIZES[c] for c in terms[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "W")],
    )
    layout = weight_layouts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))["W"]
    assert not layout.calibratable and "Einsum" in (layout.rtn_reason or "")


def test_a_calibrated_baseline_rounds_an_einsum_weight_better_than_nearest(tmp_path):
    from tqsdeploy.export.baselines import BaselineSettings, quantize_baseline

    sizes = dict(b=4, n=16, d=32, e=24)
    path, _, other = _model(tmp_path / "e.onnx", "bdn,de->bne", 1, sizes)
    windows = tmp_path / "windows.npz"
    np.savez(windows, x=np.random.default_rng(2).standard_normal([3] + [sizes[c] for c in other]).astype(np.float32))
    result = quantize_baseline(path, BaselineSettings("gptq", 4, min_params=1), windows)
    assert "W" not in result.rtn_only and result.errors["W"] < result.rtn_errors["W"], (
        result.errors,
        result.rtn_errors,
    )
