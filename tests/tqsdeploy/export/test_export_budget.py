"""`export --max-drift PCT` without --C: the most compressed model within PCT on validation windows, and
`--validate` choosing between the candidates on windows the model was not fitted to."""

import json

import models
import numpy as np
import pytest
from conftest import invoke, scored_run

from tiers import DEFAULT_TIERS
from tqsdeploy.evaluation.evaluate import evaluate
from tqsdeploy.export.validation import worst_drift

scored = scored_run(lambda folder: models.mlp_forecaster(folder / "m.onnx"), (4, 1, 32), seed=0, steps=4, name="budget")


@pytest.fixture(scope="module")
def validation(scored):
    """Six windows the score never saw (another draw), with the model's input name."""
    _, _, folder = scored
    path = folder / "val.npz"
    np.savez(path, x=np.random.default_rng(1).standard_normal((6, 1, 32)).astype(np.float32))
    return path


@pytest.fixture(scope="module")
def searched(scored, validation, tmp_path_factory):
    """One search at a budget between the drifts of the grid's points (INT8 near 0.4%, INT4 near 6% here), its
    text and its allocation record."""
    model, _, folder = scored
    out = tmp_path_factory.mktemp("searched")
    before = _prices(folder)
    code, text = invoke(
        "export", model, "--run", folder / "run", "--max-drift", "1%", "--validate", validation, "--out-dir", out
    )
    assert code == 0, text
    record = json.loads((out / "m.drift1pct.allocation.json").read_text())
    return out / "m.drift1pct.onnx", text, record, (before, _prices(folder))


def _prices(folder) -> int:
    path = folder / "run" / "measured.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_the_chosen_model_meets_the_budget_on_the_validation_windows_and_the_next_larger_c_does_not(
    scored, validation, searched, tmp_path
):
    model, _, folder = scored
    path, text, record, _ = searched
    budget = record["budget"]
    chosen = next(t for t in budget["tried"] if t["target_C"] == budget["chosen_C"])
    assert chosen["meets_budget"] and chosen["drift_ci95"][1] <= 1.0
    # measured again by eval on the written file: the number the search judged
    report = evaluate(path, model, validation, spec=folder / "run" / "rollout.toml")
    again = worst_drift(report)
    assert again.pct == pytest.approx(chosen["drift_pct"]) and again.ci95[1] <= 1.0
    assert record["target_compression"] == budget["chosen_C"] and record["chosen_on"]["windows"] == "validation"
    # every more compressed model tried misses the budget, and the search bracketed the chosen size closely (by the
    # sizes reached: a uniform model shipped at a target can be more compressed than the target asked)
    above = [t for t in budget["tried"] if t["compression"] > chosen["compression"]]
    assert above and not any(t["meets_budget"] for t in above)
    closest = min(above, key=lambda t: t["compression"])
    assert closest["compression"] <= 1.05 * chosen["compression"], budget["tried"]
    nearest = closest["target_C"]
    assert f"chose C {chosen['target_C']:.4g}" in text and "search for the most compressed model within 1%" in text
    assert not list((folder / "run").glob(".validate-*"))  # the candidates' scratch files are gone
    # the nearest larger C as one export with --C, bounded on the same windows: refused, nothing written
    code, said = invoke(
        "export", model, "--run", folder / "run", "--C", f"{nearest}", "--max-drift", "1%", "--validate", validation,
        "--out-dir", tmp_path,
    )  # fmt: skip
    assert code == 1 and "validation windows" in said and "above --max-drift 1%" in said, said
    assert not list(tmp_path.glob("*.onnx"))


def test_the_search_prices_each_unit_and_tier_once(searched):
    _, _, record, (before, after) = searched
    assert len(record["budget"]["tried"]) >= 4
    # shared group prices: one pricing rollout per unit and tier, however many targets the search tried
    assert 0 < after - before <= record["units"] * len(DEFAULT_TIERS), (before, after)


def test_validate_chooses_between_the_candidates_on_its_windows(scored, validation, tmp_path):
    model, _, folder = scored
    code, text = invoke(
        "export", model, "--run", folder / "run", "--C", "4.6", "--validate", validation, "--out-dir", tmp_path
    )
    assert code == 0, text
    record = json.loads((tmp_path / "m.C4.6.allocation.json").read_text())
    chosen_on = record["chosen_on"]
    assert chosen_on["windows"] == "validation" and chosen_on["count"] == 6
    judged = {c["label"]: c["drift_pct"] for c in chosen_on["candidates"] if c["drift_pct"] is not None}
    assert len(judged) >= 2 and record["shipped"] == min(judged, key=judged.get)
    assert "chosen on the 6 validation windows" in text
    # without --validate the scoring contexts choose, as before
    code, text = invoke("export", model, "--run", folder / "run", "--C", "4.6", "--out-dir", tmp_path / "plain")
    record = json.loads((tmp_path / "plain" / "m.C4.6.allocation.json").read_text())
    assert code == 0 and record["chosen_on"] == {"windows": "scoring"} and "budget" not in record


def test_max_drift_with_c_keeps_its_meaning(scored, tmp_path):
    model, _, folder = scored
    code, text = invoke(
        "export", model, "--run", folder / "run", "--C", "4", "--max-drift", "0.000001", "--out-dir", tmp_path
    )
    assert code == 1 and "on the scoring contexts" in text and "above --max-drift 1e-06%" in text, text
    code, text = invoke(
        "export", model, "--run", folder / "run", "--C", "4", "--max-drift", "100", "--out-dir", tmp_path
    )
    assert code == 0 and (tmp_path / "m.C4.onnx").exists(), text


def test_a_budget_no_model_meets_exits_1_and_writes_nothing(scored, validation, tmp_path):
    model, _, folder = scored
    code, text = invoke(
        "export", model, "--run", folder / "run", "--max-drift", "0.0001%", "--validate", validation, "--out-dir",
        tmp_path,
    )  # fmt: skip
    assert code == 1 and "no model meets --max-drift 0.0001% on the validation windows" in text, text
    assert "nothing written" in text and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("--max-drift", "-1"), "--max-drift takes a percentage such as 1% or 0.5, not '-1'"),
        (("--max-drift", "nan"), "--max-drift takes a percentage such as 1% or 0.5, not 'nan'"),
        (("--max-drift", "1%"), "--max-drift without --C judges the drift on validation windows: pass --validate"),
        (("--max-drift", "1%", "--validate", "missing.npz"), "--validate missing.npz: no such file"),
        (("--max-drift", "1%", "--validate", "WRONG", "--on", "middle"), "--on takes upper or point, not 'middle'"),
        (("--max-drift", "1%", "--validate", "WRONG"), "has no array for model input 'x'"),
    ],
)
def test_bad_budget_input_is_one_line_and_exit_2(scored, tmp_path, arguments, message):
    model, _, folder = scored
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, z=np.zeros((2, 1, 32), np.float32))  # not the model's input name
    arguments = [str(wrong) if a == "WRONG" else a for a in arguments]
    code, text = invoke("export", model, "--run", folder / "run", *arguments, "--out-dir", tmp_path / "out")
    assert code == 2 and message in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    assert not list((folder / "run").glob(".validate-*"))  # no scratch folder left in the run


def test_score_validation_holds_windows_out_and_export_chooses_on_them(tmp_path):
    model = models.mlp_forecaster(tmp_path / "m.onnx")
    windows = np.random.default_rng(4).standard_normal((8, 1, 32)).astype(np.float32)
    np.savez(tmp_path / "ctx.npz", x=windows)
    run = tmp_path / "run"
    code, text = invoke(
        "score", model, "--contexts", tmp_path / "ctx.npz", "--steps", 4, "--validation", 3, "--out", run
    )
    assert code == 0, text
    meta = json.loads((run / "run.json").read_text())
    assert meta["contexts"]["windows"] == 5 and meta["validation"]["windows"] == 3
    assert np.array_equal(np.load(run / "contexts.npz")["x"], windows[:5])  # swept and calibrated on
    assert np.array_equal(np.load(run / "validation.npz")["x"], windows[5:])  # neither
    code, text = invoke("export", model, "--run", run, "--C", "4.6", "--out-dir", tmp_path / "out")
    chosen_on = json.loads((tmp_path / "out" / "m.C4.6.allocation.json").read_text())["chosen_on"]
    assert code == 0 and chosen_on["windows"] == "validation" and chosen_on["count"] == 3, text
    assert chosen_on["source"] == str(run / "validation.npz")
    code, text = invoke("export", model, "--run", run, "--max-drift", "1%", "--out-dir", tmp_path / "budget")
    assert code in (0, 1) and "search for the most compressed model within 1%" in text, text
    # a score without --validation in the same folder leaves no stale held-out windows behind
    code, text = invoke("score", model, "--contexts", tmp_path / "ctx.npz", "--steps", 4, "--out", run, "--fresh")
    assert code == 0 and not (run / "validation.npz").exists(), text
    code, text = invoke("score", model, "--contexts", tmp_path / "ctx.npz", "--validation", 8, "--out", tmp_path / "r2")
    assert code == 2 and "--validation 8 holds out every window of the 8 context windows" in text, text
