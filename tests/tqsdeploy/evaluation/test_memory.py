"""Session memory, measured in a fresh process: export reports it beside the original's, eval reports it, and
`gate --max-memory` bounds it, as a size or as a ratio to the reference."""

import json

import models
from conftest import invoke, scored_run

scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", n=128, hidden=256),
    (6, 2, 128),
    seed=3,
    steps=3,
    name="memory",
)


def test_export_measures_the_written_models_session_beside_the_originals(scored, tmp_path):
    model, _, folder = scored
    code, text = invoke("export", model, "--run", folder / "run", "--C", 4, "--memory", "-o", tmp_path / "m.onnx")
    assert code == 0, text
    memory = json.loads((tmp_path / "m.allocation.json").read_text())["session_memory"]
    assert memory["peak_bytes"] > 0 and memory["original_peak_bytes"] > 0 and memory["steady_bytes"] > 0
    assert memory["peak_ratio"] == memory["peak_bytes"] / memory["original_peak_bytes"]
    assert f"session memory: peak {memory['peak_bytes'] / 1e6:.1f} MB" in text and "fresh process" in text

    code, text = invoke("export", model, "--run", folder / "run", "--C", 4, "--no-memory", "-o", tmp_path / "q.onnx")
    assert code == 0 and "session memory" not in text
    assert json.loads((tmp_path / "q.allocation.json").read_text())["session_memory"] is None


def test_gate_bounds_the_peak_by_size_or_by_ratio(scored, tmp_path):
    model, contexts, folder = scored
    candidate = tmp_path / "m.onnx"
    assert invoke("export", model, "--run", folder / "run", "--C", 4, "-o", candidate)[0] == 0
    common = ["gate", candidate, "-r", model, "-c", contexts, "--steps", 2, "--latency-batches", "1"]

    code, text = invoke(*common, "--max-memory", "100x", "--report-dir", tmp_path / "ratio")
    assert code == 0, text
    checks = {c["name"]: c for c in json.loads((tmp_path / "ratio" / "gate.json").read_text())["checks"]}
    report = json.loads((tmp_path / "ratio" / "gate.json").read_text())
    assert checks["memory_peak_ratio"]["passed"] and checks["memory_peak_ratio"]["limit"] == 100
    assert report["report"]["memory"]["candidate"]["peak_bytes"] > 0

    code, text = invoke(*common, "--max-memory", "1KB", "--report-dir", tmp_path / "bytes")
    assert code == 1, text  # no ONNX Runtime session takes under a kilobyte
    checks = {c["name"]: c for c in json.loads((tmp_path / "bytes" / "gate.json").read_text())["checks"]}
    assert not checks["memory_peak_bytes"]["passed"] and checks["memory_peak_bytes"]["limit"] == 1000

    for bad, words in (("lots", "--max-memory takes a size such as 12MB"), ("0x", "must be positive")):
        code, text = invoke(*common, "--max-memory", bad, "--report-dir", tmp_path / "bad")
        assert code == 2 and words in text and "Traceback" not in text, text
    code, text = invoke(*common, "--max-memory", "2x", "--no-latency", "--report-dir", tmp_path / "bad")
    assert code == 2 and "--no-latency turns off" in text, text
