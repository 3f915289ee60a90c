"""A BERT-style token model (int64 input_ids / attention_mask [batch, seq] -> an embedding) from a first try:
random contexts that read the embedding table, --dim for named axes, and the whole chain on examples/token_embedder."""

import json

import models
import numpy as np
import onnx
import pytest
from conftest import REPO, invoke

MODEL = REPO / "examples" / "token_embedder" / "model.onnx"


def test_random_contexts_of_a_token_model_read_the_table_and_attend_everywhere(tmp_path):
    code, text = invoke(
        "score", MODEL, "--random-contexts", "--dim", "seq=24", "--windows", 4, "--probes", 1, "--out", tmp_path / "run"
    )
    assert code == 0, text
    saved = np.load(tmp_path / "run" / "contexts.npz")
    ids, mask = saved["input_ids"], saved["attention_mask"]
    assert ids.shape == mask.shape == (4, 1, 24) and ids.dtype == mask.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 1000 and len(np.unique(ids)) > 50  # the word table's 1000 rows, spread over
    assert (mask == 1).all()
    assert (
        "'input_ids' uniform over the 1000 rows of the table it indexes; "
        "'attention_mask' all 1 (every position present)" in text
    )
    assert "rollout 1 step (detected)" in text


def test_without_a_size_for_seq_the_error_names_dim_and_the_npz_layout(tmp_path):
    code, text = invoke("score", MODEL, "--random-contexts", "--out", tmp_path / "run")
    assert code == 2 and "Traceback" not in text
    assert (
        "cannot make random contexts for input 'input_ids' [batch, seq]: "
        "its axis 1 is dynamic ('seq') and no --dim gives its size" in text
    )
    assert (
        "pass --dim seq=N" in text
        and "'input_ids' (windows, batch, seq) int64, 'attention_mask' (windows, batch, seq) int64" in text
    )
    assert not (tmp_path / "run").exists()


def test_inspect_says_what_contexts_to_write_and_what_random_ones_need():
    code, text = invoke("inspect", MODEL)
    assert (
        code == 0
        and "contexts: an .npz with arrays 'input_ids' (windows, batch, seq) int64, "
        "'attention_mask' (windows, batch, seq) int64"
        in text
    ), text
    assert "--random-contexts needs --dim seq=N; 'input_ids' indexes a table of 1000 rows" in text


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--dim", "seq"], "--dim takes NAME=SIZE with a positive integer size"),
        (["--dim", "seq=0"], "--dim takes NAME=SIZE with a positive integer size"),
        (["--dim", "seq=abc"], "--dim takes NAME=SIZE"),
        (["--dim", "seq=8", "--dim", "seq=16"], "--dim gives axis 'seq' twice"),
        (
            ["--dim", "sequence=8"],
            "no input of the model has an axis named 'sequence' (hint: its dynamic axes are named: batch, seq)",
        ),
    ],
)
def test_dim_values_that_cannot_be_meant_are_refused(tmp_path, args, phrase):
    code, text = invoke("score", MODEL, "--random-contexts", *args, "--out", tmp_path / "run")
    assert code == 2 and phrase in text and "Traceback" not in text, text


def test_a_dim_past_the_position_table_is_named_in_the_error(tmp_path):
    """--dim seq=500 on a model with 128 positions failed with ONNX Runtime's broadcast message alone, which names
    an Add node, not the size the user gave."""
    code, text = invoke(
        "score", MODEL, "--random-contexts", "--dim", "seq=500", "--windows", 2, "--out", tmp_path / "run"
    )
    assert code == 2 and "Traceback" not in text, text
    assert (
        "the model failed to run on the contexts" in text and "(hint: --dim seq=500 sized the random contexts" in text
    ), text


def test_dim_with_a_contexts_file_is_refused(tmp_path):
    code, text = invoke(
        "score",
        MODEL,
        "-c",
        REPO / "examples" / "token_embedder" / "contexts.npz",
        "--dim",
        "seq=8",
        "--out",
        tmp_path / "run",
    )
    assert code == 2 and "--dim sizes the axes of random contexts; a contexts file gives its own shapes" in text, text


def test_ids_stay_within_the_smallest_table_they_index(tmp_path):
    """An int32 id [batch] read through a Cast by a 100-row table: random ids lie in 0..99, never negative
    (standard-normal noise cast to int64 gave -2..2)."""
    model = models.gather_forecaster(tmp_path / "emb.onnx", rows=100, cast_ids=True)
    code, text = invoke(
        "score", model, "--random-contexts", "--windows", 64, "--steps", 2, "--probes", 1, "--out", tmp_path / "run"
    )
    assert code == 0, text
    ids = np.load(tmp_path / "run" / "contexts.npz")["ids"]
    assert ids.min() >= 0 and ids.max() < 100 and len(np.unique(ids)) > 20


@pytest.mark.slow
def test_the_token_example_goes_inspect_score_export_eval_gate(tmp_path, monkeypatch):
    """The README's walk-through for a token model, with its checks: single-step, ids within the table, C = 4,
    a gate."""
    monkeypatch.chdir(tmp_path)
    proto = onnx.load(str(MODEL))
    assert (
        MODEL.stat().st_size < 500_000 and proto.ir_version <= 13 and max(o.version for o in proto.opset_import) <= 26
    )
    before = MODEL.read_bytes()
    code, text = invoke("inspect", MODEL)
    assert code == 0 and "single-step model" in text and "embeddings.word_embeddings.weight" in text, text
    code, text = invoke("score", MODEL, "--random-contexts", "--dim", "seq=64", "--probes", 1)
    assert code == 0, text
    run = tmp_path / "tqs-runs" / "token_embedder_model"
    meta = json.loads((run / "run.json").read_text())
    assert (
        meta["rollout"]["steps"] == 1
        and meta["rollout"]["feedback"] == []
        and meta["contexts"]["shapes"]["input_ids"] == [8, 1, 64]
    )
    code, text = invoke("export", "--C", 4)
    assert code == 0, text
    allocation = json.loads((tmp_path / "token_embedder_model.C4.allocation.json").read_text())
    assert 4 <= allocation["compression"] <= 4 * 1.05
    sentences = REPO / "examples" / "token_embedder" / "contexts.npz"
    code, text = invoke("eval", "token_embedder_model.C4.onnx", "--reference", MODEL, "--contexts", sentences)
    assert code == 0 and "16 context windows × 1 step" in text and "| embedding (16 × 48) |" in text, text
    code, text = invoke(
        "gate",
        "token_embedder_model.C4.onnx",
        "--reference",
        MODEL,
        "--contexts",
        sentences,
        "--max-degradation",
        "2%",
        "--min-cosine",
        0.99,
        "--min-compression",
        4,
    )
    assert code == 0, text
    assert MODEL.read_bytes() == before
