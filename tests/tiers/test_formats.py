"""A stored format defined in one file (this one) and registered is priced, written, counted and run
like the built-in ones: nothing else in the toolkit needs to learn about it."""

import json

import ml_dtypes
import models
import numpy as np
import onnx
import pytest
from conftest import cli
from onnx import helper, numpy_helper

import graph_ops
from graph_ops.qdq import apply_storage, conversion_overhead_bits, emitted_bits, write_storage
from runtimes import OrtRuntime
from tiers import TIERS, Layout, encode, get_tiers, register_form
from tiers.encoded import Encoded, broadcast_scale
from tiers.formats.base import Tier, placed
from tiers.grid import Grid, GridSpec, f32, register_grid
from tqsdeploy import ScoreSettings, score

register_grid(
    "ternary",
    lambda rows: Grid(f32(np.abs(rows).mean(axis=1)), np.zeros(rows.shape[0])),
    lambda w, divisor: np.clip(np.rint(w / divisor), -1, 1),
)


@register_form
class TernaryTier(Tier):
    """Test-only: codes {-1, 0, 1} stored as INT2 times one float16 scale per output channel, rebuilt by Cast
    and Mul in either runtime layout. A new grid, a new stored form, a scale in a type of its own."""

    family = "ternary"
    calibratable = True
    forms = ("ternary",)

    @property
    def grid(self) -> GridSpec:
        return GridSpec("ternary", 2)

    def stored(self, quantized, layout, dtype):
        codes, scale, _, axis, _ = placed(quantized, layout)
        return Encoded(
            self.name,
            "ternary",
            codes.astype(ml_dtypes.int2),
            layout.shape,
            scale.astype(np.float16),
            None,
            axis,
            None,
            dtype,
        )

    @classmethod
    def _view(cls, value):
        view = [1] * len(value.shape)
        if value.axis is not None and np.ndim(value.scale) > 0:
            view[value.axis] = value.shape[value.axis]
        return view

    @classmethod
    def emit(cls, name, value, layout):
        to = helper.np_dtype_to_tensor_dtype(np.dtype(value.dtype))
        tensors = [
            numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__trits"),
            numpy_helper.from_array(np.asarray(value.scale).reshape(cls._view(value)), f"{name}__scale"),
        ]
        nodes = [
            helper.make_node("Cast", [f"{name}__trits"], [f"{name}__float"], to=to),
            helper.make_node("Cast", [f"{name}__scale"], [f"{name}__wide"], to=to),
            helper.make_node("Mul", [f"{name}__float", f"{name}__wide"], [name]),
        ]
        return tensors, nodes

    @classmethod
    def form_opset(cls, value):
        return 25  # Cast from INT2

    @classmethod
    def payload_bits(cls, value):
        return int(value.values.size) * 2 + int(np.asarray(value.scale).size) * 16

    @classmethod
    def dequantized(cls, value):
        return value.values.astype(np.float32) * broadcast_scale(value.scale, value.shape, value.axis, None)

    @classmethod
    def take_channels(cls, value, index, shape, channel_axis):
        from dataclasses import replace

        return replace(
            value,
            values=np.take(value.values, index, axis=channel_axis),
            shape=shape,
            scale=np.take(value.scale, index),
        )


TERNARY = TernaryTier("ternary", 2, frozenset({"ort"}), 25)


@pytest.fixture
def registered(monkeypatch):
    """The tier's registration: its name in the table every command resolves tiers from."""
    monkeypatch.setitem(TIERS, "ternary", TERNARY)
    return TERNARY


def test_one_file_tier_is_priced_as_it_is_written(registered):
    weight = np.random.default_rng(0).standard_normal((48, 32)).astype(np.float32)
    encoded = encode(weight, Layout.channels_on(weight.shape, 1), get_tiers(["ternary"])[0])
    assert set(np.unique(encoded.values.astype(np.int8))) == {-1, 0, 1}
    assert emitted_bits("w", encoded) == encoded.payload_bits == 48 * 32 * 2 + 32 * 16
    assert emitted_bits("w", encoded.take_channels(0, 8, 1)) == 48 * 8 * 2 + 8 * 16


def test_one_file_tier_runs_as_numpy_says(registered, tmp_path):
    model = onnx.load(str(models.mlp_forecaster(tmp_path / "mlp.onnx")))
    layouts = graph_ops.weight_layouts(model)
    weights = graph_ops.read_weights(
        model, [n for n, weight_layout in layouts.items() if weight_layout.is_operand_weight]
    )
    stored = {n: encode(w, layouts[n], TERNARY) for n, w in weights.items()}
    for layout in ("fused", "dequantized"):
        exported = apply_storage(model, stored, layout=layout)
        onnx.checker.check_model(exported, full_check=True)
        opset = next(o.version for o in exported.opset_import if o.domain in ("", "ai.onnx"))
        sizes = graph_ops.io.tensor_sizes(model)
        priced = (
            graph_ops.weight_bits(model)
            + conversion_overhead_bits(model, opset)
            + sum(emitted_bits(n, e, layout) - sizes[n] for n, e in stored.items())
        )
        assert graph_ops.weight_bits(exported) == priced
    fake = graph_ops.replace_weights(model, {n: e.dequantize() for n, e in stored.items()})
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    got = OrtRuntime().open(graph_ops.model_bytes(exported)).run({"x": x})["y"]
    want = OrtRuntime().open(graph_ops.model_bytes(graph_ops.io.runtime_compatible(fake))).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    written = write_storage(model, stored, tmp_path / "ternary.onnx")
    assert (
        written.weight_bits == priced and priced / 8 < written.bytes < priced / 8 + 8192
    )  # the graph's own bytes on top


def test_one_file_tier_exports_end_to_end(registered, tmp_path):
    """`export --uniform ternary`: the allocation's priced bytes are the written tensors' bytes."""
    model = models.mlp_forecaster(tmp_path / "mlp.onnx", n=64, hidden=128)
    contexts = tmp_path / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(5).standard_normal((4, 2, 64)).astype(np.float32))
    score(model, contexts, steps=3, out=tmp_path / "run", settings=ScoreSettings(gauss_draws=1))
    result = cli(
        "export",
        model,
        "--run",
        tmp_path / "run",
        "--uniform",
        "ternary",
        "--rounding",
        "gptq",
        "-o",
        tmp_path / "t.onnx",
    )
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "t.allocation.json").read_text())
    assert {row["tier"] for row in meta["tiers"]} == {"ternary"}
    proto = onnx.load(str(tmp_path / "t.onnx"))
    assert graph_ops.weight_bits(proto) == meta["weight_bits"]
    units = {
        n
        for n, layout in graph_ops.weight_layouts(onnx.load(str(model))).items()
        if layout.is_operand_weight and layout.params >= 1024
    }
    unit_bits = sum(graph_ops.io.tensor_bits(t) for t in proto.graph.initializer if t.name.split("__")[0] in units)
    assert unit_bits == 8 * sum(row["bytes"] for row in meta["tiers"])
    assert meta["reference_bits"] / meta["weight_bits"] == pytest.approx(meta["compression"])
