"""Weights written in ONNX Runtime's own low-bit kernels (MatMulNBits, GatherBlockQuantized) compute exactly what the
codes' numpy dequantization says, on a real session: every code width, signed and asymmetric grids, per-channel and
blockwise scales, a weight shared by two MatMuls, Gemm with transB, channel groups at different tiers, and tables;
the file needs the ONNX Runtime release `oldest_release` names, and `runtime_forms` reads back what runs."""

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graph_ops
from graph_ops.native import GATHER, MATMUL, NativeUse, native_uses, runtime_forms
from graph_ops.qdq import write_storage
from runtimes.ort_versions import oldest_release
from tiers import TIERS, Rounding, encode, split
from tiers.formats.native import NativeOptions
from tiers.quantizer import Layout

EXACT = NativeOptions(accuracy_level=0, min_params=0, split_min_bytes=0)


def _layouts(proto, names):
    found = graph_ops.weight_layouts(proto, names)
    return {n: Layout(found[n].shape, found[n].perm, found[n].row_groups) for n in names}


def _encoded(proto, tier: str, group_size=None) -> dict:
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    names = [n for n, w in weights.items() if w.ndim == 2 and w.size >= 512]
    layouts = _layouts(proto, names)
    return {n: encode(weights[n], layouts[n], TIERS[tier], Rounding(), None, group_size) for n in names}


def _run(path, feeds) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _write_native(proto, stored, path, options=EXACT):
    uses = native_uses(proto)
    plans = {n: e.native(n, uses[n], options) for n, e in stored.items() if n in uses}
    return write_storage(proto, stored, path, layout="native", native={n: p for n, p in plans.items() if p})


@pytest.mark.parametrize("tier", ["int8-asym", "int4-asym", "int2-asym", "int8", "int4", "int2"])
def test_matrix_weights_as_matmulnbits_compute_the_dequantized_model(tmp_path, tier):
    """MatMul weights (one shared by two MatMuls) and a Gemm's transposed B: every consumer becomes MatMulNBits, and
    at accuracy level 0 the session's outputs equal the float model built from the dequantized codes."""
    path = models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128)
    proto = onnx.load(path)
    stored = _encoded(proto, tier)
    written = _write_native(proto, stored, tmp_path / "native.onnx")
    nodes = onnx.load(written.path).graph.node
    assert sum(n.op_type == "MatMulNBits" for n in nodes) >= 4 and not any(n.op_type == "MatMul" for n in nodes)
    fake = graph_ops.replace_weights(proto, {n: e.dequantize() for n, e in stored.items()})
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    reference = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[
        0
    ]
    np.testing.assert_allclose(_run(written.path, {"x": x}), reference, rtol=1e-5, atol=1e-6)


def test_int8_activations_stay_within_a_small_relative_error(tmp_path):
    path = models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128)
    proto = onnx.load(path)
    stored = _encoded(proto, "int4-asym")
    exact = _write_native(proto, stored, tmp_path / "exact.onnx")
    fast = _write_native(proto, stored, tmp_path / "fast.onnx", NativeOptions(accuracy_level=4, min_params=0))
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    a, b = _run(exact.path, {"x": x}), _run(fast.path, {"x": x})
    error = np.abs(a - b).max() / np.abs(a).max()
    assert 0 < error < 1e-2, error


@pytest.mark.parametrize("group_size", [None, 256])
def test_2_bit_codes_run_in_blocks_of_at_most_128(tmp_path, group_size):
    """2-bit MatMulNBits has no fast kernel for blocks of 256: a per-channel grid picks blocks of at most 128, and a
    group size of 256 is written as pairs of 128-blocks sharing its scale and zero point (K = 1100: the last group
    half padding), still exactly the dequantized model."""
    a = np.random.default_rng(6).standard_normal((1100, 1100)) / 33
    proto = onnx.load(models.linear_map(tmp_path / "lin.onnx", a))
    stored = _encoded(proto, "int2-asym", group_size=group_size)
    written = _write_native(proto, stored, tmp_path / "native.onnx")
    node = next(n for n in onnx.load(written.path).graph.node if n.op_type == "MatMulNBits")
    attributes = {a.name: a.i for a in node.attribute}
    assert attributes["bits"] == 2 and attributes["block_size"] <= 128
    fake = graph_ops.replace_weights(proto, {n: e.dequantize() for n, e in stored.items()})
    x = np.random.default_rng(7).standard_normal((2, 1100)).astype(np.float32)
    want = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(_run(written.path, {"x": x}), want, rtol=1e-5, atol=1e-5)


def test_blockwise_codes_keep_their_blocks(tmp_path):
    path = models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128)
    proto = onnx.load(path)
    stored = _encoded(proto, "int4-asym", group_size=32)
    written = _write_native(proto, stored, tmp_path / "native.onnx")
    blocks = {
        a.i
        for n in onnx.load(written.path).graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "block_size"
    }
    assert blocks == {32}
    fake = graph_ops.replace_weights(proto, {n: e.dequantize() for n, e in stored.items()})
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    reference = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[
        0
    ]
    np.testing.assert_allclose(_run(written.path, {"x": x}), reference, rtol=1e-5, atol=1e-6)


def test_channel_groups_at_different_tiers_are_one_kernel_each_joined(tmp_path):
    """A weight whose output channels sit on int8, int4 and fp32 becomes two MatMulNBits and a float MatMul,
    concatenated: the outputs equal the dequantized model's."""
    proto = onnx.load(models.linear_map(tmp_path / "lin.onnx", np.random.default_rng(0).standard_normal((96, 96)) / 10))
    weight = onnx.numpy_helper.to_array(proto.graph.initializer[0])
    layout = _layouts(proto, ["W"])["W"]
    parts = [
        encode(weight[:, :32], Layout((96, 32), layout.perm, 1), TIERS["int8-asym"], Rounding(), None),
        encode(weight[:, 32:64], Layout((96, 32), layout.perm, 1), TIERS["int4-asym"], Rounding(), None),
        TIERS["fp32"].float_copy(weight[:, 64:]),
    ]
    joined = split(parts, layout)
    written = _write_native(proto, {"W": joined}, tmp_path / "native.onnx")
    ops = [n.op_type for n in onnx.load(written.path).graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("MatMul") == 1 and "Concat" in ops
    x = np.random.default_rng(3).standard_normal((5, 96)).astype(np.float32)
    np.testing.assert_allclose(_run(written.path, {"x": x}), x @ joined.dequantize(), rtol=1e-5, atol=1e-6)


def test_adjacent_groups_at_one_tier_are_one_kernel_and_a_small_split_weight_folds(tmp_path):
    """Groups [int4 | int4 | int8]: the two int4 groups become one MatMulNBits over their 64 channels, the outputs
    still the dequantized model's; with the default options this 36 KB weight, needing two kernels, is folded."""
    proto = onnx.load(models.linear_map(tmp_path / "lin.onnx", np.random.default_rng(6).standard_normal((96, 96)) / 10))
    weight = onnx.numpy_helper.to_array(proto.graph.initializer[0])
    layout = _layouts(proto, ["W"])["W"]
    tiers = ["int4-asym", "int4-asym", "int8-asym"]
    parts = [
        encode(weight[:, 32 * i : 32 * (i + 1)], Layout((96, 32), layout.perm, 1), TIERS[tier], Rounding(), None)
        for i, tier in enumerate(tiers)
    ]
    joined = split(parts, layout)
    written = _write_native(proto, {"W": joined}, tmp_path / "native.onnx")
    nodes = onnx.load(written.path).graph.node
    widths = sorted(a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "N")
    assert widths == [32, 64]
    x = np.random.default_rng(7).standard_normal((5, 96)).astype(np.float32)
    np.testing.assert_allclose(_run(written.path, {"x": x}), x @ joined.dequantize(), rtol=1e-5, atol=1e-6)
    assert joined.native("W", native_uses(proto)["W"], NativeOptions(min_params=0)) is None


def test_channel_groups_of_a_transposed_gemm_weight_keep_its_storage(tmp_path):
    """Gemm(x, W1, b1, transB=1) stores W1 as [N, K]: its int4 group becomes MatMulNBits, its float group a Gemm
    reading the slice transposed (a MatMul would multiply by [N, K]), the bias added once after the Concat."""
    proto = onnx.load(models.gemm_pair(tmp_path / "gemm.onnx", n=32, hidden=96))
    weight = onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == "W1"))
    layout = _layouts(proto, ["W1"])["W1"]
    assert layout.perm == (0, 1)  # output channels along axis 0
    parts = [
        encode(weight[:64], Layout((64, 32), layout.perm, 1), TIERS["int4-asym"], Rounding(), None),
        TIERS["fp32"].float_copy(weight[64:]),
    ]
    joined = split(parts, layout)
    written = _write_native(proto, {"W1": joined}, tmp_path / "native.onnx")
    ops = [n.op_type for n in onnx.load(written.path).graph.node]
    assert ops.count("MatMulNBits") == 1 and "Concat" in ops
    fake = graph_ops.replace_weights(proto, {"W1": joined.dequantize()})
    x = np.random.default_rng(5).standard_normal((3, 32)).astype(np.float32)
    want = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(_run(written.path, {"x": x}), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tier", ["int4-asym", "int4", "int8-asym", "int8"])
def test_tables_as_gatherblockquantized_gather_the_dequantized_rows(tmp_path, tier):
    path = models.gather_forecaster(tmp_path / "emb.onnx", rows=100, n=32)
    proto = onnx.load(path)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    stored = {"emb": encode(weights["emb"], _layouts(proto, ["emb"])["emb"], TIERS[tier], Rounding(), None)}
    assert native_uses(proto)["emb"] == NativeUse(GATHER, 0)
    written = _write_native(proto, stored, tmp_path / "native.onnx")
    assert "GatherBlockQuantized" in [n.op_type for n in onnx.load(written.path).graph.node]
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 32)).astype(np.float32), "ids": np.array([3, 97])}
    fake = graph_ops.replace_weights(proto, {"emb": stored["emb"].dequantize()})
    reference = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(_run(written.path, feeds), reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ids", [np.array([0, 3, 24, 25, 49, 50, 74, 75, 99]), np.array([99, 0])])
def test_a_table_cut_into_row_groups_gathers_each_from_its_own_kernel(tmp_path, ids):
    """Rows [0:25) int8, [25:50) int4, [50:75) int4, [75:100) fp32: the two int4 groups are one GatherBlockQuantized,
    the fp32 rows a float Gather, and every index, at either edge of a group, reads its row as the dequantized table
    does; 2-bit rows on a release without 2-bit GatherBlockQuantized are a Gather of their packed 2-bit codes."""
    proto = onnx.load(models.gather_forecaster(tmp_path / "emb.onnx", rows=100, n=32))
    table = next(onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == "emb")
    layout = _layouts(proto, ["emb"])["emb"]
    rows = Layout((25, 32), layout.perm, 1)
    parts = [
        encode(table[i * 25 : (i + 1) * 25], rows, TIERS[tier], Rounding(), None)
        for i, tier in enumerate(["int8-asym", "int4-asym", "int4-asym"])
    ]
    parts.append(TIERS["fp32"].float_copy(table[75:]))
    joined = split(parts, layout).compact()  # packed codes, as the run's cache keeps them
    written = _write_native(proto, {"emb": joined}, tmp_path / "native.onnx")
    ops = [n.op_type for n in onnx.load(written.path).graph.node]
    assert ops.count("GatherBlockQuantized") == 2 and ops.count("Where") == 2
    feeds = {"x": np.zeros((len(ids), 32), np.float32), "ids": ids}
    fake = graph_ops.replace_weights(proto, {"emb": joined.dequantize()})
    want = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(_run(written.path, feeds), want, rtol=1e-6, atol=1e-7)

    two_bit = split(
        [
            encode(table[:50], Layout((50, 32), layout.perm, 1), TIERS["int2-asym"], Rounding(), None),
            encode(table[50:], Layout((50, 32), layout.perm, 1), TIERS["int8-asym"], Rounding(), None),
        ],
        layout,
    )
    older = _write_native(proto, {"emb": two_bit}, tmp_path / "two.onnx", NativeOptions((2, 4, 8), (4, 8), 0, 0))
    assert [n.op_type for n in onnx.load(older.path).graph.node].count("GatherBlockQuantized") == 1
    assert runtime_forms(onnx.load(older.path))["emb"].form == "Gather of 2-bit codes + GatherBlockQuantized 8-bit"
    fake = graph_ops.replace_weights(proto, {"emb": two_bit.dequantize()})
    want = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(_run(older.path, feeds), want, rtol=1e-6, atol=1e-7)


def _rank_2_ids(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The table model with ids [a, batch] (a token model's [batch, sequence]); y [a, batch, n] by broadcasting."""
    ids = next(i for i in proto.graph.input if i.name == "ids")
    ids.type.tensor_type.shape.dim.insert(0, onnx.TensorShapeProto.Dimension(dim_param="a"))
    proto.graph.output[0].type.tensor_type.ClearField("shape")
    return proto


@pytest.mark.parametrize(
    "tiers,gather_bits",
    [
        (["int1"], (4, 8)),
        (["int2-asym"], (4, 8)),
        (["int2"], (2, 4, 8)),  # a width no GatherBlockQuantized block divides (30)
        (["int2-asym", "int1", "int2", "int8-asym"], (4, 8)),
    ],
)
@pytest.mark.parametrize("ids", [np.array([0, 24, 25, 49, 50, 74, 75, 99]), np.array([[99, 0, 25], [50, 49, 74]])])
def test_rows_no_kernel_takes_are_gathered_as_packed_codes_and_dequantized_after(tmp_path, tiers, gather_bits, ids):
    """Sign bits, 2-bit codes on a release whose GatherBlockQuantized takes none, codes of a row width no block
    divides: a Gather reads their packed bytes and only the picked rows are unpacked, exactly the dequantized table's
    rows, for 1-D and 2-D indices; the session holds the codes (no float copy of the table is folded)."""
    proto = onnx.load(models.gather_forecaster(tmp_path / "emb.onnx", rows=100, n=30))
    proto = _rank_2_ids(proto) if ids.ndim == 2 else proto
    table = next(onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == "emb")
    layout, size = _layouts(proto, ["emb"])["emb"], 100 // len(tiers)
    parts = [
        encode(table[i * size : (i + 1) * size], Layout((size, 30), layout.perm, 1), TIERS[tier], Rounding(), None)
        for i, tier in enumerate(tiers)
    ]
    stored = split(parts, layout).compact() if len(parts) > 1 else parts[0]
    written = _write_native(
        proto, {"emb": stored}, tmp_path / "native.onnx", NativeOptions((2, 4, 8), gather_bits, 0, 0)
    )
    held = runtime_forms(onnx.load(written.path))["emb"]
    assert "Gather of" in held.form and "folded" not in held.form and held.bytes < table.nbytes / 3
    feeds = {"x": np.zeros((ids.shape[-1], 30), np.float32), "ids": ids}
    fake = graph_ops.replace_weights(proto, {"emb": stored.dequantize()})
    want = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = _run(written.path, feeds)
    assert got.shape == want.shape == (*ids.shape, 30)
    np.testing.assert_array_equal(got, want)


def test_sign_bits_of_a_matrix_weight_run_as_2_bit_codes_around_a_zero_point(tmp_path):
    """MatMulNBits takes no 1-bit codes: INT1's signs become 2-bit codes {0, 2} with zero point 1, exactly +-|s|, in
    the kernel rather than a float copy folded at load."""
    proto = onnx.load(
        models.linear_map(tmp_path / "lin.onnx", np.random.default_rng(3).standard_normal((1024, 1024)) / 32)
    )
    stored = _encoded(proto, "int1")
    written = _write_native(proto, stored, tmp_path / "native.onnx")
    assert {f.form for f in runtime_forms(onnx.load(written.path)).values()} == {"MatMulNBits 2-bit"}
    fake = graph_ops.replace_weights(proto, {n: e.dequantize() for n, e in stored.items()})
    x = np.random.default_rng(4).standard_normal((3, 1024)).astype(np.float32)
    want = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(_run(written.path, {"x": x}), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,bits", [(384, 4), (1024, 2)])
def test_2_bit_codes_of_a_narrow_weight_run_in_4_bit_containers(tmp_path, k, bits):
    """Below `min_k_2bit` input channels the 2-bit kernel is slower than the float MatMul: the same codes go in 4-bit
    containers, and the outputs are still the dequantized model's."""
    proto = onnx.load(models.linear_map(tmp_path / "lin.onnx", np.random.default_rng(8).standard_normal((k, k)) / k))
    stored = _encoded(proto, "int2-asym")
    written = _write_native(proto, stored, tmp_path / "native.onnx")
    node = next(n for n in onnx.load(written.path).graph.node if n.op_type == "MatMulNBits")
    assert next(a.i for a in node.attribute if a.name == "bits") == bits
    fake = graph_ops.replace_weights(proto, {n: e.dequantize() for n, e in stored.items()})
    x = np.random.default_rng(9).standard_normal((3, k)).astype(np.float32)
    want = ort.InferenceSession(fake.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(_run(written.path, {"x": x}), want, rtol=1e-5, atol=1e-6)


def test_the_oldest_release_follows_what_the_file_holds(tmp_path):
    """4-bit MatMulNBits on an opset-17 model loads from 1.20; 8-bit codes need 1.23, 2-bit 1.24, and the
    dequantized layout's Cast from 4-bit codes 1.23."""
    path = models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128)
    proto = onnx.load(path)
    for tier, release in (("int4-asym", (1, 20)), ("int8-asym", (1, 23)), ("int2-asym", (1, 24))):
        written = _write_native(proto, _encoded(proto, tier), tmp_path / f"{tier}.onnx")
        assert oldest_release(onnx.load(written.path))[0] == release, tier
    folded = write_storage(proto, _encoded(proto, "int4-asym"), tmp_path / "folded.onnx", layout="dequantized")
    version, why = oldest_release(onnx.load(folded.path))
    assert version == (1, 23) and "a Cast from 4-bit codes" in why


def test_runtime_forms_name_what_runs_and_what_it_holds(tmp_path):
    path = models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128)
    proto = onnx.load(path)
    stored = _encoded(proto, "int4-asym")
    native = runtime_forms(onnx.load(_write_native(proto, stored, tmp_path / "native.onnx").path))
    folded = runtime_forms(onnx.load(write_storage(proto, stored, tmp_path / "folded.onnx", layout="dequantized").path))
    assert {native[n].form for n in stored} == {"MatMulNBits 4-bit"}
    assert {folded[n].form for n in stored} == {"folded at load"}
    for name, encoded in stored.items():  # codes held, against a float copy of the weight
        assert native[name].bytes < folded[name].bytes == 4 * encoded.dequantize().size


def test_a_weight_read_by_another_kind_of_node_is_not_native(tmp_path):
    proto = onnx.load(models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128))
    uses = native_uses(proto)
    assert all(u.kind == MATMUL for u in uses.values())
    name = next(iter(uses))
    proto.graph.node.append(onnx.helper.make_node("Identity", [name], ["leak"]))
    assert name not in native_uses(proto)
