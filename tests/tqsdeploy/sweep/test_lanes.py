"""Lanes: a sweep's tasks run side by side in one process and give the one-lane table bit for bit."""

import json
import threading

import models
import numpy as np
import pytest
from conftest import cli

from runtimes import OrtRuntime
from tqsdeploy import ScoreSettings, score
from tqsdeploy.errors import InputError, RolloutError
from tqsdeploy.sweep import LANE_EXTRA_BYTES, ProbeSource, Task, interleaved, plan_tasks, sweep_lanes
from tqsdeploy.sweep.probes import UnitProbes
from tqsdeploy.units import UnitSelection

SETTINGS = ScoreSettings(gauss_draws=2)
ONE_THREAD = OrtRuntime(threads=1)  # the same kernels in every lane and in the one-lane run: equal to the bit


def _table(case, tmp_path, strategy, lanes, **kwargs):
    model, contexts, spec = case(tmp_path)
    return score(
        model,
        contexts,
        spec=spec,
        out=tmp_path / f"{strategy}-{lanes}",
        settings=SETTINGS,
        runtime=ONE_THREAD,
        strategy=strategy,
        lanes=lanes,
        selection=UnitSelection(min_params=100),
        **kwargs,
    )


@pytest.mark.parametrize(
    "case,strategy",
    [(models.shared_weight_case, s) for s in ("feed", "rebuild", "unit", "prefix", "batch")]
    + [(models.assorted_case, s) for s in ("feed", "unit", "prefix")],
)
def test_three_lanes_give_the_one_lane_table(tmp_path, case, strategy):
    one = _table(case, tmp_path, strategy, 1)
    three = _table(case, tmp_path, strategy, 3)
    items = {
        "prefix": len(three.meta.get("prefix_cuts", [])),
        "unit": three.frame.height,
        "batch": three.frame.height,
    }.get(strategy, 3 * three.frame.height)
    assert one.meta["lanes"] == 1 and three.meta["lanes"] == min(3, items) and three.meta["strategy"] == strategy
    assert three.frame.height >= 3
    assert three.frame.drop("seconds").equals(one.frame.drop("seconds"))
    assert len((tmp_path / f"{strategy}-3" / "sweep.jsonl").read_text().splitlines()) == 3 * three.frame.height


def test_an_interrupted_sweep_on_lanes_resumes_without_rerunning_what_landed(tmp_path):
    whole = _table(models.shared_weight_case, tmp_path, "feed", 1)
    landed = []
    with pytest.raises(models.Interrupt):
        _table(models.shared_weight_case, tmp_path, "feed", 2, on_result=models.interrupt_after(4, landed))
    assert len((tmp_path / "feed-2" / "sweep.jsonl").read_text().splitlines()) == 4  # only this thread writes the log
    rerun = []
    resumed = _table(models.shared_weight_case, tmp_path, "feed", 2, on_result=lambda r: rerun.append(r.key))
    assert len(rerun) == 3 * whole.frame.height - 4 and not set(rerun) & set(landed)
    assert resumed.frame.drop("seconds").equals(whole.frame.drop("seconds"))


def test_a_lane_that_fails_ends_the_sweep_with_its_error(tmp_path, monkeypatch):
    perturb = UnitProbes.perturb

    def failing(self, probe, draw, seed):
        if draw == 1:
            raise RolloutError("draw 1 failed")
        return perturb(self, probe, draw, seed)

    monkeypatch.setattr(UnitProbes, "perturb", failing)
    with pytest.raises(RolloutError, match="draw 1 failed"):
        _table(models.shared_weight_case, tmp_path, "unit", 2)
    landed = [json.loads(line) for line in (tmp_path / "unit-2" / "sweep.jsonl").read_text().splitlines()]
    assert all(row["draw"] != 1 for row in landed)


def test_lanes_taking_units_out_of_plan_order_build_each_perturbation_once(tmp_path, monkeypatch):
    """With per-unit work items two lanes ask for two units' tasks at once, not in the plan's order:
    a task asked for before its build started is built by the asker and never again."""
    model, contexts, spec = models.assorted_case(tmp_path)
    from tqsdeploy.scoring.prepare import prepare
    from tqsdeploy.scoring.request import ScoreRequest
    from tqsdeploy.sweep import SweepSettings

    request = ScoreRequest(
        model, contexts, spec, settings=SETTINGS, selection=UnitSelection(min_params=100), sweep=SweepSettings(lanes=1)
    )
    job = prepare(request).job
    tasks = plan_tasks(list(job.units.values()), True, 2)
    built = []
    build = ProbeSource._build
    monkeypatch.setattr(ProbeSource, "_build", lambda self, task: built.append((self, task)) or build(self, task))
    source = ProbeSource(job)
    source.share(2)
    source.plan(tasks)  # plan order, while the lanes below take units 0 and 1 at once, then 2 and 3
    one = ProbeSource(job)
    units = [[t for t in tasks if t.unit == u] for u in dict.fromkeys(t.unit for t in tasks)]
    for pair in range(0, len(units), 2):
        for depth in range(3):
            for item in units[pair : pair + 2]:
                got, want = source.get(item[depth]), one.get(item[depth])
                assert got.delta_sq == want.delta_sq and all(
                    np.array_equal(got.weights[n], want.weights[n]) for n in want.weights
                )
    source.close()
    one.close()
    assert sorted((t for s, t in built if s is source), key=tasks.index) == tasks


def test_interleaved_is_the_order_lanes_ask_in():
    items = [[Task(u, "gauss", d) for d in range(n)] for u, n in (("a", 2), ("b", 3), ("c", 1))]
    assert [(t.unit, t.draw) for t in interleaved(items, 2)] == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("b", 2),
        ("c", 0),
    ]


def test_lane_counts():
    import os

    cores = len(os.sched_getaffinity(0))
    small, large = 1 << 20, LANE_EXTRA_BYTES + 1
    assert sweep_lanes(None, "cpu", None, small) == min(8, cores)
    assert sweep_lanes(None, "cpu", cores, small) == 1  # threads fixed at every core: one lane
    assert sweep_lanes(None, "cpu", None, large) == 1  # another lane's sessions would pass the memory headroom
    assert sweep_lanes(None, "cpu", None, LANE_EXTRA_BYTES // 2) == min(3, cores)
    assert sweep_lanes(5, "cpu", None, large) == 5
    assert sweep_lanes(None, "cuda", None, small) == 1
    with pytest.raises(InputError, match="CPU provider only"):
        sweep_lanes(2, "cuda", None, small)
    with pytest.raises(InputError, match="1 or more"):
        sweep_lanes(0, "cpu", None, small)


def test_default_lanes_split_the_cores(two_branch, tmp_path):
    import os

    model, contexts = two_branch
    table = score(model, contexts, steps=3, out=tmp_path / "run", settings=SETTINGS, strategy="feed")
    cores = len(os.sched_getaffinity(0))
    assert table.meta["lanes"] == min(8, cores)
    assert table.meta["threads_per_lane"] == (max(1, cores // min(8, cores)) if cores > 1 else None)


def test_cli_refuses_lanes_with_workers_in_one_line(two_branch, tmp_path):
    model, contexts = two_branch
    result = cli(
        "score",
        model,
        "--contexts",
        contexts,
        "--steps",
        "2",
        "--lanes",
        "2",
        "--workers",
        "2",
        "--out",
        tmp_path / "r",
    )
    assert result.exit_code == 2
    assert "--lanes runs tasks side by side in this process" in result.output and "Traceback" not in result.output
    result = cli("score", model, "--contexts", contexts, "--steps", "2", "--lanes", "2", "--out", tmp_path / "ok")
    assert result.exit_code == 0, result.output
    assert "strategy" in result.output and "2 lanes" in " ".join(result.output.split())


def test_export_prices_and_refines_on_lanes_as_on_one(tmp_path):
    """Export's independent rollouts (the measured price list, refinement's trials) on three lanes give the
    one-lane prices, allocation and drift to the bit."""
    import shutil

    from tqsdeploy.export import ExportSettings, Planner

    model = models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128)
    contexts = tmp_path / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(5).standard_normal((6, 2, 64)).astype(np.float32))
    score(model, contexts, steps=4, out=tmp_path / "run", settings=ScoreSettings(gauss_draws=1), runtime=ONE_THREAD)
    outcomes = {}
    for lanes in (1, 3):
        run = shutil.copytree(tmp_path / "run", tmp_path / f"run-{lanes}")
        planner = Planner(run, settings=ExportSettings(refine=2, lanes=lanes), runtime=ONE_THREAD)
        prices = {key: result.div_sq for key, result in planner.pricing.measured().items()}
        refined, drift = planner.comparison.refiner.refine(planner.pricing.allocate(5))
        outcomes[lanes] = (len(planner.measuring.lanes), prices, refined.tiers, drift.div_sq)
        planner.close()
    assert outcomes[1][0] == 1 and outcomes[3][0] == 3
    assert len(outcomes[3][1]) >= 6 and len(set(outcomes[3][2].values())) > 1  # a mixed allocation, from real prices
    assert outcomes[3][1:] == outcomes[1][1:]


@pytest.mark.parametrize("hold", [0, None])
def test_the_nominal_made_on_a_lane_gives_the_one_lane_table(tmp_path, monkeypatch, hold):
    """On lanes the nominal rollout is a lane's first work item while the others start on tasks, holding their
    outputs until it is made (`hold` 0: none held, each waits for it at its first step)."""
    import sys

    sweep = sys.modules["tqsdeploy.sweep"]
    if hold is not None:
        monkeypatch.setattr(sys.modules["tqsdeploy.sweep.nominal"], "HOLD_BYTES", hold)
    made_on = []
    make = sweep.SweepRunner._make_nominal
    monkeypatch.setattr(
        sweep.SweepRunner,
        "_make_nominal",
        lambda self, *a, **k: (made_on.append(threading.current_thread().name), make(self, *a, **k))[1],
    )
    one = _table(models.shared_weight_case, tmp_path, "rebuild", 1)
    made_on.clear()
    two = _table(models.shared_weight_case, tmp_path, "rebuild", 2)
    assert len(made_on) == 1 and made_on[0].startswith("tqs-lane")
    assert two.meta["lanes"] == 2 and two.frame.drop("seconds").equals(one.frame.drop("seconds"))


def test_a_nominal_that_fails_on_a_lane_ends_the_sweep_with_its_message(tmp_path):
    model = models.nan_model(tmp_path / "nan.onnx")
    contexts = np.random.default_rng(0).standard_normal((3, 2, 32)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=contexts)
    with pytest.raises(RolloutError, match="NaN or Inf"):
        score(
            model,
            tmp_path / "c.npz",
            steps=3,
            out=tmp_path / "run",
            settings=SETTINGS,
            runtime=ONE_THREAD,
            strategy="rebuild",
            lanes=2,
        )
    log = tmp_path / "run" / "sweep.jsonl"
    assert not log.exists() or log.read_text() == ""  # no task finished without the nominal to compare with
