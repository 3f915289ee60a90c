"""What a degradation bound judges (`gate --on`), said in every report; and the offset-free drift."""

import json
import xml.etree.ElementTree as ET

import models
import numpy as np
import pytest
from conftest import invoke

from tqsdeploy.evaluation.metrics import metrics


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gate-on")
    model = models.shift_model(folder / "shift.onnx")
    np.savez(folder / "ctx.npz", x=np.random.default_rng(0).standard_normal((8, 2, 16)).astype(np.float32))
    code, text = invoke("baseline", model, "--method", "rtn", "--bits", 4, "-o", folder / "q.onnx")
    assert code == 0, text
    code, text = invoke(
        "eval", folder / "q.onnx", "-r", model, "-c", folder / "ctx.npz", "--steps", 3, "--no-latency", "--report",
        folder / "eval",
    )  # fmt: skip
    assert code == 0, text
    return model, folder, json.loads((folder / "eval.json").read_text())["outputs"]["y"]


def _gate(model, folder, bound: float, *options):
    return invoke(
        "gate", folder / "q.onnx", "-r", model, "-c", folder / "ctx.npz", "--steps", 3, "--no-latency",
        "--max-degradation", f"{bound}%", "--report-dir", folder / "g", *options,
    )  # fmt: skip


def test_upper_fails_what_point_passes_and_every_report_says_which(pair):
    """The user's case: a 0.5% bound passed a model whose interval reached 2.02%. Between the estimate and the
    interval's upper end, the default (`--on upper`) fails and `--on point` passes."""
    model, folder, output = pair
    point, (low, high) = output["degradation_pct"], output["degradation_ci95"]
    assert output["degradation_basis"] == "reference drift" and low < point < high
    bound = (point + high) / 2
    code, text = _gate(model, folder, bound)
    assert code == 1, text
    assert f"degradation[y] (reference drift, upper 95%) = {high:.6g}% (upper of [" in text
    assert "judge the upper end of the 95% interval over the context windows (--on upper, the default" in text
    report = json.loads((folder / "g" / "gate.json").read_text())
    (check,) = report["checks"]
    assert report["on"] == "upper" and check["on"] == "upper" and check["measured"] == high
    assert check["estimate"] == point and check["interval"] == [low, high] and not report["passed"]
    case = ET.parse(folder / "g" / "junit.xml").getroot().find("testcase")
    assert case.find("properties/property[@name='on']").get("value") == "upper" and case.find("failure") is not None
    assert "--on upper, the default" in (folder / "g" / "gate.md").read_text()

    code, text = _gate(model, folder, bound, "--on", "point")
    assert code == 0, text
    assert f"| degradation[y] (reference drift, estimate) | {point:.6g}% (estimate; interval [" in text
    report = json.loads((folder / "g" / "gate.json").read_text())
    assert report["on"] == "point" and report["passed"] and report["checks"][0]["measured"] == point
    assert "(--on point; --on upper judges the upper end of the 95% interval; --on lower judges the lower" in text


def test_lower_fails_only_beyond_the_noise(pair):
    """`--on lower`: a model fails only when the windows show it past the bound, the interval's lower end above it
    (a bound between the lower end and the estimate passes, one under the lower end fails)."""
    model, folder, output = pair
    point, low = output["degradation_pct"], output["degradation_ci95"][0]
    code, text = _gate(model, folder, (low + point) / 2, "--on", "lower")
    assert code == 0, text
    assert f"degradation[y] (reference drift, lower 95%) | {low:.6g}% (lower of [" in text
    report = json.loads((folder / "g" / "gate.json").read_text())
    assert report["on"] == "lower" and report["checks"][0]["measured"] == low and report["passed"]
    code, text = _gate(model, folder, (low + point) / 2)  # the same bound fails as the default judges it
    assert code == 1, text
    assert low > 0  # RTN INT4 on this model: its whole interval is above zero
    code, text = _gate(model, folder, low / 2, "--on", "lower")
    assert code == 1 and "violates <= " in text, text


def test_the_offset_free_drift_bound(pair):
    model, folder, output = pair
    drift = output["vs_reference"]
    limit = drift["drift_std_pct_ci95"][1] * 1.01
    code, text = invoke(
        "gate", folder / "q.onnx", "-r", model, "-c", folder / "ctx.npz", "--steps", 3, "--no-latency",
        "--max-drift-std", f"{limit}%", "--report-dir", folder / "d",
    )  # fmt: skip
    assert code == 0 and "drift_std[y] (% of the reference's std, upper 95%)" in text, text
    code, text = invoke("gate", folder / "q.onnx", "-r", model, "-c", folder / "ctx.npz", "--on", "mean")
    assert code == 2 and "--on takes upper, point, lower, not 'mean'" in text, text


def test_drift_relative_to_the_reference_std_ignores_an_offset():
    """The same model reads 0.352% or 0.919% drift of mean |reference| with and without --zscore (issue 55): a
    constant added to the series moves that figure, not the drift as a share of the reference's variability."""
    rng = np.random.default_rng(0)
    t = np.arange(6 * 4 * 24).reshape(6, 4, 24)
    reference = np.sin(t / 7.0) + 0.1 * rng.standard_normal(t.shape)
    candidate = reference + 0.05 * rng.standard_normal(t.shape)
    plain = metrics(candidate, reference, None, 200, 0)["vs_reference"]
    shifted = metrics(candidate + 40.0, reference + 40.0, None, 200, 0)["vs_reference"]
    assert plain["drift_std_pct"] == pytest.approx(np.abs(candidate - reference).mean() / reference.std() * 100)
    assert shifted["drift_std_pct"] == pytest.approx(plain["drift_std_pct"], rel=1e-9)
    assert shifted["drift_std_pct_ci95"] == pytest.approx(plain["drift_std_pct_ci95"], rel=1e-9)
    assert shifted["drift_pct"] < plain["drift_pct"] / 10  # today's figure, kept under its name, moves with it
    scaled = metrics(3 * candidate, 3 * reference, None, 200, 0)["vs_reference"]  # and a change of units
    assert scaled["drift_std_pct"] == pytest.approx(plain["drift_std_pct"], rel=1e-9)
