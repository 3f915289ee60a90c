"""Units read as module paths where the exporter generated their ONNX names, in inspect, score and export alike,
with the ONNX name kept beside them (and as their identity in every file)."""

import json

import models
import numpy as np
import polars as pl
import pytest
from conftest import invoke

import graph_ops
from tqsdeploy.units import UnitSelection, select_units


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    folder = tmp_path_factory.mktemp("names")
    model = models.exporter_names(folder / "m.onnx")
    np.savez(folder / "ctx.npz", x=np.random.default_rng(0).standard_normal((4, 2, 64)).astype(np.float32))
    return model, folder


def test_inspect_shows_module_paths_beside_the_onnx_names(named):
    model, _ = named
    code, text = invoke("inspect", model, "--json")
    assert code == 0, text
    units = {u["unit"]: u["label"] for u in json.loads(text)["units"]}
    assert units == {
        "val_3": "encoder.fc.weight",
        "val_7": "mix.weight",
        "val_20": "pair.matmul (val_20)",
        "val_21": "pair.matmul (val_21)",
        "onnx::MatMul_12": "head.proj.MatMul",
    }
    code, text = invoke("inspect", model, columns=250)
    assert code == 0 and "┃ unit ┃ onnx name ┃" in text and "│ encoder.fc.weight │ val_3 │" in text, text


def test_include_and_exclude_match_the_module_path_too(named):
    model, _ = named
    tensors = graph_ops.find_weight_tensors(graph_ops.load_model(model).proto)
    kept = select_units(tensors, UnitSelection(exclude=r"^mix\.|pair"))
    assert [u.name for u in kept] == ["val_3", "onnx::MatMul_12"]
    added = select_units(tensors, UnitSelection(min_params=10**6, include=r"encoder\.fc"))
    assert [(u.name, u.label) for u in added] == [("val_3", "encoder.fc.weight")]


def test_score_and_export_tables_keep_both_names(named, tmp_path):
    model, folder = named
    code, text = invoke("score", model, "-c", folder / "ctx.npz", "--steps", 2, "--out", tmp_path / "run", columns=250)
    assert code == 0 and "│ encoder.fc.weight │ val_3 │" in text, text
    scores = pl.read_csv(tmp_path / "run" / "scores.csv")
    assert dict(zip(scores["unit"], scores["label"]))["val_7"] == "mix.weight"  # the ONNX name stays the key
    code, text = invoke("export", model, "--run", tmp_path / "run", "--C", 4, "--out-dir", tmp_path, columns=250)
    assert code == 0, text
    table = pl.read_parquet(tmp_path / "m.C4.allocation.parquet")
    cut = table.filter(pl.col("unit") == "val_3")
    assert cut.height > 1 and all(
        label == f"encoder.fc.weight[{channels}]" and slot == f"val_3[{channels}]"
        for slot, label, channels in cut.select("slot", "label", "channels").iter_rows()
    )  # a channel group is named like its unit
    record = json.loads((tmp_path / "m.C4.allocation.json").read_text())
    assert {row["label"] for row in record["tiers"]} == set(table["label"]) and record["slots"] == table.height
    assert f"'encoder.fc.weight' in {cut.height}" in text and f"here 5 units as {table.height} slots" in text
