"""RNN/GRU/LSTM weights are calibrated like any other: W on the input sequence, R on the states it multiplied.

The rows a calibration builds for R must be exactly the states h_{t-1} the recurrence multiplied, each direction
in its own order and its own column block; a shift the wrong way, or the two directions summed into one block,
would still give a plausible Hessian and a silently worse model. So the statistic is checked against a numpy
LSTM written from the ONNX definition (itself checked against ONNX Runtime)."""

import models
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graph_ops import weight_layouts
from graph_ops.calibration import expose_tensors, layer_inputs, waves
from graph_ops.recurrent import add_recurrent_states
from runtimes.ort import OrtRuntime
from tqsdeploy.export.baselines import BaselineSettings, quantize_baseline

SEQ, BATCH, INPUTS, HIDDEN = 7, 3, 5, 4


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def _numpy_lstm(x, W, R, B, direction_index: int, reverse: bool, h0=None):
    """ONNX LSTM (gates i, o, f, c; initial cell state zero) for one direction: (Y [seq, batch, H], the states R
    multiplied at each step, in the order the direction runs)."""
    w, r, b = (
        W[direction_index],
        R[direction_index],
        B[direction_index, : 4 * HIDDEN] + B[direction_index, 4 * HIDDEN :],
    )
    h = np.zeros((x.shape[1], HIDDEN)) if h0 is None else h0[direction_index]
    c = np.zeros_like(h)
    ys, multiplied = np.zeros((x.shape[0], x.shape[1], HIDDEN)), []
    for t in reversed(range(x.shape[0])) if reverse else range(x.shape[0]):
        multiplied.append(h)
        gates = x[t] @ w.T + h @ r.T + b
        i, o, f, g = (gates[:, k * HIDDEN : (k + 1) * HIDDEN] for k in range(4))
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
        ys[t] = h
    return ys, np.concatenate(multiplied)


def _lstm_model(path, direction: str, batch_first: bool, keep_y: bool = True):
    """One LSTM node, weights [directions, 4H, K] as the legacy exporter stores them; Y kept or left unnamed."""
    rng = np.random.default_rng(1)
    dirs = 2 if direction == "bidirectional" else 1
    init = {
        "W": rng.standard_normal((dirs, 4 * HIDDEN, INPUTS)).astype(np.float32) / 2,
        "R": rng.standard_normal((dirs, 4 * HIDDEN, HIDDEN)).astype(np.float32) / 2,
        "B": rng.standard_normal((dirs, 8 * HIDDEN)).astype(np.float32) / 4,
    }
    x_shape = [BATCH, SEQ, INPUTS] if batch_first else [SEQ, BATCH, INPUTS]
    outputs = ["Y", "Y_h"] if keep_y else ["", "Y_h"]
    node = helper.make_node(
        "LSTM", ["x", "W", "R", "B"], outputs, hidden_size=HIDDEN, direction=direction, layout=int(batch_first)
    )
    graph_outputs = [helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, None)]
    if keep_y:
        graph_outputs.insert(0, helper.make_tensor_value_info("Y", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        [node],
        "lstm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        graph_outputs,
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return path, init


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_an_lstms_rows_are_the_inputs_and_states_its_weights_multiplied(tmp_path, direction, batch_first):
    """ONNX Runtime runs only time-first recurrences: a batch-first node's Y is the time-first one's, transposed."""
    path, init = _lstm_model(tmp_path / "lstm.onnx", direction, batch_first=False)
    x = np.random.default_rng(2).standard_normal((SEQ, BATCH, INPUTS))
    Y = OrtRuntime().open(path).run({"x": x.astype(np.float32)})["Y"]  # [seq, directions, batch, H]
    if batch_first:
        path, _ = _lstm_model(tmp_path / "lstm_batch_first.onnx", direction, batch_first=True)
    fed, Y = (np.swapaxes(x, 0, 1), np.transpose(Y, (2, 0, 1, 3))) if batch_first else (x, Y)
    layouts = weight_layouts(onnx.load(str(path)))
    assert layouts["W"].calibratable and layouts["R"].calibratable
    assert layouts["W"].perm == layouts["R"].perm == (1, 0, 2)  # Wt columns: one block per direction
    directions = ("forward", "reverse") if direction == "bidirectional" else (direction,)
    blocks_h, blocks_x = [], []
    for d, name in enumerate(directions):
        ys, multiplied = _numpy_lstm(x, init["W"], init["R"], init["B"], d, name == "reverse")
        y_of_d = Y[:, :, d] if batch_first else Y[:, d]
        np.testing.assert_allclose(
            np.swapaxes(y_of_d, 0, 1) if batch_first else y_of_d, ys, atol=2e-6
        )  # the reference is ONNX's LSTM
        blocks_h.append(
            multiplied.T @ multiplied
        )  # the zero initial state adds nothing, so leaving it out changes no sum
        blocks_x.append(x.reshape(-1, INPUTS).T @ x.reshape(-1, INPUTS))
    (w_use,), (r_use,) = layouts["W"].uses, layouts["R"].uses
    (w_rows,), (r_rows,) = layer_inputs(w_use, fed), layer_inputs(r_use, Y)
    wt_w, wt_r = (layouts[n].to_wt(init[n]) for n in ("W", "R"))
    assert w_rows.shape[1] == wt_w.shape[1] and r_rows.shape[1] == wt_r.shape[1]
    np.testing.assert_allclose(w_rows.T @ w_rows, _block_diagonal(blocks_x), atol=1e-9)
    np.testing.assert_allclose(r_rows.T @ r_rows, _block_diagonal(blocks_h), atol=1e-5)


def _block_diagonal(blocks):
    size = sum(b.shape[0] for b in blocks)
    out, start = np.zeros((size, size)), 0
    for block in blocks:
        out[start : start + block.shape[0], start : start + block.shape[0]] = block
        start += block.shape[0]
    return out


def test_an_unnamed_y_is_named_in_the_calibration_graph_and_both_weights_share_the_nodes_wave(tmp_path):
    """torch leaves Y unnamed when only the last state is used: R's rows still come from it, and W and R
    (whose X is the node's own output) are solved in one wave, after the weights upstream of the input."""
    path = models.sliced_lstm(tmp_path / "lstm.onnx")
    proto = onnx.load(str(path))
    layouts = weight_layouts(proto)
    (r_use,) = layouts["rnn.weight_hh"].uses
    assert r_use.x == "h_last/Y" and r_use.recurrent.operand == "R"
    assert [sorted(wave) for wave in waves(proto, layouts)] == [["rnn.weight_hh", "rnn.weight_ih"], ["Wo"]]


def test_a_calibrated_baseline_rounds_the_recurrent_weights_with_their_statistics(tmp_path):
    """GPTQ on the LSTM's own rows reconstructs its gates better than rounding to nearest does (the export
    reports it per layer), and the file it writes runs; nothing is left rounded to nearest."""
    path = models.sliced_lstm(tmp_path / "lstm.onnx", seq=12)
    windows = tmp_path / "windows.npz"
    np.savez(windows, x=np.random.default_rng(5).standard_normal((8, 12, 16)).astype(np.float32))
    result = quantize_baseline(path, BaselineSettings("gptq", 4, min_params=1), windows)
    assert not {"rnn.weight_ih", "rnn.weight_hh"} & set(result.rtn_only), result.rtn_only
    for name in ("rnn.weight_ih", "rnn.weight_hh"):
        assert result.errors[name] < result.rtn_errors[name], (result.errors, result.rtn_errors)


def test_a_gru_whose_candidate_reads_r_times_h_keeps_r_rounded_to_nearest(tmp_path):
    """Without linear_before_reset, R's candidate block multiplies r⊙h, which no graph tensor holds."""
    rng = np.random.default_rng(0)
    init = {
        "W": rng.standard_normal((1, 3 * HIDDEN, INPUTS)).astype(np.float32),
        "R": rng.standard_normal((1, 3 * HIDDEN, HIDDEN)).astype(np.float32),
    }
    for before_reset, r_calibrated in ((0, False), (1, True)):
        node = helper.make_node("GRU", ["x", "W", "R"], ["Y"], hidden_size=HIDDEN, linear_before_reset=before_reset)
        graph = helper.make_graph(
            [node],
            "gru",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SEQ, 1, INPUTS])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(v, k) for k, v in init.items()],
        )
        layouts = weight_layouts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        assert layouts["W"].calibratable and layouts["R"].calibratable == r_calibrated
        assert r_calibrated or "r*h" in layouts["R"].rtn_reason


def test_a_bidirectional_lstm_whose_directions_are_stacked_by_concat_calibrates_each_on_its_own_states(tmp_path):
    """torch's default exporter stores each direction's [4H, K] weight apart, gate-sliced, unsqueezed and
    concatenated along the direction axis: each weight is told its direction from its place in that Concat,
    and its rows are that direction's states only (the reverse one's run backwards)."""
    rng = np.random.default_rng(3)
    init = {"B": (rng.standard_normal((2, 8 * HIDDEN)) / 4).astype(np.float32), "zero_axis": np.array([0], np.int64)}
    nodes = []
    for stored, width in (("weight_ih", INPUTS), ("weight_hh", HIDDEN)):
        for suffix in ("", "_reverse"):
            init[stored + suffix] = (rng.standard_normal((4 * HIDDEN, width)) / 2).astype(np.float32)
            nodes += models._gate_sliced(stored + suffix, HIDDEN, f"{stored}{suffix}_onnx", [], init)
        nodes.append(
            helper.make_node("Concat", [f"{stored}_onnx", f"{stored}_reverse_onnx"], [f"{stored}_both"], axis=0)
        )
    nodes += [
        helper.make_node(
            "LSTM", ["x", "weight_ih_both", "weight_hh_both", "B"], ["Y"], hidden_size=HIDDEN, direction="bidirectional"
        )
    ]
    graph = helper.make_graph(
        nodes,
        "bidir",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SEQ, BATCH, INPUTS])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    path = tmp_path / "bidir.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    layouts = weight_layouts(onnx.load(str(path)))
    x = rng.standard_normal((SEQ, BATCH, INPUTS))
    Y = OrtRuntime().open(path).run({"x": x.astype(np.float32)})["Y"]

    def onnx_order(w):
        return np.concatenate([w[g * HIDDEN : (g + 1) * HIDDEN] for g in (0, 3, 1, 2)])  # as _gate_sliced

    W = np.stack([onnx_order(init["weight_ih"]), onnx_order(init["weight_ih_reverse"])])
    R = np.stack([onnx_order(init["weight_hh"]), onnx_order(init["weight_hh_reverse"])])
    for d, suffix in enumerate(("", "_reverse")):
        ys, multiplied = _numpy_lstm(x, W, R, init["B"], d, bool(suffix))
        np.testing.assert_allclose(Y[:, d], ys, atol=2e-6)
        (w_use,), (r_use,) = layouts["weight_ih" + suffix].uses, layouts["weight_hh" + suffix].uses
        assert w_use.recurrent.directions == r_use.recurrent.directions == ((d, "reverse" if suffix else "forward"),)
        (r_rows,) = layer_inputs(r_use, Y)
        np.testing.assert_allclose(r_rows.T @ r_rows, multiplied.T @ multiplied, atol=1e-5)


@pytest.mark.parametrize("seq", [1, 4])
def test_a_fed_initial_state_is_a_row_of_r_so_a_one_step_cell_is_calibrated_too(tmp_path, seq):
    """A cell run one step per call, its state fed back by the rollout (initial_h a graph input): R multiplies
    only that state. The calibration graph puts it on both ends of Y; the rows are every state R multiplied."""
    rng = np.random.default_rng(4)
    init = {
        "W": rng.standard_normal((2, 4 * HIDDEN, INPUTS)).astype(np.float32) / 2,
        "R": rng.standard_normal((2, 4 * HIDDEN, HIDDEN)).astype(np.float32) / 2,
        "B": rng.standard_normal((2, 8 * HIDDEN)).astype(np.float32) / 4,
    }
    node = helper.make_node(
        "LSTM", ["x", "W", "R", "B", "", "h0"], ["", "h_next"], hidden_size=HIDDEN, direction="bidirectional"
    )
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, BATCH, INPUTS]),
        helper.make_tensor_value_info("h0", TensorProto.FLOAT, [2, BATCH, HIDDEN]),
    ]
    graph = helper.make_graph(
        [node],
        "cell",
        inputs,
        [helper.make_tensor_value_info("h_next", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    layouts = weight_layouts(proto)
    (r_use,) = layouts["R"].uses
    assert r_use.x == "h_next/states" and r_use.recurrent.initial
    path = tmp_path / "with_states.onnx"
    onnx.save(expose_tensors(add_recurrent_states(proto, layouts), [r_use.x]), str(path))
    x, h0 = rng.standard_normal((seq, BATCH, INPUTS)), rng.standard_normal((2, BATCH, HIDDEN))
    states = OrtRuntime().open(path).run({"x": x.astype(np.float32), "h0": h0.astype(np.float32)})[r_use.x]
    (rows,) = layer_inputs(r_use, states)
    expected = [(m.T @ m) for m in (_numpy_lstm(x, init["W"], init["R"], init["B"], d, d == 1, h0)[1] for d in (0, 1))]
    np.testing.assert_allclose(rows.T @ rows, _block_diagonal(expected), atol=1e-5)


def test_an_r_that_multiplied_no_state_is_rounded_to_nearest_not_zeroed(tmp_path):
    """One-step windows with no state fed: R only ever multiplied the zero initial state, so it has no rows.
    GPTQ would zero every column it never saw (all of them); it is rounded to nearest instead."""
    from tiers import TIERS, encode

    init = {
        "W": np.random.default_rng(0).standard_normal((1, 4 * HIDDEN, INPUTS)).astype(np.float32),
        "R": np.random.default_rng(1).standard_normal((1, 4 * HIDDEN, HIDDEN)).astype(np.float32),
    }
    node = helper.make_node("LSTM", ["x", "W", "R"], ["Y"], hidden_size=HIDDEN)
    graph = helper.make_graph(
        [node],
        "cell",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "b", INPUTS])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1, "b", HIDDEN])],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    path, windows = tmp_path / "cell.onnx", tmp_path / "windows.npz"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    np.savez(windows, x=np.random.default_rng(2).standard_normal((4, 1, 3, INPUTS)).astype(np.float32))
    result = quantize_baseline(path, BaselineSettings("gptq", 4, min_params=1), windows)
    nearest = encode(init["R"], weight_layouts(onnx.load(str(path)))["R"], TIERS["int4-asym"])
    np.testing.assert_array_equal(result.encoded["R"].dequantize(), nearest.dequantize())
    assert "W" in result.errors


def test_one_weight_stacked_for_both_directions_is_calibrated_on_both(tmp_path):
    """Tied directions (one stored R unsqueezed and concatenated twice): it reaches the node once per direction,
    so its statistic sums both directions' states, as its two uses' objectives do."""
    rng = np.random.default_rng(6)
    init = {
        "W": rng.standard_normal((2, 4 * HIDDEN, INPUTS)).astype(np.float32),
        "R": rng.standard_normal((4 * HIDDEN, HIDDEN)).astype(np.float32),
        "zero_axis": np.array([0], np.int64),
    }
    nodes = [
        helper.make_node("Unsqueeze", ["R", "zero_axis"], ["R1"]),
        helper.make_node("Concat", ["R1", "R1"], ["R2"], axis=0),
        helper.make_node("LSTM", ["x", "W", "R2"], ["Y"], hidden_size=HIDDEN, direction="bidirectional"),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SEQ, BATCH, INPUTS])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    layout = weight_layouts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))["R"]
    assert layout.calibratable and layout.perm == (0, 1)
    assert sorted(u.recurrent.directions for u in layout.uses) == [((0, "forward"),), ((1, "reverse"),)]
