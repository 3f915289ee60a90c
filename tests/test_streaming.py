"""Models that keep their weights in external-data files are scored and evaluated without a copy of them.

`score` hands ONNX Runtime a graph-only session file whose tensors still point
into the model's own data file, and reads each unit's weights from that file when
the sweep reaches the unit; `eval` opens the model files themselves. Both must
give exactly what the in-memory path gives.
"""

import numpy as np
import onnx
import polars as pl

import graph_ops
import models
from runtimes import OrtRuntime
from tqsdeploy.evaluate import evaluate
from tqsdeploy.export import Planner
from tqsdeploy.score import ScoreSettings, score


def _external_copy(model, folder):
    """The same model with every tensor in one external-data file."""
    folder.mkdir()
    proto = onnx.load(str(model))
    target = folder / "model.onnx"
    onnx.save_model(proto, str(target), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    return target


def test_external_data_models_score_and_evaluate_as_in_memory_ones(tmp_path):
    inline = models.mlp_forecaster(tmp_path / "inline.onnx", n=32, hidden=64)
    external = _external_copy(inline, tmp_path / "ext")
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).standard_normal((3, 2, 32)).astype(np.float32))
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in external.parent.iterdir())
    settings = ScoreSettings(gauss_draws=2)

    a = score(inline, tmp_path / "c.npz", steps=4, out=tmp_path / "run_inline", settings=settings, strategy="feed")
    b = score(external, tmp_path / "c.npz", steps=4, out=tmp_path / "run_ext", settings=settings)
    gammas = lambda table: dict(zip(table.frame["unit"], table.frame["gamma"]))
    assert gammas(a) == gammas(b)

    # the run folder holds the graph only: its session file is far smaller than the weights it points at
    session_files = list((tmp_path / "run_ext").glob("graph-*.onnx"))
    data_bytes = (external.parent / "model.onnx.data").stat().st_size
    assert len(session_files) == 1 and session_files[0].stat().st_size < data_bytes / 4
    assert not list((tmp_path / "run_ext").glob("*.data"))

    # weights read on demand equal the loaded ones, read-only
    loaded = graph_ops.load_model(external, load_external=False)
    names = [t.name for t in loaded.proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    full = graph_ops.read_weights(graph_ops.load_model(external).proto, names)
    lazy = graph_ops.FileWeights(loaded.proto, names, external.parent)
    for name in names:
        assert np.array_equal(lazy[name], full[name]) and not lazy[name].flags.writeable

    # a resumed score reuses the graph-only session file; export and eval of the external model work from it
    again = score(external, tmp_path / "c.npz", steps=4, out=tmp_path / "run_ext", settings=settings)
    assert gammas(again) == gammas(b)
    planner = Planner(tmp_path / "run_ext", external)
    outcome = planner.export(4, tmp_path / "out" / "q.onnx")
    planner.close()
    in_memory = Planner(tmp_path / "run_inline", inline)
    expected = in_memory.export(4, tmp_path / "out_inline" / "q.onnx")
    in_memory.close()
    assert outcome.shipped == expected.shipped and outcome.compression == expected.compression
    assert list(outcome.path.parent.glob("q.onnx.*.data"))  # an input with external data gives an output with external data
    x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    run = lambda path: OrtRuntime(exact_qdq=True).open(path, external_data_dir=path.parent).run({"x": x})["y"]
    assert np.array_equal(run(outcome.path), run(expected.path))
    reports = [evaluate(outcome.path, reference, tmp_path / "c.npz", steps=4) for reference in (inline, external)]
    assert reports[0]["outputs"]["y"]["vs_reference"]["drift_pct"] == reports[1]["outputs"]["y"]["vs_reference"]["drift_pct"]
    assert reports[0]["compression"] == reports[1]["compression"]

    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in external.parent.iterdir()) == before
