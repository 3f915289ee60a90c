"""Build the tiny BERT-style sentence embedder (`model.onnx`) and its sentences (`contexts.npz`).

Run from the repository root: `python examples/token_embedder/build.py`. numpy and onnx only, seeded, no
download and no training: the weights are random (scaled as a freshly initialised BERT's), so the
embeddings mean nothing. The model exists to have the *shape* of a user's token model (int64
`input_ids` / `attention_mask` [batch, seq] → a mean-pooled embedding) in the repository, for the tests and
the README's walk-through.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
VOCAB, POSITIONS, WIDTH, HEADS, FFN, LAYERS = 1000, 128, 48, 4, 96, 2
PAD = 0


def build(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    init: dict[str, np.ndarray] = {}
    nodes: list = []

    def weight(name: str, shape, scale: float = 0.02) -> str:
        init[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
        return name

    def const(name: str, value) -> str:
        init[name] = np.asarray(value)
        return name

    def node(op: str, inputs, output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output

    def layer_norm(x: str, name: str) -> str:
        init[f"{name}.weight"], init[f"{name}.bias"] = np.ones(WIDTH, np.float32), np.zeros(WIDTH, np.float32)
        return node("LayerNormalization", [x, f"{name}.weight", f"{name}.bias"], name, axis=-1, epsilon=1e-12)

    def linear(x: str, name: str, fan_in: int, fan_out: int) -> str:
        init[f"{name}.bias"] = np.zeros(fan_out, np.float32)
        return node(
            "Add",
            [node("MatMul", [x, weight(f"{name}.weight", (fan_in, fan_out))], f"{name}.matmul"), f"{name}.bias"],
            name,
        )

    # embeddings: word table (a Gather unit indexed by input_ids) + positions 0..seq-1 (a Gather on Range)
    const("zero", np.array(0, np.int64)), const("one", np.array(1, np.int64)), const("axis1", np.array([1], np.int64))
    words = node(
        "Gather", [weight("embeddings.word_embeddings.weight", (VOCAB, WIDTH)), "input_ids"], "embeddings.words"
    )
    seq = node("Squeeze", [node("Shape", ["input_ids"], "shape", start=1, end=2)], "seq_len")
    positions = node("Range", ["zero", seq, "one"], "position_ids")
    placed = node(
        "Gather",
        [weight("embeddings.position_embeddings.weight", (POSITIONS, WIDTH)), positions],
        "embeddings.positions",
    )
    hidden = layer_norm(node("Add", [words, placed], "embeddings.sum"), "embeddings.LayerNorm")

    # additive attention mask [batch, 1, 1, seq]: 0 where attended, -1e4 on padding
    mask = node("Cast", ["attention_mask"], "mask_float", to=TensorProto.FLOAT)
    (
        const("neg", np.array(-1e4, np.float32)),
        const("one_f", np.array(1.0, np.float32)),
        const("axes12", np.array([1, 2], np.int64)),
    )
    bias = node(
        "Unsqueeze",
        [node("Mul", [node("Sub", ["one_f", mask], "unmasked"), "neg"], "mask_bias"), "axes12"],
        "attention_bias",
    )

    head = WIDTH // HEADS
    (
        const("split_heads", np.array([0, -1, HEADS, head], np.int64)),
        const("merge_heads", np.array([0, -1, WIDTH], np.int64)),
    )
    (
        const("scale", np.array(1 / np.sqrt(head), np.float32)),
        const("half", np.array(0.5, np.float32)),
        const("root2", np.array(np.sqrt(2), np.float32)),
    )
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"

        def heads(name: str, perm) -> str:
            projected = linear(hidden, f"{p}.attention.self.{name}", WIDTH, WIDTH)
            return node(
                "Transpose",
                [node("Reshape", [projected, "split_heads"], f"{p}.{name}.split")],
                f"{p}.{name}.heads",
                perm=perm,
            )

        q, k, v = heads("query", [0, 2, 1, 3]), heads("key", [0, 2, 3, 1]), heads("value", [0, 2, 1, 3])
        scores = node(
            "Add",
            [node("Mul", [node("MatMul", [q, k], f"{p}.scores.raw"), "scale"], f"{p}.scores.scaled"), bias],
            f"{p}.scores",
        )
        context = node("MatMul", [node("Softmax", [scores], f"{p}.probs", axis=-1), v], f"{p}.context.heads")
        context = node(
            "Reshape",
            [node("Transpose", [context], f"{p}.context.t", perm=[0, 2, 1, 3]), "merge_heads"],
            f"{p}.context",
        )
        attended = linear(context, f"{p}.attention.output.dense", WIDTH, WIDTH)
        hidden = layer_norm(
            node("Add", [attended, hidden], f"{p}.attention.residual"), f"{p}.attention.output.LayerNorm"
        )
        inner = linear(hidden, f"{p}.intermediate.dense", WIDTH, FFN)  # GELU (erf form)
        gelu = node(
            "Mul",
            [
                node("Mul", [inner, "half"], f"{p}.gelu.half"),
                node(
                    "Add",
                    [node("Erf", [node("Div", [inner, "root2"], f"{p}.gelu.scaled")], f"{p}.gelu.erf"), "one_f"],
                    f"{p}.gelu.sum",
                ),
            ],
            f"{p}.gelu",
        )
        out = linear(gelu, f"{p}.output.dense", FFN, WIDTH)
        hidden = layer_norm(node("Add", [out, hidden], f"{p}.output.residual"), f"{p}.output.LayerNorm")

    # mean over the attended tokens: sum(hidden * mask) / sum(mask)
    const("axis_last", np.array([2], np.int64)), const("tiny", np.array(1e-9, np.float32))
    weights = node("Unsqueeze", [mask, "axis_last"], "mask_3d")
    summed = node("ReduceSum", [node("Mul", [hidden, weights], "masked_hidden"), "axis1"], "pooled_sum", keepdims=0)
    count = node("Max", [node("ReduceSum", [mask, "axis1"], "token_count", keepdims=1), "tiny"], "token_count_safe")
    node("Div", [summed, count], "embedding")

    graph = helper.make_graph(
        nodes,
        "token_embedder",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
            for n in ("input_ids", "attention_mask")
        ],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tqsdeploy examples/token_embedder/build.py"
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, str(path))
    return path


def sentences(path: Path, count: int = 16, seq: int = 32, seed: int = 1) -> Path:
    """`count` 'sentences' of random token ids, padded to `seq` (mask 0 and id PAD after each one's length)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, seq + 1, count)
    ids = rng.integers(1, VOCAB, (count, 1, seq))
    mask = (np.arange(seq)[None, None, :] < lengths[:, None, None]).astype(np.int64)
    np.savez(path, input_ids=np.where(mask == 1, ids, PAD).astype(np.int64), attention_mask=mask)
    return path


if __name__ == "__main__":
    model = build(HERE / "model.onnx")
    sentences(HERE / "contexts.npz")
    print(f"wrote {model} ({model.stat().st_size / 1e3:.0f} kB) and {HERE / 'contexts.npz'}")
