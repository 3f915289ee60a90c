"""Float tiers (fp32, bf16, fp16): the weight kept as a float, narrower ones behind a Cast.

Forms: 'raw' (the weight as it is, its own type) and 'cast' (a bfloat16/float16
copy + Cast to the weight's type, which every runtime folds at load).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from tiers.encoded import Encoded
from tiers.formats.base import Emission, Fed, Tier, register_form


def to_float16(weight: np.ndarray) -> np.ndarray:
    """float16 of `weight` keeping every value's sign and finiteness, as onnxconverter-common's
    `convert_np_to_float16` does: magnitudes past 65504 saturate instead of becoming Inf, nonzero ones
    below the smallest subnormal stay nonzero instead of flushing to zero. Written out because that
    function warns once per saturated tensor, and `warnings.catch_warnings` cannot silence it while
    other threads price or export. It is the plain cast with only the values it would turn to Inf or
    to zero fixed after, faster than that function and than clamping every value first
    (docs/design-notes/tiers.md, 'float16 without onnxconverter-common')."""
    weight = np.asarray(weight, np.float32)
    with np.errstate(over="ignore"):
        narrow = weight.astype(np.float16)
    broken = np.zeros(0, bool)
    if np.count_nonzero(narrow) != np.count_nonzero(
        weight
    ):  # nonzero values below half the smallest subnormal became 0
        broken = (narrow == 0) & (weight != 0)
    if np.isinf(narrow).any():  # finite values past 65504 (from 65520 they round to Inf)
        past = np.isinf(narrow) & np.isfinite(weight)
        broken = past if broken.size == 0 else broken | past
    if broken.any():
        limits = np.finfo(np.float16)
        fixed = np.clip(np.abs(weight[broken]), limits.smallest_subnormal, limits.max)
        narrow[broken] = np.copysign(fixed, weight[broken]).astype(np.float16)
    return narrow


NARROWERS = {"bfloat16": lambda w: np.asarray(w).astype(np.float32).astype(ml_dtypes.bfloat16), "float16": to_float16}
"""How a weight becomes each narrower float type a tier can store."""


@register_form
@dataclass(frozen=True)
class FloatTier(Tier):
    """A float copy of the weight: as it is when the tier is at least as wide as the weight's type, else narrowed."""

    narrow: str | None = None
    """numpy name of the stored type when narrower than the weight's (None: never narrowed, fp32)."""

    family: ClassVar[str] = "float"
    quantized: ClassVar[bool] = False
    forms: ClassVar[tuple[str, ...]] = ("raw", "cast")

    def float_copy(self, weight: np.ndarray) -> Encoded:
        weight = np.asarray(weight)
        dtype = weight.dtype.name if weight.dtype.kind == "f" else "float32"
        if self.narrow is None or self.bits >= 8 * weight.dtype.itemsize:
            return Encoded(self.name, "raw", weight, weight.shape, dtype=dtype)
        return Encoded(self.name, "cast", NARROWERS[self.narrow](weight), weight.shape, dtype=dtype)

    @classmethod
    def emit(cls, name: str, value: Encoded, layout: str) -> Emission:
        """'raw': the float initializer; 'cast': the narrow one + Cast (the same in both layouts)."""
        if value.form == "raw" or value.values.dtype == np.dtype(value.dtype):
            return [
                numpy_helper.from_array(
                    np.ascontiguousarray(value.values.astype(np.dtype(value.dtype), copy=False)), name
                )
            ], []
        stored = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__{value.values.dtype.name}")
        to = helper.np_dtype_to_tensor_dtype(np.dtype(value.dtype))
        return [stored], [helper.make_node("Cast", [stored.name], [name], to=to, name=f"{name}__cast")]

    def opset_for(self, dtype: str, blockwise: bool) -> int:
        return max(self.opset, 6 if self.narrow else 1)  # Cast

    @classmethod
    def form_opset(cls, value: Encoded) -> int:
        if value.form == "raw":
            return 1
        return 13 if value.values.dtype.name == "bfloat16" else 6

    @classmethod
    def dequantized(cls, value: Encoded) -> np.ndarray:
        return value.values.astype(np.float32)

    @classmethod
    def take_channels(cls, value: Encoded, index: np.ndarray, shape: tuple[int, ...], channel_axis: int) -> Encoded:
        return replace(value, values=np.take(value.values, index, axis=channel_axis), shape=shape)

    @classmethod
    def fed(cls, name: str, value: Encoded) -> Fed | None:
        """A float16 copy is fed as it is stored (half the bytes) and Cast in the graph; others as floats."""
        if value.form != "cast" or value.values.dtype != np.float16:
            return None
        prefix = f"{name}__fed"
        feeds = {f"{prefix}_half": value.values}
        nodes = [
            helper.make_node(
                "Cast",
                [f"{prefix}_half"],
                [name],
                to=helper.np_dtype_to_tensor_dtype(np.dtype(value.dtype)),
                name=f"{prefix}_cast",
            )
        ]
        return (
            [helper.make_tensor_value_info(f"{prefix}_half", onnx.TensorProto.FLOAT16, list(value.shape))],
            feeds,
            nodes,
        )
