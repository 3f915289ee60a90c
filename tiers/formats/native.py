"""Integer codes in the forms ONNX Runtime's own low-bit kernels read: MatMulNBits for a matrix weight, and
GatherBlockQuantized for an embedding table (`graph_ops.native` rewrites the consumers).

Both kernels take blocks of codes along the reduction axis with a scale (and zero point) per block; a per-channel
grid is the same grid with its scale repeated in each block, so the values computed are the codes' exact
dequantization. The layouts are those onnxruntime's kernels read (docs/design-notes/tiers.md, "Native forms").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
from onnx import helper, numpy_helper

from graph_ops.native import GATHER, GATHERED_CODES, MATMUL, NativePart, NativeUse
from tiers.encoded import Encoded

BLOCK_SIZES = (16, 32, 64, 128, 256)
"""Block sizes every supported ONNX Runtime takes for MatMulNBits (powers of two from 16)."""
LARGEST_FAST_BLOCK = {2: 128}
"""Code width -> the largest block its MatMulNBits runs fast: 2-bit codes in blocks of 256 ran 11-71x slower than the
float MatMul (no fast kernel; blocks of 128: 0.04-0.96x), so wider blocks are written as blocks of 128 sharing a scale
(docs/design-notes/export.md, "Which weights are written natively")."""


@dataclass(frozen=True)
class NativeOptions:
    """What the target runtime's kernels take, and how they are asked to compute."""

    matmul_bits: tuple[int, ...] = (2, 4, 8)
    """Code widths its MatMulNBits runs (4 from ONNX Runtime 1.20, 8 from 1.23, 2 from 1.24)."""
    gather_bits: tuple[int, ...] = (4, 8)
    """Code widths its GatherBlockQuantized runs (4 from 1.20, 8 from 1.23)."""
    accuracy_level: int = 4
    """MatMulNBits' `accuracy_level`: 4 quantizes activations to int8 inside the kernel (fast at every width), 0
    computes in float (exact, but 2- and 8-bit codes then run many times slower than a float MatMul)."""
    min_params: int = 16384
    """Smaller weights stay float weights folded at load: the kernels' fixed cost outweighs their reads."""
    min_k: int = 256
    """MatMul weights with fewer input channels stay folded too: below it the kernel ran 1.4-2.8x slower than the
    float MatMul here at every code width (docs/design-notes/export.md, "Which weights are written natively")."""
    min_k_2bit: int = 1024
    """2-bit codes of a MatMul weight with fewer input channels are written in 4-bit containers (the same codes,
    exact): the 2-bit kernel ran 1.3-1.6x slower than the float MatMul at K = 384, the 4-bit one 0.9-1.1x."""
    split_min_bytes: int = 1 << 20
    """A weight whose channel groups need several kernels is folded instead when its float copy is smaller than
    this: each kernel costs about 10 µs a call, which a small weight's few reads cannot earn back."""


def _code_bits(codes: np.ndarray) -> tuple[int, bool] | None:
    """(bits, signed) of integer codes of 2, 4 or 8 bits; None for other codes (FP8)."""
    try:
        info = ml_dtypes.iinfo(codes.dtype)
    except ValueError:
        return None
    bits = {np.int8: 8, np.uint8: 8}.get(codes.dtype.type, info.bits)
    return (bits, info.min < 0) if bits in (2, 4, 8) else None


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes, last axis packed least significant bits first (what both kernels read)."""
    per = 8 // bits
    codes = codes.astype(np.uint8)
    if per == 1:
        return codes
    pad = -codes.shape[-1] % per
    if pad:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (pad,), np.uint8)], axis=-1)
    codes = codes.reshape(codes.shape[:-1] + (-1, per))
    packed = np.zeros(codes.shape[:-1], np.uint8)
    for i in range(per):
        packed |= codes[..., i] << np.uint8(i * bits)
    return packed


def _block_size(k: int, n: int, bits: int, zero: bool) -> int:
    """The block size storing a per-channel grid in the fewest bytes (codes padded to whole blocks, a 4-byte scale
    and a zero point per block) among those its width's kernel runs fast; a tie goes to the larger block."""

    def size(block: int) -> float:
        blocks = -(-k // block)
        return n * (blocks * block * bits / 8 + blocks * 4 + (blocks * bits / 8 if zero else 0))

    fast = [b for b in BLOCK_SIZES if b <= LARGEST_FAST_BLOCK.get(bits, b)]
    return min(reversed(fast), key=size)


def matmul_part(name: str, value: Encoded, use: NativeUse, options: NativeOptions) -> NativePart | None:
    """MatMulNBits of a 2-D weight's integer codes; None where the kernel cannot take them as they are."""
    found = _code_bits(value.values) if value.form == "dequantize" and len(value.shape) == 2 else None
    k_axis = 1 - use.n_axis
    if found is not None and found[0] == 2 and 4 in options.matmul_bits:
        if 2 not in options.matmul_bits or value.shape[k_axis] < options.min_k_2bit:
            value, found = _widened(value), (4, found[1])
    if found is None or found[0] not in options.matmul_bits or value.dtype not in ("float32", "float16"):
        return None
    bits, signed = found
    codes = np.asarray(value.values).astype(np.int16)
    blocked = value.block_size is not None
    if blocked and (value.axis != k_axis or value.block_size not in BLOCK_SIZES):
        return None
    if not blocked and value.axis is not None and value.axis != use.n_axis:
        return None
    wt = codes if use.n_axis == 0 else codes.T  # [N, K]
    n, k = wt.shape
    block = value.block_size if blocked else _block_size(k, n, bits, value.zero_point is not None)
    blocks = -(-k // block)
    scale, zero = _per_block(value, n, blocks, use.n_axis)
    fast = LARGEST_FAST_BLOCK.get(bits, block)
    if block > fast:  # the same grid in smaller blocks, each repeating its block's scale and zero point
        blocks = -(-k // fast)
        scale = np.repeat(scale, block // fast, axis=1)[:, :blocks]
        zero = None if zero is None else np.repeat(zero, block // fast, axis=1)[:, :blocks]
        block = fast
    offset = 1 << (bits - 1) if signed else 0
    wt = np.concatenate([wt + offset, np.zeros((n, blocks * block - k), np.int16)], axis=1).reshape(n, blocks, block)
    tensors = [
        numpy_helper.from_array(_pack(wt, bits), f"{name}__nbits"),
        numpy_helper.from_array(scale.astype(value.dtype), f"{name}__nbits_scale"),
    ]
    if zero is not None:
        tensors.append(numpy_helper.from_array(_pack(zero.astype(np.int16) + offset, bits), f"{name}__nbits_zero"))
    attributes = {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": options.accuracy_level}
    return NativePart("MatMulNBits", tuple(t.name for t in tensors), attributes, tuple(tensors))


def gather_part(name: str, value: Encoded, options: NativeOptions) -> NativePart | None:
    """GatherBlockQuantized of a table's integer codes, one scale per row repeated per block; None where the kernel
    does not take them (`gathered_part` then keeps them as codes)."""
    found = _code_bits(value.values) if value.form == "dequantize" and len(value.shape) == 2 else None
    if found is None or found[0] not in options.gather_bits or value.block_size or value.axis not in (0, None):
        return None
    bits, signed = found
    rows, width = value.shape
    block = next((b for b in reversed(BLOCK_SIZES) if width % b == 0), None)
    if block is None or value.dtype not in ("float32", "float16"):
        return None
    blocks = width // block
    scale, zero = _per_block(value, rows, blocks, 0)
    codes = np.asarray(value.values)
    if bits == 4:  # the table as an ordinary 4-bit tensor (ONNX packing), its zero points the same type
        tensors = [numpy_helper.from_array(np.ascontiguousarray(codes), f"{name}__gbq")]
        attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": block}
        zero_tensor = None if zero is None else np.ascontiguousarray(zero.astype(codes.dtype))
    else:  # 8-bit: unsigned bytes, `bits` declared (ONNX Runtime 1.23 and later)
        offset = 128 if signed else 0
        tensors = [numpy_helper.from_array((codes.astype(np.int16) + offset).astype(np.uint8), f"{name}__gbq")]
        attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": block, "bits": 8}
        zero_tensor = None if zero is None else (zero.astype(np.int16) + offset).astype(np.uint8)
    tensors.append(numpy_helper.from_array(scale.astype(value.dtype), f"{name}__gbq_scale"))
    if zero_tensor is not None:
        tensors.append(numpy_helper.from_array(zero_tensor, f"{name}__gbq_zero"))
    return NativePart(
        "GatherBlockQuantized", tuple(t.name for t in tensors), attributes, tuple(tensors), shape=tuple(value.shape)
    )


def _widened(value: Encoded) -> Encoded:
    """2-bit codes and zero points as 4-bit ones of the same values (a release whose kernel takes no 2-bit)."""
    wide = ml_dtypes.int4 if ml_dtypes.iinfo(value.values.dtype).min < 0 else ml_dtypes.uint4
    zero = None if value.zero_point is None else np.asarray(value.zero_point).astype(np.int16).astype(wide)
    return replace(value, values=np.asarray(value.values).astype(np.int16).astype(wide), zero_point=zero)


def table_part(name: str, value: Encoded, options: NativeOptions) -> NativePart:
    """Rows of a table: GatherBlockQuantized where the kernel takes their codes, else a Gather of their packed codes,
    else (float rows) a Gather on the rows' float copy (folded at load, like any float part)."""
    part = gather_part(name, value, options) or gathered_part(name, value)
    if part is not None:
        return part
    folded = float_part(name, value)
    return NativePart("Gather", folded.inputs, {}, folded.initializers, folded.nodes, folded.shape)


def gathered_part(name: str, value: Encoded) -> NativePart | None:
    """A table's per-row integer or sign codes, packed in bytes that a Gather reads, unpacked and dequantized after
    it (`graph_ops.native`): only the rows an index picks become floats, so the session holds the codes, for the
    widths GatherBlockQuantized does not take on the target (2-bit before ONNX Runtime 1.27, sign bits, 8-bit before
    1.23). None for other forms, blockwise scales, or a table read along another axis."""
    if len(value.shape) != 2 or value.block_size or value.axis not in (0, None):
        return None
    if value.dtype not in ("float32", "float16"):
        return None
    rows, width = value.shape
    if value.form == "packed_sign":  # bit b -> (b - 0.5) * 2|s|: exactly -|s| or +|s|
        bits, codes = 1, np.unpackbits(np.asarray(value.values))[: rows * width].reshape(rows, width)
        scale, zero, offset = 2 * np.asarray(value.scale, np.float32).reshape(-1, 1), None, 0.5
    elif value.form == "dequantize" and (found := _code_bits(value.values)) is not None:
        bits, signed = found
        offset = 1 << (bits - 1) if signed else 0
        codes = (np.asarray(value.values).astype(np.int16) + offset).astype(np.uint8)
        scale, zero = _per_block(value, rows, 1, 0)
        zero = None if zero is None else (zero.astype(np.int16) + offset).astype(np.uint8)
    else:
        return None
    scale = np.broadcast_to(scale, (rows, 1))
    tensors = [
        numpy_helper.from_array(_planes(codes, bits), f"{name}__gcodes{bits}"),
        numpy_helper.from_array(np.ascontiguousarray(scale).astype(value.dtype), f"{name}__gcodes_scale"),
    ]
    if zero is not None:
        tensors.append(numpy_helper.from_array(np.ascontiguousarray(zero), f"{name}__gcodes_zero"))
    attributes = {"bits": bits, "width": width, "offset": float(offset), "dtype": value.dtype}
    return NativePart(GATHERED_CODES, tuple(t.name for t in tensors), attributes, tuple(tensors), shape=(rows, width))


def _planes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[rows, W] codes as [rows, ceil(W / per)] bytes, byte j holding columns j, j + W', j + 2W', ... at bits 0, b,
    2b, ... (W' the bytes per row): one shift per plane and a reshape unpack them, whatever the indices' shape."""
    per = 8 // bits
    rows, width = codes.shape
    wide = -(-width // per)
    padded = np.zeros((rows, per * wide), np.uint8)
    padded[:, :width] = codes
    planes = padded.reshape(rows, per, wide)
    packed = np.zeros((rows, wide), np.uint8)
    for k in range(per):
        packed |= planes[:, k, :] << np.uint8(k * bits)
    return packed


def _per_block(value: Encoded, n: int, blocks: int, n_axis: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale and zero point as [N, blocks]: a per-channel (or per-tensor) grid's repeated, a blockwise one's as is."""

    def shaped(array):
        if array is None:
            return None
        array = np.asarray(array)
        if value.block_size:
            return array if n_axis == 0 else array.T
        return np.repeat(np.broadcast_to(array.reshape(-1), (n,)).reshape(n, 1), blocks, axis=1)

    return np.ascontiguousarray(shaped(value.scale), np.float32), shaped(value.zero_point)


def float_part(name: str, value: Encoded) -> NativePart:
    """A part the kernels cannot take, as a float weight its own form's dequantized layout makes (folded at load)."""
    initializers, nodes = value.emit(name, "dequantized")
    return NativePart(
        "MatMul", (name,), {}, tuple(initializers), tuple(nodes) or _identity(name, initializers), tuple(value.shape)
    )


def _identity(name: str, initializers) -> tuple:
    """A raw part's tensor is its own initializer: no node produces it."""
    return (
        ()
        if any(t.name == name for t in initializers)
        else (helper.make_node("Identity", [initializers[0].name], [name]),)
    )


__all__ = ["GATHER", "MATMUL", "NativeOptions", "float_part", "gather_part", "gathered_part", "matmul_part"]


def merged(parts: tuple[NativePart, ...]) -> tuple[NativePart, ...]:
    """Adjacent MatMulNBits parts with the same attributes and inputs as one kernel over their output channels:
    codes, scales and zero points are all [N, ...], so they concatenate along N."""
    out: list[NativePart] = []
    for part in parts:
        last = out[-1] if out else None
        if (
            last is not None
            and part.op == last.op
            and part.op in ("MatMulNBits", "GatherBlockQuantized", GATHERED_CODES)
            and _without_n(part.attributes) == _without_n(last.attributes)
            and len(part.initializers) == len(last.initializers)
            and all(a.data_type == b.data_type for a, b in zip(part.initializers, last.initializers))
        ):
            tensors = tuple(
                numpy_helper.from_array(
                    np.concatenate([numpy_helper.to_array(a), numpy_helper.to_array(b)], axis=0), a.name
                )
                for a, b in zip(last.initializers, part.initializers)
            )
            attributes = dict(last.attributes)
            if "N" in attributes:
                attributes["N"] += part.attributes["N"]
            shape = (last.shape[0] + part.shape[0], *last.shape[1:]) if last.shape and part.shape else ()
            out[-1] = NativePart(part.op, last.inputs, attributes, tensors, shape=shape)
        else:
            out.append(part)
    return tuple(out)


def _without_n(attributes: dict) -> dict:
    return {key: value for key, value in attributes.items() if key != "N"}
