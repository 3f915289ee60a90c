"""Long work shows progress: plain lines with ETA when not on a terminal, a bar on one."""

import io
import re
import time

import models
import numpy as np
from conftest import cli
from rich.console import Console

from tqsdeploy.progress import INTERVAL_S, Progress


class _Stamped(io.StringIO):
    """A console's file that notes when each line was written."""

    def __init__(self):
        super().__init__()
        self.stamps: list[tuple[float, str]] = []

    def write(self, text):
        self.stamps += [(time.monotonic(), line) for line in text.splitlines() if line]
        return super().write(text)


def test_plain_lines_a_done_line_per_stage_and_timed_lines_at_most_one_per_interval_for_the_command():
    """A 9-second export printed about 60 lines (issue 55, item 5): off a terminal each display says when its work is
    done, and between those every display on the console together prints at most one timed line per interval."""
    stream = io.StringIO()
    with Progress(Console(file=stream, width=200), "scoring", 40, "rollouts", interval=3600) as bar:
        for _ in range(40):
            bar.advance(detail="unit")
    assert stream.getvalue().splitlines() == [stream.getvalue().splitlines()[0]]  # no line per tenth any more
    assert re.fullmatch(r"scoring: 40/40 rollouts \(100%\), done in \d+ s", stream.getvalue().strip())

    stamped, interval = _Stamped(), 0.25
    console = Console(file=stamped, width=200)
    started = time.monotonic()
    for stage in ("encoding (uniform int4)", "encoding (uniform int8)", "encoding (mixed)"):  # one command's stages
        with Progress(console, stage, 10, "weights", interval=interval) as bar:
            for _ in range(10):
                time.sleep(0.03)
                bar.advance(detail="w")
    elapsed = time.monotonic() - started
    done = [(t, line) for t, line in stamped.stamps if "(100%), done in" in line]
    timed = [(t, line) for t, line in stamped.stamps if "(100%), done in" not in line]
    assert [line.split(":")[0] for _, line in done] == [
        "encoding (uniform int4)",
        "encoding (uniform int8)",
        "encoding (mixed)",
    ]
    assert timed and len(timed) <= elapsed / interval + 1, stamped.stamps
    for (before, _), (at, line) in zip(stamped.stamps, stamped.stamps[1:]):
        if "done in" not in line:  # a timed line comes an interval after the command's last line, whichever printed it
            assert at - before >= interval * 0.9, stamped.stamps
    assert all(re.search(r", \d+ s elapsed, ETA \d+ s \[w\]$", line) for _, line in timed), timed
    stream = io.StringIO()
    with Progress(Console(file=stream, width=200), "slow", 1000, interval=0) as bar:  # the time rule alone
        bar.advance()
        bar.advance()
    assert stream.getvalue().count("slow: ") == 2


def test_terminal_gets_a_rich_bar():
    stream = io.StringIO()
    with Progress(Console(file=stream, force_terminal=True, width=120), "measuring tiers", 3, "rollouts") as bar:
        for _ in range(3):
            bar.advance()
    text = stream.getvalue()
    assert "measuring tiers" in text and "3/3" in text and "ETA" in text and "━" in text


def test_an_estimate_of_what_is_left_is_the_eta_from_the_start_on_a_line_and_on_a_bar():
    """Items that differ in cost by orders of magnitude (the frontier's steps) show the caller's estimate, before the
    first item ends and after, not the items' pace."""
    left = [3725.0]
    stream = io.StringIO()
    with Progress(Console(file=stream, width=200), "frontier", 10, "steps", interval=0) as bar:
        bar.remaining = lambda: left[0]
        bar.advance()
        left[0] = 65.0
        bar.advance()
    lines = stream.getvalue().splitlines()
    assert "1/10 steps (10%)" in lines[0] and lines[0].endswith("ETA 1 h 02 min")
    assert lines[1].endswith("ETA 1 min 05 s")
    stream = io.StringIO()
    bar = Progress(Console(file=stream, force_terminal=True, width=120), "frontier", unit="steps")
    bar.remaining = lambda: 3725.0
    bar.start(10)
    bar.advance()
    bar.stop()
    assert "1:02:05" in stream.getvalue()


def test_score_export_baseline_and_frontier_print_progress_off_a_terminal(tmp_path):
    model = models.gather_forecaster(tmp_path / "emb.onnx")
    contexts = tmp_path / "ctx.npz"
    np.savez(
        contexts, x=np.random.default_rng(1).standard_normal((3, 1, 32)).astype(np.float32), ids=np.array([[1]] * 3)
    )

    def run(*args):
        result = cli(*args)
        assert result.exit_code == 0, result.output
        return result.output

    text = run("score", model, "-c", contexts, "--steps", 2, "--probes", 1, "--out", tmp_path / "run")
    assert re.findall(r"^scoring: .*", text, re.M) == ["scoring: 4/4 rollouts (100%), done in 0 s"]  # a short one
    started = time.monotonic()
    text = run("export", model, "--run", tmp_path / "run", "--C", 2, "--out-dir", tmp_path)
    seconds = time.monotonic() - started
    assert re.search(r"measuring tiers: (\d+)/\1 rollouts \(100%\), done in", text)
    lines = re.findall(r"^(?:encoding|measuring).*", text, re.M)
    stages = [line for line in lines if "(100%), done in" in line]
    assert len(lines) - len(stages) <= seconds / INTERVAL_S + 1, lines  # a line per stage, a few more on time
    passes = re.findall(
        r"encoding \((uniform|mixed) ([^)]*)\): (\d+)/\3 weights \(100%\), done in", text
    )  # every pass, each to its end
    assert ("uniform", "int8-asym qep", "2") in passes and ("mixed", "qep", "2") in passes
    assert text.index("encoding (uniform int2-asym qep)") < text.index(
        "measuring tiers"
    )  # the tiers' passes come before the rollouts' ETA
    text = run("baseline", model, "--method", "gptq", "--bits", 4, "--calib", contexts, "-o", tmp_path / "b.onnx")
    assert "gptq W4: 4/4 weights (100%), done in" in text  # a pass per grid (--grids auto): 2 weights each
    text = run(
        "frontier",
        model,
        "-c",
        contexts,
        "--steps",
        2,
        "--C",
        2,
        "--baselines",
        "rtn",
        "--bits",
        4,
        "--out",
        tmp_path / "f",
    )
    assert re.search(r"frontier: (\d+)/\1 steps \(100%\), done in", text)


def test_a_long_step_still_prints_on_time():
    import time

    stream = io.StringIO()
    with Progress(Console(file=stream, width=200), "frontier", 10, "steps", interval=0.2) as bar:
        bar.advance(detail="export C4")
        time.sleep(0.7)  # no advance: the timer keeps the log alive
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.startswith("frontier: 1/10 steps") for line in lines[1:]), lines


def test_every_plain_line_carries_elapsed_time_and_an_eta_from_an_estimate_until_an_item_ends():
    """`scoring: 0/50 rollouts (0%)` ten times over 110 s looked dead (issue 34, item 7): before any item ends a line
    still says how long it has run, and the caller's estimate as the ETA; after one ends, the pace does."""
    stream = io.StringIO()
    with Progress(Console(file=stream, width=200), "scoring", 50, "rollouts", interval=0) as bar:
        bar.advance(0)  # a line with nothing finished (what the heartbeat prints during a long first rollout)
        bar.estimate(110)
        bar.advance(0)
        bar.advance()
    lines = stream.getvalue().splitlines()
    assert re.fullmatch(r"scoring: 0/50 rollouts \(0%\), \d+ s elapsed", lines[0]), lines
    assert re.fullmatch(
        r"scoring: 0/50 rollouts \(0%\), \d+ s elapsed, ETA about 1 min [45]\d s \(estimated\)", lines[1]
    ), lines
    assert re.fullmatch(r"scoring: 1/50 rollouts \(2%\), \d+ s elapsed, ETA \d+ s", lines[2]), lines


def test_score_hands_auto_s_sweep_estimate_to_the_progress(two_branch, tmp_path):
    from tqsdeploy import ScoreSettings, score

    model, contexts = two_branch
    estimates = []
    table = score(
        model,
        contexts,
        steps=2,
        out=tmp_path / "run",
        settings=ScoreSettings(gauss_draws=1),
        on_estimate=estimates.append,
    )
    assert (
        len(estimates) == 1
        and estimates[0] > 0
        and table.meta["strategy_estimates_s"][table.meta["strategy"]] == estimates[0]
    )


def test_every_encoding_pass_of_an_export_runs_to_its_end_and_no_display_outlives_the_command(two_branch, tmp_path):
    """A calibrated pass that takes weights from an earlier pass (refinement's check of the mixed model) counts them
    as done: before, they were never reported, the pass's display never reached its total and was never stopped,
    and its timer went on printing "encoding (mixed qep): 2/3 weights" into whatever ran next in the process."""
    import threading

    from tqsdeploy.progress import HEARTBEAT_THREAD

    model, contexts = two_branch
    result = cli("score", model, "-c", contexts, "--steps", 4, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    for target in (3, 6):
        result = cli("export", model, "--run", tmp_path / "run", "--C", target, "--out-dir", tmp_path, "--force")
        assert result.exit_code == 0, result.output
        begun = re.findall(r"^encoding \(([^)]*)\): \d+/\d+ weights", result.output, re.M)
        ended = re.findall(r"^encoding \(([^)]*)\): (\d+)/\2 weights \(100%\), done in", result.output, re.M)
        assert begun and set(begun) == {label for label, _ in ended}, result.output
        assert not [t for t in threading.enumerate() if t.name == HEARTBEAT_THREAD]
