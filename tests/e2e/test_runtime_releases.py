"""Which ONNX Runtime a file needs: the floor pyproject.toml declares is the one tqsdeploy writes for by default,
every export says the oldest release that loads it, and a file written for an older release (`--target
ort-cpu@1.20`) loads and runs there.

The last check needs a Python with that older onnxruntime: `.ci/run` makes one and names it in
TQS_ORT_1_20_PYTHON (`make oldest-ort`); without it the test is skipped and says so. The whole round trip on the
declared floor is `make oldest-ort` too: the demo and these tests in a venv pinned to it.
"""

import json
import os
import re
import subprocess
import sys

import models
import numpy as np
import onnx
import onnxruntime
import pytest
from conftest import REPO, invoke, scored_run

from runtimes.ort_versions import OLDEST_SUPPORTED, oldest_release, parse_version, version_text

scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", n=128, hidden=256),
    (6, 2, 128),
    seed=7,
    steps=4,
    name="releases",
)

OLD_PYTHON = os.environ.get("TQS_ORT_1_20_PYTHON")


def _floor(requirement: str) -> tuple[int, int]:
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(rf'"{re.escape(requirement)}>=([0-9.]+)', text)
    assert found, f"pyproject.toml declares no lower bound for {requirement}"
    return parse_version(found.group(1))


def test_the_declared_floor_is_the_release_written_for_by_default():
    assert _floor("onnxruntime") == OLDEST_SUPPORTED
    assert _floor("onnxruntime-gpu") == OLDEST_SUPPORTED
    ci = (REPO / "Makefile").read_text()
    pinned = re.search(r"^ORT_OLDEST \?= ([0-9.]+)$", ci, re.M)
    assert pinned and parse_version(pinned.group(1)) == OLDEST_SUPPORTED  # what CI's oldest-runtime venv installs


def test_the_default_export_says_which_release_loads_it_and_keeps_to_the_floor(scored, tmp_path):
    model, contexts, folder = scored
    code, text = invoke("export", model, "--run", folder / "run", "--C", "4,8", "--out-dir", tmp_path)
    assert code == 0, text
    for target in ("C4", "C8"):
        path = tmp_path / f"mlp.{target}.onnx"
        record = json.loads(path.with_suffix(".allocation.json").read_text())
        release = parse_version(record["oldest_onnxruntime"]["release"])
        assert release <= OLDEST_SUPPORTED and release == oldest_release(onnx.load(str(path)))[0]
        assert f"loads on ONNX Runtime {version_text(release)}" in text
        proto = onnx.load(str(path), load_external_data=False)
        assert proto.ir_version <= 13 and all(
            o.version <= 26 for o in proto.opset_import if o.domain in ("", "ai.onnx")
        )
    assert parse_version(onnxruntime.__version__) >= OLDEST_SUPPORTED  # and this runtime (the floor in CI) ran them
    code, text = invoke(
        "eval",
        tmp_path / "mlp.C8.onnx",
        "-r",
        model,
        "-c",
        contexts,
        "--steps",
        2,
        "--no-latency",
        "--report",
        tmp_path / "ev",
    )
    assert code == 0, text
    said = json.loads((tmp_path / "ev.json").read_text())["oldest_onnxruntime"]
    assert said == json.loads((tmp_path / "mlp.C8.allocation.json").read_text())["oldest_onnxruntime"]
    assert f"Loads on ONNX Runtime {said['release']} or later" in text


def test_an_unknown_or_too_old_release_is_refused_in_one_line(scored, tmp_path):
    model, _, folder = scored
    for target, words in (("ort-cpu@1.19", "1.20 or later"), ("ort-cpu@one", "is not a release number")):
        code, text = invoke(
            "export", model, "--run", folder / "run", "--C", 4, "--target", target, "--out-dir", tmp_path
        )
        assert code == 2 and words in text and "Traceback" not in text, text


@pytest.mark.skipif(
    OLD_PYTHON is None, reason="TQS_ORT_1_20_PYTHON names no Python with onnxruntime 1.20 (`make oldest-ort` does)"
)
def test_a_file_written_for_1_20_loads_and_runs_on_onnxruntime_1_20(scored, tmp_path):
    """`--target ort-cpu@1.20`: IR 10, opset 21, no 2-bit tiers; onnxruntime 1.20.1 loads it and computes what
    this runtime computes from it."""
    model, contexts, folder = scored
    code, text = invoke(
        "export", model, "--run", folder / "run", "--C", 4, "--target", "ort-cpu@1.20", "-o", tmp_path / "old.onnx"
    )
    assert code == 0, text
    proto = onnx.load(str(tmp_path / "old.onnx"))
    assert proto.ir_version <= 10 and oldest_release(proto)[0] <= (1, 20)
    x = np.load(contexts)["x"][0]
    np.save(tmp_path / "x.npy", x)
    here = onnxruntime.InferenceSession(str(tmp_path / "old.onnx"), providers=["CPUExecutionProvider"])
    want = here.run(None, {"x": x})[0]
    script = (
        "import sys, numpy as np, onnxruntime as ort\n"
        "assert ort.__version__.startswith('1.20'), ort.__version__\n"
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
        "np.save(sys.argv[3], s.run(None, {'x': np.load(sys.argv[2])})[0])\n"
    )
    done = subprocess.run(
        [OLD_PYTHON, "-c", script, str(tmp_path / "old.onnx"), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-3, atol=1e-4)
    assert sys.executable != OLD_PYTHON
