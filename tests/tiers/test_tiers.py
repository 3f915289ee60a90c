"""Tiers: grids, stored forms, honest costs, and the ONNX round trip of every (tier, rounding) pair."""

import models
import numpy as np
import onnx
import pytest

import graph_ops
from graph_ops.qdq import apply_storage, conversion_overhead_bits, emitted_bits
from runtimes import OrtRuntime
from tiers import METHODS, TIERS, Layout, Rounding, TierError, encode, get_tiers, split, tier_for_bits
from tqsdeploy.encoding.calibrator import CalibrationRollout, Calibrator
from tqsdeploy.encoding.encoder import Encoder
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.units import Unit

RNG = np.random.default_rng(0)
W = RNG.standard_normal((64, 48)).astype(np.float32)
LAYOUTS = [Layout.channels_on((64, 48), 1), Layout.channels_on((64, 48), 0), Layout((64, 48))]


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("layout,group", [(LAYOUTS[0], None), (LAYOUTS[0], 16), (LAYOUTS[1], None), (LAYOUTS[2], None)])
def test_cost_is_what_the_file_stores(tier, layout, group):
    """The payload (codes, scales, zero points) is what the emitted tensors hold, plus only the
    unpack constants of packed signs; every compression in the tool divides by emitted bits."""
    encoded = encode(W, layout, TIERS[tier], group_size=group)
    assert encoded.dequantize().shape == W.shape
    emitted = emitted_bits("w", encoded)
    if encoded.form == "packed_sign":
        assert encoded.payload_bits < emitted < encoded.payload_bits + 600
    elif encoded.form == "raw":
        assert emitted == W.size * 32
    else:
        assert emitted == encoded.payload_bits


@pytest.mark.parametrize(
    "tier,limit",
    [
        ("fp32", 0),
        ("bf16", 5e-3),
        ("fp16", 1e-3),
        ("fp8", 0.04),
        ("int8", 0.01),
        ("int8-asym", 0.01),
        ("int4", 0.1),
        ("int4-asym", 0.09),
        ("int2", 0.4),
        ("int2-asym", 0.37),
        ("int1", 0.62),
    ],
)
def test_error_shrinks_with_bits(tier, limit):
    encoded = encode(W, LAYOUTS[0], TIERS[tier])
    error = np.linalg.norm(encoded.dequantize() - W) / np.linalg.norm(W)
    assert error <= limit


def test_codes_in_range_and_grids_use_the_whole_range():
    for name, low, high in (
        ("int8", -128, 127),
        ("int4", -8, 7),
        ("int2", -2, 1),
        ("int4-asym", 0, 15),
        ("int2-asym", 0, 3),
    ):
        codes = encode(W, LAYOUTS[0], TIERS[name]).values.astype(np.int32)
        assert codes.min() >= low and codes.max() <= high
    assert set(np.unique(encode(W, LAYOUTS[0], TIERS["int2"]).values.astype(np.int32))) == {-2, -1, 0, 1}
    asym = encode(W, LAYOUTS[0], TIERS["int2-asym"])
    assert asym.zero_point is not None and asym.zero_point.dtype.name == "uint2"


def test_blockwise_scales_follow_dequantizelinear_layout():
    stored = encode(W, LAYOUTS[0], TIERS["int4"], group_size=16)
    assert stored.axis == 0 and stored.block_size == 16 and stored.scale.shape == (4, 48)


def test_unknown_and_unsupported_tiers():
    with pytest.raises(TierError, match="unknown tier 'int5'"):
        get_tiers(["int5"])
    with pytest.raises(TierError, match="cannot run on target 'trt'"):
        get_tiers(["int2"], target="trt")
    with pytest.raises(TierError, match="cannot run on target 'trt'"):
        get_tiers(["int4-asym"], target="trt", group_size=64)
    with pytest.raises(TierError, match="blocks of 64 or 128"):
        get_tiers(["int4"], target="trt")
    assert [t.name for t in get_tiers(["int4", "fp32", "int8"], target="trt", group_size=64)] == [
        "fp32",
        "int8",
        "int4",
    ]
    assert (
        tier_for_bits(4).name == "int4-asym"
        and tier_for_bits(8, symmetric=True).name == "int8"
        and tier_for_bits(1).name == "int1"
    )
    with pytest.raises(TierError, match="no 5-bit tier"):
        tier_for_bits(5)


def test_channel_groups_split_and_join_exactly():
    """A weight cut into channel groups at different tiers dequantizes to the groups' own values."""
    layout = LAYOUTS[0]
    whole = {t: encode(W, layout, TIERS[t]) for t in ("int8-asym", "int2-asym", "bf16")}
    parts = [
        whole["int8-asym"].take_channels(0, 10, 1),
        whole["int2-asym"].take_channels(10, 30, 1),
        whole["bf16"].take_channels(30, 48, 1),
    ]
    joined = split(parts, layout)
    expected = np.concatenate(
        [
            whole["int8-asym"].dequantize()[:, :10],
            whole["int2-asym"].dequantize()[:, 10:30],
            whole["bf16"].dequantize()[:, 30:],
        ],
        axis=1,
    )
    np.testing.assert_array_equal(joined.dequantize(), expected)
    assert joined.payload_bits == sum(p.payload_bits for p in parts)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """Uniform encodings of the MLP forecaster's units, calibrated on real rollouts."""
    folder = tmp_path_factory.mktemp("tiers")
    path = models.mlp_forecaster(folder / "mlp.onnx")
    model = graph_ops.load_model(path)
    layouts = graph_ops.weight_layouts(model.proto, ["W1", "Wshared", "W3"])
    units = [Unit(n, (layouts[n],)) for n in layouts]
    weights = graph_ops.read_weights(model.proto, list(layouts))
    contexts = Contexts({"x": np.random.default_rng(1).standard_normal((6, 8, 32)).astype(np.float32)}, "test")
    spec = RolloutSpec.from_dict({"steps": 3, "feedback": [{"output": "y", "input": "x"}]})

    def make():
        return Encoder(
            units,
            layouts,
            weights,
            calibrator=lambda: Calibrator(model.proto, layouts, CalibrationRollout(contexts, spec), weights=weights),
            track_errors=True,
        )

    coder = make()
    yield model, coder, make
    coder.close()


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("method", METHODS)
def test_every_tier_and_rounding_round_trips_through_onnx_runtime(encoder, tier, method):
    """The exported graph computes exactly what numpy says is stored, for every (tier, rounding) pair;
    the shared weight is stored once."""
    model, coder, _ = encoder
    stored = coder.uniform(TIERS[tier], Rounding(method))
    exported = apply_storage(model.proto, stored)
    onnx.checker.check_model(exported)
    assert exported.ir_version <= 13 and all(o.version <= 26 for o in exported.opset_import)
    fake = graph_ops.replace_weights(model.proto, {n: s.dequantize() for n, s in stored.items()})
    x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    got = OrtRuntime(exact_qdq=True).open(graph_ops.model_bytes(exported)).run({"x": x})["y"]
    want = OrtRuntime().open(graph_ops.model_bytes(graph_ops.io.runtime_compatible(fake))).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    producers = [n for n in exported.graph.node if "Wshared" in n.output]
    initializers = [t for t in exported.graph.initializer if t.name == "Wshared"]
    assert len(producers) + len(initializers) == 1
    assert sum("Wshared" in n.input for n in exported.graph.node) == 2
    opset = next(o.version for o in exported.opset_import if o.domain in ("", "ai.onnx"))
    sizes = graph_ops.io.tensor_sizes(model.proto)
    expected = (
        graph_ops.weight_bits(model.proto)
        + conversion_overhead_bits(model.proto, opset)
        + sum(emitted_bits(n, s) - sizes[n] for n, s in stored.items())
    )
    assert graph_ops.weight_bits(exported) == expected


@pytest.mark.parametrize("tier", ["int8-asym", "int4-asym", "int4", "int2-asym", "int2", "int1"])
def test_gptq_layer_error_never_exceeds_round_to_nearest(encoder, tier):
    """On the calibration statistics each weight was quantized with, GPTQ's reconstruction error is at most RTN's."""
    coder = encoder[2]()
    coder.uniform(TIERS[tier], Rounding("gptq"))
    assert set(coder.log.errors) == {"W1", "Wshared", "W3"}
    for name, error in coder.log.errors.items():
        assert error <= coder.log.rtn_errors[name] * (1 + 1e-9), (tier, name)
    coder.close()


def test_grid_search_in_row_blocks_equals_the_whole_matrix_search(monkeypatch):
    """The shrink search runs in cache-sized row blocks; rows are independent, so grids are identical."""
    from tiers import grid

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((97, 300)) * rng.uniform(0.05, 4.0, (97, 1))
    for bits, symmetric in ((2, False), (3, True), (4, False)):
        spec = grid.GridSpec("int", bits, symmetric=symmetric, search=True)
        monkeypatch.setattr(grid, "SEARCH_BLOCK", 1 << 40)
        grid._SEARCHED.clear()
        whole = grid.find_grid(rows, spec)
        monkeypatch.setattr(grid, "SEARCH_BLOCK", 700)  # 2 rows per block, last block short
        grid._SEARCHED.clear()
        blocked = grid.find_grid(rows, spec)
        assert np.array_equal(whole.scale, blocked.scale) and np.array_equal(whole.zero, blocked.zero)
        again = grid.find_grid(rows, spec)  # remembered, and a copy the caller may change
        again.scale[:] = 0
        assert np.array_equal(grid.find_grid(rows, spec).scale, blocked.scale)


def test_float32_screened_search_finds_the_exact_float64_grids():
    """The search prices every shrink in float32 and works out float64 sums only for the shrinks that
    float32's rounding could make the least: the grids must be the exact search's, bit for bit, also
    where shrinks tie or nearly tie (weights already on a grid), on heavy tails and outliers, on rows of
    extreme magnitude (searched exactly) and on all-zero rows."""
    from tiers import grid

    rng = np.random.default_rng(11)
    cases = [
        rng.standard_normal((64, 1024)) / 30,
        rng.standard_t(3, (48, 1024)),
        np.rint(rng.standard_normal((48, 1024)) * 3).clip(-8, 7) * 0.05,  # already 4-bit: exact ties
        np.rint(rng.uniform(0, 15, (48, 1024))) * 0.1 - 0.3,
        rng.standard_normal((48, 1024)) * 10.0 ** rng.uniform(-14, 14, (48, 1)),  # some rows past the screened range
        np.vstack([np.zeros((8, 2048)), rng.standard_normal((8, 2048)) * (rng.uniform(size=(8, 2048)) < 0.05)]),
        np.hstack([rng.standard_normal((32, 1023)), np.full((32, 1), 1e3)]),
    ]
    # short float32 rows where float32's least shrink is not float64's for a row or two (int2: rows 1164 and
    # 3835 of the first, int3: row 4049 of the second): without the screen's slack the grids would differ
    cases += [
        (np.random.default_rng(seed).standard_normal((4096, k)) * 1e-3).astype(np.float32).astype(np.float64)
        for seed, k in ((4, 4), (7, 6))
    ]
    for rows in cases:
        assert rows.size >= grid.SCREEN_FROM
        for bits, symmetric in ((2, False), (3, True), (4, False), (8, False)):
            spec = grid.GridSpec("int", bits, symmetric=symmetric, search=True)
            lo, hi = np.minimum(rows.min(axis=1), 0.0), np.maximum(rows.max(axis=1), 0.0)
            empty = (lo == 0) & (hi == 0)
            lo, hi = np.where(empty, -1.0, lo), np.where(empty, 1.0, hi)
            exact = [np.zeros(len(rows)), np.zeros(len(rows))]
            grid._exact(rows, grid._trials(lo, hi, spec), spec, *exact, None)
            screened = [np.zeros(len(rows)), np.zeros(len(rows))]
            grid._search(rows, lo, hi, spec, *screened)
            assert np.array_equal(exact[0], screened[0]) and np.array_equal(exact[1], screened[1]), (bits, symmetric)


def test_fp16_tier_keeps_sign_and_finiteness():
    """Past float16's range a weight saturates (never Inf); below its smallest subnormal it keeps its sign (never 0)."""
    from tiers.formats.floats import to_float16

    weight = np.array([1e6, -1e6, 1e-10, -1e-10, 0.0, 0.1234, -3.5], np.float32)
    narrow = to_float16(weight)
    assert narrow.dtype == np.float16 and np.isfinite(narrow).all()
    assert narrow[0] == 65504 and narrow[1] == -65504
    assert narrow[2] > 0 and narrow[3] < 0 and narrow[4] == 0
    assert np.array_equal(narrow[5:], weight[5:].astype(np.float16))


def test_fp16_tier_is_onnxconverter_commons_conversion_bit_for_bit_without_its_warnings():
    """`to_float16` writes out onnxconverter-common's conversion (which warns for every saturated tensor,
    past what `warnings.catch_warnings` can silence under threads): the same bits for every float32."""
    import warnings

    from onnxconverter_common.float16 import convert_np_to_float16

    from tiers.formats.floats import to_float16

    rng = np.random.default_rng(0)
    weight = np.concatenate(
        [
            rng.standard_normal(4000) * 10.0 ** rng.uniform(-12, 7, 4000),
            [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 1e9, 2.9e-8, 3e-8, -6e-8, 1e-40],
        ]
    ).astype(np.float32)
    limits = np.finfo(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = convert_np_to_float16(
            weight, min_positive_val=float(limits.smallest_subnormal), max_finite_val=float(limits.max)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        narrow = to_float16(weight)
    assert np.array_equal(narrow.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("tier", ["int2", "int2-asym", "int4", "int4-asym", "int8-asym", "fp8", "int1"])
@pytest.mark.parametrize("layout,group", [(LAYOUTS[0], None), (LAYOUTS[0], 16), (LAYOUTS[1], None), (LAYOUTS[2], None)])
def test_compact_encodings_pack_sub_byte_codes_and_store_the_same(tier, layout, group):
    """What caches keep: INT4/INT2 codes packed as on disk (2 or 4 per byte), with the same
    dequantized weight, the same size and the same codes back when expanded."""
    encoded = encode(W, layout, TIERS[tier], group_size=group)
    compact = encoded.compact()
    bits = TIERS[tier].bits
    if TIERS[tier].family == "int" and bits < 8:
        assert compact.values.data.nbytes == -(-W.size * bits // 8)
    else:
        assert compact.values is encoded.values
    np.testing.assert_array_equal(compact.dequantize(), encoded.dequantize())
    assert compact.payload_bits == encoded.payload_bits and emitted_bits("w", compact) == emitted_bits("w", encoded)
    expanded = compact.expand()
    assert expanded.values.dtype == encoded.values.dtype
    np.testing.assert_array_equal(expanded.values.view(np.uint8), encoded.values.view(np.uint8))
    if layout.perm is not None:
        parts = split(
            [
                encoded.take_channels(0, 20, layout.channel_axis),
                encode(W, layout, TIERS["int8-asym"]).take_channels(
                    20, 64 if layout.channel_axis == 0 else 48, layout.channel_axis
                ),
            ],
            layout,
        )
        np.testing.assert_array_equal(parts.compact().dequantize(), parts.dequantize())


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_sizes_come_from_stored_forms_without_the_grid_search(encoder, method):
    """Export prices a tier's bits on the unsearched grid's stored forms, kept nowhere: every rounding
    method stores exactly as many bits at every tier."""
    _, coder, _ = encoder
    for tier in ["int8-asym", "int4-asym", "int4", "int2-asym", "int1", "fp8", "bf16"]:
        for unit in coder.units:
            forms = coder.stored_forms(unit, tier)
            for name, form in forms.items():
                assert emitted_bits(name, form) == emitted_bits(name, coder.tensor(name, tier, Rounding(method))), (
                    tier,
                    name,
                )


def test_full_precision_layer_inputs_are_kept_across_waves_with_the_same_codes(encoder, monkeypatch):
    """GPTAQ/QEP's full-precision layer inputs (the same for every wave and pass) come from one run per
    sample while they are small; the codes are those of a run per wave."""
    import tqsdeploy.encoding.calibrator as calibrate

    codes = []
    for share in (1e9, 0.0):  # this small model's activations outweigh its weights: force both ways
        monkeypatch.setattr(calibrate, "FULL_CACHE_SHARE", share)
        monkeypatch.setattr(calibrate, "FULL_CACHE_FLOOR", 0)
        monkeypatch.setattr(calibrate, "FULL_INPUTS_FLOOR", 0)
        coder = encoder[2]()
        stored = coder.uniform(TIERS["int2-asym"], Rounding("qep"))
        assert bool(coder.calibrator._full_cache) == (share > 0)
        codes.append({n: e.expand().values.view(np.uint8) for n, e in stored.items()})
        coder.close()
    for name in codes[0]:
        np.testing.assert_array_equal(codes[0][name], codes[1][name])


def _single_weight_model(encoded, layout) -> tuple[onnx.ModelProto, np.ndarray]:
    """y = x @ W (channels on axis 1) or Gemm(x, W, transB=1) (channels on axis 0), W stored as `encoded`,
    and a batch of 5 rows of x."""
    from onnx import TensorProto, helper

    transposed = layout.perm is not None and layout.channel_axis == 0
    k = W.shape[1] if transposed else W.shape[0]
    node = (
        helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)
        if transposed
        else helper.make_node("MatMul", ["x", "W"], ["y"])
    )
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64 if transposed else 48])],
        [onnx.numpy_helper.from_array(W, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return model, np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize(
    "layout,group",
    [(LAYOUTS[0], None), (LAYOUTS[0], 16), (LAYOUTS[0], 20), (LAYOUTS[1], None), (LAYOUTS[1], 24), (LAYOUTS[2], None)],
)
def test_dequantized_layout_folds_at_load_and_equals_the_fake_quantized_model(tmp_path, tier, layout, group):
    """The 'dequantized' runtime layout: ONNX Runtime's default session folds every stored weight into a float
    initializer (its optimized graph reads no codes: nothing dequantizes per call, where the 'fused' layout's
    integer codes run as MatMulNBits or DequantizeLinear on every call), its outputs equal the numpy
    fake-quantized model's to the bit, and the file stores the same codes, scales and zero points (blocks add
    a few shape constants)."""
    from graph_ops.qdq import per_call_dequantization

    encoded = encode(W, layout, TIERS[tier], group_size=group)
    model, x = _single_weight_model(encoded, layout)
    fake = graph_ops.replace_weights(model, {"W": encoded.dequantize()})
    want = OrtRuntime().open(graph_ops.model_bytes(fake)).run({"x": x})["y"]
    seen = {}
    for layout_name in ("dequantized", "fused"):
        exported = apply_storage(model, {"W": encoded}, layout=layout_name)
        onnx.checker.check_model(exported, full_check=True)
        assert exported.ir_version <= 13 and all(o.version <= 26 for o in exported.opset_import)
        optimized = tmp_path / f"{layout_name}.optimized.onnx"
        got = OrtRuntime(optimized_model_path=str(optimized)).open(graph_ops.model_bytes(exported)).run({"x": x})["y"]
        seen[layout_name] = (got, per_call_dequantization(onnx.load(str(optimized))), graph_ops.weight_bits(exported))
    got, per_call, bits = seen["dequantized"]
    assert per_call == {}
    np.testing.assert_array_equal(got, want)
    if encoded.form == "dequantize" and TIERS[tier].family == "int":  # the fused layout reads codes on every call
        fused_ops = {n.op_type for n in onnx.load(str(tmp_path / "fused.optimized.onnx")).graph.node}
        assert seen["fused"][1] or "MatMulNBits" in fused_ops, fused_ops  # DequantizeLinear, or fused into a kernel
    extra = bits - seen["fused"][2]
    assert (
        extra == 0 if not group else 0 <= extra <= 8 * 8 * 8
    )  # blocks: two shapes of rank 3 and 2, maybe a slice's three scalars
    assert emitted_bits("W", encoded, "dequantized") - emitted_bits("W", encoded) == extra


def test_a_split_weight_in_the_dequantized_layout_folds_every_part():
    """Channel groups at different tiers (one Concat of their parts) fold into one float weight too."""
    from graph_ops.qdq import per_call_dequantization

    layout = LAYOUTS[0]
    parts = split(
        [
            encode(W, layout, TIERS["int2-asym"]).take_channels(0, 20, 1),
            encode(W, layout, TIERS["int4"], group_size=16).take_channels(20, 48, 1),
        ],
        layout,
    )
    model, x = _single_weight_model(parts, layout)
    want = (
        OrtRuntime()
        .open(graph_ops.model_bytes(graph_ops.replace_weights(model, {"W": parts.dequantize()})))
        .run({"x": x})["y"]
    )
    exported = apply_storage(model, {"W": parts}, layout="dequantized")
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        optimized = f"{folder}/optimized.onnx"
        got = OrtRuntime(optimized_model_path=optimized).open(graph_ops.model_bytes(exported)).run({"x": x})["y"]
        assert per_call_dequantization(onnx.load(optimized)) == {}
    np.testing.assert_array_equal(got, want)


def test_the_opset_conversion_adds_no_shape_annotations(encoder):
    """INT2 needs opset 25, and the converter records the shapes it infers as value_info. ONNX Runtime fuses more
    with them (ETTh1's Add + LayerNormalization became a SkipLayerNormalization 5x slower than the pair, the
    exported model 1.2x slower than FP32 on one thread), so the output keeps only the annotations the model had."""
    model, coder, _ = encoder
    exported = apply_storage(model.proto, coder.uniform(TIERS["int2-asym"], Rounding("rtn")), layout="dequantized")
    assert next(o.version for o in exported.opset_import if o.domain in ("", "ai.onnx")) == 25
    assert [v.name for v in exported.graph.value_info] == [v.name for v in model.proto.graph.value_info]
