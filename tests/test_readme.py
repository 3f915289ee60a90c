"""Every runnable README block runs: bash lines through the CLI, Python blocks as written.

A block preceded by `<!-- not run: reason -->` is skipped (the reason says why).
The blocks run in a folder holding a small forecaster under the names the
README uses (forecaster.onnx, ctx.npz, truth.npz) and a link to the repository's
examples/, so the quick-start blocks finish in seconds and the examples' own
commands run on the committed models.
"""

import re
import shlex

import numpy as np
import pytest
from typer.testing import CliRunner

import models
from runtimes import OrtRuntime
from tqsdeploy.cli import app

from conftest import REPO

FENCE = re.compile(r"(?:<!--\s*(not run:[^>]*)-->\s*\n)?```(\w*)\n(.*?)```", re.S)


def blocks(language: str) -> list[tuple[int, str, str | None]]:
    text = (REPO / "README.md").read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(3), m.group(1)) for m in FENCE.finditer(text) if m.group(2) == language]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """forecaster.onnx, ctx.npz and truth.npz (the reference's own rollout, shifted by 0.01) in the working folder."""
    model = models.mlp_forecaster(tmp_path / "forecaster.onnx", n=32, hidden=64)
    x = np.random.default_rng(0).standard_normal((4, 2, 32)).astype(np.float32)
    np.savez(tmp_path / "ctx.npz", x=x)
    session = OrtRuntime().open(model)
    truth = []
    for window in x:
        state, steps = window, []
        for _ in range(8):
            state = session.run({"x": state})["y"]
            steps.append(state + 0.01)
        truth.append(np.stack(steps))
    np.savez(tmp_path / "truth.npz", y=np.stack(truth))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_block_is_run_or_says_why_not():
    fenced = [(line, language, reason) for language in ("bash", "python") for line, _, reason in blocks(language)]
    assert fenced and all(reason is None or len(reason) > len("not run: ") + 10 for _, _, reason in fenced)
    assert sum(reason is None for _, _, reason in fenced) >= 2
    assert "../shared" not in (REPO / "README.md").read_text()


def shell_words(command: str, variables: dict[str, str]) -> list[str]:
    """One README line as the shell would split it: comments dropped, `NAME=value` assignments
    recorded (and nothing run), `$NAME` expanded from earlier assignments."""
    words = shlex.split(command, comments=True)
    if words and all(re.fullmatch(r"[A-Za-z_]\w*=.*", word) for word in words):
        variables.update(word.split("=", 1) for word in words)
        return []
    expand = lambda word: re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: variables[m.group(1) or m.group(2)], word)
    return [expand(word) for word in words]


@pytest.mark.parametrize("line, body", [(line, body) for line, body, reason in blocks("bash") if reason is None])
def test_bash_block(workdir, line, body):
    (workdir / "examples").symlink_to(REPO / "examples")
    runner, variables = CliRunner(), {}
    for command in body.strip().splitlines():
        words = shell_words(command, variables)
        if not words:
            continue
        assert words[0] == "tqsdeploy", f"README line {line}: only tqsdeploy commands run here: {command}"
        result = runner.invoke(app, words[1:])
        assert result.exit_code == 0, f"README line {line}: {command}\n{result.output}"


@pytest.mark.parametrize("line, body", [(line, body) for line, body, reason in blocks("python") if reason is None])
def test_python_block(workdir, line, body):
    exec(compile(body, f"README.md:{line}", "exec"), {"__name__": "readme"})
