"""Precision tiers: quantizers, bit costs and the dequantization they emit."""

from tiers.quantize import fake_quantize, quantize_symmetric, symmetric_scale

__all__ = ["fake_quantize", "quantize_symmetric", "symmetric_scale"]
