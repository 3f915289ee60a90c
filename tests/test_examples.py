"""The CLI end to end on the committed example models (slow: real rollouts)."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tqsdeploy.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
pytestmark = pytest.mark.slow


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output + (result.stderr or "")


@pytest.mark.parametrize("example", ["etth1_patchtst", "era5_emulator", "lorenz96"])
def test_score_export_eval_gate(example, tmp_path):
    folder = REPO / "examples" / example
    model = tmp_path / "model.onnx"
    shutil.copy(folder / "model.onnx", model)
    before = model.read_bytes()
    common = ["--contexts", folder / "contexts.npz", "--spec", folder / "rollout.toml"]
    code, text = _run("score", model, *common, "--out", tmp_path / "run", "--probes", "1")
    assert code == 0, text
    scores = json.loads((tmp_path / "run" / "run.json").read_text())
    assert scores["status"] == "complete" and scores["units"] >= 3
    code, text = _run("export", model, "--run", tmp_path / "run", "--C", "4", "--out-dir", tmp_path)
    assert code == 0, text
    allocation = json.loads((tmp_path / "model.C4.allocation.json").read_text())
    assert allocation["achieved_compression"] >= 4
    code, text = _run("eval", tmp_path / "model.C4.onnx", "--reference", model, *common, "--truth", folder / "truth.npz", "--report", tmp_path / "eval")
    assert code == 0, text
    report = json.loads((tmp_path / "eval.json").read_text())
    output = next(iter(report["outputs"].values()))
    assert output["vs_truth"]["reference_mae"] > 0 and report["compression"] > 3.5
    code, text = _run("gate", tmp_path / "model.C4.onnx", "--reference", model, *common, "--min-compression", "3.5", "--max-degradation", "1000%", "--report-dir", tmp_path / "gate")
    assert code == 0, text
    assert model.read_bytes() == before


def test_ci_workflow_commands_match_the_cli():
    """Every tqsdeploy subcommand the example workflow uses exists and takes those options."""
    workflow = (REPO / "examples" / "ci" / "compress-and-gate.yml").read_text()
    for command in ("score", "export", "gate"):
        assert f"tqsdeploy {command}" in workflow
        code, text = _run(command, "--help")
        assert code == 0
    for option in ("--max-degradation", "--min-compression", "--report-dir", "--truth", "--spec"):
        assert option in workflow
        assert option in _run("gate", "--help")[1]
