"""Which ONNX Runtime releases load a model: the IR version, opsets, element types and kernels each release takes.

Measured on every release from 1.20 to 1.32 with real sessions and exact results (docs/design-notes/runtimes.md,
"What each ONNX Runtime release loads"). `oldest_release` reads a file and names the oldest release that runs it
and why; `Release` is what an export targeting one release may write.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from graph_ops.native import kernel_bits

OLDEST_SUPPORTED = (1, 24)
"""The oldest release tqsdeploy runs on and writes for by default (pyproject.toml's lower bound): the first with
2-bit codes (DequantizeLinear opset 25, MatMulNBits bits 2) and IR 13."""
IR_FROM = {10: (1, 20), 11: (1, 23), 12: (1, 24), 13: (1, 24), 14: (1, 32)}
"""IR version -> the first release that loads it."""
OPSET_FROM = {21: (1, 20), 22: (1, 21), 23: (1, 23), 24: (1, 24), 25: (1, 24), 26: (1, 25), 27: (1, 32), 28: (1, 32)}
"""Default-domain opset -> the first release that loads it (opsets up to 21 load on 1.20)."""
NBITS_FROM = {4: (1, 20), 8: (1, 23), 2: (1, 24)}
"""MatMulNBits `bits` -> the first release that runs it exactly."""
GATHER_BITS_FROM = {4: (1, 20), 8: (1, 23), 2: (1, 27)}
"""GatherBlockQuantized code width -> the first release that runs it (8 needs the `bits` attribute, from 1.23)."""
SUB_BYTE = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
TWO_BIT = {onnx.TensorProto.INT2, onnx.TensorProto.UINT2}


def version_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def parse_version(text: str) -> tuple[int, int]:
    """'1.24' or '1.24.4' -> (1, 24); ValueError otherwise."""
    parts = text.strip().split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"'{text}' is not a release number such as 1.24")
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class Release:
    """What a file written for one ONNX Runtime release may hold."""

    version: tuple[int, int] = OLDEST_SUPPORTED

    @property
    def max_ir(self) -> int:
        return max(ir for ir, first in IR_FROM.items() if first <= self.version)

    @property
    def max_opset(self) -> int:
        return max(opset for opset, first in OPSET_FROM.items() if first <= self.version)

    def matmul_bits(self) -> tuple[int, ...]:
        return tuple(sorted(b for b, first in NBITS_FROM.items() if first <= self.version))

    def gather_bits(self) -> tuple[int, ...]:
        return tuple(sorted(b for b, first in GATHER_BITS_FROM.items() if first <= self.version))

    @property
    def casts_sub_byte(self) -> bool:
        """Cast from 4-bit codes to float (the dequantized layout's first step), from 1.23."""
        return self.version >= (1, 23)


def oldest_release(model: onnx.ModelProto) -> tuple[tuple[int, int], list[str]]:
    """The oldest release that loads and runs `model` (at least 1.20, the oldest measured), and what sets it."""
    needs: list[tuple[tuple[int, int], str]] = [((1, 20), "the oldest release measured")]
    if model.ir_version in IR_FROM or model.ir_version > 10:
        needs.append((IR_FROM.get(model.ir_version, (99, 0)), f"IR version {model.ir_version}"))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    if opset > 21:
        needs.append((OPSET_FROM.get(opset, (99, 0)), f"opset {opset}"))
    types = {t.name: t.data_type for t in model.graph.initializer}
    for node in model.graph.node:
        needs += _node_needs(node, types)
    version = max(v for v, _ in needs)
    return version, sorted({why for v, why in needs if v == version and v > (1, 20)})


def _node_needs(node: onnx.NodeProto, types: dict[str, int]) -> list[tuple[tuple[int, int], str]]:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    read = {types.get(name) for name in node.input}
    if node.op_type == "MatMulNBits":
        bits = kernel_bits(node)
        return [(NBITS_FROM.get(bits, (99, 0)), f"MatMulNBits with {bits}-bit codes")]
    if node.op_type == "GatherBlockQuantized":
        bits = kernel_bits(node)
        first = GATHER_BITS_FROM.get(bits, (99, 0))
        return [
            (max(first, (1, 23) if "bits" in attributes else (1, 20)), f"GatherBlockQuantized with {bits}-bit codes")
        ]
    if node.op_type == "Cast" and read & SUB_BYTE:
        return [((1, 23), "a Cast from 4-bit codes")]
    if read & TWO_BIT:
        return [((1, 24), f"2-bit codes read by {node.op_type}")]
    return []
