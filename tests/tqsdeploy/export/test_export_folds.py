"""`export --select kfold[:K]`: the kind of model chosen on folds of the scoring windows, each judged by a score
run of the other windows, then built from the full run."""

import json
import os

import models
import numpy as np
import pytest
from conftest import invoke, scored_run

from tqsdeploy import score
from tqsdeploy.errors import InputError
from tqsdeploy.export.folds import Selection, fold_windows, kind_of

scored = scored_run(lambda folder: models.mlp_forecaster(folder / "m.onnx"), (8, 1, 32), seed=0, steps=4, name="folds")


@pytest.fixture(scope="module")
def folded(scored, tmp_path_factory):
    """One export at C 4 chosen on 4 folds: its text and allocation record."""
    model, _, folder = scored
    out = tmp_path_factory.mktemp("folded")
    code, text = invoke(
        "export", model, "--run", folder / "run", "--C", "4", "--select", "kfold:4", "-o", out / "k.onnx"
    )
    assert code == 0, text
    return text, json.loads((out / "k.allocation.json").read_text())


def test_the_folds_partition_the_windows_and_each_sub_run_never_saw_its_fold(scored, folded):
    _, contexts, folder = scored
    _, record = folded
    chose = record["chosen_on"]
    assert chose["windows"] == "kfold" and chose["folds"] == 4
    windows = chose["fold_windows"]
    assert sorted(w for fold in windows for w in fold) == list(range(8)) and all(len(f) == 2 for f in windows)
    every = np.load(contexts)["x"]
    for index, (fold, sub) in enumerate(zip(windows, chose["fold_runs"])):
        run = folder / "run" / sub
        meta = json.loads((run / "run.json").read_text())
        assert meta["status"] == "complete" and meta["fold"]["held_out"] == fold and meta["fold"]["fold"] == index
        assert meta["validation"]["held_out_windows"] == fold and meta["contexts"]["windows"] == 6
        rest = [w for w in range(8) if w not in fold]
        # scored and calibrated on the other windows only, judged on the fold
        np.testing.assert_array_equal(np.load(run / "contexts.npz")["x"], every[rest])
        np.testing.assert_array_equal(np.load(run / "validation.npz")["x"], every[fold])


def test_the_shipped_kind_is_the_one_with_the_lowest_drift_pooled_over_the_folds(folded):
    text, record = folded
    chose = record["chosen_on"]
    sizes = [len(fold) for fold in chose["fold_windows"]]
    pooled = {}
    for kind in chose["kinds"]:
        by_fold = kind["drift_pct_by_fold"]
        assert len(by_fold) == 4
        if None in by_fold:  # not judged on every fold (a uniform method one fold's comparison pruned): not pooled
            assert kind["pooled_drift_pct"] is None
            continue
        expected = sum(d * n for d, n in zip(by_fold, sizes)) / sum(sizes)
        assert kind["pooled_drift_pct"] == pytest.approx(expected)
        pooled[kind["label"]] = expected
    assert {"mixed, as priced", "uniform int4-asym qep"} <= set(pooled), pooled
    best = min(pooled, key=pooled.get)
    assert chose["chosen"] == best and kind_of(chose["shipped"]) == best
    assert kind_of(record["shipped"]) == best
    assert f"chosen on 4 folds of the scoring windows: {chose['shipped']} drifted least" in text


def test_a_second_export_reuses_the_fold_runs_and_chooses_the_same(scored, folded, tmp_path):
    model, _, folder = scored
    _, record = folded
    runs = [folder / "run" / sub for sub in record["chosen_on"]["fold_runs"]]
    before = [(os.stat(r / "sweep.jsonl").st_mtime_ns, os.stat(r / "scores.parquet").st_mtime_ns) for r in runs]
    code, text = invoke(
        "export", model, "--run", folder / "run", "--C", "4", "--select", "kfold:4", "-o", tmp_path / "again.onnx"
    )
    assert code == 0, text
    again = json.loads((tmp_path / "again.allocation.json").read_text())["chosen_on"]
    assert again == record["chosen_on"]
    assert [(os.stat(r / "sweep.jsonl").st_mtime_ns, os.stat(r / "scores.parquet").st_mtime_ns) for r in runs] == before


def test_an_export_without_select_chooses_on_the_scoring_contexts_and_makes_no_folds(scored, tmp_path):
    model, _, folder = scored
    code, text = invoke("export", model, "--run", folder / "run", "--C", "4", "-o", tmp_path / "d.onnx")
    assert code == 0, text
    record = json.loads((tmp_path / "d.allocation.json").read_text())
    assert record["chosen_on"] == {"windows": "scoring"} and "folds" not in text


@pytest.mark.parametrize(
    "select, said",
    [
        ("kfold:1", "K must be a whole number of folds, at least 2"),
        ("kfold:x", "K must be a whole number of folds, at least 2"),
        ("kfold:9", "--select kfold:9 needs at least 9 scoring windows; the run has 8"),
        ("folds", "--select takes scoring, validation or kfold[:K], not 'folds'"),
        ("scoring:3", "--select takes scoring, validation or kfold[:K], not 'scoring:3'"),
        ("validation", "--select validation needs validation windows"),
    ],
)
def test_a_bad_selection_is_one_line_and_exit_2(scored, tmp_path, select, said):
    model, _, folder = scored
    code, text = invoke(
        "export", model, "--run", folder / "run", "--C", "4", "--select", select, "-o", tmp_path / "x.onnx"
    )
    assert code == 2 and said in text and "Traceback" not in text, text
    assert not list(tmp_path.iterdir())


def test_kfold_goes_with_c_only_and_not_with_validation_windows(scored, tmp_path):
    model, contexts, folder = scored
    run = folder / "run"
    code, text = invoke(
        "export", model, "--run", run, "--uniform", "int4-asym", "--select", "kfold", "-o", tmp_path / "u.onnx"
    )
    assert code == 2 and "--select kfold chooses between the candidates of --C" in text, text
    code, text = invoke(
        "export",
        model,
        "--run",
        run,
        "--C",
        "4",
        "--select",
        "kfold",
        "--validate",
        contexts,
        "-o",
        tmp_path / "v.onnx",
    )
    assert code == 2 and "cannot go with --select kfold" in text, text


def test_selection_and_folds_read_as_documented():
    assert Selection.parse("kfold") == Selection("kfold", 3) and Selection.parse("kfold:5") == Selection("kfold", 5)
    assert Selection.parse("scoring") == Selection("scoring")
    # contiguous stretches of near-equal size, every window once
    assert fold_windows(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert fold_windows(6, 6) == [[i] for i in range(6)]
    assert kind_of("uniform int2-asym qep/min-max") == "uniform int2-asym qep"
    assert kind_of("mixed, calibrated as allocated") == "mixed, calibrated as allocated"


@pytest.mark.parametrize("held_out", [(0, 0), (8,), (-1,), tuple(range(8))])
def test_windows_held_out_by_index_must_be_distinct_windows_leaving_some_to_score(scored, tmp_path, held_out):
    model, contexts, _ = scored
    with pytest.raises(InputError, match="are not distinct windows of the 8 context windows leaving some to score"):
        score(model, contexts, steps=2, out=tmp_path / "run", held_out=held_out)
    assert not (tmp_path / "run" / "run.json").exists()
