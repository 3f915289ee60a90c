"""Tiny ONNX models built in code, written to real files for the tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _model(nodes, inputs, outputs, initializers, path: Path) -> Path:
    graph = helper.make_graph(
        nodes, "test", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    return path


def _state_model(nodes, init, path: Path, n: int, dtype=TensorProto.FLOAT, batch="batch") -> Path:
    """A model mapping a state x [batch, n] to y [batch, n] (replace rollouts)."""
    io = [helper.make_tensor_value_info(name, dtype, [batch, n]) for name in ("x", "y")]
    return _model(nodes, io[:1], io[1:], init, path)


def linear_map(path: Path, a: np.ndarray, batch="batch") -> Path:
    """x_{t+1} = A x_t for row-vector states x [batch, n]: y = x @ A^T."""
    n = a.shape[0]
    return _state_model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        {"W": np.ascontiguousarray(a.T.astype(np.float32))},
        path,
        n,
        batch=batch,
    )


def two_branch(path: Path, n: int = 32, seed: int = 0) -> Path:
    """y = x @ Wmain + 0 * (x @ Wdead) + 0.01 * tanh(x @ Wsmall).

    Wdead is multiplied by zero (dead); Wmain sits on the direct output path,
    Wsmall feeds a contracting branch.
    """
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    init = {
        "Wmain": (0.98 * q).astype(np.float32),
        "Wdead": rng.standard_normal((n, n)).astype(np.float32),
        "Wsmall": (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32),
        "zero": np.zeros((1,), np.float32),
        "tiny": np.full((1,), 0.01, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "Wmain"], ["main"]),
        helper.make_node("MatMul", ["x", "Wdead"], ["dead_raw"]),
        helper.make_node("Mul", ["dead_raw", "zero"], ["dead_out"]),
        helper.make_node("MatMul", ["x", "Wsmall"], ["small_raw"]),
        helper.make_node("Tanh", ["small_raw"], ["small_t"]),
        helper.make_node("Mul", ["small_t", "tiny"], ["small_out"]),
        helper.make_node("Add", ["main", "dead_out"], ["s1"]),
        helper.make_node("Add", ["s1", "small_out"], ["y"]),
    ]
    return _state_model(nodes, init, path, n)


def shift_model(path: Path, length: int = 16, horizon: int = 4, seed: int = 0) -> Path:
    """y [batch, H] = tanh(x [batch, L] @ W1) @ W2: a tiny shift-rollout forecaster."""
    rng = np.random.default_rng(seed)
    init = {
        "W1": (rng.standard_normal((length, 64)) / np.sqrt(length)).astype(np.float32),
        "W2": (rng.standard_normal((64, horizon)) / 8).astype(np.float32),
    }
    return _model(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"]),
            helper.make_node("Tanh", ["h"], ["a"]),
            helper.make_node("MatMul", ["a", "W2"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", length])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", horizon])],
        init,
        path,
    )


def nan_model(path: Path, n: int = 32) -> Path:
    """y = sqrt(x @ W): NaN as soon as a state goes negative."""
    rng = np.random.default_rng(0)
    return _state_model(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Sqrt", ["h"], ["y"])],
        {"W": rng.standard_normal((n, n)).astype(np.float32)},
        path,
        n,
    )


def small_weights_model(path: Path) -> Path:
    """Only a 4x4 weight: nothing reaches the default --min-params."""
    return linear_map(path, np.eye(4) * 0.5)


def assorted_ops(path: Path) -> Path:
    """Weights reaching Gather, Gemm, Conv (through Transpose) and a Constant-node MatMul weight."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((100, 16)).astype(np.float32)
    gemm_w = rng.standard_normal((16, 64)).astype(np.float32)
    conv_t = rng.standard_normal((3, 3, 4, 8)).astype(np.float32)  # stored HWIO, transposed to OIHW
    const_w = rng.standard_normal((64, 32)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),  # [batch, 16]
        helper.make_node("Gemm", ["e", "gemm_w", "gemm_b"], ["g"]),  # [batch, 64]
        helper.make_node("Constant", [], ["const_w"], value=numpy_helper.from_array(const_w, "const_w")),
        helper.make_node("MatMul", ["g", "const_w"], ["y"]),
        helper.make_node("Transpose", ["conv_t"], ["conv_w"], perm=[3, 2, 0, 1]),
        helper.make_node("Conv", ["img", "conv_w"], ["z"], pads=[1, 1, 1, 1]),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("img", TensorProto.FLOAT, ["batch", 4, 8, 8]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 8, 8, 8]),
        ],
        {"emb": emb, "gemm_w": gemm_w, "gemm_b": np.zeros(64, np.float32), "conv_t": conv_t},
        path,
    )


def mlp_forecaster(path: Path, n: int = 32, hidden: int = 64, seed: int = 0) -> Path:
    """y = x + 0.3 * tanh(tanh(tanh(x @ W1) @ Wshared) @ Wshared) @ W3ᵀ (Gemm, transB=1).

    A stable residual map with a weight shared by two MatMuls and a Gemm weight
    stored transposed: the export tests' workhorse.
    """
    rng = np.random.default_rng(seed)
    init = {
        "W1": (rng.standard_normal((n, hidden)) / np.sqrt(n)).astype(np.float32),
        "Wshared": (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
        "W3": (rng.standard_normal((n, hidden)) / np.sqrt(hidden)).astype(np.float32),
        "b3": np.zeros(n, np.float32),
        "gain": np.array([0.3], np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["a1"]),
        helper.make_node("MatMul", ["a1", "Wshared"], ["h2"]),
        helper.make_node("Tanh", ["h2"], ["a2"]),
        helper.make_node("MatMul", ["a2", "Wshared"], ["h3"]),
        helper.make_node("Tanh", ["h3"], ["a3"]),
        helper.make_node("Gemm", ["a3", "W3", "b3"], ["d"], transB=1),
        helper.make_node("Mul", ["d", "gain"], ["step"]),
        helper.make_node("Add", ["x", "step"], ["y"]),
    ]
    return _state_model(nodes, init, path, n)


def fp16_mlp(path: Path, n: int = 32, hidden: int = 64, seed: int = 0, dtype=np.float16) -> Path:
    """A float16 (or `dtype`) model end to end: y = x + 0.3 * tanh(x @ W1) @ W2, all in that type."""
    rng = np.random.default_rng(seed)
    init = {
        "W1": (rng.standard_normal((n, hidden)) / np.sqrt(n)).astype(dtype),
        "W2": (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(dtype),
        "gain": np.array([0.3], dtype),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("MatMul", ["a", "W2"], ["d"]),
        helper.make_node("Mul", ["d", "gain"], ["s"]),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    return _state_model(nodes, init, path, n, dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def fp16_gelu_mlp(path: Path, n: int = 32, hidden: int = 64, seed: int = 0) -> Path:
    """y = x + 0.3 * gelu(x @ W1) @ W2 in float16, gelu as Div, Erf, Add, Mul, Mul (what float16 converters leave):
    ONNX Runtime runs this graph differently once its declared opset is 20 or more (outputs move by ~1e-4)."""
    rng = np.random.default_rng(seed)
    half = np.float16
    init = {
        "W1": (rng.standard_normal((n, hidden)) / np.sqrt(n)).astype(half),
        "W2": (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(half),
        "root2": np.array(np.sqrt(2), half),
        "one": np.array(1, half),
        "half": np.array(0.5, half),
        "gain": np.array(0.3, half),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Div", ["h", "root2"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["gate"]),
        helper.make_node("Mul", ["h", "gate"], ["gated"]),
        helper.make_node("Mul", ["gated", "half"], ["a"]),
        helper.make_node("MatMul", ["a", "W2"], ["d"]),
        helper.make_node("Mul", ["d", "gain"], ["s"]),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    return _state_model(nodes, init, path, n, dtype=TensorProto.FLOAT16)


def gather_forecaster(path: Path, rows: int = 100, n: int = 32, seed: int = 0, cast_ids: bool = False) -> Path:
    """y = 0.5 * x @ W + 0.1 * emb[ids]: a state x [batch, n] fed back, ids [batch] a constant input
    selecting rows of an embedding table emb [rows, n] (read by Gather only; `cast_ids`: ids are
    int32 and cast to int64 on the way, as some exporters do)."""
    rng = np.random.default_rng(seed)
    init = {
        "W": (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32),
        "emb": rng.standard_normal((rows, n)).astype(np.float32),
        "half": np.full((1,), 0.5, np.float32),
        "tenth": np.full((1,), 0.1, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Mul", ["h", "half"], ["h2"]),
        helper.make_node("Gather", ["emb", "ids64" if cast_ids else "ids"], ["e"]),
        helper.make_node("Mul", ["e", "tenth"], ["e2"]),
        helper.make_node("Add", ["h2", "e2"], ["y"]),
    ]
    if cast_ids:
        nodes.insert(0, helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64))
    ids_type = TensorProto.INT32 if cast_ids else TensorProto.INT64
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n]),
            helper.make_tensor_value_info("ids", ids_type, ["batch"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        init,
        path,
    )


def gemm_pair(path: Path, n: int = 32, hidden: int = 64, seed: int = 0) -> Path:
    """y = 0.5 * x + Gemm(tanh(Gemm(x, W1ᵀ, b1, transB=1)), W2, b2, alpha=0.3, beta=2): both Gemm layouts, biases
    as weights."""
    rng = np.random.default_rng(seed)
    init = {
        "W1": (rng.standard_normal((hidden, n)) / np.sqrt(n)).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(hidden)).astype(np.float32),
        "W2": (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(np.float32),
        "b2": (0.05 * rng.standard_normal(n)).astype(np.float32),
        "half": np.full((1,), 0.5, np.float32),
    }
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "W2", "b2"], ["d"], alpha=0.3, beta=2.0),
        helper.make_node("Mul", ["x", "half"], ["hx"]),
        helper.make_node("Add", ["hx", "d"], ["y"]),
    ]
    return _state_model(nodes, init, path, n)


def conv_forecaster(path: Path, channels: int = 4, size: int = 6, seed: int = 0) -> Path:
    """y = x + 0.3 * Conv(tanh(Conv(x, W1, b1)), W2, b2, group=2) on a state x [batch, C, size, size]."""
    rng = np.random.default_rng(seed)
    init = {
        "W1": (rng.standard_normal((2 * channels, channels, 3, 3)) / 6).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(2 * channels)).astype(np.float32),
        "W2": (rng.standard_normal((channels, channels, 3, 3)) / 6).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(channels)).astype(np.float32),
        "gain": np.full((1,), 0.3, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "W1", "b1"], ["h"], pads=[1, 1, 1, 1]),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("Conv", ["a", "W2", "b2"], ["d"], pads=[1, 1, 1, 1], group=2),
        helper.make_node("Mul", ["d", "gain"], ["s"]),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    io = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", channels, size, size]) for name in ("x", "y")
    ]
    return _model(nodes, io[:1], io[1:], init, path)


def conv_stack(
    path: Path, channels: int = 5, hidden: int = 16, size: int = 8, seed: int = 0, batch_norm: bool = False
) -> Path:
    """y = x + 0.1 * Conv(relu(Conv(relu(Conv(x))))) on x [batch, channels, size, size], channels 5 -> hidden ->
    hidden -> 5: wide enough for ONNX Runtime's NCHWc Conv kernels (which pad the 5 channels to their block).
    `batch_norm`: a BatchNormalization after the first Conv (ONNX Runtime folds it into that Conv's weight)."""
    rng = np.random.default_rng(seed)
    init = {
        "W1": (rng.standard_normal((hidden, channels, 3, 3)) / 6).astype(np.float32),
        "W2": (rng.standard_normal((hidden, hidden, 3, 3)) / 12).astype(np.float32),
        "W3": (rng.standard_normal((channels, hidden, 3, 3)) / 12).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(hidden)).astype(np.float32),
        "gain": np.full((1,), 0.1, np.float32),
    }
    first = "h"
    nodes = [helper.make_node("Conv", ["x", "W1"], ["h"], pads=[1, 1, 1, 1])]
    if batch_norm:
        init.update(
            bn_scale=(1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
            bn_bias=(0.1 * rng.standard_normal(hidden)).astype(np.float32),
            bn_mean=(0.1 * rng.standard_normal(hidden)).astype(np.float32),
            bn_var=(1 + 0.1 * rng.random(hidden)).astype(np.float32),
        )
        nodes.append(helper.make_node("BatchNormalization", ["h", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["hn"]))
        first = "hn"
    nodes += [
        helper.make_node("Relu", [first], ["a"]),
        helper.make_node("Conv", ["a", "W2", "b2"], ["h2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h2"], ["a2"]),
        helper.make_node("Conv", ["a2", "W3"], ["d"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["d", "gain"], ["s"]),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    io = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", channels, size, size]) for name in ("x", "y")
    ]
    return _model(nodes, io[:1], io[1:], init, path)


def batch_mean(path: Path, n: int = 32, seed: int = 0) -> Path:
    """y = tanh(x @ W) - 0.1 * mean over the batch of tanh(x @ W): the rows of a batch are not independent."""
    rng = np.random.default_rng(seed)
    init = {"W": (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32), "tenth": np.full((1,), 0.1, np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("ReduceMean", ["a"], ["m"], axes=[0], keepdims=1),
        helper.make_node("Mul", ["m", "tenth"], ["mt"]),
        helper.make_node("Sub", ["a", "mt"], ["y"]),
    ]
    return _state_model(nodes, init, path, n)


def assorted_case(folder: Path):
    """(model, contexts, rollout spec): a Gather table, a Gemm (transB=0), a Constant-node MatMul weight and a
    Conv weight read through a Transpose; one step, no feedback."""
    from tqsdeploy.rollout import RolloutSpec
    from tqsdeploy.rollout.contexts import Contexts

    rng = np.random.default_rng(0)
    contexts = Contexts(
        {
            "ids": rng.integers(0, 100, (3, 5)).astype(np.int64),
            "img": rng.standard_normal((3, 5, 4, 8, 8)).astype(np.float32),
        },
        source="test",
    )
    return (
        assorted_ops(Path(folder) / "assorted.onnx"),
        contexts,
        RolloutSpec(steps=1, feedback=(), trajectory=("y", "z")),
    )


def shared_weight_case(folder: Path, steps: int = 4):
    """(model, contexts, rollout spec): a residual MLP with one weight read by two MatMuls and a transB Gemm,
    its state fed back for `steps` steps."""
    from tqsdeploy.rollout import RolloutSpec
    from tqsdeploy.rollout.contexts import Contexts

    contexts = Contexts({"x": np.random.default_rng(1).standard_normal((4, 2, 32)).astype(np.float32)}, source="test")
    return (
        mlp_forecaster(Path(folder) / "mlp.onnx"),
        contexts,
        RolloutSpec.from_dict({"steps": steps, "feedback": [{"output": "y", "input": "x"}]}),
    )


class Interrupt(Exception):
    """What a user's Ctrl-C stands in for: raised from a sweep's progress callback."""


def interrupt_after(count: int, seen: list):
    """An `on_result` callback that records each result's key in `seen` and interrupts once `count` have landed."""

    def record(result):
        seen.append(result.key)
        if len(seen) == count:
            raise Interrupt

    return record


def deep_residual_stack(
    path: Path, depth: int = 8, n: int = 16, hidden: int = 32, tokens: int = 4, seed: int = 0
) -> Path:
    """x [batch, tokens, n] -> y, `depth` pre-norm-free transformer-like blocks h = LayerNorm(h + relu(h @ U_i) @ V_i),
    with `S` read by the blocks 1 and 3 (added to their residual: a weight shared across levels, so the
    activations after block 1 hold it at full precision until its wave) and `T` by every block's output
    (h @ T added before the norm: one weight reused depth times, quantized last). Add + LayerNormalization is
    what ONNX Runtime fuses when it knows both shapes: what a calibration wave cut at its inputs must not change."""
    rng = np.random.default_rng(seed)
    init = {
        "ln_scale": np.ones(n, np.float32),
        "ln_bias": np.zeros(n, np.float32),
        "S": (rng.standard_normal((n, n)) / np.sqrt(n) * 0.5).astype(np.float32),
        "T": (rng.standard_normal((n, n)) / np.sqrt(n) * 0.3).astype(np.float32),
    }
    nodes, h = [], "x"
    for i in range(depth):
        init[f"U{i}"] = (rng.standard_normal((n, hidden)) / np.sqrt(n)).astype(np.float32)
        init[f"V{i}"] = (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(np.float32)
        nodes += [
            helper.make_node("MatMul", [h, f"U{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
            helper.make_node("MatMul", [f"r{i}", f"V{i}"], [f"d{i}"]),
        ]
        branch = f"d{i}"
        if i in (1, 3):
            nodes += [
                helper.make_node("MatMul", [h, "S"], [f"e{i}"]),
                helper.make_node("Add", [f"d{i}", f"e{i}"], [f"de{i}"]),
            ]
            branch = f"de{i}"
        nodes += [
            helper.make_node("MatMul", [h, "T"], [f"t{i}"]),
            helper.make_node("Add", [branch, f"t{i}"], [f"b{i}"]),
            helper.make_node("Add", [h, f"b{i}"], [f"s{i}"]),
            helper.make_node("LayerNormalization", [f"s{i}", "ln_scale", "ln_bias"], [f"h{i}"], axis=-1),
        ]
        h = f"h{i}"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", tokens, n]) for name in ("x", "y")]
    return _model(nodes, io[:1], io[1:], init, path)


def _gate_sliced(stored: str, hidden: int, out: str, via: list, init: dict) -> list:
    """Nodes reading `stored` [4H, K] as torch's default exporter does for an LSTM weight: four Slices of its
    gate blocks along axis 0, concatenated in ONNX's order (torch IFGO -> ONNX IOFC) and unsqueezed to [1, 4H, K].
    `via`: ops put between the initializer and the Slices (e.g. a Mul the unit finder does not follow)."""
    nodes, source = [], stored
    for i, (op, operand) in enumerate(via):
        nodes.append(helper.make_node(op, [source, operand], [f"{out}_via{i}"]))
        source = f"{out}_via{i}"
    for g in range(5):
        init.setdefault(f"gate_at{g}", np.array([g * hidden], np.int64))
    init.setdefault("axis0", np.array([0], np.int64))
    nodes += [
        helper.make_node("Slice", [source, f"gate_at{g}", f"gate_at{g + 1}", "axis0"], [f"{out}_gate{g}"])
        for g in range(4)
    ]
    nodes.append(helper.make_node("Concat", [f"{out}_gate{g}" for g in (0, 3, 1, 2)], [f"{out}_cat"], axis=0))
    nodes.append(helper.make_node("Unsqueeze", [f"{out}_cat", "axis0"], [out]))
    return nodes


def sliced_lstm(
    path: Path, n: int = 16, hidden: int = 16, seq: int = 6, seed: int = 0, unfollowed: bool = False
) -> Path:
    """x [batch, seq, n] -> y = x + (last LSTM state) @ Wo, its W [4H, n] and R [4H, H] stored as torch's default
    (dynamo) exporter stores them (`_gate_sliced`). `unfollowed`: R passes a Mul by 1 first, which nothing follows."""
    rng = np.random.default_rng(seed)
    init = {
        "rnn.weight_ih": (rng.standard_normal((4 * hidden, n)) / np.sqrt(n)).astype(np.float32),
        "rnn.weight_hh": (rng.standard_normal((4 * hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
        "bias": (0.1 * rng.standard_normal((1, 8 * hidden))).astype(np.float32),
        "Wo": (0.3 * rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(np.float32),
        "one": np.ones((1,), np.float32),
    }
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2])]
    nodes += _gate_sliced("rnn.weight_ih", hidden, "W", [], init)
    nodes += _gate_sliced("rnn.weight_hh", hidden, "R", [("Mul", "one")] if unfollowed else [], init)
    nodes += [
        helper.make_node("LSTM", ["xt", "W", "R", "bias"], ["", "h_last"], hidden_size=hidden),
        helper.make_node("Squeeze", ["h_last", "axis0"], ["h"]),
        helper.make_node("MatMul", ["h", "Wo"], ["d"]),
        helper.make_node("Unsqueeze", ["d", "seq_axis"], ["d3"]),
        helper.make_node("Add", ["x", "d3"], ["y"]),
    ]
    init["seq_axis"] = np.array([1], np.int64)
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", seq, n]) for name in ("x", "y")]
    return _model(nodes, io[:1], io[1:], init, path)


def _scoped(node, scopes: list[str], fx_args: str = "") -> onnx.NodeProto:
    """`node` with the metadata torch's dynamo exporter leaves: its module scopes and the FX node it came from."""
    helper.set_metadata_props(
        node,
        {
            "pkg.torch.onnx.name_scopes": repr(scopes),
            "pkg.torch.onnx.fx_node": f"%{scopes[-1]} : call_function[target=torch.ops.aten.linear.default]"
            f"(args = ({fx_args}), kwargs = {{}})",
        },
    )
    return node


def exporter_names(path: Path, seed: int = 0) -> Path:
    """A shift forecaster x [batch, 64] -> y [batch, 16] whose weights carry the names exporters generate, each with
    what the reading node says of its module (`graph_ops.names`):

    - `val_3` (MatMul), `val_7` (through a Transpose): dynamo's `pkg.torch.onnx.name_scopes` and FX node, naming
      `encoder.fc.weight` and `mix.weight`; an int64 `val_2` read in `encoder.fc` does not claim its name;
    - `val_20`, `val_21`: two weights of one module with no parameter named, whose label is shared (`pair.matmul`);
    - `onnx::MatMul_12`: TorchScript's, its node named `/head/proj/MatMul`;
    - `decoder.weight`: a readable name, kept."""
    rng = np.random.default_rng(seed)

    def weight(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    init = {
        "val_3": weight(64, 64),
        "val_7": weight(64, 64),
        "val_20": weight(64, 64),
        "val_21": weight(64, 64),
        "onnx::MatMul_12": weight(64, 32),
        "decoder.weight": weight(32, 16),
        "val_2": np.array([-1, 64], np.int64),
    }
    nodes = [
        _scoped(
            helper.make_node("MatMul", ["x", "val_3"], ["h1"], name="node_MatMul_4"),
            ["", "encoder", "encoder.fc", "linear"],
            "%x, %p_encoder_fc_weight, %p_encoder_fc_bias",
        ),
        _scoped(
            helper.make_node("Reshape", ["h1", "val_2"], ["h1r"], name="node_view"),
            ["", "encoder", "encoder.fc", "view"],
            "%linear, %p_encoder_fc_weight",
        ),
        helper.make_node("Tanh", ["h1r"], ["t1"]),
        _scoped(helper.make_node("Transpose", ["val_7"], ["w7"], perm=[1, 0]), ["", "mix", "t"], "%p_mix_weight"),
        _scoped(helper.make_node("MatMul", ["t1", "w7"], ["h2"]), ["", "mix", "linear_1"], "%t1, %p_mix_weight"),
        _scoped(helper.make_node("MatMul", ["h2", "val_20"], ["a"]), ["", "pair", "matmul"], "%h2, %w"),
        _scoped(helper.make_node("MatMul", ["h2", "val_21"], ["b"]), ["", "pair", "matmul"], "%h2, %w"),
        helper.make_node("Add", ["a", "b"], ["h3"]),
        helper.make_node("Tanh", ["h3"], ["t3"]),
        helper.make_node("MatMul", ["t3", "onnx::MatMul_12"], ["p"], name="/head/proj/MatMul"),
        helper.make_node("MatMul", ["p", "decoder.weight"], ["y"], name="node_MatMul_30"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        init,
        path,
    )
