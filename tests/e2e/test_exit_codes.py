"""Every command: a bad input is one line on stderr and exit 2, a failed gate
exits 1, a bug exits 3; never a traceback (unless TQS_DEBUG=1 asks for it)."""

import models
import pytest
from conftest import cli

from tqsdeploy.errors import InternalError


def _run(args):
    result = cli(*args)
    stderr = result.stderr if result.stderr_bytes is not None else result.output
    return result, [line for line in stderr.splitlines() if line.strip()]


@pytest.fixture
def bad_spec(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("steps = [[[\n")
    return path


CASES = {
    "inspect-bad-spec": lambda m, c, t, s: ["inspect", m, "--spec", s],
    "inspect-missing": lambda m, c, t, s: ["inspect", t / "nope.onnx"],
    "score-probe": lambda m, c, t, s: ["score", m, "-c", c, "--probe", "xyz", "-o", t / "run"],
    "score-fresh-resume": lambda m, c, t, s: ["score", m, "-c", c, "--fresh", "--resume", "-o", t / "run"],
    "export-C0": lambda m, c, t, s: ["export", m, "--C", "0"],
    "export-Cnan": lambda m, c, t, s: ["export", m, "--C", "nan"],
    "export-C-negative": lambda m, c, t, s: ["export", m, "--C", "-1"],
    "export-C-junk": lambda m, c, t, s: ["export", m, "--C", "4,abc"],
    "export-no-run": lambda m, c, t, s: ["export", m, "--C", "4", "--run", t / "no-run"],
    "export-C-empty": lambda m, c, t, s: ["export", m, "--C", ""],
    "export-C-repeated": lambda m, c, t, s: ["export", m, "--C", "4,4.0"],
    "export-tiers-empty": lambda m, c, t, s: ["export", m, "--C", "4", "--tiers", ","],
    "export-o-and-out-dir": lambda m, c, t, s: ["export", m, "--C", "4", "-o", t / "a.onnx", "--out-dir", t],
    "baseline-bits": lambda m, c, t, s: ["baseline", m, "--method", "rtn", "--bits", "5"],
    "frontier-contexts": lambda m, c, t, s: ["frontier", m, "-c", t / "nope.npz"],
    "frontier-bits": lambda m, c, t, s: ["frontier", m, "-c", c, "--bits", "5", "-o", t / "fr"],
    "frontier-tiers": lambda m, c, t, s: ["frontier", m, "-c", c, "--tiers", "int5", "-o", t / "fr"],
    "frontier-buckets": lambda m, c, t, s: ["frontier", m, "-c", c, "--buckets", "junk", "-o", t / "fr"],
    "frontier-eval-truth-alone": lambda m, c, t, s: ["frontier", m, "-c", c, "--eval-truth", c, "-o", t / "fr"],
    "engine-not-onnx": lambda m, c, t, s: ["engine", c],
    "eval-not-onnx": lambda m, c, t, s: ["eval", c, "--reference", m, "--contexts", c],
    "gate-bound": lambda m, c, t, s: ["gate", m, "--reference", m, "--contexts", c, "--max-degradation", "abc"],
    "gate-max-size-0": lambda m, c, t, s: [
        "gate",
        m,
        "-r",
        m,
        "-c",
        c,
        "--steps",
        "2",
        "--max-size",
        "0MB",
        "--no-latency",
        "--report-dir",
        t / "g",
    ],  # was a failed gate
    "gate-bound-twice": lambda m, c, t, s: [
        "gate",
        m,
        "-r",
        m,
        "-c",
        c,
        "--max-degradation",
        "1%",
        "--max-degradation=50%",
    ],
    "score-steps-twice": lambda m, c, t, s: ["score", m, "-c", c, "--steps", "2", "-T", "3"],
    # an empty item in a list once dropped silently ('1,,8' ran as '1,8'; '--columns ,' meant every column)
    "export-C-empty-item": lambda m, c, t, s: ["export", m, "--C", "4,,8"],
    "export-tiers-empty-item": lambda m, c, t, s: ["export", m, "--C", "4", "--tiers", "int8,int4,"],
    "score-horizons-empty-item": lambda m, c, t, s: [
        "score",
        m,
        "-c",
        c,
        "--steps",
        "4",
        "--horizons",
        "1,,4",
        "-o",
        t / "run",
    ],
    "score-columns-empty": lambda m, c, t, s: ["score", m, "-c", c, "--steps", "2", "--columns", ",", "-o", t / "run"],
    "score-columns-twice": lambda m, c, t, s: [
        "score",
        m,
        "-c",
        c,
        "--steps",
        "2",
        "--columns",
        "OT,OT",
        "-o",
        t / "run",
    ],
    # --zscore on an .npz was ignored without a word: the model ran on windows the user believed standardised
    "score-zscore-npz": lambda m, c, t, s: ["score", m, "-c", c, "--steps", "2", "--zscore", "-o", t / "run"],
    "eval-zscore-npz": lambda m, c, t, s: [
        "eval",
        m,
        "-r",
        m,
        "-c",
        c,
        "--steps",
        "2",
        "--zscore",
        "--no-latency",
        "--report",
        t / "r",
    ],
    # --windows with an .npz was ignored without a word: every window of the file ran
    "score-windows-npz": lambda m, c, t, s: ["score", m, "-c", c, "--steps", "2", "--windows", "1", "-o", t / "run"],
    "gate-windows-npz": lambda m, c, t, s: [
        "gate",
        m,
        "-r",
        m,
        "-c",
        c,
        "--steps",
        "2",
        "--windows",
        "1",
        "--max-degradation",
        "5%",
        "--no-latency",
        "--report-dir",
        t / "g",
    ],
    # an ONNX model was written under whatever name -o gave it
    "baseline-o-not-onnx": lambda m, c, t, s: ["baseline", m, "--method", "rtn", "--bits", "4", "-o", t / "q.npz"],
    "baseline-o-no-suffix": lambda m, c, t, s: ["baseline", m, "--method", "rtn", "--bits", "4", "-o", t / "q"],
    "eval-latency-batches-empty-item": lambda m, c, t, s: [
        "eval",
        m,
        "-r",
        m,
        "-c",
        c,
        "--steps",
        "2",
        "--latency-batches",
        "1,,2",
        "--report",
        t / "r",
    ],
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, two_branch, tmp_path, bad_spec):
    model, ctx = two_branch
    result, lines = _run(CASES[case](model, ctx, tmp_path, bad_spec))
    assert result.exit_code == 2, (result.exit_code, lines)
    assert len(lines) == 1 and lines[0].startswith("error"), lines
    assert "Traceback" not in result.output


def test_failed_gate_exits_1(two_branch, tmp_path):
    model, ctx = two_branch
    result, _ = _run(
        [
            "gate",
            model,
            "--reference",
            model,
            "--contexts",
            ctx,
            "--min-compression",
            "1000",
            "--report-dir",
            tmp_path / "gate",
        ]
    )
    assert result.exit_code == 1, result.output
    assert (tmp_path / "gate" / "gate.json").exists()


def test_a_refused_gate_leaves_no_empty_report_folder(two_branch, tmp_path):
    """The write check runs before the inputs are read; the folders it made must not outlive a refusal."""
    model, ctx = two_branch
    report_dir = tmp_path / "reports" / "gate"
    result, lines = _run(
        ["gate", model, "--reference", tmp_path / "missing.onnx", "--contexts", ctx, "--report-dir", report_dir]
    )
    assert result.exit_code == 2 and "missing.onnx" in lines[0], lines
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("command", ["export", "baseline", "inspect"])
def test_the_input_model_is_never_an_output_even_with_force(two_branch, tmp_path, command):
    model, ctx = two_branch
    before = model.read_bytes()
    if command == "export":
        assert (
            _run(["score", model, "-c", ctx, "--probe", "quant", "--steps", 2, "-o", tmp_path / "run"])[0].exit_code
            == 0
        )
        args = [
            "export",
            model,
            "--run",
            tmp_path / "run",
            "--C",
            "4",
            "--rounding",
            "rtn",
            "--refine",
            "0",
            "-o",
            model,
            "--force",
        ]
    elif command == "baseline":
        args = ["baseline", model, "--method", "rtn", "--bits", "4", "-o", model, "--force"]
    else:
        args = ["inspect", model, "--emit-spec", model, "--force"]
    result, lines = _run(args)
    assert result.exit_code == 2 and len(lines) == 1 and "never overwritten" in lines[0], lines
    assert model.read_bytes() == before


def test_an_output_named_as_a_folder_is_refused(two_branch, tmp_path):
    model, _ = two_branch
    result, lines = _run(["baseline", model, "--method", "rtn", "--bits", "4", "-o", f"{tmp_path / 'newdir'}/"])
    assert result.exit_code == 2 and "is a folder" in lines[0], lines
    assert not (tmp_path / "newdir").exists()


def test_a_score_refused_before_writing_leaves_no_run_folder(two_branch, tmp_path):
    """The run folder is created and locked before the inputs are read; a refusal must not leave it (lock file and
    all)."""
    _, ctx = two_branch
    result, lines = _run(["score", tmp_path / "typo.onnx", "-c", ctx, "-o", tmp_path / "runs" / "x"])
    assert result.exit_code == 2 and "does not exist" in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_frontier_checks_its_truth_before_any_work(two_branch, tmp_path):
    """A truth of the wrong shape once failed (exit 3) after the score, every export and every eval had run."""
    import numpy as np

    model, ctx = two_branch
    windows = len(np.load(ctx)["x"])
    np.savez(tmp_path / "t.npz", y=np.zeros((windows, 1, 1, 32)))
    result, lines = _run(
        ["frontier", model, "-c", ctx, "--steps", 2, "--truth", tmp_path / "t.npz", "--C", "4", "-o", tmp_path / "fr"]
    )
    assert result.exit_code == 2 and "truth 'y' has shape" in lines[0], lines
    assert not (tmp_path / "fr").exists()


def test_a_candidate_that_outputs_nan_fails_any_gate(two_branch, tmp_path):
    """A gate on size alone once passed (exit 0) a candidate whose rollout was NaN: non-finite outputs fail every
    gate."""
    model, ctx = two_branch
    broken = models.nan_model(tmp_path / "broken.onnx")  # same signature as two_branch: x, y [batch, 32]
    result, lines = _run(
        [
            "gate",
            broken,
            "-r",
            model,
            "-c",
            ctx,
            "--steps",
            2,
            "--no-latency",
            "--min-compression",
            "0.5",
            "--report-dir",
            tmp_path / "g",
        ]
    )
    assert result.exit_code == 1, result.output
    assert lines[-1].startswith("gate failed: finite[y]"), lines
    result, lines = _run(
        [
            "gate",
            broken,
            "-r",
            model,
            "-c",
            ctx,
            "--steps",
            2,
            "--no-latency",
            "--max-degradation",
            "1e400",
            "--report-dir",
            tmp_path / "g",
        ]
    )
    assert result.exit_code == 2 and "finite percentage" in lines[0], lines  # '1e400' is inf: a bound everything passes


@pytest.mark.parametrize("command", ["baseline", "eval", "gate"])
def test_an_output_under_a_plain_file_names_the_file_in_the_way(two_branch, tmp_path, command):
    """'cannot create folder blk: File exists' left the user to work out that blk was a file."""
    model, ctx = two_branch
    blocker = tmp_path / "blk"
    blocker.write_text("")
    args = {
        "baseline": ["baseline", model, "--method", "rtn", "--bits", "4", "-o", blocker / "q" / "b.onnx"],
        "eval": ["eval", model, "-r", model, "-c", ctx, "--steps", 2, "--no-latency", "--report", blocker / "r"],
        "gate": [
            "gate",
            model,
            "-r",
            model,
            "-c",
            ctx,
            "--steps",
            2,
            "--no-latency",
            "--max-degradation",
            "5%",
            "--report-dir",
            blocker / "g",
        ],
    }[command]
    result, lines = _run(args)
    assert result.exit_code == 2 and len(lines) == 1 and f"{blocker} is a file, not a folder" in lines[0], lines


def test_a_report_named_like_its_json_is_that_json_not_r_json_json(two_branch, tmp_path):
    """eval --report r.json wrote r.json.json and r.json.md."""
    model, ctx = two_branch
    result, _ = _run(
        ["eval", model, "-r", model, "-c", ctx, "--steps", 2, "--no-latency", "--report", tmp_path / "r.json"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.glob("r.*")) == ["r.json", "r.md"]


@pytest.mark.parametrize("given", ["existing", "new/"])
def test_a_report_given_as_a_folder_goes_inside_it(two_branch, tmp_path, given):
    """eval --report repdir/ wrote repdir.json and repdir.md beside the folder."""
    model, ctx = two_branch
    folder = tmp_path / given.rstrip("/")
    if given == "existing":
        folder.mkdir()
    result, _ = _run(
        ["eval", model, "-r", model, "-c", ctx, "--steps", 2, "--no-latency", "--report", f"{tmp_path}/{given}"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in folder.iterdir()) == ["two.eval.json", "two.eval.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["two.onnx", "ctx.npz", folder.name])


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder nobody can write: chmod for a plain user, a read-only bind mount for root (chmod does not stop root)."""
    import os
    import subprocess

    source, folder = tmp_path / "source", tmp_path / "ro"
    source.mkdir()
    folder.mkdir()
    if os.geteuid() != 0:
        yield source, source
        source.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", str(source), str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"running as root and cannot bind-mount a read-only folder: {mounted.stderr.decode().strip()}")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("running as root and cannot remount a folder read-only")
        yield source, folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_default_report_beside_a_read_only_candidate_hints_at_report(two_branch, read_only_folder):
    """The default report goes beside the candidate; where that cannot be written the fix is --report, so say so."""
    model, ctx = two_branch
    source, folder = read_only_folder
    (source / "cand.onnx").write_bytes(model.read_bytes())
    if folder == source:
        source.chmod(0o555)
    result, lines = _run(["eval", folder / "cand.onnx", "-r", model, "-c", ctx, "--steps", 2, "--no-latency"])
    assert result.exit_code == 2 and len(lines) == 1, lines
    assert str(folder) in lines[0] and "--report" in lines[0], lines


def test_export_max_drift_takes_a_percentage_as_gate_bounds_do(two_branch, tmp_path):
    """--max-drift 5% was refused ('Input should be a valid number') though gate's bounds take '5%' and README
    writes PCT."""
    model, ctx = two_branch
    assert _run(["score", model, "-c", ctx, "--probe", "quant", "--steps", 2, "-o", tmp_path / "run"])[0].exit_code == 0
    common = ["export", model, "--run", tmp_path / "run", "--C", "4", "--rounding", "rtn", "--refine", "0"]
    result, lines = _run([*common, "--max-drift", "50%", "-o", tmp_path / "a.onnx"])
    assert result.exit_code == 0 and (tmp_path / "a.onnx").exists(), lines
    result, lines = _run([*common, "--max-drift", "-1%", "-o", tmp_path / "b.onnx"])
    assert result.exit_code == 2 and "--max-drift takes a percentage" in lines[0], lines


def test_export_refuses_an_output_that_is_not_named_onnx(two_branch, tmp_path):
    """`export -o q.npz` wrote an ONNX model named q.npz (and q.allocation.json beside it)."""
    model, ctx = two_branch
    assert _run(["score", model, "-c", ctx, "--probe", "quant", "--steps", 2, "-o", tmp_path / "run"])[0].exit_code == 0
    result, lines = _run(
        [
            "export",
            model,
            "--run",
            tmp_path / "run",
            "--C",
            "4",
            "--rounding",
            "rtn",
            "--refine",
            "0",
            "-o",
            tmp_path / "q.npz",
        ]
    )
    assert result.exit_code == 2 and len(lines) == 1 and "does not end in .onnx" in lines[0] and "q.onnx" in lines[0], (
        lines
    )
    assert not (tmp_path / "q.npz").exists() and not list(tmp_path.glob("q.*"))


def _broken_inspect(*args, **kwargs):
    raise InternalError("an invariant of inspect broke")


def test_an_internal_error_is_one_line_and_exit_3(two_branch, monkeypatch):
    """A bug (an InternalError, as any exception nothing expects) is one line naming it, exit 3, no traceback."""
    import tqsdeploy.scoring.inspect

    monkeypatch.delenv("TQS_DEBUG", raising=False)
    monkeypatch.setattr(tqsdeploy.scoring.inspect, "inspect_model", _broken_inspect)
    model, _ = two_branch
    result, lines = _run(["inspect", model])
    assert result.exit_code == 3, (result.exit_code, lines)
    assert len(lines) == 1 and lines[0].startswith("error: internal error (InternalError: an invariant"), lines
    assert "TQS_DEBUG=1" in lines[0] and "Traceback" not in result.output


def test_tqs_debug_shows_an_internal_errors_traceback(two_branch, tmp_path):
    """TQS_DEBUG=1 lets the bug through: the command dies with Python's traceback, which names where it was raised."""
    import os
    import subprocess
    import sys

    model, _ = two_branch
    script = (
        "import sys, tqsdeploy.scoring.inspect as inspect\n"
        "from tqsdeploy.errors import InternalError\n"
        "def broken(*args, **kwargs):\n"
        "    raise InternalError('an invariant of inspect broke')\n"
        "inspect.inspect_model = broken\n"
        "from tqsdeploy.cli import main\n"
        "sys.argv = ['tqsdeploy', 'inspect', sys.argv[1]]\n"
        "main()\n"
    )
    for debug, code in (("1", 1), ("", 3)):
        env = {**os.environ, "TQS_DEBUG": debug}
        done = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True, text=True, env=env)
        assert done.returncode == code, (debug, done.returncode, done.stderr)
        if debug:
            assert "Traceback (most recent call last)" in done.stderr and "in broken" in done.stderr, done.stderr
            assert (
                done.stderr.strip().splitlines()[-1] == "tqsdeploy.errors.InternalError: an invariant of inspect broke"
            )
        else:
            assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
