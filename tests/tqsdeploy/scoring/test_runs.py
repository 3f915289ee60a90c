"""A score run read back as one typed object (`ScoreRun`), runs this version cannot read refused in one line,
and runtimes made by provider name behind the `Runtime` protocol."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import cli

import runtimes
from runtimes.trt import TrtRuntime
from tqsdeploy import ScoreRun, ScoreSettings, UnitSelection, score
from tqsdeploy.errors import InputError
from tqsdeploy.scoring.runs import RUN_FORMAT, model_label


@pytest.fixture
def run(two_branch, tmp_path):
    model, contexts = two_branch
    return score(
        model,
        contexts,
        steps=4,
        out=tmp_path / "run",
        settings=ScoreSettings(gauss_draws=1, horizons=(1, 2)),
        selection=UnitSelection(min_params=4),
        strategy="feed",
    )


def test_a_loaded_run_carries_what_score_returned(run, two_branch):
    loaded = ScoreRun.load(run.run_dir)
    assert loaded.frame.equals(run.frame) and loaded.meta == json.loads(json.dumps(run.meta)) and loaded.complete
    assert (
        loaded.model.path == Path(two_branch[0]).resolve()
        and loaded.model.sha256 == run.model.sha256
        and loaded.model.bytes > 0
    )
    assert loaded.spec == run.spec and loaded.spec.steps == 4
    assert loaded.settings == ScoreSettings(gauss_draws=1, horizons=(1, 2))
    assert loaded.selection == UnitSelection(min_params=4)
    assert loaded.strategy == "feed" and loaded.fingerprint == run.meta["fingerprint"]
    assert loaded.contexts_sha256 == run.meta["contexts"]["sha256"] and loaded.versions["tqsdeploy"]
    assert loaded.timings_s["sweep"] > 0 and loaded.meta["format"] == RUN_FORMAT


def test_a_run_prepares_its_own_sweep_again(run, two_branch):
    prepared = ScoreRun.load(run.run_dir).prepare(
        Path(two_branch[0]), runtimes.DEFAULT_RUNTIME, strategy="feed", lanes=1, runtime_keeps_weights=True
    )
    try:
        assert (
            replace(prepared.spec, origin=run.spec.origin) == run.spec
            and prepared.contexts.sha256 == run.contexts_sha256
        )
        assert sorted(u.name for u in prepared.units) == sorted(run.frame["unit"])
    finally:
        prepared.session.close()


def _export_fails(run_dir: Path, model, *phrases):
    result = cli("export", model, "--run", run_dir, "--C", "4", "-o", run_dir.parent / "q.onnx")
    text = " ".join((result.output + (result.stderr if result.stderr_bytes is not None else "")).split())
    assert result.exit_code == 2 and "Traceback" not in text, text
    for phrase in phrases:
        assert phrase in text, text


def test_a_folder_without_run_json_is_refused_in_one_line(two_branch, tmp_path):
    (tmp_path / "empty").mkdir()
    _export_fails(tmp_path / "empty", two_branch[0], "is not a finished score run")
    with pytest.raises(InputError, match="not a finished score run"):
        ScoreRun.load(tmp_path / "empty")


@pytest.mark.parametrize(
    "change, phrase",
    [
        (lambda meta: meta.update(format=RUN_FORMAT + 1), "is from a newer tqsdeploy"),
        (lambda meta: meta.pop("probe"), "is not a score run this version of tqsdeploy can read"),
        (lambda meta: meta["probe"].update(rounding_bits=3), "is not a score run this version of tqsdeploy can read"),
    ],
)
def test_a_run_of_another_version_is_refused_in_one_line(run, two_branch, change, phrase):
    path = run.run_dir / "run.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))
    _export_fails(run.run_dir, two_branch[0], phrase)


def test_a_run_json_that_is_not_json_is_refused_in_one_line(run, two_branch):
    (run.run_dir / "run.json").write_text("{ not json")
    _export_fails(run.run_dir, two_branch[0], "is not valid JSON")


def test_runtimes_come_by_provider_name_behind_one_protocol():
    cpu = runtimes.for_provider("cpu", 2)
    assert cpu.provider == "cpu" and cpu.threads == 2 and cpu.with_threads(1).threads == 1
    assert runtimes.for_provider("cuda", tf32=True).tf32
    engine = runtimes.for_provider("trt-engine", 4)  # CPU threads do not apply to TensorRT
    assert (
        isinstance(engine, TrtRuntime)
        and engine.threads is None
        and engine.with_threads(2) is engine
        and engine.yielding() is engine
    )
    members = [name for name in vars(runtimes.Runtime) if not name.startswith("_")] + list(
        runtimes.Runtime.__annotations__
    )
    for made in (cpu, engine):
        assert all(hasattr(made, name) for name in members), [name for name in members if not hasattr(made, name)]
    with pytest.raises(
        runtimes.RuntimeUnavailable, match="unknown provider 'tpu'; choose one of cpu, cuda, tensorrt, trt-engine"
    ):
        runtimes.for_provider("tpu")
    with pytest.raises(runtimes.RuntimeUnavailable, match="has no setting exact_qdq"):
        runtimes.for_provider("trt-engine", exact_qdq=True)


def test_a_linked_model_is_labelled_by_the_path_given_not_its_target(two_branch, tmp_path, monkeypatch):
    """A Hugging Face snapshot links snap/model.onnx to blobs/<hash>: the label once took the blob's folder."""
    model, ctx = two_branch
    (tmp_path / "blobs").mkdir()
    blob = tmp_path / "blobs" / "9f2c41d0"
    blob.write_bytes(model.read_bytes())
    for folder in ("snap", "lnk"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "model.onnx").symlink_to(Path("..") / "blobs" / blob.name)
    monkeypatch.chdir(tmp_path)
    assert (
        model_label("lnk/model.onnx") == "lnk_model" and model_label(tmp_path / "snap" / "model.onnx") == "snap_model"
    )
    assert model_label("snap/../lnk/model.onnx") == "lnk_model"
    result = cli("score", "snap/model.onnx", "-c", ctx, "--probe", "quant")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tqs-runs" / "snap_model" / "run.json").exists(), sorted(
        p.name for p in (tmp_path / "tqs-runs").iterdir()
    )
