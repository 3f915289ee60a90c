"""Weights that reach their operand through row-preserving data movement (Slice, Concat, Unsqueeze), as torch's
default exporter writes an LSTM's: units with per-row layouts, exported files that run through the same chain."""

import json

import models
import numpy as np
import onnx
import pytest
from conftest import invoke, scored_run
from onnx import TensorProto, helper, numpy_helper

import graph_ops
from graph_ops import weight_layouts
from runtimes import OrtRuntime
from tqsdeploy.export import Planner
from tqsdeploy.units import UnitSelection, select_units, selection_notes


def test_gate_sliced_lstm_weights_are_per_row_units(tmp_path):
    """The stored [4H, K] tensors are units whose rows are the gate rows (axis 0), calibrated as the legacy
    exporter's [1, 4H, K] LSTM weights are (gate rows moved meet the same X); nothing is left to note."""
    path = models.sliced_lstm(tmp_path / "lstm.onnx")
    layouts = weight_layouts(onnx.load(str(path)))
    for name in ("rnn.weight_ih", "rnn.weight_hh"):
        layout = layouts[name]
        assert layout.op_types == ("LSTM",) and layout.perm == (0, 1) and layout.channels == 64, layout
        assert layout.calibratable and layout.uses[0].recurrent.directions == ((0, "forward"),), layout
    assert layouts["bias"].op_types == ()
    loaded = graph_ops.load_model(path)
    tensors = graph_ops.find_weight_tensors(loaded.proto)
    units = select_units(tensors, UnitSelection())
    assert sorted(u.name for u in units) == ["rnn.weight_hh", "rnn.weight_ih"]
    assert selection_notes(loaded, tensors, units, UnitSelection()) == []


def _matmul_through(path, along: int):
    """y = x @ Concat(Slice(W)) with W [16, 64] sliced in two along `along` and put back in the other order."""
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    half = w.shape[along] // 2
    init = {
        "W": w,
        "a": np.array([along], np.int64),
        "s0": np.array([0], np.int64),
        "s1": np.array([half], np.int64),
        "s2": np.array([2 * half], np.int64),
    }
    nodes = [
        helper.make_node("Slice", ["W", "s0", "s1", "a"], ["lo"]),
        helper.make_node("Slice", ["W", "s1", "s2", "a"], ["hi"]),
        helper.make_node("Concat", ["hi", "lo"], ["Wc"], axis=along),
        helper.make_node("MatMul", ["x", "Wc"], ["y"]),
    ]
    io = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16]),
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64]),
    ]
    graph = helper.make_graph(nodes, "m", io[:1], io[1:], [numpy_helper.from_array(v, k) for k, v in init.items()])
    return weight_layouts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))["W"]


def test_moving_output_channels_keeps_calibration_and_moving_inputs_does_not():
    """Rows moved along the output-channel axis meet the same X, so calibration still applies; columns moved
    along the reduction axis would need X reordered, so the weight is rounded to nearest."""
    rows = _matmul_through(None, along=1)
    assert rows.perm == (1, 0) and rows.calibratable, rows
    columns = _matmul_through(None, along=0)
    assert (
        columns.perm == (1, 0)
        and not columns.calibratable
        and columns.rtn_reason == "reaches MatMul through Slice, Concat"
    ), columns


scored = scored_run(
    lambda folder: models.sliced_lstm(folder / "lstm.onnx"), (3, 2, 6, 16), seed=1, steps=2, name="sliced_lstm"
)


@pytest.mark.parametrize("tier", ["int8", "int4"])
def test_export_runs_through_the_slices_and_matches_numpy_fake_quant(scored, tier):
    """The written file keeps the Slice/Concat chain and runs it on the dequantized weights: ONNX Runtime gives
    what the fake-quantized float model gives, and each stored row holds its own grid."""
    model, _, folder = scored
    with Planner(folder / "run") as planner:
        outcome = planner.export(None, folder / f"lstm.{tier}.onnx", uniform_tier=tier)
        fake = outcome.fake_quantized()
        reference = planner.model.proto
    exported = onnx.load(str(outcome.path))
    onnx.checker.check_model(exported)
    assert sum(n.op_type == "Slice" for n in exported.graph.node) == 8 and not {"rnn.weight_ih", "rnn.weight_hh"} & {
        t.name for t in exported.graph.initializer
    }
    levels = 2 ** int(tier[3:])
    for name in ("rnn.weight_ih", "rnn.weight_hh"):
        rows = fake[name]
        assert rows.shape == (64, 16) and max(len(np.unique(r)) for r in rows) <= levels
        assert len({float(np.ptp(r)) for r in rows}) > 32  # a grid per row, not one per tensor
    x = np.random.default_rng(2).standard_normal((2, 6, 16)).astype(np.float32)
    got = OrtRuntime(exact_qdq=True).open(outcome.path).run({"x": x})["y"]
    want = OrtRuntime().open(graph_ops.model_bytes(graph_ops.replace_weights(reference, fake))).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    original = OrtRuntime().open(model).run({"x": x})["y"]
    assert 0 < np.abs(got - original).max() < (0.01 if tier == "int8" else 0.2) * np.abs(original).max()


def test_an_unfollowed_path_is_named_by_inspect_and_export(tmp_path):
    """R reaches the LSTM through a Mul nothing follows: inspect names it, its size and the path; export's
    out-of-reach hint names it instead of suggesting a lower --min-params (it is above it)."""
    model = models.sliced_lstm(tmp_path / "lstm.onnx", unfollowed=True)
    code, text = invoke("inspect", model, "--json")
    info = json.loads(text[text.index("{") :])
    assert code == 0 and [u["unit"] for u in info["units"]] == ["rnn.weight_ih"], text
    assert (
        "'rnn.weight_hh' (1,024 params) is not a unit: reaches LSTM through Mul, Slice, Concat, Unsqueeze "
        "(not followed); name it with --include" in info["notes"][0]
    )
    np.savez(tmp_path / "ctx.npz", x=np.random.default_rng(1).standard_normal((2, 1, 6, 16)).astype(np.float32))
    code, text = invoke(
        "score", model, "-c", tmp_path / "ctx.npz", "--steps", "2", "--probes", "1", "--out", tmp_path / "run"
    )
    assert code == 0 and "'rnn.weight_hh' (1,024 params) is not a unit" in text, text
    code, text = invoke("export", model, "--run", tmp_path / "run", "--C", "4", "--out-dir", tmp_path)
    assert code == 2 and "out of reach" in text and "'rnn.weight_hh' (1,024 params: reaches LSTM through Mul" in text, (
        text
    )
    assert "lower --min-params" not in text and "name them with --include" in text
