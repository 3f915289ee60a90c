"""Help shows every choice and the text rich would eat; gate reports carry numbers with units, escaped once."""

import json
import xml.etree.ElementTree as ET

import models
import numpy as np
import pytest
from conftest import invoke

from tqsdeploy.cli import app


@pytest.mark.parametrize(
    "command, shown",
    [
        (
            "score",
            [
                "quant|gauss|both",
                "auto|feed|rebuild",
                "tensor|block",
                "cpu|cuda|tensorrt|trt-engine",
                "tqsdeploy[ray]",
                "Required unless --random-contexts",
            ],
        ),
        (
            "export",
            [
                "rtn|gptq|gptaq|qep",
                "measured|response|paper",
                "mckp|greedy",
                "file|units",
                "ort-cpu|ort-cuda|trt",
                "auto|native|dequantized|fused",
                "int4-asym",
                "--max-drift",
                "--force",
            ],
        ),
        ("baseline", ["rtn|gptq|gptaq|qep", "1|2|3|4|8", "dequantized|fused", "required"]),
        ("eval", ["--columns", "--windows", "--no-latency", "--latency-batches", "required"]),
        ("gate", ["--columns", "--max-slowdown", "--no-latency", "required", "upper|point", "--max-drift-std"]),
        ("frontier", ["--columns"]),
        ("inspect", ["--spec"]),
    ],
)
def test_help_shows_choices(command, shown):
    code, text = invoke(command, "--help", columns=250, layout=True)
    assert code == 0
    for phrase in shown:
        assert phrase in text, f"{command} --help lacks {phrase!r}"


def test_gate_reports_units_numeric_bounds_and_escapes_once(tmp_path):
    model = models.shift_model(tmp_path / "shift.onnx")
    np.savez(tmp_path / "ctx.npz", x=np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32))
    candidate = tmp_path / "a&b.onnx"
    code, text = invoke("baseline", model, "--method", "rtn", "--bits", 4, "-o", candidate, columns=250, layout=True)
    assert code == 0, text
    code, text = invoke(
        "gate",
        candidate,
        "-r",
        model,
        "-c",
        tmp_path / "ctx.npz",
        "--steps",
        2,
        "--max-degradation",
        "0%",
        "--min-compression",
        100,
        "--report-dir",
        tmp_path / "g",
        columns=250,
        layout=True,
    )
    assert code == 1, text
    gate = json.loads((tmp_path / "g" / "gate.json").read_text())
    degradation, compression = gate["checks"]
    assert (
        degradation["limit"] == 0.0
        and degradation["unit"] == "%"
        and compression["limit"] == 100.0
        and compression["operator"] == ">="
    )
    assert degradation["on"] == "upper" and degradation["measured"] == degradation["interval"][1] >= 0
    shown = f"degradation[y] (reference drift, upper 95%) = {degradation['measured']:.6g}% (upper of"
    assert shown in " ".join(text.split())
    suite = ET.parse(tmp_path / "g" / "junit.xml").getroot()
    assert suite.get("name") == f"tqsdeploy gate: {candidate}" and suite.get("failures") == "2"
    case = suite.find("testcase[@name='compression']")
    assert case.get("classname") == "tqsdeploy.gate"  # what CI dashboards group the cases by: kept across module moves
    assert float(case.find("properties/property[@name='limit']").get("value")) == 100.0
    assert case.find("failure").get("message").endswith("x violates >= 100x")
    assert "| compression | " in (tmp_path / "g" / "gate.md").read_text()


def test_inspect_of_a_spec_without_feedback(tmp_path):
    model = models.shift_model(tmp_path / "shift.onnx")
    spec = tmp_path / "one.toml"
    spec.write_text('steps = 1\ntrajectory = ["y"]\n')
    code, text = invoke("inspect", model, "--spec", spec, columns=250, layout=True)
    assert code == 0 and "single-step model, nothing fed back: T = 1" in text, text


def test_an_abort_or_exit_passing_the_group_is_handled():
    """A closed pipe under --help or Ctrl-C at a prompt surfaces as Abort/SystemExit at the group: no AttributeError
    traceback."""
    import typer

    from tqsdeploy.cli import _OneLineErrors

    probe = typer.Typer(cls=_OneLineErrors)

    @probe.command()
    def stop():
        raise typer.Abort()

    @probe.command()
    def other():
        pass

    assert typer.main.get_command(probe).main(["stop"], standalone_mode=False) == 130


def test_no_help_text_is_eaten_by_rich_markup():
    """Every option's help is shown whole: rich reads an unescaped '[batch, dim]' as a style tag and drops it."""
    import typer

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        code, text = invoke(name, "--help", columns=250, layout=True)
        assert code == 0
        shown = " ".join(text.replace("│", " ").split())
        for param in command.params:
            wanted = " ".join((getattr(param, "help", None) or "").replace("\\[", "[").split())
            assert wanted in shown, f"{name} --help shows {param.name}'s help altered: {wanted!r}"


def test_flags_read_as_flags_in_help():
    """A flag shows no type: `--no-latency <bool>` read as a flag taking a value (`--no-latency true` then fails with
    'unexpected extra argument'); options that take one keep theirs."""
    import typer

    group = typer.main.get_command(app)
    code, text = invoke("--help", columns=250, layout=True)
    assert code == 0 and "<bool>" not in text and "--version" in text
    for name in group.commands:
        code, text = invoke(name, "--help", columns=250, layout=True)
        assert code == 0 and "<bool>" not in text, f"{name} --help shows <bool>"
        assert "<path>" in text or "<int" in text or "<str>" in text, name
    code, text = invoke("eval", "--help", columns=250, layout=True)
    row = next(line for line in text.splitlines() if "--no-latency" in line)
    assert row.split("--no-latency")[1].split()[0] == "Skip", row  # the help follows the flag, nothing between
