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


def test_large_single_file_models_are_streamed_from_a_copy_of_their_weights_in_the_run_folder(tmp_path, monkeypatch):
    """Past STREAM_COPY_BYTES a model holding its weights inside the .onnx is scored from a one-time copy of them
    into a data file in the run folder (reused on resume and by export): same γ, same exported model."""
    import sys

    score_module = sys.modules["tqsdeploy.score"]  # the package re-exports the function under the same name

    model = models.mlp_forecaster(tmp_path / "m.onnx", n=32, hidden=64)
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).standard_normal((3, 2, 32)).astype(np.float32))
    settings = ScoreSettings(gauss_draws=2)
    plain = score(model, tmp_path / "c.npz", steps=4, out=tmp_path / "plain", settings=settings, strategy="feed")
    monkeypatch.setattr(score_module, "STREAM_COPY_BYTES", 0)
    copied = score(model, tmp_path / "c.npz", steps=4, out=tmp_path / "copied", settings=settings)
    gammas = lambda table: dict(zip(table.frame["unit"], table.frame["gamma"]))
    assert gammas(plain) == gammas(copied)
    copies = sorted(p.name for p in (tmp_path / "copied").glob("weights-*"))
    assert len(copies) == 2 and copies[1].endswith(".data")  # the graph and its data file
    stamp = (tmp_path / "copied" / copies[1]).stat().st_mtime_ns
    assert gammas(score(model, tmp_path / "c.npz", steps=4, out=tmp_path / "copied", settings=settings)) == gammas(plain)
    assert (tmp_path / "copied" / copies[1]).stat().st_mtime_ns == stamp  # reused, not rewritten

    outcomes = []
    for run in ("plain", "copied"):
        planner = Planner(tmp_path / run, model)
        outcomes.append(planner.export(4, tmp_path / f"out_{run}" / "q.onnx"))
        planner.close()
    x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    ys = [OrtRuntime(exact_qdq=True).open(o.path, external_data_dir=o.path.parent).run({"x": x})["y"] for o in outcomes]
    assert outcomes[0].shipped == outcomes[1].shipped and np.array_equal(ys[0], ys[1])

    # a fresh score of another model into the same folder removes the copy
    other = models.mlp_forecaster(tmp_path / "other.onnx", n=32, hidden=64, seed=5)
    score(other, tmp_path / "c.npz", steps=4, out=tmp_path / "copied", settings=settings, resume=False)
    assert not any(name in copies for name in (p.name for p in (tmp_path / "copied").iterdir()))
