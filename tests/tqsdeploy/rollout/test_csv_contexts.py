"""CSV contexts everywhere: eval and gate read them, the rows after each window are the truth, bad cells are named."""

import json

import models
import numpy as np
import onnxruntime as ort
import pytest
from conftest import invoke


def _write_csv(path, data, header="date,a,b", cells=None):
    lines = [header] + [f"2020-01-{i % 28 + 1:02d},{float(row[0])!r},{float(row[1])!r}" for i, row in enumerate(data)]
    for line, text in (cells or {}).items():
        lines[line - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    folder = tmp_path_factory.mktemp("csv")
    model = models.shift_model(folder / "shift.onnx")  # x [batch, 16] -> y [batch, 4]
    t = np.arange(120)
    data = np.stack([np.sin(t / 5.0), np.cos(t / 7.0) + 0.1 * t / 120], axis=1)
    csv = _write_csv(folder / "data.csv", data)
    code, text = invoke("baseline", model, "--method", "rtn", "--bits", 4, "-o", folder / "cand.onnx")
    assert code == 0, text
    return model, folder / "cand.onnx", csv, data


def _rollout(model, window, steps):
    session = ort.InferenceSession(str(model))
    state, out = window.astype(np.float32), []
    for _ in range(steps):
        y = session.run(None, {"x": state})[0]
        out.append(y)
        state = np.concatenate([state[:, y.shape[1] :], y], axis=1)
    return np.stack(out)  # (steps, batch, 4)


def test_eval_takes_a_csv_and_its_continuation_is_the_truth(series, tmp_path):
    model, candidate, csv, data = series
    code, text = invoke(
        "eval", candidate, "-r", model, "-c", csv, "--steps", 3, "--windows", 5, "--report", tmp_path / "ev"
    )
    assert code == 0, text
    report = json.loads((tmp_path / "ev.json").read_text())
    assert report["windows"] == 5 and "12 rows after each window" in report["truth"]
    assert "Truth: the 12 rows after each window" in (tmp_path / "ev.md").read_text()
    # the reference's MAE against the rows after each window, computed here by hand
    starts = np.linspace(0, 120 - 16 - 12, 5).round().astype(int)
    errors = []
    for s in starts:
        forecast = _rollout(model, data[s : s + 16].T, 3)  # two series as a batch of 2
        truth = np.stack([data[s + 16 + 4 * k : s + 20 + 4 * k].T for k in range(3)])
        errors.append(np.abs(forecast - truth).mean())
    out = report["outputs"]["y"]
    assert out["vs_truth"]["reference_mae"] == pytest.approx(np.mean(errors), rel=1e-5)
    assert out["degradation_basis"] == "truth"


def test_gate_takes_a_csv_with_chosen_columns(series, tmp_path):
    model, candidate, csv, _ = series
    common = ["-r", model, "-c", csv, "--steps", 2, "--columns", "b", "--report-dir", tmp_path]
    code, text = invoke("gate", candidate, *common, "--max-degradation", "1000%")
    assert code == 0, text
    gate = json.loads((tmp_path / "gate.json").read_text())
    assert gate["report"]["truth"] and "truth" in gate["checks"][0]["name"]
    code, text = invoke("gate", candidate, *common, "--max-degradation", "0%")
    assert code == 1, text


@pytest.mark.parametrize(
    "cells, phrase",
    [
        ({7: "2020-01-06,0.5,abc"}, "line 7, column 'b': 'abc' is not a number"),
        ({9: "2020-01-08,1e39,0.5"}, "line 9, column 'a': 1e39 is beyond float32's range"),
        ({4: "2020-01-03,,0.5"}, "line 4, column 'a': is empty"),
        ({5: "2020-01-04,inf,0.5"}, "line 5, column 'a': 'inf' is not finite"),
    ],
)
def test_bad_csv_cells_are_named(series, tmp_path, cells, phrase):
    model, candidate, _, data = series
    bad = _write_csv(tmp_path / "bad.csv", data, cells=cells)
    for command in (
        ["score", model, "-c", bad, "--steps", 2, "--out", tmp_path / "run"],
        ["eval", candidate, "-r", model, "-c", bad, "--steps", 2],
    ):
        code, text = invoke(*command)
        assert code == 2 and phrase in text and "Traceback" not in text, text


def test_wrong_context_files_say_what_was_expected(series, tmp_path):
    model, candidate, csv, _ = series
    np.save(tmp_path / "ctx.npy", np.zeros((2, 1, 16), np.float32))
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object))
    cases = [
        (tmp_path / "ctx.npy", [], "is not an .npz or a .csv"),
        (tmp_path / "objects.npz", [], "is not an .npz archive of arrays"),
        (csv, ["--columns", "a,zz"], "has no column 'zz' (it has: date, a, b)"),
    ]
    for path, extra, phrase in cases:
        for command in ("eval", "gate"):
            code, text = invoke(
                command,
                candidate,
                "-r",
                model,
                "-c",
                path,
                "--steps",
                2,
                *extra,
                *["--min-compression", 1] if command == "gate" else [],
            )
            assert code == 2 and phrase in text and "contains pickled data" not in text, text


def test_more_windows_than_the_csv_holds_are_refused(series, tmp_path):
    """120 rows, windows of 16 and 4 rows of truth after them: 101 distinct windows. Asking for more once
    repeated windows silently, and --windows 100000 ran out of memory."""
    model, candidate, csv, _ = series
    code, text = invoke(
        "eval",
        candidate,
        "-r",
        model,
        "-c",
        csv,
        "--steps",
        1,
        "--columns",
        "a",
        "--windows",
        102,
        "--report",
        tmp_path / "r",
    )
    assert code == 2 and "holds 101 distinct windows" in text and "--windows 101 or fewer" in text, text
    code, text = invoke(
        "eval",
        candidate,
        "-r",
        model,
        "-c",
        csv,
        "--steps",
        1,
        "--columns",
        "a",
        "--windows",
        101,
        "--report",
        tmp_path / "r",
    )
    assert code == 0, text


def test_a_univariate_model_fed_every_column_says_what_it_multiplies_and_a_fixed_series_axis_is_refused(tmp_path):
    """A model taking [batch, L] gets each CSV column as a series: 3 columns are 3x the work, which the summary and
    a warning now say (naming --columns); a model whose series axis is fixed at 1 cannot take 3 columns and says
    which to pick instead of a shape puzzle (issue 34, item 5)."""
    from onnx import TensorProto, helper

    model = models.shift_model(tmp_path / "shift.onnx")  # x [batch, 16] -> y [batch, 4]
    t = np.arange(120)
    csv = tmp_path / "three.csv"
    csv.write_text(
        "date,a,b,c\n"
        + "\n".join(f"2020-01-{i % 28 + 1:02d},{np.sin(i / 5)},{np.cos(i / 7)},{i / 120}" for i in t)
        + "\n"
    )
    code, text = invoke(
        "score",
        model,
        "-c",
        csv,
        "--windows",
        4,
        "--steps",
        2,
        "--probes",
        1,
        "--min-params",
        16,
        "-o",
        tmp_path / "all",
    )
    assert code == 0, text
    assert "4 context windows × 3 series each (CSV columns a, b, c): 3x the work of one series" in text
    assert "model input 'x' [batch, 16] takes one series per batch row" in text, (
        text
    )  # the shape printed, not eaten as markup
    assert (
        "each of the 3 numeric columns of" in text
        and "3 series per window, 3x the work of one; pass --columns to use fewer (e.g. --columns c" in text
    )
    assert any("3x the work of one" in w for w in json.loads((tmp_path / "all" / "run.json").read_text())["warnings"])
    code, text = invoke(
        "score",
        model,
        "-c",
        csv,
        "--columns",
        "c",
        "--windows",
        4,
        "--steps",
        2,
        "--probes",
        1,
        "--min-params",
        16,
        "-o",
        tmp_path / "one",
    )
    assert code == 0 and "4 context windows;" in text and "series" not in text, text

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W"], ["h"]),
        helper.make_node("Unsqueeze", ["h", "last"], ["y"]),
    ]
    fixed = models._model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 1])],
        {"flat": np.array([-1, 16]), "W": rng.standard_normal((16, 4)).astype(np.float32), "last": np.array([2])},
        tmp_path / "fixed.onnx",
    )
    code, text = invoke(
        "score", fixed, "-c", csv, "--windows", 4, "--steps", 2, "--min-params", 16, "-o", tmp_path / "fixed"
    )
    assert (
        code == 2
        and "model input 'x' [batch, 16, 1] takes 1 series per window, and" in text
        and "has 3 numeric columns (a, b, c)" in text
    ), text
    assert "pick 1 with --columns, e.g. --columns c" in text and not (tmp_path / "fixed").exists()
    code, text = invoke(
        "score",
        fixed,
        "-c",
        csv,
        "--columns",
        "b",
        "--windows",
        4,
        "--steps",
        2,
        "--probes",
        1,
        "--min-params",
        16,
        "-o",
        tmp_path / "fixed",
    )
    assert code == 0, text


def test_eval_of_every_csv_column_says_so_as_score_does(tmp_path):
    """eval on a CSV of three series for a univariate model averaged its metrics over all three under the heading
    '4 context windows' and no warning; it now says the series and warns, naming --columns."""
    model = models.shift_model(tmp_path / "shift.onnx")  # x [batch, 16] -> y [batch, 4]
    t = np.arange(120)
    csv = tmp_path / "three.csv"
    csv.write_text(
        "date,a,b,c\n"
        + "\n".join(f"2020-01-{i % 28 + 1:02d},{np.sin(i / 5)},{np.cos(i / 7)},{i / 120}" for i in t)
        + "\n"
    )
    code, text = invoke(
        "eval", model, "-r", model, "-c", csv, "--windows", 4, "--steps", 2, "--no-latency", "--report", tmp_path / "r"
    )
    assert code == 0, text
    assert "4 context windows × 3 series each (CSV columns a, b, c) × 2 steps" in text
    assert (
        "warning: model input 'x' [batch, 16] takes one series per batch row" in text
        and "pass --columns to use fewer" in text
    )
    code, text = invoke(
        "eval",
        model,
        "-r",
        model,
        "-c",
        csv,
        "--columns",
        "c",
        "--windows",
        4,
        "--steps",
        2,
        "--no-latency",
        "--report",
        tmp_path / "r",
    )
    assert code == 0 and "4 context windows × 2 steps" in text and "warning" not in text, text


def test_frontier_cuts_a_csv_as_score_does(series, tmp_path):
    """frontier takes --windows and --zscore like score, eval and gate: its score run holds the windows asked for."""
    model, _, csv, data = series
    code, text = invoke(
        "frontier",
        model,
        "-c",
        csv,
        "--columns",
        "a",
        "--windows",
        5,
        "--zscore",
        "--steps",
        3,
        "--C",
        2,
        "--baselines",
        "rtn",
        "--bits",
        8,
        "--min-params",
        1,
        "-o",
        tmp_path / "f",
    )
    assert code == 0, text
    windows = np.load(tmp_path / "f" / "score" / "contexts.npz")["x"]
    column = data[:, 0]
    assert windows.shape == (5, 1, 16) and np.allclose(
        windows[0, 0], (column[:16] - column.mean()) / column.std(), atol=1e-3
    )  # standardised
