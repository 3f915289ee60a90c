"""What every stored format provides, and the table that finds a format by the form it writes.

A stored format is one class. Its instances are its tiers (name, bit count, runtimes, opset); the
class owns, for the weights it stores, the grid their codes lie on, the encoder that turns a weight
(or the codes a rounding method chose) into an `Encoded`, the floats the runtime computes from it
(numpy), the ONNX emitters of both runtime layouts, the opset those need, what a calibration run
feeds for it, and how a channel group is cut out of it. The rest of the toolkit reaches a stored
weight only through these: `Encoded` asks the class registered for its form (`FORMS`), the writer
(`graph_ops.qdq`) asks the `Encoded`, and sizes are the bits of what the emitter writes
(`graph_ops.io.element_bits` reads a code type's width off the type). A new format is one file
and its registration (`register_form` on the class, its tiers in `tiers.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx

from graph_ops.io import element_bits
from tiers.grid import GridSpec

if TYPE_CHECKING:
    from graph_ops.layout import Layout
    from graph_ops.native import NativePlan
    from tiers.encoded import Encoded
    from tiers.gptq import Quantized

Emission = tuple[list[onnx.TensorProto], list[onnx.NodeProto]]
"""Initializers and nodes that produce one weight."""

Fed = tuple[list[onnx.ValueInfoProto], dict[str, np.ndarray], list[onnx.NodeProto]]
"""Graph inputs, their values and the nodes that rebuild one weight from what is fed."""


class StoredForm:
    """What is done with a weight in one stored form. Class methods: everything is read from the `Encoded`."""

    forms: ClassVar[tuple[str, ...]] = ()
    """The `Encoded.form` names this class writes and reads."""

    @classmethod
    def emit(cls, name: str, value: "Encoded", layout: str) -> Emission:
        """Initializers and nodes that produce tensor `name` from `value`, in runtime `layout`
        (`graph_ops.qdq.LAYOUTS`)."""
        raise NotImplementedError

    @classmethod
    def form_opset(cls, value: "Encoded") -> int:
        """Lowest default-domain opset the emitted nodes need."""
        raise NotImplementedError

    @classmethod
    def dequantized(cls, value: "Encoded") -> np.ndarray:
        """The weight the runtime computes from `value` (codes expanded), float32 (exact dequantization)."""
        raise NotImplementedError

    @classmethod
    def take_channels(cls, value: "Encoded", index: np.ndarray, shape: tuple[int, ...], channel_axis: int) -> "Encoded":
        """Output channels `index` (along `channel_axis` of the stored weight, new `shape`) in the same form."""
        raise NotImplementedError

    @classmethod
    def payload_bits(cls, value: "Encoded") -> int:
        """Bits of values, scales (priced in the weight's type) and zero points: what the weight itself costs on
        disk."""
        bits = int(value.values.size) * element_bits(value.values.dtype)
        if value.scale is not None:
            bits += int(np.asarray(value.scale).size) * element_bits(value.dtype)
        if value.zero_point is not None:
            bits += int(value.zero_point.size) * element_bits(value.zero_point.dtype)
        return bits

    @classmethod
    def fed(cls, name: str, value: "Encoded") -> Fed | None:
        """What a calibration run feeds to rebuild the weight in the graph; None: fed as the floats it stands for."""
        return None

    @classmethod
    def native(cls, name: str, value: "Encoded", use, options) -> "NativePlan | None":
        """The weight in a form ONNX Runtime's low-bit kernels read (`graph_ops.native`), for consumers that read it
        as `use` (`NativeUse`) on a runtime taking `options` (`tiers.formats.native.NativeOptions`); None: written in
        the dequantized layout instead."""
        return None


FORMS: dict[str, type[StoredForm]] = {}
"""Stored form name -> the class that writes it."""


def register_form(cls: type[StoredForm]) -> type[StoredForm]:
    """Class decorator: make `cls` the owner of its `forms`."""
    for form in cls.forms:
        FORMS[form] = cls
    return cls


def form_of(form: str) -> type[StoredForm]:
    if form not in FORMS:
        raise ValueError(f"unknown stored form '{form}'")
    return FORMS[form]


@dataclass(frozen=True)
class Tier(StoredForm):
    """One precision tier: an instance of its stored format."""

    name: str
    bits: int
    runtimes: frozenset[str]
    opset: int
    """Lowest ONNX opset its stored form needs."""
    symmetric: bool = True
    """Integer tiers: signed codes without zero point; False: unsigned codes with a zero point per scale."""

    family: ClassVar[str] = ""
    """'float' (fp32/bf16/fp16), 'int', 'fp8' or 'binary'."""
    quantized: ClassVar[bool] = True
    """Stores codes on a grid (as opposed to a float copy of the weight)."""
    calibratable: ClassVar[bool] = False
    """GPTQ, GPTAQ and QEP can choose its codes."""
    blockwise: ClassVar[bool] = False
    """Takes `--group-size` (scales per block of input features)."""

    def opset_for(self, dtype: str, blockwise: bool) -> int:
        """Lowest opset its stored form of a `dtype` weight can need (`blockwise`: scales per block): what an
        export decides its output opset from before any weight is encoded (`form_opset` of each encoding)."""
        return self.opset

    @property
    def grid(self) -> GridSpec:
        raise ValueError(f"tier '{self.name}' stores floats, not codes")

    @property
    def container_bits(self) -> int:
        """Bits each code takes on disk."""
        return self.bits

    def stored(self, quantized: "Quantized", layout: "Layout", dtype: str) -> "Encoded":
        """The stored form of Wt-level codes on this tier's grid, in the weight's stored layout."""
        raise ValueError(f"tier '{self.name}' stores floats, not codes")

    def float_copy(self, weight: np.ndarray) -> "Encoded":
        """The stored form of a float tier's copy of `weight`."""
        raise ValueError(f"tier '{self.name}' stores codes: encode them with a rounding method")


def placed(
    quantized: "Quantized", layout: "Layout"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None, int | None]:
    """(codes, scale, zero, axis, block_size) of Wt-level codes in the stored layout, the scales shaped as
    DequantizeLinear takes them: one per tensor, per output channel, or per block of the stored reduction axis."""
    codes = layout.from_wt(quantized.codes)
    scale, zero = quantized.scale, quantized.zero
    axis, block = None, None
    if layout.perm is None:
        scale, zero = scale.reshape(()), zero.reshape(())
    elif quantized.group_size <= 0:
        axis, scale, zero = layout.perm[0], scale[:, 0], zero[:, 0]
    else:  # blocks along the stored reduction axis of a rank-2 weight
        axis, block = layout.perm[1], quantized.group_size
        if layout.perm == (1, 0):
            scale, zero = scale.T, zero.T
    scale = np.array(scale, np.float32, order="C")  # ascontiguousarray would turn a 0-d scale into 1-d
    return codes, scale, zero, axis, block
