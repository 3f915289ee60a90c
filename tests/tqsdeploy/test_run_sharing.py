"""An export and a score on one run folder: exports share the run, a score writing it needs it alone, and prices
are kept only for the run they were measured on.

A score --fresh once replaced the run under a running export, which then wrote prices measured with 4 steps
into the new 40-step run, and later exports reused them (another allocation shipped). Real sessions on a small
MLP; the export's hold is taken by a real `Planner`, the score's by `claim_run_folder`: no timing races."""

import json
import os
import shutil
import subprocess
import sys

import models
import numpy as np
import pytest
from conftest import REPO

from tqsdeploy import ScoreSettings, score
from tqsdeploy.errors import InputError
from tqsdeploy.export import ExportProgress, Planner
from tqsdeploy.files import claim_run_folder

SETTINGS = ScoreSettings(gauss_draws=0)


@pytest.fixture
def run(tmp_path):
    model = models.mlp_forecaster(tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).standard_normal((3, 1, 32)).astype(np.float32))
    score(model, tmp_path / "c.npz", steps=3, out=tmp_path / "run", settings=SETTINGS)
    return model, tmp_path / "c.npz", tmp_path / "run"


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "tqsdeploy", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _prices(text: str) -> dict[str, list[float]]:
    """A price list (measured.jsonl) by slot and key."""
    return {(r := json.loads(line))["unit"] + " " + r["probe"]: r["div_sq"] for line in text.splitlines()}


def test_score_fresh_is_refused_while_an_export_reads_the_run_and_exports_share_it(run):
    model, contexts, run_dir = run
    before = (run_dir / "run.json").read_bytes()
    planner = Planner(run_dir)
    other = Planner(run_dir)  # a second export of the same run at once: both price, through .measured.lock
    try:
        assert planner.pricing.measured() and other.pricing.measured()
        result = _cli("score", model, "-c", contexts, "-o", run_dir, "--steps", 4, "--probe", "quant", "--fresh")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"an export is reading the score run in {run_dir}" in errors[0]
        with pytest.raises(InputError, match="an export is reading the score run"):
            score(model, contexts, steps=4, out=run_dir, settings=SETTINGS, resume=False)
        assert (run_dir / "run.json").read_bytes() == before and (run_dir / "measured.jsonl").exists()
    finally:
        planner.close()
        other.close()
    assert (
        _cli("score", model, "-c", contexts, "-o", run_dir, "--steps", 4, "--probe", "quant", "--fresh").returncode == 0
    )  # the exports are done


def test_an_export_is_refused_while_a_score_writes_the_run(run):
    _, _, run_dir = run
    with claim_run_folder(run_dir):
        with pytest.raises(InputError, match="a score command is writing to"):
            Planner(run_dir)
    Planner(run_dir).close()


def test_prices_measured_on_a_replaced_run_are_not_reused(run):
    """The 3-step run's prices left in the 4-step run that replaced it (what the race wrote) price nothing there:
    every price is measured again, as a run folder without them measures it."""
    model, contexts, run_dir = run
    planner = Planner(run_dir)
    planner.pricing.measured()
    planner.close()
    stale = (run_dir / "measured.jsonl").read_text()
    score(model, contexts, steps=4, out=run_dir, settings=SETTINGS, resume=False)
    shutil.copytree(run_dir, run_dir.parent / "clean")
    (run_dir / "measured.jsonl").write_text(stale)
    counted = []
    planner = Planner(run_dir, progress=ExportProgress(on_measuring=counted.append))
    planner.pricing.measured(on_result=lambda result: None)
    planner.close()
    prices = planner.prices  # a channel group is priced from its unit's rollout (--group-prices shared)
    rolled = {prices.task(*prices.rolled(slot, tier)).key for slot, tier in planner.pricing.measured_tasks()}
    assert counted == [len(rolled)]
    fresh = {
        key: value
        for key, value in _prices((run_dir / "measured.jsonl").read_text()).items()
        if key not in _prices(stale)
    }
    clean = Planner(run_dir.parent / "clean")
    clean.pricing.measured()
    clean.close()
    assert len(fresh) == len(rolled) and _prices((run_dir.parent / "clean" / "measured.jsonl").read_text()) == fresh


def test_an_export_whose_run_was_replaced_under_it_stops_in_one_line(run, tmp_path):
    """A replacement that did not wait for the export (an older tqsdeploy, a folder without locks): the export
    writes no price into the new run. The same run written again is no replacement."""
    model, contexts, run_dir = run
    other = score(model, contexts, steps=4, out=tmp_path / "other", settings=SETTINGS)
    planner = Planner(run_dir)
    try:
        (run_dir / "run.json").write_text((run_dir / "run.json").read_text())  # rewritten, the same run
        planner.pricing.measured(tasks=planner.pricing.eager_tasks()[:1])
        shutil.copy(other.run_dir / "run.json", run_dir / "run.json")
        with pytest.raises(InputError, match=f"the score run in {run_dir} was replaced while this export ran"):
            planner.pricing.measured()
        assert len((run_dir / "measured.jsonl").read_text().splitlines()) == 1
    finally:
        planner.close()
