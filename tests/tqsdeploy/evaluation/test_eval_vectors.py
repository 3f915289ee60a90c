"""eval and gate read embedding outputs as vectors: cosine similarity and nearest-neighbour agreement."""

import json

import models
import numpy as np
import onnxruntime as ort
import pytest
from conftest import invoke
from onnx import TensorProto, helper

from tqsdeploy.evaluation.metrics import looks_like_embedding


def _encoder(path, noise: float):
    """A sentence encoder: input_ids [batch, 6] -> sentence_embedding [batch, 16] = tanh(mean of the ids'
    rows of a table) and a head logits [batch, 4]; `noise` perturbs the table (the 'quantized' candidate)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 16)).astype(np.float32)
    table += noise * np.random.default_rng(1).standard_normal(table.shape).astype(np.float32)
    head = rng.standard_normal((16, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["rows"]),
        helper.make_node("ReduceMean", ["rows"], ["mean"], axes=[1], keepdims=0),
        helper.make_node("Tanh", ["mean"], ["sentence_embedding"]),
        helper.make_node("MatMul", ["sentence_embedding", "Whead"], ["logits"]),
    ]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 6])]
    outputs = [
        helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", 16]),
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4]),
    ]
    return models._model(nodes, inputs, outputs, {"table": table, "Whead": head}, path)


def test_eval_reports_cosine_and_same_neighbour_for_embedding_outputs_as_numpy_computes_them(tmp_path):
    reference, candidate = _encoder(tmp_path / "ref.onnx", 0.0), _encoder(tmp_path / "cand.onnx", 0.6)
    ids = np.random.default_rng(2).integers(0, 50, (4, 4, 6))  # 4 windows of 4 sentences of 6 tokens
    np.savez(tmp_path / "ctx.npz", input_ids=ids)
    code, text = invoke(
        "eval", candidate, "--reference", reference, "--contexts", tmp_path / "ctx.npz", "--report", tmp_path / "r"
    )
    assert code == 0, text
    report = json.loads((tmp_path / "r.json").read_text())

    def embed(path):  # an independent run and computation: plain ONNX Runtime, numpy
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return np.concatenate([session.run(["sentence_embedding"], {"input_ids": window})[0] for window in ids]).astype(
            np.float64
        )

    a, b = embed(candidate), embed(reference)
    cosine = np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    def neighbours(e):
        s = (e / np.linalg.norm(e, axis=1)[:, None]) @ (e / np.linalg.norm(e, axis=1)[:, None]).T
        np.fill_diagonal(s, -2)
        return s.argmax(axis=1)

    same = int((neighbours(a) == neighbours(b)).sum())
    got = report["outputs"]["sentence_embedding"]["cosine"]
    assert got["vectors"] == 16 and got["dim"] == 16 and got["neighbour_vectors"] == 16
    assert got["mean"] == pytest.approx(cosine.mean(), abs=1e-6) and got["min"] == pytest.approx(cosine.min(), abs=1e-6)
    assert (
        got["same_neighbour"] == same and 0 < same < 16 and cosine.min() < 0.99
    )  # the noise moves vectors and some neighbours
    assert (
        "cosine" not in report["outputs"]["logits"]
    )  # a [batch, 4] head named logits is not read as vectors unless asked
    assert (
        f"| sentence_embedding (16 × 16) | {cosine.mean():.6f} | {cosine.min():.6f} | {same}/16 |"
        in (tmp_path / "r.md").read_text()
    )

    code, text = invoke(
        "eval",
        candidate,
        "--reference",
        reference,
        "--contexts",
        tmp_path / "ctx.npz",
        "--report",
        tmp_path / "all",
        "--cosine",
    )
    assert code == 0 and "cosine" in json.loads((tmp_path / "all.json").read_text())["outputs"]["logits"], text
    code, text = invoke(
        "eval",
        candidate,
        "--reference",
        reference,
        "--contexts",
        tmp_path / "ctx.npz",
        "--report",
        tmp_path / "none",
        "--no-cosine",
    )
    assert (
        code == 0 and "cosine" not in json.loads((tmp_path / "none.json").read_text())["outputs"]["sentence_embedding"]
    ), text

    gate = (
        "gate",
        candidate,
        "--reference",
        reference,
        "--contexts",
        tmp_path / "ctx.npz",
        "--report-dir",
        tmp_path / "g",
    )
    code, text = invoke(*gate, "--min-cosine", f"{cosine.min() - 1e-4:.6f}")
    assert code == 0, text
    code, text = invoke(*gate, "--min-cosine", "0.999")
    assert code == 1 and f"cosine_min[sentence_embedding] = {cosine.min():.6g} violates >= 0.999" in text, text
    code, text = invoke(*gate, "--min-cosine", "0.9", "--no-cosine")
    assert code == 2 and "--min-cosine: no output" in text and "--cosine" in text, text


def test_the_embedding_rule():
    assert looks_like_embedding("sentence_embedding", ["?", 384]) and looks_like_embedding(
        "last_hidden_state", ["?", "?", 768]
    )
    assert looks_like_embedding("pooler_output", [1, 768]) and looks_like_embedding("embeddings", ["batch", 512])
    assert not looks_like_embedding("forecast", ["?", 48]) and not looks_like_embedding("embedding", ["?", 1])
    assert not looks_like_embedding("embedding", ["?", "dim"]) and not looks_like_embedding("embedding", ["?", 2, 3, 4])
