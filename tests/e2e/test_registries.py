"""A rounding method, a runtime, a sweep strategy and an allocation objective each defined by one entry in its
registry reach the CLI's choices and help, run, and show in the reports, with nothing else in the toolkit edited;
once the test's registration is undone they are gone again (as tests/tiers/test_formats.py does for a tier)."""

import json
from functools import partial

import models
import numpy as np
import onnx
import polars as pl
import pytest
from conftest import invoke

from runtimes import RUNTIMES, OrtRuntime, Provider
from tiers import METHODS, Method
from tqsdeploy.export.objectives import OBJECTIVES, Objective
from tqsdeploy.sweep.strategies import BY_NAME, Feed

wide_invoke = partial(invoke, columns=250, unbox=True)  # help wraps inside a box


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("registries")
    model = models.mlp_forecaster(folder / "mlp.onnx")
    contexts = folder / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(2).standard_normal((6, 2, 32)).astype(np.float32))
    return model, contexts, folder


def _weights(path) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


FAKE_METHOD = Method("fake", "FAKE", stats=False)
"""Round to nearest under another name: no statistics, so every tier rounds it as RTN."""


def test_a_registered_method_is_offered_run_and_labelled(small, monkeypatch):
    model, contexts, folder = small
    with monkeypatch.context() as registered:
        registered.setitem(METHODS, "fake", FAKE_METHOD)
        code, text = wide_invoke("baseline", "--help")
        assert code == 0 and "rtn|gptq|gptaq|qep|fake" in text and "rtn, gptq, gptaq, qep or fake." in text
        code, text = wide_invoke("export", "--help")
        assert "rtn|gptq|gptaq|qep|fake|auto" in text and "grid: rtn, gptq, gptaq, qep or fake (calibrated" in text
        code, text = wide_invoke("frontier", "--help")
        assert "rtn|gptq|gptaq|qep|fake|auto" in text and "[default: rtn,gptq,gptaq,qep,fake]" in text

        code, text = wide_invoke(
            "baseline", model, "--method", "fake", "--bits", "4", "--calib", contexts, "-o", folder / "fake4.onnx"
        )
        assert code == 0, text
        assert (
            "fake W4 (int4-asym)" in text
            and "fake rounds each weight to nearest and reads no calibration data: --calib not used" in text
        )
        code, text = wide_invoke("baseline", model, "--method", "rtn", "--bits", "4", "-o", folder / "rtn4.onnx")
        assert code == 0, text
        fake, rtn = _weights(folder / "fake4.onnx"), _weights(folder / "rtn4.onnx")
        assert fake.keys() == rtn.keys() and all(np.array_equal(fake[n], rtn[n]) for n in fake)
        assert json.loads((folder / "fake4.baseline.json").read_text())["method"] == "fake"

        out = folder / "front"
        code, text = wide_invoke(
            "frontier",
            model,
            "-c",
            contexts,
            "--steps",
            "2",
            "--C",
            "4",
            "--baselines",
            "fake",
            "--bits",
            "4",
            "-o",
            out,
        )
        assert code == 0, text
        frame = pl.read_parquet(out / "frontier.parquet")
        assert ("FAKE", "W4") in set(zip(frame["method"], frame["setting"]))
        assert "FAKE" in (out / "report.md").read_text()
    assert "fake" not in METHODS
    code, text = wide_invoke("baseline", "--help")
    assert "|fake" not in text and "qep or fake" not in text
    code, text = wide_invoke("baseline", model, "--method", "fake", "--bits", "4", "-o", folder / "gone.onnx")
    assert code == 2 and "--method must be one of rtn, gptq, gptaq, qep" in text


def make(provider, threads=None, **options):
    """The fake provider's runtime: ONNX Runtime on the CPU (what `runtimes.for_provider` calls in the entry's
    module)."""
    return OrtRuntime(threads=threads, **options)


FAKE_PROVIDER = Provider("fake", __name__, "ONNX Runtime's CPU provider under another name")


def test_a_registered_runtime_is_offered_and_evaluates(small, monkeypatch):
    model, contexts, folder = small
    code, text = wide_invoke("baseline", model, "--method", "rtn", "--bits", "4", "-o", folder / "candidate.onnx")
    assert code == 0, text
    with monkeypatch.context() as registered:
        registered.setitem(RUNTIMES, "fake", FAKE_PROVIDER)
        code, text = wide_invoke("eval", "--help")
        assert "cpu|cuda|tensorrt|fake" in text and "cpu, cuda, tensorrt or fake." in text
        code, text = wide_invoke("score", "--help")
        assert "cpu|cuda|tensorrt|trt-engine|fake" in text
        assert (
            "or trt-engine (native TensorRT, weights refitted), "
            "or fake (ONNX Runtime's CPU provider under another name)." in text
        )
        code, text = wide_invoke("export", "--help")
        assert "cpu|cuda|tensorrt|fake" in text

        reports = {}
        for provider in ("fake", "cpu"):
            prefix = folder / f"eval-{provider}"
            code, text = wide_invoke(
                "eval",
                folder / "candidate.onnx",
                "-r",
                model,
                "-c",
                contexts,
                "--steps",
                "2",
                "--provider",
                provider,
                "--no-latency",
                "--report",
                prefix,
            )
            assert code == 0, text
            reports[provider] = json.loads(prefix.with_suffix(".json").read_text())
        assert reports["fake"]["runtime"]["provider"] == "fake"
        assert reports["fake"]["outputs"] == reports["cpu"]["outputs"]  # the same runtime underneath: the same numbers
    assert "fake" not in RUNTIMES
    code, text = wide_invoke("eval", "--help")
    assert "cpu|cuda|tensorrt " in text and "fake" not in text


class FakeFeed(Feed):
    """'feed' under another name."""

    name = "fake"
    help = "feed under another name"


def test_a_registered_strategy_is_offered_and_scores(small, monkeypatch):
    model, contexts, folder = small
    with monkeypatch.context() as registered:
        registered.setitem(BY_NAME, "fake", FakeFeed)
        code, text = wide_invoke("score", "--help")
        assert (
            "auto|feed|rebuild|unit|prefix|batch|fake" in text
            and "dynamic-batch models), fake (feed under another name) or auto (time them" in text
        )
        scores = {}
        for strategy in ("fake", "feed"):
            run = folder / f"run-{strategy}"
            code, text = wide_invoke("score", model, "-c", contexts, "--steps", "3", "--strategy", strategy, "-o", run)
            assert code == 0, text
            assert json.loads((run / "run.json").read_text())["strategy"] == strategy
            scores[strategy] = pl.read_parquet(run / "scores.parquet").sort("unit")
        assert scores["fake"]["gamma"].to_list() == scores["feed"]["gamma"].to_list()
    assert "fake" not in BY_NAME
    code, text = wide_invoke(
        "score", model, "-c", contexts, "--steps", "3", "--strategy", "fake", "-o", folder / "run-gone"
    )
    assert code == 2 and "unknown strategy 'fake'; choose one of auto, feed, rebuild, unit, prefix, batch" in text


class _Flat(Objective):
    """Every live slot's loss is its share of the bits it loses: a fake that needs no rollout."""

    def losses(self, view, measured):
        return (lambda slot, tier: 0.0 if slot.unit in view.dead else slot.params * 2.0 ** (-tier.bits)), set()


def test_a_registered_objective_is_offered_allocated_and_recorded(small, monkeypatch):
    """A fake objective in `OBJECTIVES` reaches export's and frontier's --objective, allocates an export whose record
    names it, and is refused again once unregistered."""
    model, contexts, folder = small
    code, text = wide_invoke("score", model, "--contexts", contexts, "--steps", "3", "--out", folder / "objective-run")
    assert code == 0, text
    with monkeypatch.context() as registered:
        registered.setitem(OBJECTIVES, "flat", _Flat("flat", "a test's flat price"))
        for command in ("export", "frontier"):
            code, text = wide_invoke(command, "--help")
            assert code == 0 and "measured|response|paper|flat" in text, text
        code, text = wide_invoke(
            "export",
            model,
            "--run",
            folder / "objective-run",
            "--C",
            "4",
            "--objective",
            "flat",
            "--rounding",
            "rtn",
            "-o",
            folder / "flat.onnx",
        )
        assert code == 0, text
        record = json.loads((folder / "flat.allocation.json").read_text())
        assert record["objective"] == "flat" or record["shipped"].startswith("uniform"), record["shipped"]
        assert ("mixed, as priced", "flat", "rtn") in {
            (c["label"], c["objective"], c["rounding"]) for c in record["compared"]
        }
    code, text = wide_invoke(
        "export",
        model,
        "--run",
        folder / "objective-run",
        "--C",
        "4",
        "--objective",
        "flat",
        "-o",
        folder / "flat2.onnx",
    )
    assert code == 2 and "unknown objective 'flat'" in text
