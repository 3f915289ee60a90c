"""eval's 'Runtime:' line says how ONNX Runtime ran the candidate's weights, and only what it did."""

import json

import models
import numpy as np
import pytest
from conftest import cli


@pytest.mark.parametrize(
    "layout,phrase",
    [
        (None, "float weights (no stored codes"),  # the original itself, or an fp16 copy
        (
            "fused",
            "DequantizeLinear runs on every call (no MatMul it fuses with",
        ),  # Conv kernels: nothing becomes MatMulNBits
    ],
)
def test_the_runtime_line_claims_no_int8_fusion_that_did_not_happen(tmp_path, layout, phrase):
    """A float model and a fused Conv model were once described as 'DequantizeLinear->MatMul fused into MatMulNBits
    with accuracy_level 4 (int8 activations)' beside 'MatMulNBits nodes: 0'."""
    model = models.conv_stack(tmp_path / "conv.onnx")
    contexts = tmp_path / "c.npz"
    np.savez(contexts, x=np.random.default_rng(0).standard_normal((2, 1, 5, 8, 8)).astype(np.float32))
    candidate = model
    if layout:
        candidate = tmp_path / "q.onnx"
        result = cli(
            "baseline",
            model,
            "--method",
            "rtn",
            "--bits",
            "8",
            "--min-params",
            "1",
            "--runtime-layout",
            layout,
            "-o",
            candidate,
        )
        assert result.exit_code == 0, result.output
    result = cli(
        "eval", candidate, "-r", model, "-c", contexts, "--steps", "2", "--no-latency", "--report", tmp_path / "ev"
    )
    assert result.exit_code == 0, result.output
    runtime = json.loads((tmp_path / "ev.json").read_text())["runtime"]
    assert runtime["matmulnbits_nodes"] == 0
    assert phrase in runtime["mode"] and "int8 activations" not in runtime["mode"], runtime["mode"]
