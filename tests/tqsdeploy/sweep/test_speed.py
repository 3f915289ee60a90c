"""Sweep strategies: every way of applying perturbations gives feed's scores."""

import models
import numpy as np
import pytest
from conftest import cli

from tqsdeploy import ScoreSettings, score
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.scoring.prepare import prepare
from tqsdeploy.scoring.request import ScoreRequest
from tqsdeploy.scoring.runs import ScoreRun
from tqsdeploy.sweep import SweepSettings
from tqsdeploy.sweep.probes import UnitProbes, perturb, quantization_probe
from tqsdeploy.units import UnitSelection

ONE_LANE = SweepSettings(lanes=1)
"""What `prepare` ran on before it took a request: one lane."""

SETTINGS = ScoreSettings(gauss_draws=2)


def _assorted(tmp_path):
    return models.assorted_case(tmp_path)


def _shared(tmp_path, steps=4):
    return models.shared_weight_case(tmp_path, steps)


def _shared_one_step(tmp_path):
    return _shared(tmp_path, steps=1)


@pytest.mark.parametrize("case", [_assorted, _shared, _shared_one_step])
def test_every_strategy_gives_feeds_scores(tmp_path, case):
    model, contexts, spec = case(tmp_path)
    strategies = ("rebuild", "unit", "prefix")  # prefix: the first step cut, then the whole model
    frames = {
        s: score(
            model,
            contexts,
            spec=spec,
            out=tmp_path / s,
            settings=SETTINGS,
            strategy=s,
            selection=UnitSelection(min_params=100),
        ).frame.sort("unit")
        for s in ("feed", *strategies)
    }
    assert frames["feed"].height >= 3
    for strategy in strategies:
        assert frames[strategy]["unit"].to_list() == frames["feed"]["unit"].to_list()
        for column in ("gamma_quant", "gamma_gauss", "probe_norm"):
            np.testing.assert_allclose(
                frames[strategy][column].to_numpy(),
                frames["feed"][column].to_numpy(),
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"{strategy} {column}",
            )


@pytest.mark.parametrize("steps", [1, 3])
def test_prefix_keeps_dead_units_exactly_dead(two_branch, tmp_path, steps):

    model, contexts = two_branch
    result = cli(
        "score", model, "--contexts", contexts, "--steps", steps, "--strategy", "prefix", "--out", tmp_path / "run"
    )
    assert result.exit_code == 0, result.output
    table = ScoreRun.load(tmp_path / "run")
    assert f"strategy prefix ({len(table.meta['prefix_cuts'])} cuts)" in " ".join(result.output.split())
    rows = {r["unit"]: r for r in table.frame.iter_rows(named=True)}
    assert rows["Wdead"]["dead"] and rows["Wdead"]["rel_divergence"] == 0.0 and not rows["Wsmall"]["dead"]
    feed = score(model, contexts, steps=steps, out=tmp_path / "feed", strategy="feed").frame.sort("unit")
    np.testing.assert_allclose(table.frame.sort("unit")["gamma"].to_numpy(), feed["gamma"].to_numpy(), rtol=1e-5)


def test_auto_estimates_every_strategy_and_records_its_pick(two_branch, tmp_path, monkeypatch):
    import tqsdeploy.sweep.choice

    model, contexts = two_branch
    # a sweep this small runs on feed untimed: its bound (every window its own call) is all auto records
    small = score(model, contexts, steps=3, out=tmp_path / "small", settings=SETTINGS)
    assert small.meta["strategy"] == "feed" and set(small.meta["strategy_estimates_s"]) == {"feed"}
    assert 0 < small.meta["strategy_estimates_s"]["feed"] < tqsdeploy.sweep.choice.SMALL_SWEEP_S * small.meta["lanes"]
    monkeypatch.setattr(tqsdeploy.sweep.choice, "SMALL_SWEEP_S", 0.0)  # as if it were large
    table = score(model, contexts, steps=3, out=tmp_path / "run", settings=SETTINGS)
    estimates = table.meta["strategy_estimates_s"]
    assert set(estimates) == {"feed", "rebuild", "unit", "prefix", "batch"} and all(v > 0 for v in estimates.values())
    assert table.meta["strategy"] in estimates
    assert small.frame.drop("seconds").equals(
        score(model, contexts, steps=3, out=tmp_path / "feed", settings=SETTINGS, strategy="feed").frame.drop("seconds")
    )


def test_a_unit_session_only_overrides_its_own_weights(tmp_path):
    model, contexts, spec = _shared(tmp_path)
    job = prepare(ScoreRequest(model, contexts, spec, sweep=ONE_LANE)).job
    session = job.unit_factory(["Wshared"])
    assert session.weights == {"Wshared"}
    assert job.session_factory().weights == {"W1", "Wshared", "W3"}


def test_probes_built_once_per_unit_match_the_one_off_perturbation(tmp_path):
    model, contexts, spec = _shared(tmp_path)
    job = prepare(ScoreRequest(model, contexts, spec, sweep=ONE_LANE)).job
    unit = job.units["Wshared"]
    probes = UnitProbes(unit, job.weights, 6)
    quant = probes.perturb("quant", 0, seed=0)
    np.testing.assert_array_equal(quant.weights["Wshared"], quantization_probe(job.weights["Wshared"], 6))
    residual_sq = quant.delta_sq
    for draw in range(2):
        gauss = probes.perturb("gauss", draw, seed=0)
        again = perturb(unit, job.weights, "gauss", draw, 6, seed=0)
        np.testing.assert_array_equal(
            gauss.weights["Wshared"], again.weights["Wshared"]
        )  # seeded by (seed, unit, draw)
        assert gauss.weights["Wshared"].dtype == np.float32
        assert gauss.delta_sq == pytest.approx(residual_sq, rel=1e-4)  # same Frobenius norm as the quant residual
    assert not np.array_equal(
        probes.perturb("gauss", 0, 0).weights["Wshared"], probes.perturb("gauss", 1, 0).weights["Wshared"]
    )


def test_the_cut_holds_only_nodes_downstream_of_the_weight(tmp_path):
    import onnx

    import graph_ops

    proto = graph_ops.lift_constants(onnx.load(models.assorted_ops(tmp_path / "m.onnx")), ["const_w"])
    types = graph_ops.prefix.element_types(proto)
    cut = graph_ops.prefix.cut_downstream(proto, ["gemm_w"], ["y", "z"], types)
    assert [n.op_type for n in cut.model.graph.node] == [
        "Gemm",
        "MatMul",
    ]  # not the Gather before it, not the Conv beside it
    assert cut.boundary == ("e",) and cut.outputs == ("y",)
    assert {i.name for i in cut.model.graph.input} == {"e", "gemm_w"}
    assert graph_ops.prefix.cut_downstream(proto, ["conv_t"], ["y"], types).outputs == ()
    walk = graph_ops.prefix.GraphWalk(proto.graph)  # the indexed walk finds what a scan of the sorted graph finds
    for weights in (["gemm_w"], ["conv_t"], ["emb"], ["const_w"], ["gemm_w", "conv_t"]):
        affected, nodes = set(weights), []
        for node in proto.graph.node:
            if set(node.input) & affected:
                nodes.append(node)
                affected.update(node.output)
        found, reached = walk.downstream(set(weights))
        assert [walk.nodes[i] for i in found] == nodes and reached == affected


def test_probes_built_ahead_on_a_helper_thread_are_the_ones_asked_for(tmp_path):
    from tqsdeploy.sweep import ProbeSource, plan_tasks

    model, contexts, spec = _shared(tmp_path)
    job = prepare(ScoreRequest(model, contexts, spec, sweep=ONE_LANE)).job
    tasks = plan_tasks(list(job.units.values()), True, 2)
    source = ProbeSource(job)
    ahead = [source.get(t, tasks[i + 1] if i + 1 < len(tasks) else None) for i, t in enumerate(tasks)]
    guessed_wrong = source.get(tasks[0], tasks[-1])  # built ahead: the last task; asked next: the second
    second = source.get(tasks[1])
    source.close()
    for task, change in [*zip(tasks, ahead), (tasks[0], guessed_wrong), (tasks[1], second)]:
        once = perturb(job.units[task.unit], job.weights, task.probe, task.draw, job.probe_bits, job.seed, job.rows)
        assert change.delta_sq == once.delta_sq
        for name, value in once.weights.items():
            np.testing.assert_array_equal(change.weights[name], value)


def _chain(path, layers=4, width=64):
    """x -> MatMul(W0) -> Relu -> ... -> y: one unit per layer, each layer as costly as the others."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, previous = [], [], "x"
    for i in range(layers):
        inits.append(
            numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"W{i}")
        )
        nodes.append(helper.make_node("MatMul", [previous, f"W{i}"], [f"m{i}"]))
        previous = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("Relu", [f"m{i}"], [previous]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save_model(model, str(path))
    return model


def test_units_share_a_cut_only_when_its_build_costs_more_than_the_runs_it_saves(tmp_path):
    import graph_ops

    proto = _chain(tmp_path / "chain.onnx")
    units = {f"W{i}": [f"W{i}"] for i in range(4)}
    costs = graph_ops.prefix.node_costs(proto, {"x": (8, 64)})
    assert costs[0] == 8 * 64 * 64 and costs[1] == 8 * 64  # MatMul multiply-adds, Relu its output
    cheap = graph_ops.prefix.plan_cuts(proto, units, costs, call_s=1.0, build_s=1e-3, runs_per_unit=5, fed_penalty=0.0)
    assert cheap.groups == (("W0",), ("W1",), ("W2",), ("W3",))  # every unit on the least it must run
    costly = graph_ops.prefix.plan_cuts(
        proto, units, costs, call_s=1.0, build_s=100.0, runs_per_unit=5, fed_penalty=0.0
    )
    assert costly.groups == (("W0", "W1", "W2", "W3"),)  # one build for all
    assert costly.seconds > cheap.seconds
    # the cheap plan's estimate: per unit a small build plus 6 runs (5 probes, the cut's nominal) of what follows it
    layer = (costs[0] + costs[1]) / sum(costs)
    expected = sum(1e-3 * (0.3 + 0.7 * (4 - i) / 4) + 6 * layer * (4 - i) for i in range(4))
    assert cheap.seconds == pytest.approx(expected, rel=1e-9)
    # per cut: its own build and runs, what a lane taking it spends (the first cut, over the whole chain, costs most)
    assert cheap.group_seconds == pytest.approx(
        [1e-3 * (0.3 + 0.7 * (4 - i) / 4) + 6 * layer * (4 - i) for i in range(4)], rel=1e-9
    )
    assert costly.group_seconds == pytest.approx([costly.seconds], rel=1e-12)
    assert cheap.order == ["W0", "W1", "W2", "W3"] and costly.group_of("W2") == 0
    # with 3 probes the first two units tie on runs (W1 in W0's cut: 3 runs of a layer more, one nominal run fewer)
    assert graph_ops.prefix.plan_cuts(proto, units, costs, 1.0, 1e-3, 3, 0.0).groups[0] == ("W0", "W1")
    # but fed weights run without pre-packed kernels: a cut holding both pays that on both
    assert graph_ops.prefix.plan_cuts(proto, units, costs, 1.0, 1e-3, 3, 0.5).groups[0] == ("W0",)


def test_prefix_sweeps_a_model_from_its_files_with_feeds_scores(tmp_path):
    import onnx

    proto = _chain(tmp_path / "chain.onnx")
    folder = tmp_path / "ext"
    folder.mkdir()
    onnx.save_model(
        proto,
        str(folder / "chain.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="chain.onnx.data",
        size_threshold=0,
    )
    folder.chmod(0o555)  # read-only: cut sessions read the model's own files and write nothing beside them
    contexts = Contexts({"x": np.random.default_rng(1).standard_normal((4, 3, 64)).astype(np.float32)}, source="test")
    spec = RolloutSpec(steps=1, feedback=(), trajectory=("y",))
    try:
        feed = score(
            folder / "chain.onnx", contexts, spec=spec, out=tmp_path / "feed", settings=SETTINGS, strategy="feed"
        )
        prefix = score(
            folder / "chain.onnx", contexts, spec=spec, out=tmp_path / "prefix", settings=SETTINGS, strategy="prefix"
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("tqsdeploy.sweep.choice.SMALL_SWEEP_S", 0.0)  # time the strategies even on a sweep this small
            auto = score(folder / "chain.onnx", contexts, spec=spec, out=tmp_path / "auto", settings=SETTINGS)
    finally:
        folder.chmod(0o755)
    assert prefix.meta["strategy"] == "prefix" and not prefix.meta["warnings"]
    assert sorted(u for group in prefix.meta["prefix_cuts"] for u in group) == ["W0", "W1", "W2", "W3"]
    for column in ("gamma_quant", "gamma_gauss", "probe_norm"):
        np.testing.assert_allclose(
            prefix.frame.sort("unit")[column].to_numpy(), feed.frame.sort("unit")[column].to_numpy(), rtol=1e-5
        )
    assert set(auto.meta["strategy_estimates_s"]) == {
        "feed",
        "prefix",
    }  # the rebuilding strategies need the weights in memory
    assert sorted((folder).iterdir()) == [folder / "chain.onnx", folder / "chain.onnx.data"]
    with pytest.raises(
        RolloutError, match="streamed from its files needs a single-step rollout"
    ):  # one session at a time
        score(
            folder / "chain.onnx",
            contexts,
            spec=RolloutSpec.from_dict({"steps": 2, "feedback": [{"output": "y", "input": "x"}]}),
            out=tmp_path / "two",
            strategy="prefix",
        )


def test_perturbations_built_several_ahead_equal_those_built_one_at_a_time(tmp_path):
    """On a GPU several perturbations are built at once on helper threads (`ProbeSource.depth`): every
    task still gets exactly its own perturbation, across unit changes and on a Gather table's read rows."""
    from tqsdeploy.sweep import ProbeSource, plan_tasks

    model, contexts, spec = _assorted(tmp_path)
    job = prepare(ScoreRequest(model, contexts, spec, settings=SETTINGS, sweep=ONE_LANE)).job
    tasks = plan_tasks(list(job.units.values()), True, 3)
    one, deep = ProbeSource(job, depth=1), ProbeSource(job, depth=4)
    deep.plan(tasks)
    assert len(deep._pending) == 4
    for task in tasks:
        want, got = one.get(task), deep.get(task)
        assert len(deep._pending) <= 4 and len(deep._units) <= 2  # 4 tasks a unit: at most the unit run and the next
        assert want.delta_sq == got.delta_sq and want.weights.keys() == got.weights.keys()
        assert all(np.array_equal(want.weights[n], got.weights[n]) for n in want.weights)
    assert not deep._pending
    one.close()
    deep.close()


@pytest.mark.parametrize("depth", [1, 3])
def test_each_perturbation_is_built_once_when_its_task_was_prefetched_before_the_plan(tmp_path, monkeypatch, depth):
    """'prefix' starts the first task's build before the sweep's plan arrives: that task must not be built
    again, nor the pipeline shift so that every later task is built twice."""
    from tqsdeploy.sweep import ProbeSource, plan_tasks

    model, contexts, spec = _assorted(tmp_path)
    job = prepare(ScoreRequest(model, contexts, spec, settings=SETTINGS, sweep=ONE_LANE)).job
    tasks = plan_tasks(list(job.units.values()), True, 2)
    built = []
    build = ProbeSource._build
    monkeypatch.setattr(ProbeSource, "_build", lambda self, task: built.append(task) or build(self, task))
    source = ProbeSource(job, depth=depth)
    source.prefetch(tasks[0])
    source.plan(tasks)
    for i, task in enumerate(tasks):
        source.get(task, tasks[i + 1] if i + 1 < len(tasks) else None)
    source.close()
    assert sorted(built, key=tasks.index) == tasks

    # a resumed run: the guessed first task is done already, so the plan lacks it; builds still run ahead
    built.clear()
    source = ProbeSource(job, depth=depth)
    source.prefetch(tasks[0])
    source.plan(tasks[1:])
    assert list(source._pending) == tasks[1 : 1 + depth]
    for task in tasks[1:]:
        source.get(task)
    source.close()
    assert built[0] == tasks[0] and sorted(built[1:], key=tasks.index) == tasks[1:]


def test_a_sweep_building_perturbations_four_ahead_gives_the_same_scores(tmp_path, monkeypatch):
    from tqsdeploy.sweep import SweepRunner

    model, contexts, spec = _shared(tmp_path)
    plain = score(model, contexts, spec=spec, out=tmp_path / "one", settings=SETTINGS, strategy="feed")
    monkeypatch.setattr(SweepRunner, "_probe_depth", lambda self: 4)  # what a GPU session gets
    deep = score(model, contexts, spec=spec, out=tmp_path / "four", settings=SETTINGS, strategy="feed")
    assert plain.frame["gamma_quant"].to_list() == deep.frame["gamma_quant"].to_list()
    assert plain.frame["gamma_gauss"].to_list() == deep.frame["gamma_gauss"].to_list()


def test_the_calibration_session_sleeps_between_calls(tmp_path):
    """Calibration alternates ONNX Runtime calls with BLAS-heavy Hessian products: its session's idle threads
    must not spin (on 2 cores spinning made the demo's calibration 2.2x slower). Spinning changes no value."""
    import graph_ops
    from runtimes import OrtRuntime
    from tqsdeploy.encoding.calibrator import CalibrationRollout, Calibrator

    entry = ("session.intra_op.allow_spinning", "0")
    assert OrtRuntime().yielding().config == (entry,) and OrtRuntime().yielding().yielding().config == (entry,)
    model, contexts, spec = _shared(tmp_path)
    loaded = graph_ops.load_model(model)
    names = [w.name for w in graph_ops.find_weight_tensors(loaded.proto) if w.params >= 100]
    layouts = graph_ops.weight_layouts(loaded.proto, names)
    calibrator = Calibrator(
        loaded.proto,
        layouts,
        CalibrationRollout(contexts, spec),
        OrtRuntime(threads=2),
        weights=graph_ops.read_weights(loaded.proto, names),
    )
    assert calibrator._open_args[1].config == (entry,) and calibrator._open_args[1].threads == 2
    calibrator.close()


def test_auto_weighs_each_strategy_on_the_lanes_the_sweep_will_run():
    """Pieces of work go to the lane that frees first, in order: fine pieces share the lanes evenly, one coarse
    piece (a plan of one cut, a unit session) keeps a lane busy while the others idle."""
    from tqsdeploy.sweep.choice import _makespan

    assert _makespan([1.0] * 15, 2) == 8.0  # 15 tasks on 2 lanes: the last runs alone
    assert _makespan([1.0] * 16, 2) == 8.0
    assert _makespan([12.0], 2) == 12.0  # one cut of everything: one lane
    assert _makespan([6.0, 2.0, 2.0, 2.0], 2) == 6.0
    assert _makespan([2.0, 2.0, 2.0, 6.0], 2) == 8.0  # the big piece last finishes late (6 alone would allow 6)
    assert _makespan([3.0, 1.0], 1) == 4.0
