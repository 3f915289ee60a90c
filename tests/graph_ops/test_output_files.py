"""What the writers may touch beside an output: only the files they made.

A rewritten model's old external-data file goes; a user's file that merely looks like one, a data file
another model in the folder still reads, and the input's own files never do. A write that fails leaves no
data file behind, and names the file system cannot hold are refused before the work.
"""

import hashlib
import shutil

import models
import numpy as np
import onnx
import pytest
from conftest import cli

import graph_ops
from runtimes import OrtRuntime


def _data_files(folder, name="q.onnx"):
    return sorted(p.name for p in folder.glob(f"{name}.*.data"))


def _runs(path, folder):
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    return OrtRuntime().open(path, external_data_dir=folder).run({"x": x})["y"]


def test_a_rewrite_removes_only_the_data_file_its_previous_version_read(tmp_path):
    proto = onnx.load(str(models.mlp_forecaster(tmp_path / "m.onnx")))
    out = tmp_path / "out"
    out.mkdir()
    for name in (
        "q.onnx.20261127.data",
        "q.onnx.backup01.data",
        "q.onnx.ABCDEF12.data",
    ):  # a user's files, named like ours
        (out / name).write_text("mine")
    graph_ops.save_model(onnx.ModelProto.FromString(proto.SerializeToString()), out / "q.onnx", external_data=True)
    first = set(_data_files(out)) - {"q.onnx.20261127.data", "q.onnx.backup01.data", "q.onnx.ABCDEF12.data"}
    shutil.copy(out / "q.onnx", out / "kept.onnx")  # a copy of the model reads the same data file
    graph_ops.save_model(onnx.ModelProto.FromString(proto.SerializeToString()), out / "q.onnx", external_data=True)
    second = set(_data_files(out)) - first - {"q.onnx.20261127.data", "q.onnx.backup01.data", "q.onnx.ABCDEF12.data"}
    assert len(first) == 1 and len(second) == 1
    assert all(
        (out / n).read_text() == "mine"
        for n in ("q.onnx.20261127.data", "q.onnx.backup01.data", "q.onnx.ABCDEF12.data")
    )
    assert (out / first.pop()).exists()  # the copy still reads it
    np.testing.assert_array_equal(_runs(out / "kept.onnx", out), _runs(out / "q.onnx", out))

    (out / "kept.onnx").unlink()
    before = set(_data_files(out))
    graph_ops.save_model(onnx.ModelProto.FromString(proto.SerializeToString()), out / "q.onnx", external_data=True)
    assert (
        before - set(_data_files(out)) == second
    )  # the data the replaced model read goes; the first (no model's now) is not the writer's to judge


def test_a_failed_model_write_leaves_no_data_file(tmp_path):
    proto = onnx.load(str(models.mlp_forecaster(tmp_path / "m.onnx")))
    out = tmp_path / "out"
    (out / "q.onnx").mkdir(
        parents=True
    )  # the model cannot replace a folder: its rename fails after the data was written
    (out / "q.onnx" / "keep").write_text("x")
    with pytest.raises(graph_ops.io.OutputError, match="cannot write"):
        graph_ops.save_model(proto, out / "q.onnx", external_data=True)
    assert _data_files(out) == [] and not list(out.glob(".*partial"))


def test_baseline_never_overwrites_the_inputs_external_data_even_with_force(tmp_path):
    proto = onnx.load(str(models.mlp_forecaster(tmp_path / "inline.onnx")))
    onnx.save_model(
        proto,
        str(tmp_path / "m.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.onnx",
        size_threshold=0,
    )
    digest = hashlib.sha256((tmp_path / "weights.onnx").read_bytes()).hexdigest()
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).standard_normal((3, 2, 32)).astype(np.float32))
    result = cli(
        "baseline",
        tmp_path / "m.onnx",
        "--method",
        "rtn",
        "--bits",
        "4",
        "--calib",
        tmp_path / "c.npz",
        "-o",
        tmp_path / "weights.onnx",
        "--force",
    )
    assert result.exit_code == 2 and "the input model's own file" in result.output, result.output
    assert hashlib.sha256((tmp_path / "weights.onnx").read_bytes()).hexdigest() == digest


def test_an_output_name_too_long_for_the_file_system_is_refused_before_the_work(tmp_path):
    model = models.mlp_forecaster(tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).standard_normal((3, 2, 32)).astype(np.float32))
    name = "q" * 230 + ".onnx"  # fits the file system itself, but not the writer's temporary data file beside it
    result = cli(
        "baseline", model, "--method", "rtn", "--bits", "4", "--calib", tmp_path / "c.npz", "-o", tmp_path / name
    )
    assert (
        result.exit_code == 2 and "too long" in result.output and "at most 223 bytes" in " ".join(result.output.split())
    ), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "m.onnx"]


def test_export_refuses_to_overwrite_a_lone_allocation_table(two_branch, tmp_path):
    model, ctx = two_branch
    assert cli("score", model, "-c", ctx, "-o", tmp_path / "run", "--probe", "quant").exit_code == 0
    (tmp_path / "q.allocation.parquet").write_text("mine")
    result = cli("export", model, "--run", tmp_path / "run", "--C", "4", "--rounding", "rtn", "-o", tmp_path / "q.onnx")
    assert result.exit_code == 2 and "q.allocation.parquet already exists" in " ".join(result.output.split()), (
        result.output
    )
    assert (tmp_path / "q.allocation.parquet").read_text() == "mine"
