"""Precision tiers: quantizers, bit costs and the stored forms they emit."""

from tiers.encoded import Encoded
from tiers.quantize import fake_quantize, quantize_symmetric, symmetric_scale
from tiers.registry import DEFAULT_TIERS, TIERS, Layout, Stored, Tier, TierError, get_tiers

__all__ = [
    "DEFAULT_TIERS",
    "TIERS",
    "Encoded",
    "Layout",
    "Stored",
    "Tier",
    "TierError",
    "fake_quantize",
    "get_tiers",
    "quantize_symmetric",
    "symmetric_scale",
]
