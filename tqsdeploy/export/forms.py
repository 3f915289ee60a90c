"""How each weight is written for the export's target: in ONNX Runtime's own low-bit kernels where they take it
(`graph_ops.native`: MatMulNBits, GatherBlockQuantized), else in a layout (`graph_ops.qdq.LAYOUTS`).

Sizing prices a weight and the writer writes it through this one object, so the bits priced are the bits written;
`runs_as` says in words what the runtime runs for each tensor (the summary and the allocation record show it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from graph_ops.io import tensor_bits
from graph_ops.native import GATHER, GATHERED_CODES, MATMUL, NATIVE_OPS, NativePlan, NativeUse, native_uses
from graph_ops.qdq import emitted_bits
from runtimes.ort_versions import Release
from tiers import Encoded
from tiers.formats.native import NativeOptions

KERNEL_ACCURACY = {"int8": 4, "exact": 0}
"""`--kernel-accuracy` -> MatMulNBits' accuracy_level: 'int8' quantizes activations inside the kernel (fast at every
code width, about 1e-3 relative error per product), 'exact' computes in float (2- and 8-bit codes then run far
slower than a float MatMul: docs/design-notes/export.md, "Kernel accuracy")."""


@dataclass(frozen=True)
class FormPolicy:
    """What the target allows: its layout, the release it must load on, the kernels' accuracy."""

    layout: str
    release: Release = Release()
    kernel_accuracy: str = "int8"
    min_params: int = NativeOptions.min_params
    min_k: int = NativeOptions.min_k
    min_table_bytes: int = NativeOptions.split_min_bytes
    """A table whose float copy is smaller is folded: its row groups' gathers, or its codes unpacked after a Gather,
    cost more per call than its folded float rows (a 92 K-parameter token model's row-grouped table ran 2x FP32 at
    batch 1); a megabyte is noise beside a session's own memory."""

    def options(self) -> NativeOptions:
        return NativeOptions(
            self.release.matmul_bits(), self.release.gather_bits(), KERNEL_ACCURACY[self.kernel_accuracy], min_params=0
        )


def _pays(shape, use: NativeUse, policy: FormPolicy) -> bool:
    """Whether a weight is large enough for its kernel: parameters, for a MatMul its input channels, for a table its
    float size (decided for the whole tensor, so that its slots are priced in the form the writer gives it)."""
    size = int(np.prod(shape, dtype=np.int64))
    if size < policy.min_params:
        return False
    if use.kind == GATHER:
        return 4 * size >= policy.min_table_bytes
    return use.kind != MATMUL or len(shape) != 2 or shape[1 - use.n_axis] >= policy.min_k


FOUR_BIT = (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4))
"""4-bit integer codes: what ONNX Runtime before 1.23 cannot Cast (`runtimes.ort_versions.SUB_BYTE`)."""


def _has_4_bit_codes(encoded: Encoded) -> bool:
    """Whether the encoding (or any channel group of it) stores 4-bit integer codes."""
    if encoded.form == "split":
        return any(_has_4_bit_codes(part) for part in encoded.parts)
    codes = encoded.values if encoded.form == "dequantize" else None
    return codes is not None and np.dtype(codes.dtype) in FOUR_BIT


def _plan_words(plan: NativePlan) -> str:
    """'MatMulNBits 2/4-bit', 'GatherBlockQuantized 4-bit + Gather of 2-bit codes + float parts', ..."""
    words = []
    widths = sorted({p.attributes.get("bits", 4) for p in plan.parts if p.op in NATIVE_OPS})
    if widths:
        kernel = "GatherBlockQuantized" if plan.kind == GATHER else "MatMulNBits"
        words.append(f"{kernel} {'/'.join(map(str, widths))}-bit")
    packed = sorted({p.attributes["bits"] for p in plan.parts if p.op == GATHERED_CODES})
    if packed:
        words.append(f"Gather of {'/'.join(map(str, packed))}-bit codes")
    if any(p.op not in (*NATIVE_OPS, GATHERED_CODES) for p in plan.parts):
        words.append("float parts")
    return " + ".join(words)


def _held_bytes(plan: NativePlan, dtype: str) -> int:
    """Bytes a native plan holds after load: its kernels' codes, scales and zero points as stored, and its float
    parts (channel groups at a tier no kernel takes, folded at load) as floats of the weight's type."""
    kernel_bits = sum(
        tensor_bits(t) for p in plan.parts if p.op in (*NATIVE_OPS, GATHERED_CODES) for t in p.initializers
    )
    floats = sum(math.prod(p.shape) for p in plan.parts if p.op not in (*NATIVE_OPS, GATHERED_CODES))
    return kernel_bits // 8 + floats * np.dtype(dtype).itemsize


class WeightForms:
    """Each unit tensor's written form, decided per tensor once (its consumers and size) and per encoding."""

    def __init__(self, proto, layouts: dict, policy: FormPolicy):
        self.policy = policy
        self._options = policy.options()
        uses = native_uses(proto) if policy.layout == "native" else {}
        self.uses: dict[str, NativeUse] = {
            name: use for name, use in uses.items() if name in layouts and _pays(layouts[name].shape, use, policy)
        }
        """The weights whose consumers all read a native form, large enough to pay for its kernel."""

    def plan(self, name: str, encoded: Encoded) -> NativePlan | None:
        """The native plan of tensor `name` at `encoded` (a whole tensor, or a channel stretch of it), or None."""
        use = self.uses.get(name)
        if use is None or encoded.dtype != "float32":
            return None
        return encoded.native(name, use, self._options)

    def layout_of(self, encoded: Encoded) -> str:
        """The layout a tensor not written natively takes: the dequantized one, unless its release cannot Cast
        4-bit codes (before ONNX Runtime 1.23), where DequantizeLinear loads instead."""
        if self.policy.layout != "native":
            return self.policy.layout
        if not self.policy.release.casts_sub_byte and _has_4_bit_codes(encoded):
            return "fused"
        return "dequantized"

    def priced(self, name: str, encoded: Encoded) -> tuple[int, int]:
        """(bits the weight puts in the file, bytes it holds in an ONNX Runtime session after load), from one plan:
        the allocator prices both here, the writer writes the first and reports the second."""
        plan = self.plan(name, encoded)
        if plan is not None:
            return sum(tensor_bits(t) for t in plan.initializers), _held_bytes(plan, encoded.dtype)
        return emitted_bits(name, encoded, self.layout_of(encoded)), self._loaded_bytes(name, encoded)

    def bits(self, name: str, encoded: Encoded) -> int:
        """Bits of every tensor the weight puts in the file, as the writer writes it."""
        return self.priced(name, encoded)[0]

    def resident_bytes(self, name: str, encoded: Encoded) -> int:
        """About the bytes the weight holds in an ONNX Runtime session after load, as `runs_as` says it runs."""
        return self.priced(name, encoded)[1]

    def _loaded_bytes(self, name: str, encoded: Encoded) -> int:
        """A weight not in a kernel after load: DequantizeLinear's codes (its float output is a per-call
        activation), else the float weight ONNX Runtime folds it into (fp16/bf16 Casts, INT1's unpacking, the
        dequantized layout), of the original's type."""
        if encoded.form == "split":
            return sum(self.resident_bytes(f"{name}__part{i}", part) for i, part in enumerate(encoded.parts))
        if encoded.form == "dequantize" and self.layout_of(encoded) == "fused":
            return encoded.payload_bits // 8
        return math.prod(encoded.shape) * np.dtype(encoded.dtype).itemsize

    def plans(self, encodings: dict[str, Encoded]) -> dict[str, NativePlan]:
        """The native plans of a whole model's encodings (what `graph_ops.qdq.write_storage` rewrites)."""
        found = {name: self.plan(name, encoded) for name, encoded in encodings.items()}
        return {name: plan for name, plan in found.items() if plan is not None}

    def runs_as(self, name: str, encoded: Encoded) -> str:
        """What ONNX Runtime runs for the tensor, in words: the kernel and its code widths, or a folded float."""
        plan = self.plan(name, encoded)
        if plan is not None:
            return _plan_words(plan)
        if encoded.form == "raw":
            return "float (as stored)"
        if encoded.form == "dequantize" and self.layout_of(encoded) == "fused":
            return "DequantizeLinear every call"
        return "float, folded at load"

    def with_layout(self, layout: str) -> "WeightForms":
        """The same decisions written in another layout (a benchmark's second file)."""
        forms = WeightForms.__new__(WeightForms)
        forms.policy, forms._options = replace(self.policy, layout=layout), self._options
        forms.uses = self.uses if layout == "native" else {}
        return forms
