"""Rollout specs: feedback mechanics, detection and TOML round trips."""

import numpy as np
import pytest

from runtimes import IOSpec
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import Feedback, RolloutSpec, detect, next_feeds

F32 = np.dtype(np.float32)


def test_shift_drops_oldest_and_appends_output():
    spec = RolloutSpec(steps=2, feedback=(Feedback("y", "x", "shift", -1),), trajectory=("y",))
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    y = np.full((2, 2), -1, np.float32)
    new = next_feeds({"x": x}, {"y": y}, spec)["x"]
    np.testing.assert_array_equal(new[:, :4], x[:, 2:])
    np.testing.assert_array_equal(new[:, 4:], y)


def test_shift_along_middle_axis():
    spec = RolloutSpec(steps=1, feedback=(Feedback("y", "x", "shift", 1),), trajectory=("y",))
    x = np.random.default_rng(0).standard_normal((1, 5, 3)).astype(np.float32)
    y = np.zeros((1, 2, 3), np.float32)
    new = next_feeds({"x": x}, {"y": y}, spec)["x"]
    assert new.shape == x.shape
    np.testing.assert_array_equal(new[:, :3], x[:, 2:])


def test_replace_and_constant_inputs():
    spec = RolloutSpec(steps=1, feedback=(Feedback("y", "x"),), trajectory=("y",))
    feeds = {"x": np.zeros((1, 3), np.float32), "forcing": np.ones((1, 2), np.float32)}
    new = next_feeds(feeds, {"y": np.full((1, 3), 2, np.float32)}, spec)
    np.testing.assert_array_equal(new["x"], 2)
    assert new["forcing"] is feeds["forcing"]


def test_replace_shape_mismatch_is_a_rollout_error():
    spec = RolloutSpec(steps=1, feedback=(Feedback("y", "x"),), trajectory=("y",))
    with pytest.raises(RolloutError, match="needs equal shapes"):
        next_feeds({"x": np.zeros((1, 3), np.float32)}, {"y": np.zeros((1, 4), np.float32)}, spec)


def test_detect_replace_and_shift():
    same = detect([IOSpec("s", ("b", 1, 33, 49), F32)], [IOSpec("n", ("b", 1, 33, 49), F32)], steps=4)
    assert same.feedback == (Feedback("n", "s", "replace", -1),) and same.origin == "detected"
    shift = detect([IOSpec("x", ("b", 512), F32)], [IOSpec("y", ("b", 96), F32)], steps=4)
    assert shift.feedback == (Feedback("y", "x", "shift", -1),)


def test_names_break_a_shape_tie():
    spec = detect([IOSpec("x", ("b", 8), F32), IOSpec("t", ("b", 8), F32)], [IOSpec("y", ("b", 8), F32)], steps=2)
    assert spec.feedback == (Feedback("y", "x", "replace", -1),)


@pytest.mark.parametrize(
    "inputs,outputs",
    [
        ([IOSpec("x", ("b", 8), F32)], [IOSpec("y", ("b", 16), F32)]),  # longer than the input
        ([IOSpec("x", ("b", 8), F32)], [IOSpec("y", ("b", 8, 2), F32)]),
        ([IOSpec("x", ("b", 8, 3), F32)], [IOSpec("y", ("b", 4, 2), F32)]),
    ],
)
def test_unfeedable_models_are_single_step(inputs, outputs):
    spec = detect(inputs, outputs)
    assert spec.steps == 1 and spec.feedback == () and spec.trajectory == ("y",)
    with pytest.raises(RolloutError, match="single-step") as info:
        detect(inputs, outputs, steps=2)
    assert "--steps 1" in str(info.value)


def test_toml_round_trip(tmp_path):
    spec = RolloutSpec(
        steps=5, feedback=(Feedback("y", "x", "shift", -1), Feedback("h_out", "h", "replace")), trajectory=("y",)
    )
    path = tmp_path / "spec.toml"
    path.write_text(spec.to_toml())
    assert RolloutSpec.from_toml(path) == spec


def test_toml_round_trip_escapes_names_and_keeps_reasons(tmp_path):
    """Names with quotes, backslashes and non-ASCII survive; a multi-line reason stays a comment."""
    spec = RolloutSpec(
        steps=3,
        feedback=(
            Feedback('out"put\\1', "in\\put", "shift", -1),
            Feedback(None, "mäsk", "shift", -1, fill=1.0, length=4),
        ),
        trajectory=('out"put\\1',),
    )
    text = spec.to_toml({"mäsk": "observed\nflag"})
    assert "# observed\n# flag\n" in text
    path = tmp_path / "spec.toml"
    path.write_text(text)
    assert RolloutSpec.from_toml(path) == spec


def test_bad_mode_and_steps():
    with pytest.raises(RolloutError, match="mode"):
        RolloutSpec.from_dict({"steps": 2, "feedback": [{"output": "y", "input": "x", "mode": "append"}]})
    with pytest.raises(RolloutError, match="at least 1 step"):
        RolloutSpec.from_dict({"steps": 0, "feedback": [{"output": "y", "input": "x"}]})


def test_a_dynamic_leading_axis_that_is_time_is_not_batched(tmp_path):
    """A time-first LSTM ([seq, batch, F], torch's default layout): concatenating windows along the dynamic
    axis 0 keeps every shape right while the LSTM carries its state from one window into the next. The engine
    must notice (a window run alone disagrees with its rows of the batched run) and go window by window."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from runtimes import OrtRuntime
    from tqsdeploy.rollout.contexts import Contexts
    from tqsdeploy.rollout.engine import RolloutEngine

    rng = np.random.default_rng(1)
    init = {
        "Wl": rng.standard_normal((1, 128, 8)) * 0.3,
        "Rl": rng.standard_normal((1, 128, 32)) * 0.15,
        "Wo": rng.standard_normal((32, 8)) * 0.1,
    }
    nodes = [
        helper.make_node("LSTM", ["x", "Wl", "Rl"], ["Y"], hidden_size=32),
        helper.make_node("Squeeze", ["Y", "one"], ["Ys"]),
        helper.make_node("MatMul", ["Ys", "Wo"], ["d"]),
        helper.make_node("Add", ["x", "d"], ["y"]),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["seq", "batch", 8]) for n in ("x", "y")]
    tensors = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in init.items()] + [
        numpy_helper.from_array(np.array([1]), "one")
    ]
    path = tmp_path / "lstm.onnx"
    onnx.save(
        helper.make_model(
            helper.make_graph(nodes, "lstm", io[:1], io[1:], tensors),
            opset_imports=[helper.make_opsetid("", 17)],
            ir_version=9,
        ),
        str(path),
    )
    x = rng.standard_normal((3, 16, 1, 8)).astype(np.float32)
    session = OrtRuntime().open(path)
    spec = RolloutSpec.from_dict({"steps": 3, "feedback": [{"output": "y", "input": "x", "mode": "replace"}]})
    engine = RolloutEngine(session, Contexts({"x": x}, source="test"), spec)
    got = engine.trajectories()["y"]
    assert not engine.batched
    for w in range(3):
        state = x[w]
        for t in range(3):
            state = session.run({"x": state})["y"]
            np.testing.assert_allclose(got[w, t], state, rtol=1e-5, atol=1e-6)


def _saved(tmp_path, name, nodes, inputs, outputs, weights):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def io(items):
        return [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in items]

    graph = helper.make_graph(
        nodes, name, io(inputs), io(outputs), [numpy_helper.from_array(v, k) for k, v in weights.items()]
    )
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


@pytest.mark.parametrize("case", ["history", "singleton"])
def test_outputs_one_rank_off_their_input_shift_into_it(tmp_path, case):
    """A state into a two-frame history ([B, 3] into [B, 2, 3], FuXi/FengWu-style) and a forecast with a
    trailing singleton ([B, 2, 1] into [B, 8]): detected as shifts and rolled out as a hand-written loop would."""
    from onnx import helper

    from runtimes import OrtRuntime
    from tqsdeploy.rollout import detect_rollout
    from tqsdeploy.rollout.contexts import Contexts
    from tqsdeploy.rollout.engine import RolloutEngine

    rng = np.random.default_rng(2)
    if case == "history":
        path = _saved(
            tmp_path,
            case,
            [
                helper.make_node("ReduceMean", ["state"], ["m"], axes=[1], keepdims=0),
                helper.make_node("MatMul", ["m", "W"], ["next_state"]),
            ],
            [("state", ["b", 2, 3])],
            [("next_state", ["b", 3])],
            {"W": rng.standard_normal((3, 3)).astype(np.float32) * 0.9},
        )
        x = rng.standard_normal((3, 1, 2, 3)).astype(np.float32)
    else:
        path = _saved(
            tmp_path,
            case,
            [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Unsqueeze", ["h", "axes"], ["y"])],
            [("x", ["b", 8])],
            [("y", ["b", 2, 1])],
            {"W": rng.standard_normal((8, 2)).astype(np.float32) * 0.4, "axes": np.array([2])},
        )
        x = rng.standard_normal((3, 1, 8)).astype(np.float32)
    session = OrtRuntime().open(path)
    spec = detect_rollout(session.inputs, session.outputs, steps=4).spec
    (edge,) = spec.feedback
    assert edge.mode == "shift" and edge.axis == {"history": -2, "singleton": -1}[case]
    got = RolloutEngine(session, Contexts({session.inputs[0].name: x}, source="test"), spec).trajectories()[
        spec.trajectory[0]
    ]
    for w in range(3):
        state = x[w]
        for t in range(4):
            out = session.run({session.inputs[0].name: state})[spec.trajectory[0]]
            np.testing.assert_allclose(got[w, t], out, rtol=1e-5, atol=1e-6)
            step = out[:, None] if case == "history" else out[..., 0]
            state = np.concatenate([state, step], axis=1)[:, -state.shape[1] :]


def _calendar_model(path):
    """y = 0.5·x + hour (hour an int64 [batch, 1] calendar input)."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["hour"], ["h"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "half"], ["scaled"]),
        helper.make_node("Add", ["scaled", "h"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "calendar",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("hour", TensorProto.INT64, ["batch", 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor("half", TensorProto.FLOAT, [1], [0.5])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


def test_an_advanced_calendar_input_moves_each_step_and_wraps(tmp_path):
    """hour 22 → 23 → 0 with by = 1, modulo = 24: without the edge it stayed 22 for the whole rollout."""
    from runtimes import OrtRuntime
    from tqsdeploy.rollout import rollout

    spec_file = tmp_path / "spec.toml"
    spec_file.write_text(
        'steps = 3\ntrajectory = ["y"]\n[[feedback]]\noutput = "y"\ninput = "x"\n'
        '[[feedback]]\ninput = "hour"\nmode = "advance"\nby = 1\nmodulo = 24\n'
    )
    spec = RolloutSpec.from_toml(spec_file)
    assert RolloutSpec.from_toml(spec_file) == RolloutSpec.from_dict(
        __import__("tomllib").loads(spec.to_toml())
    )  # round trip keeps by/modulo
    session = OrtRuntime().open(_calendar_model(tmp_path / "m.onnx"))
    spec.check([s for s in session.inputs], session.outputs)
    steps = [
        s["y"][0, 0]
        for s in rollout(session, {"x": np.zeros((1, 3), np.float32), "hour": np.array([[22]], np.int64)}, spec)
    ]
    assert steps == [22.0, 0.5 * 22 + 23, 0.5 * (0.5 * 22 + 23) + 0]


@pytest.mark.parametrize(
    "edge, message",
    [
        ('input = "hour"\nmode = "advance"\n', "it takes `by`"),
        ('output = "y"\ninput = "hour"\nmode = "advance"\nby = 1\n', "no `output`"),
        ('input = "hour"\nmode = "advance"\nby = 0.5\n', "must be whole numbers"),
        ('input = "hour"\nmode = "advance"\nby = 1\nmodulo = 0\n', "must be positive"),
        ('input = "hour"\nmode = "shift"\nfill = 0\nby = 1\n', 'only apply to mode = "advance"'),
    ],
)
def test_advance_edges_are_checked(tmp_path, edge, message):
    from runtimes import OrtRuntime

    spec_file = tmp_path / "spec.toml"
    spec_file.write_text(
        'steps = 3\ntrajectory = ["y"]\n[[feedback]]\noutput = "y"\ninput = "x"\n[[feedback]]\n' + edge
    )
    session = OrtRuntime().open(_calendar_model(tmp_path / "m.onnx"))
    with pytest.raises(RolloutError, match=message.replace("(", r"\(")):
        RolloutSpec.from_toml(spec_file).check(session.inputs, session.outputs)
