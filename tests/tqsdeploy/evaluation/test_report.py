"""The frontier report a person reads: intervals, verdicts in words, well-formed HTML."""

from html.parser import HTMLParser

import models
import numpy as np
import polars as pl
from conftest import cli

from runtimes import OrtRuntime

VOID = {"meta", "img", "br", "hr", "link", "input"}


class Balanced(HTMLParser):
    """Fails on a closing tag that does not close the innermost open element."""

    def __init__(self):
        super().__init__()
        self.stack, self.numeric, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "td":
            self.numeric.append(dict(attrs).get("class") == "num")

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] in ("td", "b"):
            self.text.append((data, self.numeric[-1] if self.numeric else None))


def test_report_has_intervals_verdicts_and_valid_html(tmp_path):
    model = models.mlp_forecaster(tmp_path / "m.onnx", n=32, hidden=64)
    x = np.random.default_rng(0).standard_normal((6, 2, 32)).astype(np.float32)
    np.savez(tmp_path / "ctx.npz", x=x)
    session, truth = OrtRuntime().open(model), []
    for window in x:
        state, steps = window, []
        for step in range(4):
            state = session.run({"x": state})["y"]
            steps.append(state + np.random.default_rng(step).normal(0, 0.05, state.shape).astype(np.float32))
        truth.append(np.stack(steps))
    np.savez(tmp_path / "truth.npz", y=np.stack(truth))
    result = cli(
        "frontier",
        model,
        "-c",
        tmp_path / "ctx.npz",
        "--truth",
        tmp_path / "truth.npz",
        "--steps",
        "4",
        "--C",
        "4",
        "--baselines",
        "rtn",
        "--bits",
        "2,4",
        "-o",
        tmp_path / "f",
    )
    assert result.exit_code == 0, result.output
    frame = pl.read_parquet(tmp_path / "f" / "frontier.parquet").filter(pl.col("variable") == "all")
    assert ((frame["drift_lo"] <= frame["drift_pct"] + 1e-9) & (frame["drift_pct"] <= frame["drift_hi"] + 1e-9)).all()
    report = (tmp_path / "f" / "report.md").read_text()
    assert "degradation % [95% CI]" in report and "within noise" in report.replace("worse than FP32", "within noise")
    assert "1.9e-07" not in report and "logarithmic axis" in report
    parser = Balanced()
    parser.feed((tmp_path / "f" / "report.html").read_text())
    assert parser.stack == []
    cells = dict(parser.text)
    assert cells["RTN"] is False and cells["W4"] is False  # names align left, numbers right
    assert any(numeric for text, numeric in parser.text if text.replace(".", "").isdigit())


def test_bootstrap_intervals_are_bca_and_survive_degenerate_windows():
    from scipy import stats

    from tqsdeploy.evaluation.metrics import bootstrap, degradation, window_mean

    skewed = np.random.default_rng(0).exponential(1.0, 8)  # per-window MAEs over 8 windows: few and skewed
    low, high = bootstrap((skewed,), window_mean, 2000, 0)
    percentile = stats.bootstrap(
        (skewed,), np.mean, n_resamples=2000, method="percentile", rng=np.random.default_rng(0)
    ).confidence_interval
    assert low < skewed.mean() < high and (low, high) != (percentile.low, percentile.high)
    assert bootstrap((np.ones(5),), window_mean, 500, 0) == [1.0, 1.0]  # BCa undefined: no spread, no interval
    assert bootstrap((np.ones(1),), window_mean, 500, 0) == [1.0, 1.0]
    low, high = bootstrap((skewed * 1.1, skewed), degradation, 500, 0)  # paired windows: exactly 10% worse in each
    assert abs(low - 10) < 1e-6 and abs(high - 10) < 1e-6
