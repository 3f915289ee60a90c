"""Precision tiers: grids, rounding methods, and the stored forms they emit.

A `Tier` is an instance of its stored format (`tiers.formats`: one class per
format, owning its grid, encoder, ONNX emitters, opset and bit count); a
`Rounding` says how codes are chosen on the grid (round to nearest, GPTQ,
GPTAQ, QEP: the entries of `tiers.methods.METHODS`); `encode` turns a weight
into the one container, `Encoded`, that pricing, measurement and the ONNX
writer all read through its format.
"""

from graph_ops.layout import Layout
from tiers.encoded import Encoded
from tiers.formats.base import StoredForm, register_form
from tiers.gptq import Quantized
from tiers.grid import GridSpec
from tiers.hessian import Hessian
from tiers.methods import METHOD_LABELS, METHODS, Method, auto_methods
from tiers.quantizer import GRIDS, RTN, Rounding, encode, quantize, split, to_encoded
from tiers.registry import (
    DEFAULT_TIERS,
    TIERS,
    TRT_TIERS,
    Tier,
    TierError,
    get_tiers,
    ladder_opset,
    precision_order,
    tier_for_bits,
)

__all__ = [
    "DEFAULT_TIERS",
    "GRIDS",
    "METHODS",
    "METHOD_LABELS",
    "RTN",
    "TIERS",
    "TRT_TIERS",
    "Encoded",
    "GridSpec",
    "Hessian",
    "Layout",
    "Method",
    "Quantized",
    "Rounding",
    "StoredForm",
    "Tier",
    "TierError",
    "auto_methods",
    "encode",
    "get_tiers",
    "ladder_opset",
    "precision_order",
    "quantize",
    "register_form",
    "split",
    "tier_for_bits",
    "to_encoded",
]
