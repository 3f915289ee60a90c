"""The fed session of ONNX Runtime's own optimized graph: weights fed in the layouts its kernels use."""

import json
import pickle

import models
import numpy as np
import onnx
import pytest

import graph_ops
from graph_ops.derived import fed_graph, marked, weight_map
from runtimes import OrtRuntime
from runtimes.derived import derived_feed
from runtimes.factories import RebuildFactory
from tqsdeploy import ScoreSettings, score
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.units import UnitSelection, select_units

ONE_THREAD = OrtRuntime(threads=1)
SELECTION = UnitSelection(min_params=100)
STATE = RolloutSpec.from_dict({"steps": 3, "feedback": [{"output": "y", "input": "x"}]})


def _factory(path):
    loaded = graph_ops.load_model(path)
    units = select_units(graph_ops.find_weight_tensors(loaded.proto), SELECTION)
    names = [n for u in units for n in u.tensor_names]
    proto = graph_ops.lift_constants(loaded.proto, names)
    stored = graph_ops.read_weights(proto, names)
    rebuild = RebuildFactory(
        graph_ops.model_bytes(proto), ONE_THREAD, {n: graph_ops.input_declarations(proto, [n]) for n in names}
    )
    return rebuild, units, {n: np.array(stored[n]) for n in names}


def _x(windows=3, seed=1):
    return np.random.default_rng(seed).standard_normal((windows, 5, 8, 8)).astype(np.float32)


def test_fed_weights_run_the_kernels_of_a_constant_session(tmp_path):
    """Fed a perturbation of each weight in turn (and the nominal again after it), the session of the optimized
    graph gives, to the bit, what a session with that perturbation baked in as a constant gives."""
    rebuild, units, weights = _factory(models.conv_stack(tmp_path / "stack.onnx"))
    feed, fed_as = derived_feed(rebuild, units, list(weights))
    assert feed is not None and fed_as.startswith("the runtime's optimized graph")
    optimized = onnx.load_model_from_string(rebuild.runtime.optimized(rebuild.model))
    if not any(n.domain == "com.microsoft.nchwc" for n in optimized.graph.node):
        pytest.skip("this CPU's ONNX Runtime has no NCHWc Conv kernels: nothing is rearranged")
    mapped = feed.made()[1]
    assert any(
        part.positions is not None for c in mapped.copies for part in c.parts
    )  # W3's 5 channels padded to a block
    assert mapped.weights == set(weights)
    assert mapped.keeps_kernels  # read by NCHWc Convs only: auto then times no rebuilt session
    assert not graph_ops.derived.WeightMap(
        mapped.copies, mapped.readers | {("", "MatMul")}
    ).keeps_kernels  # a MatMul pre-packs only constants
    session = feed()
    assert pickle.loads(pickle.dumps(feed))._made is None  # another process maps its own runtime's layouts
    x = _x()
    rng = np.random.default_rng(0)
    for name, w in weights.items():
        perturbed = (w + 0.05 * rng.standard_normal(w.shape)).astype(np.float32)
        constant = rebuild({name: perturbed})
        np.testing.assert_array_equal(session.run({"x": x, name: perturbed})["y"], constant.run({"x": x})["y"])
        np.testing.assert_array_equal(
            session.run({"x": x})["y"], rebuild({}).run({"x": x})["y"]
        )  # nothing fed: nominal
        np.testing.assert_array_equal(
            session.run({"x": x, name: w})["y"], rebuild({}).run({"x": x})["y"]
        )  # not the last one's copies


def test_a_weight_folded_with_other_values_is_fed_as_stored(tmp_path):
    """ONNX Runtime folds a BatchNormalization into the Conv before it: that weight's copy is computed, not
    rearranged, so the sweep feeds the weights as stored, says why in run.json, and scores as a rebuild does."""
    path = models.conv_stack(tmp_path / "bn.onnx", batch_norm=True)
    rebuild, units, weights = _factory(path)
    feed, fed_as = derived_feed(rebuild, units, list(weights))
    assert feed is None and "computed from the weights" in fed_as
    contexts = Contexts({"x": _x()[:, None]}, source="test")  # 3 windows of one state each
    settings = ScoreSettings(gauss_draws=1)
    fed = score(
        path,
        contexts,
        spec=STATE,
        out=tmp_path / "feed",
        settings=settings,
        runtime=ONE_THREAD,
        strategy="feed",
        selection=SELECTION,
    )
    rebuilt = score(
        path,
        contexts,
        spec=STATE,
        out=tmp_path / "rebuild",
        settings=settings,
        runtime=ONE_THREAD,
        strategy="rebuild",
        selection=SELECTION,
    )
    assert json.loads((tmp_path / "feed" / "run.json").read_text())["fed_session"].startswith("weights as stored (")
    np.testing.assert_allclose(fed.frame["gamma"].to_numpy(), rebuilt.frame["gamma"].to_numpy(), rtol=1e-4)


def test_feed_on_the_optimized_graph_scores_as_rebuild_does(tmp_path):
    path = models.conv_stack(tmp_path / "stack.onnx")
    contexts = Contexts({"x": _x(4)[:, None]}, source="test")
    settings = ScoreSettings(gauss_draws=2)
    tables = {
        strategy: score(
            path,
            contexts,
            spec=STATE,
            out=tmp_path / strategy,
            settings=settings,
            runtime=ONE_THREAD,
            strategy=strategy,
            selection=SELECTION,
            lanes=lanes,
        )
        for strategy, lanes in (("feed", 1), ("rebuild", 2))
    }
    assert tables["feed"].meta["fed_session"].startswith("the runtime's optimized graph")
    assert tables["feed"].frame.height == 3
    for column in ("gamma_quant", "gamma_gauss"):
        np.testing.assert_allclose(
            tables["feed"].frame[column].to_numpy(), tables["rebuild"].frame[column].to_numpy(), rtol=1e-9
        )


def test_a_graph_whose_structure_follows_the_values_is_refused(tmp_path):
    """The two optimized graphs are aligned node by node: any difference in structure refuses the map."""
    rebuild, units, weights = _factory(models.conv_stack(tmp_path / "stack.onnx"))
    other, _, other_weights = _factory(models.conv_stack(tmp_path / "bn.onnx", batch_norm=True))
    nominal = onnx.load_model_from_string(rebuild.runtime.optimized(rebuild.model))
    marked_other = onnx.load_model_from_string(
        other.runtime.optimized(graph_ops.model_bytes(marked(other.graph(), other_weights)))
    )
    with pytest.raises(graph_ops.GraphError, match="structure depends on the weights' values"):
        weight_map(nominal, marked_other, weights)


def test_element_numbers_stay_exact_in_float32(tmp_path):
    rebuild, _, weights = _factory(models.conv_stack(tmp_path / "stack.onnx"))
    numbered = graph_ops.read_weights(marked(rebuild.graph(), weights), list(weights))
    seen = np.concatenate([numbered[n].reshape(-1) for n in weights])
    np.testing.assert_array_equal(seen, np.arange(1, seen.size + 1, dtype=np.float32))
    with pytest.raises(graph_ops.GraphError, match="2\\^24"):
        marked(rebuild.graph(), {"W1": np.zeros(1 << 24, np.float32)})
    assert (
        fed_graph(
            onnx.load_model_from_string(rebuild.runtime.optimized(rebuild.model)),
            weight_map(
                onnx.load_model_from_string(rebuild.runtime.optimized(rebuild.model)),
                onnx.load_model_from_string(
                    rebuild.runtime.optimized(graph_ops.model_bytes(marked(rebuild.graph(), weights)))
                ),
                weights,
            ),
        ).ir_version
        <= 13
    )


def test_workers_map_their_own_layouts_and_score_alike(tmp_path):
    """A worker process receives the fed session's recipe, not this process's layouts, maps its own, and
    gives the one-process table."""
    path = models.conv_stack(tmp_path / "stack.onnx")
    contexts = Contexts({"x": _x(4)[:, None]}, source="test")
    settings = ScoreSettings(gauss_draws=1)
    tables = [
        score(
            path,
            contexts,
            spec=STATE,
            out=tmp_path / f"w{workers}",
            settings=settings,
            runtime=ONE_THREAD,
            strategy="feed",
            selection=SELECTION,
            workers=workers,
            lanes=None if workers > 1 else 1,
        )
        for workers in (1, 2)
    ]
    assert tables[1].meta["workers"] == 2
    np.testing.assert_allclose(tables[1].frame["gamma"].to_numpy(), tables[0].frame["gamma"].to_numpy(), rtol=1e-9)
