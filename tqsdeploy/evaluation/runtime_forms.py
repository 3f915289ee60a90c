"""How ONNX Runtime runs an evaluated candidate: the runtime mode in words, read off the file and the graph the
runtime optimised, and each stored weight's form with the bytes it holds after load (`graph_ops.native`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import onnx

import graph_ops
import graph_ops.native
import graph_ops.qdq

if TYPE_CHECKING:
    from tqsdeploy.evaluation.evaluate import EvalSettings

CHECKED_FOLDING_BYTES = 256 << 20
"""Largest file whose dequantized layout eval has ONNX Runtime write out folded (float-size) to check that no
dequantization runs per call; past it the check would write gigabytes."""


def reads_codes(proto) -> bool:
    """Whether any node reads stored codes (integer or FP8 initializers): DequantizeLinear, or the
    'dequantized' layout's Casts."""
    return bool(graph_ops.qdq.per_call_dequantization(proto))


def _native_kernels(proto) -> str:
    """The native low-bit nodes a written model holds, in words ('' for none): MatMulNBits by code width and
    accuracy level (4: int8 activations), GatherBlockQuantized by code width."""
    found: dict[str, int] = {}
    for node in proto.graph.node:
        if node.op_type in graph_ops.native.NATIVE_OPS:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            level = f", accuracy_level {attributes.get('accuracy_level', 0)}" if node.op_type == "MatMulNBits" else ""
            key = f"{node.op_type} ({graph_ops.native.kernel_bits(node)}-bit{level})"
            found[key] = found.get(key, 0) + 1
    return ", ".join(f"{count} {key}" for key, count in sorted(found.items()))


def dequantizes(proto) -> bool:
    return any(n.op_type == "DequantizeLinear" for n in proto.graph.node)


def runtime_mode(settings: EvalSettings, optimized_path: str, proto) -> dict:
    """How the runtime ran the candidate, read off the graph ONNX Runtime optimised (written to `optimized_path`
    where there was anything to fuse or fold)."""
    fused = sum(1 for n in proto.graph.node if n.op_type == "MatMulNBits")  # a native file's own: nothing to fuse
    per_call = None
    if os.path.exists(optimized_path):
        optimized = graph_ops.wire.skeleton(optimized_path)  # node types only: the weights stay in the file
        fused = sum(1 for n in optimized.graph.node if n.op_type == "MatMulNBits")
        per_call = graph_ops.qdq.per_call_dequantization(optimized)
    return {
        "provider": settings.provider,
        "mode": _mode(settings, proto, fused, per_call),
        "matmulnbits_nodes": fused,
        "exact": settings.exact,
        "per_call_dequantization": per_call,
    }


def _mode(settings: EvalSettings, proto, fused: int, per_call: dict | None) -> str:
    """The runtime mode in words: what the weights are stored as and which kernels run them."""
    provider = settings.provider
    native = _native_kernels(proto)
    if native:
        rest = "; the other weights as below" if dequantizes(proto) or reads_codes(proto) else ""
        return f"ONNX Runtime's own low-bit kernels on {provider} read the codes of {native}{rest}"
    if not dequantizes(proto) and not reads_codes(proto):  # the original, or an fp16 copy: nothing to fuse or fold
        return (
            f"ONNX Runtime default on {provider}: float weights (no stored codes, nothing to fuse or fold); "
            "float kernels"
        )
    if not dequantizes(proto):
        checked = (
            "its optimized graph reads no codes"
            if per_call == {}
            else "not checked: a large file"
            if per_call is None
            else f"yet its optimized graph still reads codes: {per_call}"
        )
        return (
            f"ONNX Runtime default on {provider}: weights stored dequantized-at-load, folded into float "
            f"initializers when the session is created ({checked}); float kernels, exact"
        )
    if settings.exact:
        return "exact dequantization (session.qdq_matmulnbits_accuracy_level=0)"
    if provider == "cpu" and fused == 0 and per_call is not None:  # say, Conv kernels: no MatMul to fuse with
        return (
            "ONNX Runtime default on cpu: DequantizeLinear runs on every call (no MatMul it fuses with into "
            "MatMulNBits); float kernels, exact"
        )
    if provider == "cpu":
        return (
            "ONNX Runtime default: DequantizeLinear->MatMul fused into MatMulNBits with accuracy_level 4 "
            "(int8 activations)"
        )
    return (
        f"ONNX Runtime default on {provider}: DequantizeLinear->MatMul fused into MatMulNBits, run by the GPU "
        "kernel (float activations; accuracy_level is the CPU kernel's setting)"
    )


def forms(proto) -> dict:
    """What ONNX Runtime runs for each stored weight of the candidate and the bytes it holds for it after load
    (`graph_ops.native.runtime_forms`), and the totals by form."""
    forms = graph_ops.native.runtime_forms(proto)
    totals: dict[str, dict] = {}
    for form in forms.values():
        kind = totals.setdefault(form.form, {"tensors": 0, "bytes": 0})
        kind["tensors"] += 1
        kind["bytes"] += form.bytes
    return {"by_tensor": {name: {"form": f.form, "bytes": f.bytes} for name, f in forms.items()}, "totals": totals}


def oldest_onnxruntime(proto) -> dict:
    """The oldest ONNX Runtime release that loads the candidate, and what in the file needs it."""
    from runtimes.ort_versions import oldest_release, version_text

    release, why = oldest_release(proto)
    return {"release": version_text(release), "because": why}
