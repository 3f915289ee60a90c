"""An interrupted export resumes: every pass keeps its weights one by one in the run folder's cache, and the rerun
writes the same bytes as an uninterrupted export."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import models
import numpy as np
import pytest
from conftest import scored_run

from tqsdeploy.encoding.checkpoints import FOLDER
from tqsdeploy.export import CacheOptions, ExportSettings, Planner

# A residual MLP with the shared weight split into channel groups, and a finished score run.
scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", n=32, hidden=64),
    (4, 2, 32),
    seed=3,
    steps=3,
    name="resume",
)


def _export(run, path, on_weight=None):
    """Export C 4 with QEP rounding (every pass calibrated); the weights it encoded itself, in order."""
    planner = Planner(run, settings=ExportSettings(refine=1), cache=CacheOptions())
    encoded = []

    def count(name):
        encoded.append(name)
        if on_weight is not None:
            on_weight(len(encoded))

    planner.encoder.on_weight = count
    try:
        outcome = planner.export(4, path, final=True)
        planner.finished()
    finally:
        planner.close()
    return outcome, encoded


def test_an_interrupted_export_resumes_from_its_checkpoints_and_writes_the_same_bytes(scored, tmp_path):
    model, _, folder = scored
    for name in ("whole", "cut"):
        shutil.copytree(folder / "run", tmp_path / name)
    whole, all_encoded = _export(tmp_path / "whole", tmp_path / "whole.onnx")
    assert list((tmp_path / "whole" / FOLDER).rglob("*.npz"))  # a finished export keeps its cache for the next

    def interrupt(count):
        if count == 5:
            raise KeyboardInterrupt  # what Ctrl-C raises, here between the 5th weight's encoding and its checkpoint

    with pytest.raises(KeyboardInterrupt):
        _export(tmp_path / "cut", tmp_path / "cut.onnx", interrupt)
    assert not (tmp_path / "cut.onnx").exists()
    assert len(list((tmp_path / "cut" / FOLDER).rglob("*.npz"))) == 4
    resumed, encoded = _export(tmp_path / "cut", tmp_path / "cut.onnx")
    assert (
        len(encoded) == len(all_encoded) - 4 and len(all_encoded) > 8
    )  # the four finished weights are read, not encoded again
    assert (tmp_path / "cut.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()
    assert resumed.notes == whole.notes  # what calibration said of the reused weights comes back with them


def test_checkpoints_of_other_settings_are_not_used(scored, tmp_path):
    """A checkpoint's key covers the rounding settings: GPTQ's saved weights are not read by a QEP pass."""
    model, _, folder = scored
    shutil.copytree(folder / "run", tmp_path / "run")
    from tiers import TIERS, Rounding

    planner = Planner(tmp_path / "run", cache=CacheOptions())
    planner.encoder.uniform(TIERS["int4-asym"], Rounding("gptq"))
    planner.close()
    saved = len(list((tmp_path / "run" / FOLDER).rglob("*.npz")))
    assert saved == len(planner.layouts)
    again = Planner(tmp_path / "run", cache=CacheOptions())
    again.encoder.uniform(TIERS["int4-asym"], Rounding("qep"))
    assert again.encoder.log.reused == 0
    again.encoder.uniform(TIERS["int4-asym"], Rounding("gptq"))
    assert again.encoder.log.reused == saved
    again.close()


def test_a_pass_asked_again_in_one_export_is_not_reported_as_resumed(scored, tmp_path):
    """An export drops a uniform pass from memory and reads it back from its own checkpoints when asked again:
    done at once, and not counted or announced as an interrupted export's weights."""
    model, _, folder = scored
    shutil.copytree(folder / "run", tmp_path / "run")
    from tiers import TIERS, Rounding

    planner = Planner(tmp_path / "run", cache=CacheOptions())
    calls = []
    planner.encoder.on_pass = lambda label, count, done, resumed: calls.append((count, done, resumed))
    first = planner.encoder.uniform(TIERS["int4-asym"], Rounding("gptq"))
    planner.encoder.forget("int4-asym", Rounding("gptq"))
    again = planner.encoder.uniform(TIERS["int4-asym"], Rounding("gptq"))
    planner.close()
    count = len(planner.layouts)
    assert calls == [(count, 0, 0), (count, count, 0)] and planner.encoder.log.reused == 0
    assert all(np.array_equal(first[name].dequantize(), again[name].dequantize()) for name in first)


def _whole_and_command(scored, tmp_path, options: list[str], whole: str, cut: str):
    """An uninterrupted export into tmp_path/`whole` from a copy of the score run, and the same export's command
    line from another copy (tmp_path/run) into tmp_path/`cut`."""
    model, _, folder = scored
    for name in ("run", "whole"):
        shutil.copytree(folder / "run", tmp_path / name)

    def export(run, out):
        return [
            sys.executable,
            "-m",
            "tqsdeploy",
            "export",
            str(model),
            "--run",
            str(run),
            *options,
            str(out),
        ]

    assert (
        subprocess.run(export(tmp_path / "whole", tmp_path / whole), capture_output=True, timeout=300).returncode == 0
    )
    return model, export(tmp_path / "run", tmp_path / cut)


def _holds(ready) -> bool:
    try:
        return bool(ready())
    except FileNotFoundError:
        return False


def _interrupted(command: list[str], ready, env: dict | None = None, reset=None, attempts: int = 1) -> str:
    """Run `command`, send a real SIGINT once `ready()` holds, and return its stderr (it must exit 130).
    A folder `ready` globs may not exist yet: on Python 3.11 pathlib's glob then raises instead of finding nothing.
    Where the moment `ready` marks is short (the end of one target), a busy machine can let the command finish before
    the signal lands: with `reset` (which puts the run and output folders back as they were before the command) such
    a finished run is tried again, up to `attempts` times; a run that fails any other way fails the test."""
    for attempt in range(attempts):
        if attempt and reset is not None:
            reset()
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        while process.poll() is None and not _holds(ready):
            time.sleep(0.001)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=300)
        if process.returncode != 0 or reset is None:
            break
    assert process.returncode == 130, stdout + stderr
    return stderr


def test_ctrl_c_during_export_says_what_is_kept_and_the_rerun_resumes(scored, tmp_path):
    """The command line, interrupted by a real SIGINT once the first weight is in the cache; the rerun, in another
    process, reads every weight kept (one may serve several passes) and writes what an uninterrupted export
    writes."""
    model, command = _whole_and_command(scored, tmp_path, ["--verbose", "--C", "4", "-o"], "whole.onnx", "q.onnx")
    stderr = _interrupted(
        command, lambda: list((tmp_path / "run" / FOLDER).rglob("*.npz")), {"TQS_PROGRESS_INTERVAL": "0.05"}
    )
    text = " ".join(stderr.split())
    assert (
        "interrupted: the run folder keeps the measured tier prices (measured.jsonl) "
        "and every weight a pass finished (export-cache/)" in text
    )
    assert not (tmp_path / "q.onnx").exists()
    kept = len(list((tmp_path / "run" / FOLDER).rglob("*.npz")))
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    text = " ".join(rerun.stderr.split())
    assert sum(int(n) for n in re.findall(r"(\d+) of \d+ weights read from the run's cache", text)) >= kept > 0, text
    assert (tmp_path / "q.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()


def test_a_rerun_after_ctrl_c_between_two_targets_overwrites_what_the_interrupted_export_wrote(scored, tmp_path):
    """`--C 4,8` interrupted once the C4 model is written: the same command again (no --force) resumes and writes
    what an uninterrupted export writes; a file of the same name that no interrupted export began is still refused."""
    model, command = _whole_and_command(scored, tmp_path, ["--C", "4,8", "--out-dir"], "w", "q")

    def reset():
        for name in ("run", "q"):
            shutil.rmtree(tmp_path / name, ignore_errors=True)
        shutil.copytree(scored[2] / "run", tmp_path / "run")

    written = tmp_path / "q" / "mlp.C4.allocation.json"
    _interrupted(command, written.exists, reset=reset, attempts=5)
    assert (tmp_path / "q" / "mlp.C4.onnx").exists()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    for name in ("mlp.C4.onnx", "mlp.C8.onnx"):
        assert (tmp_path / "q" / name).read_bytes() == (tmp_path / "w" / name).read_bytes()
    again = subprocess.run(
        command, capture_output=True, text=True, timeout=300
    )  # finished: nothing of it is left to resume
    assert again.returncode == 2 and "already exists" in again.stderr
