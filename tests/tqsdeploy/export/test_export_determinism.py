"""An export's answer is a function of (model, contexts, spec, target, settings): not of what else its run folder
priced.

The price list (measured.jsonl) is a cache shared by every export of a run folder; it may save time but never
change the model written. Real sessions, real solver, a small MLP (seconds)."""

import shutil

import models
from conftest import scored_run

from tqsdeploy.export import ExportSettings, Planner

scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", n=64, hidden=128),
    (6, 2, 64),
    seed=5,
    steps=6,
    name="determinism",
)


def _run(folder, into):
    """A copy of the score run with an empty price list."""
    run = into / "run"
    shutil.copytree(
        folder / "run", run, ignore=shutil.ignore_patterns("measured.jsonl", ".measured.lock", "export-checkpoints")
    )
    return run


def _export(planner, target, path):
    outcome = planner.export(target, path)
    return outcome.allocation.tiers, path.read_bytes()


def test_other_exports_before_do_not_change_the_model(scored, tmp_path):
    """Target A exported alone in a fresh run folder, and in another after targets B and C (the frontier's
    order: B near the INT2 size, where the slots are cut finer and float copies get priced lazily), writes the
    same allocation and the same bytes."""
    model, _, folder = scored
    planner = Planner(_run(folder, tmp_path / "fresh"))
    int2 = planner.comparison.uniform("int2-asym").compression
    alone = _export(planner, 4, tmp_path / "alone.onnx")
    planner.close()
    planner = Planner(_run(folder, tmp_path / "shared"))
    for target in (0.99 * int2, 2, 8):
        planner.export(target, tmp_path / f"other{target:.3f}.onnx")
    after = _export(planner, 4, tmp_path / "after.onnx")
    planner.close()
    assert after[0] == alone[0]
    assert after[1] == alone[1]


def test_prices_of_other_codes_under_the_same_label_are_not_reused(scored, tmp_path):
    """A run folder whose price list an older version left: its QEP made other codes (here round-to-nearest's,
    really measured) under today's label. The export prices today's codes again and writes what a fresh run
    folder writes (lorenz96 at the W4 size: 3.62% held-out drift from such a folder, 3.12% from a fresh one)."""
    model, _, folder = scored
    planner = Planner(_run(folder, tmp_path / "fresh"))
    alone = _export(planner, 4, tmp_path / "alone.onnx")
    planner.close()
    run = _run(folder, tmp_path / "stale")
    older = Planner(run, settings=ExportSettings(rounding="rtn"))
    older.pricing.measured()
    older.close()
    log = run / "measured.jsonl"
    log.write_text(
        log.read_text().replace("-asym/rtn", "-asym/qep")
    )  # what the older version's QEP prices were labelled
    planner = Planner(run)
    for target in (2, 8):
        planner.export(target, tmp_path / f"other{target}.onnx")
    after = _export(planner, 4, tmp_path / "after.onnx")
    planner.close()
    assert after[0] == alone[0]
    assert after[1] == alone[1]
