"""Weight perturbations for the TQS probes.

`quant`: the b-bit symmetric per-tensor quantization residual Q_b(w) - w.
`gauss`: isotropic Gaussian noise rescaled to the same Frobenius norm, one
independent draw per task. `tier:<name>[/g<G>]`: the unit quantized exactly as
export would store it at that tier (the `measured` allocation objective). Draws are seeded from (seed, unit, draw), so any
task gives the same perturbation whenever and wherever it runs: that is what
makes sweeps resumable and distributable.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from tiers import TIERS, Layout, fake_quantize, symmetric_scale
from tqsdeploy.units import Unit

PROBES = ("quant", "gauss")


@dataclass(frozen=True)
class Perturbation:
    weights: dict[str, np.ndarray]
    """Replacement values for the unit's tensors."""
    delta_sq: float
    """||delta theta||_F^2 over the unit's tensors."""


def _reference_norm(w: np.ndarray, residual: np.ndarray, bits: int) -> float:
    """Frobenius norm the Gaussian probe matches: the quantization residual's,
    or, when w happens to be exactly representable, the expected rounding noise."""
    norm = float(np.linalg.norm(residual.astype(np.float64)))
    if norm > 0:
        return norm
    expected = float(symmetric_scale(w, bits)) * np.sqrt(w.size / 12.0)
    return expected if expected > 0 else 1e-6 * np.sqrt(w.size)


def tier_probe(tier: str, group_size: int | None) -> str:
    return f"tier:{tier}" + (f"/g{group_size}" if group_size else "")


def parse_tier_probe(probe: str) -> tuple[str, int | None]:
    name, _, group = probe.removeprefix("tier:").partition("/g")
    return name, int(group) if group else None


def tier_weights(unit: Unit, weights: dict[str, np.ndarray], tier: str, group_size: int | None) -> dict[str, np.ndarray]:
    """The unit's tensors as the runtime will see them at `tier` (exact dequantization)."""
    return {
        t.name: TIERS[tier].quantize(weights[t.name], Layout(t.shape, t.channel_axis), group_size).dequantized().astype(weights[t.name].dtype)
        for t in unit.tensors
    }


def perturb(unit: Unit, weights: dict[str, np.ndarray], probe: str, draw: int, bits: int, seed: int) -> Perturbation:
    """The perturbed copy of every tensor in `unit` for one probe draw."""
    if probe.startswith("tier:"):
        replaced = tier_weights(unit, weights, *parse_tier_probe(probe))
        delta_sq = sum(float(np.sum(np.square(replaced[n].astype(np.float64) - weights[n]))) for n in replaced)
        return Perturbation(weights=replaced, delta_sq=delta_sq)
    replaced, delta_sq = {}, 0.0
    rng = np.random.default_rng([seed, zlib.crc32(unit.name.encode()), draw]) if probe == "gauss" else None
    for name in unit.tensor_names:
        w = weights[name]
        quantized = fake_quantize(w, bits)
        if probe == "quant":
            new = quantized
        elif probe == "gauss":
            noise = rng.standard_normal(w.shape)
            residual = quantized.astype(np.float64) - w.astype(np.float64)
            noise *= _reference_norm(w, residual, bits) / max(float(np.linalg.norm(noise)), 1e-30)
            new = (w.astype(np.float64) + noise).astype(w.dtype)
        else:
            raise ValueError(f"unknown probe '{probe}'")
        delta = new.astype(np.float64) - w.astype(np.float64)
        delta_sq += float(np.sum(delta * delta))
        replaced[name] = np.ascontiguousarray(new)
    return Perturbation(weights=replaced, delta_sq=delta_sq)
