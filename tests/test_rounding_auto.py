"""`export --rounding auto`: per tier, the method whose uniform model drifts least on the scoring contexts."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import models
from tiers import Rounding
from tqsdeploy import ScoreSettings, score
from tqsdeploy.cli import app
from tqsdeploy.export import ExportSettings, Planner
from tqsdeploy.export_candidates import AUTO_METHODS


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    folder = tmp_path_factory.mktemp("auto")
    model = models.mlp_forecaster(folder / "mlp.onnx", n=64, hidden=128)
    contexts = folder / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(3).standard_normal((6, 2, 64)).astype(np.float32))
    score(model, contexts, steps=6, out=folder / "run", settings=ScoreSettings(gauss_draws=1))
    return model, folder


def test_auto_picks_per_tier_the_method_that_drifts_least_and_records_it(scored):
    model, folder = scored
    reference = Planner(folder / "run", settings=ExportSettings(rounding="qep", refine=0))
    least = {}
    for tier in (t for t in reference.tiers if t.calibratable):
        drifts = {m: reference.measure(reference.encoder.uniform(tier, Rounding(m))) for m in AUTO_METHODS}
        least[tier.name] = min(drifts, key=lambda m: (drifts[m].worst_pct, drifts[m].relative_rms))
    reference.close()
    assert set(least) == {"int8-asym", "int4-asym", "int2-asym"}

    planner = Planner(folder / "run", settings=ExportSettings(rounding="auto", refine=0))
    assert {tier: planner.rounding_at(tier).method for tier in least} == least
    assert set(planner.rounding_choice) == set(least) and all(set(d) == set(AUTO_METHODS) for d in planner.rounding_choice.values())
    for tier, method in least.items():  # the mixed model's slots at a tier are that tier's chosen codes
        name = next(iter(planner.layouts))
        assert planner.encoder.tensor(name, tier, planner.rounding) is planner.encoder.uniform(tier, Rounding(method))[name]
    outcome = planner.export(4, folder / "mlp.C4.onnx")
    planner.close()
    record = json.loads((folder / "mlp.C4.allocation.json").read_text())
    used = {t for t in outcome.allocation.tiers.values() if t in least}
    assert record["rounding"] == "auto" and record["rounding_choice"] == planner.rounding_choice
    if outcome.shipped.startswith("TQS-PTQ"):
        assert record["rounding_by_tier"] == {t: least[t] for t in used}
    labels = [c["label"] for c in record["compared"]]  # the per-method uniform models it measured are candidates too
    assert sum(label.startswith("uniform") for label in labels) >= len(AUTO_METHODS)


def test_a_bad_rounding_is_refused_in_one_line(scored):
    model, folder = scored
    result = CliRunner().invoke(app, ["export", str(model), "--run", str(folder / "run"), "--C", "4", "--rounding", "best"])
    text = result.output + (result.stderr or "")
    assert result.exit_code == 2 and "unknown rounding 'best'" in text and "auto" in text and "Traceback" not in text
    assert len([line for line in text.splitlines() if line.strip()]) <= 2, text
