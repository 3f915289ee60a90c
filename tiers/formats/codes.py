"""Codes + DequantizeLinear: the stored form ('dequantize') of every tier whose codes lie on a grid with
a scale (and zero point) per tensor, per output channel, or per block of input features.

The tiers differ in their grid and code type (`tiers.formats.integer`, `tiers.formats.fp8`); this class
writes and reads what they share: the fused layout (DequantizeLinear), the dequantized layout (Cast, Sub,
Mul that ONNX Runtime folds into a float weight at load), the numpy dequantization both reproduce to the
bit, and the codes a calibration run feeds instead of floats.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from graph_ops.native import GATHER, NativePlan
from tiers.encoded import Encoded, PackedCodes, broadcast_scale
from tiers.formats.base import Emission, Fed, Tier, register_form
from tiers.formats.native import gather_part, gathered_part, matmul_part

CODE_OPSETS: dict[str, int] = {}
"""Code type (numpy name) -> lowest opset whose DequantizeLinear takes it, from every codes tier's `code_opsets`."""

DEQUANTIZED_TYPES = ("float32", "float16")
"""Weight types DequantizeLinear can produce here (its output takes the scale's type; bfloat16 aside, which
numpy cannot hold). A float64 weight is dequantized in float32 and Cast, as `Encoded.dequantize` computes it."""


def _dequantize_opset(dtype: str, blockwise: bool) -> int:
    """Lowest opset whose DequantizeLinear takes a `dtype` weight's scales (float64 weights dequantize in float32)."""
    return max(19 if dtype == "float16" else 13, 21 if blockwise else 13)


def _integer_codes(dtype) -> bool:
    """Integer codes of at most 8 bits (fed as a byte each, or packed)."""
    try:
        return ml_dtypes.iinfo(np.dtype(dtype)).bits <= 8
    except ValueError:
        return False


@register_form
class CodesTier(Tier):
    """A tier stored as codes + scales (+ zero points) behind DequantizeLinear."""

    forms: ClassVar[tuple[str, ...]] = ("dequantize",)
    code_opsets: ClassVar[dict[str, int]] = {}
    """Its code types (numpy names) and the lowest opset whose DequantizeLinear takes each."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        CODE_OPSETS.update(cls.code_opsets)

    @classmethod
    def form_opset(cls, value: Encoded) -> int:
        return max(
            _dequantize_opset(value.dtype, bool(value.block_size)),
            CODE_OPSETS.get(np.dtype(value.values.dtype).name, 13),
        )

    def opset_for(self, dtype: str, blockwise: bool) -> int:
        return max(self.opset, _dequantize_opset(dtype, blockwise and self.blockwise))

    @classmethod
    def emit(cls, name: str, value: Encoded, layout: str) -> Emission:
        return _at_load(name, value) if layout == "dequantized" else _dequantize_linear(name, value)

    @classmethod
    def native(cls, name: str, value: Encoded, use, options) -> NativePlan | None:
        if use.kind == GATHER:
            part = gather_part(name, value, options) or gathered_part(name, value)
        else:
            part = matmul_part(name, value, use, options)
        return None if part is None else NativePlan(use.kind, (part,))

    @classmethod
    def dequantized(cls, value: Encoded) -> np.ndarray:
        """float32, computed in place: one weight-sized array, however large the weight."""
        codes = value.values.astype(np.float32)
        if value.zero_point is not None:
            codes -= broadcast_scale(value.zero_point.astype(np.float32), value.shape, value.axis, value.block_size)
        written = (
            np.asarray(value.scale).astype(np.float16) if value.dtype == "float16" else value.scale
        )  # a float16 model's scales are written as float16
        codes *= broadcast_scale(written, value.shape, value.axis, value.block_size)
        return codes

    @classmethod
    def take_channels(cls, value: Encoded, index: np.ndarray, shape: tuple[int, ...], channel_axis: int) -> Encoded:
        values = np.take(value.values, index, axis=channel_axis)
        scale, zero = value.scale, value.zero_point
        if value.axis is not None and np.ndim(scale) > 0:
            along = 0 if np.ndim(scale) == 1 else channel_axis  # per-axis vector, or blockwise (weight rank)
            scale = np.take(scale, index, axis=along)
            zero = None if zero is None else np.take(zero, index, axis=along)
        return replace(value, values=values, shape=shape, scale=scale, zero_point=zero)

    @classmethod
    def fed(cls, name: str, value: Encoded) -> Fed | None:
        """Cast, Sub the zero point, Mul the scale: DequantizeLinear's arithmetic in float32 (the same values as
        `dequantized`, at any opset), fed a byte per integer code, or the packed bytes of INT4/INT2 codes as a
        cache keeps them (unpacked in the graph). None for FP8 codes and blockwise scales (fed as floats)."""
        prefix = f"{name}__fed"
        dtype = np.dtype(value.dtype)
        packed = (
            value.values
            if isinstance(value.values, PackedCodes) and not value.block_size and _integer_codes(value.values.dtype)
            else None
        )
        if packed is not None and packed.data.size * (8 // packed.bits) != packed.size:
            packed = None  # codes that do not fill their last byte: fed unpacked
        if packed is None:
            value = value.expand()
        view = [1] * len(value.shape)
        if value.axis is not None and np.ndim(value.scale) > 0:
            view[value.axis] = value.shape[value.axis]
        if packed is not None:
            feeds, nodes, centred = _unpacked_codes(prefix, packed, ml_dtypes.iinfo(packed.dtype).min < 0)
        else:
            if not _integer_codes(value.values.dtype) or value.block_size:
                return None
            container = np.int8 if ml_dtypes.iinfo(value.values.dtype).min < 0 else np.uint8
            codes = value.values if value.values.dtype == container else value.values.astype(container)
            feeds = {f"{prefix}_codes": codes}
            nodes = [
                helper.make_node(
                    "Cast", [f"{prefix}_codes"], [f"{prefix}_float"], to=onnx.TensorProto.FLOAT, name=f"{prefix}_cast"
                )
            ]
            centred = f"{prefix}_float"
        written = (
            np.asarray(value.scale).astype(np.float16) if dtype == np.float16 else value.scale
        )  # a float16 weight's scale as the file stores it
        feeds[f"{prefix}_scale"] = np.asarray(written, np.float32).reshape(view)
        if value.zero_point is not None:
            feeds[f"{prefix}_zero"] = np.asarray(value.zero_point).astype(np.float32).reshape(view)
            nodes.append(
                helper.make_node("Sub", [centred, f"{prefix}_zero"], [f"{prefix}_centred"], name=f"{prefix}_sub")
            )
            centred = f"{prefix}_centred"
        scaled = name if dtype == np.float32 else f"{prefix}_scaled"
        nodes.append(helper.make_node("Mul", [centred, f"{prefix}_scale"], [scaled], name=f"{prefix}_mul"))
        if scaled != name:
            nodes.append(
                helper.make_node(
                    "Cast",
                    [scaled],
                    [name],
                    to=helper.np_dtype_to_tensor_dtype(dtype),
                    name=f"{prefix}_to_{dtype.name}",
                )
            )
        inputs = [
            helper.make_tensor_value_info(key, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))
            for key, array in feeds.items()
        ]
        return inputs, feeds, nodes


def _dequantize_linear(name: str, value: Encoded) -> Emission:
    """The fused layout: codes, scale (and zero point) into one DequantizeLinear (then a Cast for float64 weights)."""
    dtype = np.dtype(value.dtype)
    through = dtype if dtype.name in DEQUANTIZED_TYPES else np.dtype(np.float32)
    produced = name if through == dtype else f"{name}__dq_{through.name}"
    codes = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__q")
    scale = numpy_helper.from_array(np.ascontiguousarray(value.scale, dtype=through), f"{name}__scale")
    attributes = {}
    if value.axis is not None and np.ndim(value.scale) > 0:
        attributes["axis"] = int(value.axis)
    if value.block_size:
        attributes["block_size"] = int(value.block_size)
    initializers, inputs = [codes, scale], [codes.name, scale.name]
    if value.zero_point is not None:
        zero = numpy_helper.from_array(np.ascontiguousarray(value.zero_point), f"{name}__zero")
        initializers.append(zero)
        inputs.append(zero.name)
    nodes = [helper.make_node("DequantizeLinear", inputs, [produced], name=f"{name}__dq", **attributes)]
    if produced != name:
        nodes.append(
            helper.make_node(
                "Cast", [produced], [name], to=helper.np_dtype_to_tensor_dtype(dtype), name=f"{name}__to_{dtype.name}"
            )
        )
    return initializers, nodes


def _widened(
    prefix: str, array: np.ndarray, value: Encoded, shared: str
) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto], str]:
    """A scale or zero point stored with its own elements and bytes, only reshaped, and the nodes that make it
    float32 and broadcastable against the weight: per axis it is stored as [1, n, 1, ...]; per block as
    [..., blocks, 1, ...], then Expanded to [..., blocks, block_size, ...], Reshaped to the blocked axis and
    Sliced to its length (DequantizeLinear's last block may be partial); those shape constants are named from
    `shared`, so a scale and a zero point store them once."""
    shape, axis = list(value.shape), (value.axis or 0) % max(len(value.shape), 1)
    array = np.asarray(array)
    stored, tensors, nodes = array, [], []
    if array.ndim and value.block_size:
        blocks, size = array.shape[axis], int(value.block_size)
        stored = array.reshape(shape[:axis] + [blocks, 1] + shape[axis + 1 :])
        tensors += [
            numpy_helper.from_array(
                np.array(shape[:axis] + [blocks, size] + shape[axis + 1 :], np.int64), shared + "expand"
            ),
            numpy_helper.from_array(
                np.array(shape[:axis] + [blocks * size] + shape[axis + 1 :], np.int64), shared + "blocked"
            ),
        ]
    elif array.ndim:
        stored = array.reshape([shape[i] if i == axis else 1 for i in range(len(shape))])
    tensors.insert(0, numpy_helper.from_array(np.ascontiguousarray(stored), prefix + "stored"))
    current = prefix + "stored"
    if stored.dtype != np.float32:
        nodes.append(
            helper.make_node("Cast", [current], [prefix + "float"], to=onnx.TensorProto.FLOAT, name=prefix + "float")
        )
        current = prefix + "float"
    if array.ndim and value.block_size:
        nodes += [
            helper.make_node("Expand", [current, shared + "expand"], [prefix + "expanded"], name=prefix + "expand"),
            helper.make_node(
                "Reshape", [prefix + "expanded", shared + "blocked"], [prefix + "full"], name=prefix + "reshape"
            ),
        ]
        current = prefix + "full"
        if array.shape[axis] * int(value.block_size) != shape[axis]:
            tensors += [
                numpy_helper.from_array(np.array([0], np.int64), shared + "start"),
                numpy_helper.from_array(np.array([shape[axis]], np.int64), shared + "stop"),
                numpy_helper.from_array(np.array([axis], np.int64), shared + "axis"),
            ]
            nodes.append(
                helper.make_node(
                    "Slice",
                    [current, shared + "start", shared + "stop", shared + "axis"],
                    [prefix + "sliced"],
                    name=prefix + "slice",
                )
            )
            current = prefix + "sliced"
    return tensors, nodes, current


def _at_load(name: str, value: Encoded) -> Emission:
    """The same codes, scales and zero points as `_dequantize_linear`, rebuilt into the weight by plain ops (Cast,
    Sub, Mul; Expand/Reshape/Slice for blocks) instead of DequantizeLinear. ONNX Runtime constant-folds such nodes on
    initializers when a session is created, and leaves DequantizeLinear alone (to fuse it into MatMulNBits, or
    to run it on every call): this layout runs the original's float kernels from the small file. The arithmetic
    is `CodesTier.dequantized`'s in float32 (exact small integers, one rounding at the Mul, then a Cast to
    the weight's type), so the folded weight equals the numpy fake-quantized one to the bit."""
    dtype = np.dtype(value.dtype)
    p = f"{name}__"
    codes = numpy_helper.from_array(np.ascontiguousarray(value.values), f"{name}__q")
    tensors = [codes]
    nodes = [helper.make_node("Cast", [codes.name], [p + "codes"], to=onnx.TensorProto.FLOAT, name=p + "codes")]
    current = p + "codes"
    if value.zero_point is not None:
        zero_tensors, zero_nodes, zero = _widened(p + "zero_", value.zero_point, value, p + "block_")
        tensors, nodes = tensors + zero_tensors, nodes + zero_nodes
        nodes.append(helper.make_node("Sub", [current, zero], [p + "centred"], name=p + "centre"))
        current = p + "centred"
    scale_type = (
        dtype if dtype.name in DEQUANTIZED_TYPES else np.dtype(np.float32)
    )  # stored as `_dequantize_linear` stores it
    scale_tensors, scale_nodes, scale = _widened(
        p + "scale_", np.asarray(value.scale, dtype=scale_type), value, p + "block_"
    )
    tensors += [t for t in scale_tensors if t.name not in {known.name for known in tensors}]
    nodes += scale_nodes
    scaled = name if dtype == np.float32 else p + "scaled"
    nodes.append(helper.make_node("Mul", [current, scale], [scaled], name=p + "scale"))
    if scaled != name:
        nodes.append(
            helper.make_node(
                "Cast", [scaled], [name], to=helper.np_dtype_to_tensor_dtype(dtype), name=f"{name}__to_{dtype.name}"
            )
        )
    return tensors, nodes


def _unpacked_codes(
    prefix: str, packed: PackedCodes, signed: bool
) -> tuple[dict[str, np.ndarray], list[onnx.NodeProto], str]:
    """Feeds and nodes turning sub-byte codes packed as on disk (`packed.data`, 8 // bits per byte, the
    first in the low bits) into their values as float32, shaped like the weight: every byte cast to
    float, digit i = floor(byte / 2^(bits·i)) - 2^bits · floor(byte / 2^(bits·(i+1))), two's complement
    for signed codes; all small integers, so exact. The name of the result is returned."""
    per, base = 8 // packed.bits, float(2**packed.bits)
    feeds = {
        f"{prefix}_packed": packed.data,
        f"{prefix}_column": np.array([-1, 1], np.int64),
        f"{prefix}_shape": np.array(packed.shape, np.int64),
    }
    feeds.update({f"{prefix}_div{i}": np.array(base**i, np.float32) for i in range(1, per + 1)})
    feeds[f"{prefix}_base"] = np.array(base, np.float32)
    nodes = [
        helper.make_node(
            "Cast", [f"{prefix}_packed"], [f"{prefix}_q0"], to=onnx.TensorProto.FLOAT, name=f"{prefix}_bytes"
        )
    ]
    for i in range(1, per + 1):  # q_i = floor(byte / base^i)
        nodes.append(
            helper.make_node("Div", [f"{prefix}_q0", f"{prefix}_div{i}"], [f"{prefix}_d{i}"], name=f"{prefix}_div{i}")
        )
        nodes.append(helper.make_node("Floor", [f"{prefix}_d{i}"], [f"{prefix}_q{i}"], name=f"{prefix}_floor{i}"))
    digits = []
    for i in range(per):  # digit i = q_i - base · q_{i+1}, a column of the [bytes, per] table
        nodes.append(
            helper.make_node(
                "Mul", [f"{prefix}_q{i + 1}", f"{prefix}_base"], [f"{prefix}_h{i}"], name=f"{prefix}_high{i}"
            )
        )
        nodes.append(
            helper.make_node("Sub", [f"{prefix}_q{i}", f"{prefix}_h{i}"], [f"{prefix}_x{i}"], name=f"{prefix}_digit{i}")
        )
        nodes.append(
            helper.make_node(
                "Reshape", [f"{prefix}_x{i}", f"{prefix}_column"], [f"{prefix}_c{i}"], name=f"{prefix}_column{i}"
            )
        )
        digits.append(f"{prefix}_c{i}")
    nodes.append(helper.make_node("Concat", digits, [f"{prefix}_table"], axis=1, name=f"{prefix}_table"))
    nodes.append(
        helper.make_node(
            "Reshape", [f"{prefix}_table", f"{prefix}_shape"], [f"{prefix}_digits"], name=f"{prefix}_reshape"
        )
    )
    if not signed:
        return feeds, nodes, f"{prefix}_digits"
    feeds[f"{prefix}_half"] = np.array(base / 2, np.float32)
    nodes += [  # two's complement: a digit of base / 2 or more stands for digit - base
        helper.make_node("Div", [f"{prefix}_digits", f"{prefix}_half"], [f"{prefix}_sd"], name=f"{prefix}_signdiv"),
        helper.make_node("Floor", [f"{prefix}_sd"], [f"{prefix}_neg"], name=f"{prefix}_sign"),
        helper.make_node("Mul", [f"{prefix}_neg", f"{prefix}_base"], [f"{prefix}_wrap"], name=f"{prefix}_wrap"),
        helper.make_node("Sub", [f"{prefix}_digits", f"{prefix}_wrap"], [f"{prefix}_signed"], name=f"{prefix}_signed"),
    ]
    return feeds, nodes, f"{prefix}_signed"
