"""What every test folder shares: tests/ on sys.path (so `import models` and `from conftest import ...` work from
any subfolder), the repository root, one way to run the CLI in this process, and the module's score run."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
# export measures each written model's memory in a fresh process (a second or so per model): the tests that read it
# ask for it (`--memory`); the rest of the suite's hundred-odd exports skip it
os.environ.setdefault("TQS_MEMORY", "0")

import models  # noqa: E402

from tqsdeploy import ScoreSettings, score  # noqa: E402
from tqsdeploy.cli import app  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUNNER = CliRunner()


def cli(*args, **options):
    """The CLI on args (each str()-ed), run in this process; click's Result, for tests that read its parts.
    options go to CliRunner.invoke (env, input, ...)."""
    return RUNNER.invoke(app, [str(a) for a in args], **options)


def invoke(*args, columns=None, layout=False, unbox=False):
    """(exit code, stdout and stderr) of the CLI on args, runs of whitespace made one space so that a message reads
    the same however the terminal wrapped it. columns: the terminal width (help wraps at 80 otherwise); layout: keep
    the text as printed; unbox: drop the '│' of rich's help panels first."""
    result = cli(*args, env=None if columns is None else {"COLUMNS": str(columns)})
    text = result.output + (result.stderr or "")
    if unbox:
        text = text.replace("│", " ")
    return result.exit_code, text if layout else " ".join(text.split())


def scored_run(build, contexts, *, seed, steps, name="scored"):
    """A module-scoped `scored` fixture: the model build(folder) writes, standard-normal float32 contexts of shape
    `contexts` drawn with `seed`, and a score run of `steps` steps (one Gauss draw) in folder/"run", made once for
    the module's tests. Its value is (model path, contexts path, folder). Use: scored = scored_run(...)."""

    @pytest.fixture(scope="module")
    def scored(tmp_path_factory):
        folder = tmp_path_factory.mktemp(name)
        model = build(folder)
        path = folder / "ctx.npz"
        np.savez(path, x=np.random.default_rng(seed).standard_normal(contexts).astype(np.float32))
        score(model, path, steps=steps, out=folder / "run", settings=ScoreSettings(gauss_draws=1))
        return model, path, folder

    return scored


@pytest.fixture
def two_branch(tmp_path):
    """(model path, contexts path) for the dead / direct / contracting test model."""
    model = models.two_branch(tmp_path / "two.onnx")
    contexts = tmp_path / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(3).standard_normal((4, 2, 32)).astype(np.float32))
    return model, contexts
