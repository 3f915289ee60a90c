"""Outputs outside the trajectory are reported by eval, never gated.

The score follows only the trajectory, so a head that feeds nothing else (a quantile head beside a
forecast) scores dead and drops to the lowest tier: eval must show how far such an output moved, or
the damage is silent.
"""

import json

import numpy as np
import onnx
from conftest import cli
from onnx import TensorProto, helper

from tqsdeploy.evaluation.eval_report import markdown
from tqsdeploy.evaluation.evaluate import evaluate


def _model(path, w_side):
    n = 8
    init = [
        helper.make_tensor("Wmain", TensorProto.FLOAT, [n, n], (0.9 * np.eye(n)).astype(np.float32).ravel()),
        helper.make_tensor("Wside", TensorProto.FLOAT, [n, n], w_side.astype(np.float32).ravel()),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "Wmain"], ["y"]),
        helper.make_node("MatMul", ["x", "Wside"], ["side"]),
        helper.make_node("ReduceSum", ["Wside"], ["fixed"], keepdims=0),  # no batch axis: one value per call
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n])],
        [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
            for name, shape in (("y", ["batch", n]), ("side", ["batch", n]), ("fixed", []))
        ],
        init,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, str(path))
    return path


def test_side_outputs_are_reported_apart_and_not_gated(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8))
    noise = 0.1 * rng.standard_normal((8, 8))
    reference, candidate = _model(tmp_path / "ref.onnx", w), _model(tmp_path / "cand.onnx", w + noise)
    x0 = rng.standard_normal((5, 8)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x0[:, None, :])
    (tmp_path / "spec.toml").write_text('steps = 3\ntrajectory = ["y"]\n[[feedback]]\noutput = "y"\ninput = "x"\n')

    report = evaluate(candidate, reference, tmp_path / "c.npz", spec=tmp_path / "spec.toml")
    assert list(report["outputs"]) == ["y"] and report["outputs"]["y"]["vs_reference"]["drift_pct"] == 0.0
    assert list(report["side_outputs"]) == ["side", "fixed"]
    fixed = (
        float(np.float32(w + noise).sum()),
        float(np.float32(w).sum()),
    )  # no batch axis: the engine runs window by window, each sees it whole
    np.testing.assert_allclose(
        report["side_outputs"]["fixed"]["vs_reference"]["drift_pct"],
        abs(fixed[0] - fixed[1]) / abs(fixed[1]) * 100,
        rtol=1e-4,
    )

    states = [
        x0.astype(np.float64) * 0.9**k for k in range(3)
    ]  # the trajectory is untouched: the side output sees the same inputs
    diff = np.mean([np.abs(s @ noise.astype(np.float32).astype(np.float64)).mean() for s in states])
    scale = np.mean([np.abs(s @ w.astype(np.float32).astype(np.float64)).mean() for s in states])
    np.testing.assert_allclose(
        report["side_outputs"]["side"]["vs_reference"]["drift_pct"], diff / scale * 100, rtol=1e-4
    )
    assert "Outputs outside the trajectory" in markdown(report) and "side " in markdown(report)

    result = cli(
        "gate",
        candidate,
        "--reference",
        reference,
        "--contexts",
        tmp_path / "c.npz",
        "--spec",
        tmp_path / "spec.toml",
        "--max-degradation",
        "0.001%",
        "--report-dir",
        tmp_path / "g",
    )
    assert result.exit_code == 0, (
        result.output
    )  # the forecast did not move; the side output's drift is reported, not gated
    gate = json.loads((tmp_path / "g" / "gate.json").read_text())
    assert gate["passed"]


def test_eval_reports_each_windows_error(tmp_path):
    """A drift driven by a few windows (CSV windows far from the scoring data) shows which ones."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 8))
    reference, candidate = _model(tmp_path / "ref.onnx", w), _model(tmp_path / "cand.onnx", w)
    x0 = rng.standard_normal((4, 8)).astype(np.float32)
    x0[2] *= 100  # one window far larger than the others
    np.savez(tmp_path / "c.npz", x=x0[:, None, :])
    (tmp_path / "spec.toml").write_text(
        'steps = 2\ntrajectory = ["y", "side"]\n[[feedback]]\noutput = "y"\ninput = "x"\n'
    )
    truth = {name: np.zeros((4, 2, 1, 8)) for name in ("y", "side")}
    np.savez(tmp_path / "t.npz", **truth)
    report = evaluate(candidate, reference, tmp_path / "c.npz", spec=tmp_path / "spec.toml", truth=tmp_path / "t.npz")
    by_window = report["outputs"]["y"]["vs_truth"]["mae_by_window"]
    assert len(by_window) == 4 and int(np.argmax(by_window)) == 2
    assert np.isclose(np.mean(by_window), report["outputs"]["y"]["vs_truth"]["mae"])
    assert report["outputs"]["y"]["vs_reference"]["mae_by_window"] == [0.0] * 4
