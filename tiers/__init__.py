"""Precision tiers: grids, rounding methods, and the stored forms they emit.

A `Tier` says what is stored and on which grid; a `Rounding` says how codes
are chosen on that grid (round to nearest, GPTQ, GPTAQ, QEP); `encode` turns a
weight into the one container, `Encoded`, that pricing, measurement and the
ONNX writer all read.
"""

from tiers.encoded import Encoded
from tiers.gptq import Hessian, Quantized
from tiers.grid import GridSpec
from tiers.layout import Layout
from tiers.quantizer import METHODS, RTN, Rounding, encode, quantize, split, to_encoded
from tiers.registry import DEFAULT_TIERS, TIERS, TRT_TIERS, Tier, TierError, get_tiers, tier_for_bits

__all__ = [
    "DEFAULT_TIERS",
    "METHODS",
    "RTN",
    "TIERS",
    "TRT_TIERS",
    "Encoded",
    "GridSpec",
    "Hessian",
    "Layout",
    "Quantized",
    "Rounding",
    "Tier",
    "TierError",
    "encode",
    "get_tiers",
    "quantize",
    "split",
    "tier_for_bits",
    "to_encoded",
]
