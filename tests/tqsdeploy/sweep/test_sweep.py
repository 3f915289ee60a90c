"""Ranking, the dead-unit rule and resuming an interrupted sweep."""

import json

import models
import numpy as np
import polars as pl
import pytest
from conftest import cli

from tqsdeploy import SENTINEL_GAMMA, ScoreSettings, score
from tqsdeploy.errors import InputError


@pytest.mark.parametrize("strategy", ["feed", "rebuild", "unit"])
def test_dead_unit_gets_sentinel_and_ranks_last(two_branch, tmp_path, strategy):
    model, contexts = two_branch
    table = score(model, contexts, steps=8, out=tmp_path / "run", strategy=strategy)
    assert table.meta["strategy"] == strategy
    frame = table.frame
    rows = {r["unit"]: r for r in frame.iter_rows(named=True)}
    assert rows["Wdead"]["dead"] and rows["Wdead"]["gamma"] == SENTINEL_GAMMA
    assert rows["Wdead"]["rel_divergence"] == 0.0
    assert rows["Wdead"]["rank"] == frame.height
    assert not rows["Wmain"]["dead"] and not rows["Wsmall"]["dead"]


@pytest.mark.parametrize(
    "strategy, steps", [("rebuild", 1), ("rebuild", 8), ("unit", 8), ("feed", 8), ("auto", 1), ("auto", 8)]
)
def test_a_nominal_begun_from_an_earlier_run_of_its_first_step_equals_a_fresh_rollout(two_branch, strategy, steps):
    """The batching decision (and auto's timing) already ran the first step of the one chunk: the nominal starts
    from that run when the same session makes it, and must equal, bit for bit, a rollout made afresh."""
    from tqsdeploy.scoring.prepare import prepare
    from tqsdeploy.scoring.request import ScoreRequest
    from tqsdeploy.sweep import SweepSettings

    model, contexts = two_branch
    runner = prepare(ScoreRequest(model, contexts, steps=steps, sweep=SweepSettings(strategy, lanes=1))).open_runner()
    try:
        made = [
            r
            for r in (runner.rig.first_step, runner.engine.first_run)
            if r is not None and r.session is runner.engine.session
        ]
        if strategy != "auto" or runner.strategy in (
            "rebuild",
            "unit",
            "batch",
        ):  # auto's feed runs on a session it did not time
            assert made
        fresh = [list(outs) for outs in runner.engine.steps(None)]
        assert len(fresh) == len(runner.nominal.trajectory) == steps
        for ours, theirs in zip(runner.nominal.trajectory, fresh):
            for a, b in zip(ours, theirs):
                assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
    finally:
        runner.close()


def test_direct_path_outranks_contracting_branch(two_branch, tmp_path):
    model, contexts = two_branch
    frame = score(model, contexts, steps=8, out=tmp_path / "run").frame
    assert frame["unit"].to_list() == ["Wmain", "Wsmall", "Wdead"]
    gamma = dict(zip(frame["unit"], frame["gamma_gauss"]))
    assert gamma["Wmain"] > gamma["Wsmall"]


def test_outputs_written(two_branch, tmp_path):
    model, contexts = two_branch
    table = score(model, contexts, steps=4, out=tmp_path / "run")
    run = tmp_path / "run"
    assert pl.read_parquet(run / "scores.parquet").equals(table.frame)
    assert pl.read_csv(run / "scores.csv").height == table.frame.height
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "complete" and meta["model"]["sha256"] == table.meta["model"]["sha256"]
    assert meta["rollout"]["steps"] == 4 and meta["contexts"]["windows"] == 4
    assert {"gamma_T1", "gamma_T2", "gamma_T4"} <= set(table.frame.columns)
    with np.load(run / "contexts.npz") as saved, np.load(contexts) as given:
        np.testing.assert_array_equal(saved["x"], given["x"])


def test_resume_after_interruption_matches_uninterrupted_run(two_branch, tmp_path):
    model, contexts = two_branch
    settings = ScoreSettings(gauss_draws=3)
    reference = score(model, contexts, steps=6, out=tmp_path / "whole", settings=settings).frame
    seen = []
    with pytest.raises(models.Interrupt):
        score(
            model, contexts, steps=6, out=tmp_path / "cut", settings=settings, on_result=models.interrupt_after(5, seen)
        )
    lines = (tmp_path / "cut" / "sweep.jsonl").read_text().splitlines()
    assert len(lines) == 5
    with open(tmp_path / "cut" / "sweep.jsonl", "a") as handle:
        handle.write('{"unit": "Wmain", "probe": "ga')  # a write cut off by the kill
    progress = []
    rerun = []
    resumed = score(
        model,
        contexts,
        steps=6,
        out=tmp_path / "cut",
        settings=settings,
        on_start=lambda total, done: progress.append((total, done)),
        on_result=lambda r: rerun.append(r.key),
    ).frame
    assert progress == [(12, 5)]
    assert not set(rerun) & set(seen)
    assert len((tmp_path / "cut" / "sweep.jsonl").read_text().splitlines()) == 12
    assert resumed.drop("seconds").equals(reference.drop("seconds"))


def test_changed_settings_do_not_resume_silently(two_branch, tmp_path):
    model, contexts = two_branch
    score(model, contexts, steps=4, out=tmp_path / "run")
    with pytest.raises(InputError, match="different model, contexts or settings"):
        score(model, contexts, steps=5, out=tmp_path / "run")
    fresh = score(model, contexts, steps=5, out=tmp_path / "run", resume=False)
    assert fresh.meta["rollout"]["steps"] == 5
    from runtimes import OrtRuntime

    with pytest.raises(InputError, match="different model, contexts or settings"):  # TF32 scores are another run
        score(model, contexts, steps=5, out=tmp_path / "run", runtime=OrtRuntime(tf32=True))


def test_early_stop_truncates_converged_rollouts(tmp_path):
    import models

    q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((8, 8)))
    model = models.linear_map(tmp_path / "lin.onnx", 1.05 * q)
    np.savez(tmp_path / "ctx.npz", x=np.random.default_rng(0).standard_normal((3, 1, 8)).astype(np.float32))
    from tqsdeploy import UnitSelection

    settings = ScoreSettings(gauss_draws=0, early_stop=True, early_stop_tol=0.02, early_stop_window=3)
    row = score(
        model,
        tmp_path / "ctx.npz",
        steps=64,
        out=tmp_path / "run",
        selection=UnitSelection(min_params=1),
        settings=settings,
    ).frame.row(0, named=True)
    assert 4 <= row["steps"] < 64
    assert row["gamma_T64"] is None


def test_exactly_representable_weight_is_not_called_dead(tmp_path):
    """1.05*I has a zero 6-bit residual: the quant probe is silent, the Gaussian probe scores it."""
    import models

    from tqsdeploy import UnitSelection

    model = models.linear_map(tmp_path / "eye.onnx", np.eye(8) * 1.05)
    np.savez(tmp_path / "ctx.npz", x=np.random.default_rng(0).standard_normal((3, 1, 8)).astype(np.float32))
    row = score(
        model, tmp_path / "ctx.npz", steps=8, out=tmp_path / "run", selection=UnitSelection(min_params=1)
    ).frame.row(0, named=True)
    assert not row["dead"]
    assert row["gamma_quant"] is None
    assert row["gamma"] == row["gamma_gauss"] > -10


def test_static_batch_models_run_window_by_window_with_the_same_scores(tmp_path):
    import models

    from tqsdeploy import UnitSelection

    rng = np.random.default_rng(4)
    a = rng.standard_normal((8, 8)) / 3
    np.savez(tmp_path / "ctx.npz", x=rng.standard_normal((5, 1, 8)).astype(np.float32))
    settings = ScoreSettings(gauss_draws=2)
    tables = [
        score(
            models.linear_map(tmp_path / f"{name}.onnx", a, batch),
            tmp_path / "ctx.npz",
            steps=5,
            out=tmp_path / name,
            selection=UnitSelection(min_params=1),
            settings=settings,
        )
        for name, batch in (("dynamic", "batch"), ("static", 1))
    ]
    assert tables[0].meta["batched_windows"] and not tables[1].meta["batched_windows"]
    for column in ("gamma_quant", "gamma_gauss", "gamma_T4"):
        assert tables[0].frame[column][0] == pytest.approx(tables[1].frame[column][0], rel=1e-5)


def test_feed_and_rebuild_strategies_agree(two_branch, tmp_path):
    model, contexts = two_branch
    feed, rebuild = (score(model, contexts, steps=6, out=tmp_path / s, strategy=s).frame for s in ("feed", "rebuild"))
    assert feed["unit"].to_list() == rebuild["unit"].to_list()
    for column in ("gamma_quant", "gamma_gauss", "a_max"):
        np.testing.assert_allclose(feed[column].to_numpy(), rebuild[column].to_numpy(), rtol=1e-4)


def test_a_sweep_in_worker_processes_gives_the_same_table(two_branch, tmp_path):
    """The job pickles to other processes (as it would to other machines) and the table does not change."""
    from runtimes import OrtRuntime

    model, contexts = two_branch
    runtime = OrtRuntime(threads=1)
    local = score(model, contexts, steps=5, out=tmp_path / "local", runtime=runtime, strategy="feed").frame
    spread = score(model, contexts, steps=5, out=tmp_path / "spread", runtime=runtime, strategy="feed", workers=2)
    assert spread.meta["workers"] == 2
    assert spread.frame.drop("seconds").equals(local.drop("seconds"))
    assert len((tmp_path / "spread" / "sweep.jsonl").read_text().splitlines()) == 15


def test_cli_csv_contexts_random_contexts_and_inspect_json(tmp_path):
    import json

    import models

    model = models.shift_model(tmp_path / "shift.onnx")
    rows = np.random.default_rng(0).standard_normal((200, 3)).cumsum(axis=0)
    (tmp_path / "series.csv").write_text(
        "date,a,b,c\n" + "\n".join(f"2020-01-{i % 28 + 1:02d},{a},{b},{c}" for i, (a, b, c) in enumerate(rows))
    )
    result = cli(
        "score",
        model,
        "-c",
        tmp_path / "series.csv",
        "--windows",
        "4",
        "--zscore",
        "--steps",
        "3",
        "--min-params",
        "16",
        "-o",
        tmp_path / "csv",
    )
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "csv" / "run.json").read_text())
    assert meta["contexts"]["shapes"]["x"] == [4, 3, 16] and meta["rollout"]["feedback"][0]["mode"] == "shift"
    result = cli("score", model, "--random-contexts", "--steps", "2", "--min-params", "16", "-o", tmp_path / "rnd")
    assert result.exit_code == 0 and "contexts are random, not data ('x' standard-normal noise)" in " ".join(
        (result.output + (result.stderr or "")).split()
    )
    assert json.loads((tmp_path / "rnd" / "run.json").read_text())["warnings"]
    result = cli("inspect", model, "--json", "--min-params", "16")
    info = json.loads(result.output)
    assert [u["unit"] for u in info["units"]] == ["W1", "W2"] and info["rollout"]["feedback"][0]["axis"] == -1


def test_a_model_that_only_claims_a_dynamic_batch_runs_window_by_window(tmp_path):
    """Reshape to a fixed [1, n] inside the graph: batching windows fails, one at a time works."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = 8
    w = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32) / 3
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["flat"]), helper.make_node("MatMul", ["flat", "W"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([1, n], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save_model(model, str(tmp_path / "fixed.onnx"))
    np.savez(tmp_path / "ctx.npz", x=np.random.default_rng(1).standard_normal((4, 1, n)).astype(np.float32))
    from tqsdeploy import UnitSelection

    table = score(
        tmp_path / "fixed.onnx",
        tmp_path / "ctx.npz",
        steps=3,
        out=tmp_path / "run",
        selection=UnitSelection(min_params=1),
    )
    assert not table.meta["batched_windows"] and np.isfinite(table.frame["gamma"][0])


@pytest.mark.slow
def test_a_sweep_on_ray_actors_gives_the_same_table(two_branch, tmp_path):
    pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'tqsdeploy[ray]')")
    import ray

    from runtimes import OrtRuntime

    model, contexts = two_branch
    runtime = OrtRuntime(threads=1)
    local = score(model, contexts, steps=4, out=tmp_path / "local", runtime=runtime, strategy="feed").frame
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        spread = score(
            model,
            contexts,
            steps=4,
            out=tmp_path / "ray",
            runtime=runtime,
            strategy="feed",
            workers=2,
            ray_address="local",
        )
    finally:
        ray.shutdown()
    assert spread.meta["workers"] == "ray:2"
    assert spread.frame.drop("seconds").equals(local.drop("seconds"))


def test_a_folder_probed_with_other_perturbations_is_measured_again_not_resumed(two_branch, tmp_path):
    """A run folder an older version left (its probe made another residual: here Wmain's recorded ||δθ||² is
    off by 10%) resumes only into what this version measures: that unit is probed again, the others are kept,
    and the scores equal a fresh run's."""
    model, contexts = two_branch
    settings = ScoreSettings(gauss_draws=2)
    reference = score(model, contexts, steps=6, out=tmp_path / "fresh", settings=settings).frame
    score(model, contexts, steps=6, out=tmp_path / "old", settings=settings)
    log = tmp_path / "old" / "sweep.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for record in records:
        if record["unit"] == "Wmain" and record["probe"] == "quant":
            record["delta_sq"] *= 1.1
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    rerun = []
    resumed = score(
        model,
        contexts,
        steps=6,
        out=tmp_path / "old",
        settings=settings,
        on_result=lambda r: rerun.append((r.unit, r.probe)),
    )
    assert sorted(rerun) == [("Wmain", "gauss"), ("Wmain", "gauss"), ("Wmain", "quant")]
    assert any("measured again (Wmain)" in w for w in resumed.meta["warnings"])
    assert resumed.frame.drop("seconds").equals(reference.drop("seconds"))
    untouched = score(
        model, contexts, steps=6, out=tmp_path / "old", settings=settings, on_result=lambda r: rerun.append(r.unit)
    )
    assert len(rerun) == 3 and not any("measured again" in w for w in untouched.meta["warnings"])
