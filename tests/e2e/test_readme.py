"""Every runnable block of README.md and docs/*.md runs: bash lines through the CLI, Python blocks as written.

A block preceded by `<!-- not run: reason -->` is skipped (the reason says why).
The blocks run in a folder holding a small forecaster under the names the
docs use (forecaster.onnx, ctx.npz, truth.npz) and a link to the repository's
examples/, so the quick-start blocks finish in seconds and the examples' own
commands run on the committed models.
"""

import re
import shlex

import models
import numpy as np
import pytest
from conftest import REPO, cli

from runtimes import OrtRuntime

FENCE = re.compile(r"(?:<!--\s*(not run:[^>]*)-->\s*\n)?```(\w*)\n(.*?)```", re.S)
PAGES = ["README.md", *sorted(path.relative_to(REPO).as_posix() for path in (REPO / "docs").glob("*.md"))]


def blocks(page: str, language: str) -> list[tuple[int, str, str | None]]:
    """(line, body, skip reason) of every `language` block of `page`."""
    text = (REPO / page).read_text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(3), m.group(1))
        for m in FENCE.finditer(text)
        if m.group(2) == language
    ]


def runnable(language: str) -> list:
    return [
        pytest.param(page, line, body, id=f"{page}:{line}")
        for page in PAGES
        for line, body, reason in blocks(page, language)
        if reason is None
    ]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """forecaster.onnx, ctx.npz, heldout.npz (other windows) and truth.npz (the reference's own rollout of ctx.npz,
    shifted by 0.01) in the working folder."""
    model = models.mlp_forecaster(tmp_path / "forecaster.onnx", n=32, hidden=64)
    x = np.random.default_rng(0).standard_normal((4, 2, 32)).astype(np.float32)
    np.savez(tmp_path / "ctx.npz", x=x)
    np.savez(tmp_path / "heldout.npz", x=np.random.default_rng(1).standard_normal((6, 2, 32)).astype(np.float32))
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


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_run_or_says_why_not(page):
    fenced = [(line, reason) for language in ("bash", "python") for line, _, reason in blocks(page, language)]
    short = [line for line, reason in fenced if reason is not None and len(reason) <= len("not run: ") + 10]
    assert not short, f"{page}: a skipped block at line(s) {short} gives no real reason"
    assert "../shared" not in (REPO / page).read_text(), f"{page} points into ../shared"


def test_the_readme_and_the_docs_run_blocks():
    """The README's worked example runs, and the reference pages carry runnable blocks of both languages."""
    assert any(reason is None for _, _, reason in blocks("README.md", "bash"))
    assert len(runnable("bash")) >= 7 and len(runnable("python")) >= 1 and "docs/python-api.md" in PAGES


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    unlisted = [page for page in PAGES[1:] if f"]({page})" not in readme]
    assert not unlisted, f"README.md's Documentation list misses {unlisted}"


def shell_words(command: str, variables: dict[str, str]) -> list[str]:
    """One docs line as the shell would split it: comments dropped, `NAME=value` assignments
    recorded (and nothing run), `$NAME` expanded from earlier assignments."""
    words = shlex.split(command, comments=True)
    if words and all(re.fullmatch(r"[A-Za-z_]\w*=.*", word) for word in words):
        variables.update(word.split("=", 1) for word in words)
        return []

    def expand(word):
        return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: variables[m.group(1) or m.group(2)], word)

    return [expand(word) for word in words]


@pytest.mark.parametrize("page, line, body", runnable("bash"))
def test_bash_block(workdir, page, line, body):
    (workdir / "examples").symlink_to(REPO / "examples")
    variables = {}
    for command in body.strip().splitlines():
        words = shell_words(command, variables)
        if not words:
            continue
        assert words[0] == "tqsdeploy", f"{page} line {line}: only tqsdeploy commands run here: {command}"
        result = cli(*words[1:])
        assert result.exit_code == 0, f"{page} line {line}: {command}\n{result.output}"


@pytest.mark.parametrize("page, line, body", runnable("python"))
def test_python_block(workdir, page, line, body):
    exec(compile(body, f"{page}:{line}", "exec"), {"__name__": "readme"})
