"""A Gather table is scored on the rows the contexts read, not diluted by the rest."""

import json
import math

import models
import numpy as np
import polars as pl
import pytest
from conftest import cli

from tqsdeploy import ScoreSettings, score
from tqsdeploy.scoring.prepare import prepare
from tqsdeploy.scoring.request import ScoreRequest
from tqsdeploy.sweep import SweepSettings
from tqsdeploy.sweep.probes import perturb

ONE_LANE = SweepSettings(lanes=1)
"""What `prepare` ran on before it took a request: one lane."""


def test_gather_table_scored_on_the_rows_the_contexts_read(tmp_path):
    model = models.gather_forecaster(tmp_path / "emb.onnx")
    contexts = tmp_path / "ctx.npz"
    rng = np.random.default_rng(1)
    ids = np.array([[3, 97], [97, 3], [3, 3], [-3, 97]])  # rows 3 and 97 (-3 is row 97) of 100
    np.savez(contexts, x=rng.standard_normal((4, 2, 32)).astype(np.float32), ids=ids)
    prepared = prepare(ScoreRequest(model, contexts, steps=4, sweep=ONE_LANE))
    assert prepared.job.rows["emb"].tolist() == [3, 97] and "W" not in prepared.job.rows

    unit = prepared.job.units["emb"]
    runner = prepared.open_runner()
    whole = perturb(unit, prepared.job.weights, "quant", 0, 6, 0)
    read = perturb(unit, prepared.job.weights, "quant", 0, 6, 0, prepared.job.rows)
    changed = np.flatnonzero(np.any(read.weights["emb"] != prepared.job.weights["emb"], axis=1))
    assert set(changed) <= {3, 97}
    # the output sees the same change; only the denominator shrinks (about 2/100 of the table's residual)
    np.testing.assert_allclose(runner.divergence(whole.weights)[0], runner.divergence(read.weights)[0], rtol=1e-6)
    assert read.delta_sq < whole.delta_sq / 10
    runner.close()

    table = score(model, contexts, steps=4, out=tmp_path / "run", settings=ScoreSettings(gauss_draws=1))
    rows = {r["unit"]: r for r in table.frame.iter_rows(named=True)}
    assert rows["emb"]["touched_rows"] == 2 and rows["W"]["touched_rows"] is None
    quant = [json.loads(line) for line in (tmp_path / "run" / "sweep.jsonl").read_text().splitlines()]
    emb = next(r for r in quant if r["unit"] == "emb" and r["probe"] == "quant")
    assert emb["delta_sq"] == read.delta_sq
    assert rows["emb"]["gamma_quant"] == math.log(sum(emb["div_sq"]) / (emb["delta_sq"] + 1e-12)) / 4
    assert (
        rows["emb"]["gamma_quant"] > math.log(sum(emb["div_sq"]) / whole.delta_sq) / 4 + 0.5
    )  # undiluted: ln(~50)/4 higher
    assert "touched_rows" in pl.read_csv(tmp_path / "run" / "scores.csv").columns

    result = cli("export", model, "--run", tmp_path / "run", "--C", "2", "--out-dir", tmp_path / "out")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "'emb': the scoring contexts read 2 of its 100 rows" in text
    meta = json.loads((tmp_path / "out" / "emb.C2.allocation.json").read_text())
    assert any("2 of its 100 rows" in note for note in meta["notes"])


def test_indices_cast_on_the_way_still_count_and_computed_ones_do_not(tmp_path):
    model = models.gather_forecaster(tmp_path / "cast.onnx", cast_ids=True)
    contexts = tmp_path / "ctx.npz"
    np.savez(contexts, x=np.zeros((2, 1, 32), np.float32), ids=np.array([[4], [9]], np.int32))
    assert prepare(ScoreRequest(model, contexts, steps=2, sweep=ONE_LANE)).job.rows["emb"].tolist() == [4, 9]
    # a table also read by a MatMul (tied weights) is read whole: no restriction
    import onnx
    from onnx import helper

    tied = onnx.load(str(model))
    tied.graph.node.append(helper.make_node("Transpose", ["emb"], ["emb_t"]))
    tied.graph.node.append(helper.make_node("MatMul", ["x", "emb_t"], ["unused"]))
    onnx.save(tied, str(tmp_path / "tied.onnx"))
    assert "emb" not in prepare(ScoreRequest(tmp_path / "tied.onnx", contexts, steps=2, sweep=ONE_LANE)).job.rows


def test_gaussian_probes_of_a_table_perturb_only_the_rows_read(tmp_path):
    """Both probes change the rows the contexts read and nothing else, with the same norm: a Gaussian draw
    spread over the whole table would put most of ||δθ||² on rows no output sees (γ_gauss diluted)."""
    model = models.gather_forecaster(tmp_path / "emb.onnx")
    contexts = tmp_path / "ctx.npz"
    np.savez(
        contexts,
        x=np.random.default_rng(1).standard_normal((2, 2, 32)).astype(np.float32),
        ids=np.array([[3, 97], [97, 3]]),
    )
    prepared = prepare(ScoreRequest(model, contexts, steps=2, sweep=ONE_LANE))
    unit, weights, rows = prepared.job.units["emb"], prepared.job.weights, prepared.job.rows
    quant = perturb(unit, weights, "quant", 0, 8, 0, rows)
    for draw in range(2):
        gauss = perturb(unit, weights, "gauss", draw, 8, 0, rows)
        changed = np.flatnonzero(np.any(gauss.weights["emb"] != weights["emb"], axis=1))
        assert changed.tolist() == [3, 97]
        assert gauss.delta_sq == pytest.approx(quant.delta_sq, rel=1e-4)
        again = perturb(unit, weights, "gauss", draw, 8, 0, rows)
        np.testing.assert_array_equal(gauss.weights["emb"], again.weights["emb"])  # seeded by (seed, unit, draw)
    runner = prepared.open_runner()
    # undiluted: the Gaussian probe moves the output about as much as the quant residual of the same norm
    ratio = (
        runner.divergence(perturb(unit, weights, "gauss", 0, 8, 0, rows).weights)[0][0]
        / runner.divergence(quant.weights)[0][0]
    )
    runner.close()
    assert 0.1 < ratio < 10


def test_rows_the_contexts_never_read_are_priced_as_read_rows_not_free(tmp_path):
    """Slots of a table holding only unread rows measured nothing, so they priced at 0 and went to the lowest tier for
    free (era5_downscale's unread hours at INT2: held-out windows at those hours drifted 5.6x uniform INT8)."""
    from tqsdeploy.export import ExportSettings, Planner

    model = models.gather_forecaster(tmp_path / "g.onnx", rows=64)  # 2048 parameters: a unit
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "c.npz",
        x=rng.standard_normal((4, 3, 32)).astype(np.float32),
        ids=rng.choice(np.arange(0, 64, 2), size=(4, 3)),
    )  # even rows only
    run = score(model, tmp_path / "c.npz", steps=2, out=tmp_path / "run", settings=ScoreSettings(gauss_draws=0))
    with Planner(run.run_dir, settings=ExportSettings(rounding="rtn", split_fraction=0.01)) as planner:
        choices = {c.unit: c for c in planner.pricing.choices("measured")}
        table = [
            s
            for s in planner.cut.slots
            if "emb" in planner.scored.units_by_name[s.unit].tensor_names and s.rows is not None
        ]
        unread = [s for s in table if all(r % 2 for r in range(*s.rows))]
        assert table and unread, [s.rows for s in planner.cut.slots]
        for slot in unread:
            assert all(v > 0 for t, v in choices[slot.name].loss.items() if t.startswith("int")), choices[
                slot.name
            ].loss
