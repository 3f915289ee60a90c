"""ConvTranspose weights (a U-Net's upsampling) are calibrated like Conv's: their rows, times Wt, are the output.

The rows come from a stride-1 Conv over the zero-upsampled input with the kernel flipped; an off-by-one in the
padding or a kernel left unflipped still gives a plausible Hessian, so every geometry is checked against what
ONNX Runtime computes."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graph_ops import weight_layouts
from graph_ops.calibration import layer_inputs
from runtimes.ort import OrtRuntime
from tqsdeploy.export.baselines import BaselineSettings, quantize_baseline

GEOMETRIES = [
    dict(kernel_shape=[2, 2], strides=[2, 2]),  # a U-Net's up-convolution
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
    dict(kernel_shape=[4, 4], strides=[2, 2], pads=[1, 2, 1, 0]),
    dict(kernel_shape=[3, 2], strides=[1, 3], dilations=[2, 1]),
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[3, 3, 3, 3]),  # more padding than the kernel spans: cropped
    dict(kernel_shape=[3, 3], strides=[3, 3], auto_pad="VALID"),
    dict(kernel_shape=[3], strides=[2], pads=[1, 0]),  # 1-D
]


def _model(path, attrs: dict, channels=3, out=5, seed=0):
    rank = len(attrs["kernel_shape"])
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((channels, out, *attrs["kernel_shape"])).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "Wt"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", channels] + ["s"] * rank)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", out] + ["o"] * rank)],
        [numpy_helper.from_array(w, "Wt")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path, w


@pytest.mark.parametrize("attrs", GEOMETRIES, ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_transposed_conv_rows_times_wt_are_its_output(tmp_path, attrs):
    path, w = _model(tmp_path / "up.onnx", attrs)
    rank = len(attrs["kernel_shape"])
    x = np.random.default_rng(1).standard_normal((2, 3) + (6,) * rank).astype(np.float32)
    y = OrtRuntime().open(path).run({"x": x})["y"]
    layout = weight_layouts(onnx.load(str(path)))["Wt"]
    assert layout.calibratable and layout.perm == (1, 0) + tuple(range(2, 2 + rank)), layout
    (use,) = layout.uses
    (rows,) = layer_inputs(use, x)
    rebuilt = rows.astype(np.float64) @ layout.to_wt(w).T.astype(np.float64)  # [batch·outputs, out channels]
    expected = np.moveaxis(y, 1, -1).reshape(-1, y.shape[1])
    np.testing.assert_allclose(rebuilt, expected, atol=1e-4)


def test_a_calibrated_baseline_rounds_a_transposed_conv_better_than_nearest(tmp_path):
    path, _ = _model(tmp_path / "up.onnx", GEOMETRIES[1], channels=8, out=8)
    windows = tmp_path / "windows.npz"
    np.savez(windows, x=np.random.default_rng(2).standard_normal((4, 2, 8, 10, 10)).astype(np.float32))
    result = quantize_baseline(path, BaselineSettings("gptq", 4, min_params=1), windows)
    assert "Wt" not in result.rtn_only and result.errors["Wt"] < result.rtn_errors["Wt"], (
        result.errors,
        result.rtn_errors,
    )


def test_grouped_or_output_shape_sized_transposed_convs_stay_rounded_to_nearest():
    w = numpy_helper.from_array(np.ones((4, 2, 2, 2), np.float32), "Wt")
    for attrs, reason in ((dict(group=2), "grouped"), (dict(output_shape=[8, 8], strides=[2, 2]), "output_shape")):
        node = helper.make_node("ConvTranspose", ["x", "Wt"], ["y"], kernel_shape=[2, 2], **attrs)
        graph = helper.make_graph(
            [node],
            "up",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [w],
        )
        layout = weight_layouts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))["Wt"]
        assert not layout.calibratable and reason in layout.rtn_reason
