"""Weight perturbations for the TQS probes.

`quant`: the b-bit symmetric per-tensor quantization residual Q_b(w) - w.
`gauss`: isotropic Gaussian noise rescaled to the same Frobenius norm, one
independent draw per task. Draws are seeded from (seed, unit, draw), so any
task gives the same perturbation whenever and wherever it runs: that is what
makes sweeps resumable and distributable.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from tqsdeploy.units import Unit

PROBES = ("quant", "gauss")


@dataclass(frozen=True)
class Perturbation:
    weights: dict[str, np.ndarray]
    """Replacement values for the unit's tensors."""
    delta_sq: float
    """||delta theta||_F^2 over the unit's tensors."""


def probe_scale(w: np.ndarray, bits: int) -> float:
    """Step of the probe's grid: max|w| maps to the largest code 2^(b-1) - 1."""
    return float(np.abs(w.astype(np.float32, copy=False)).max(initial=0.0)) / (2 ** (bits - 1) - 1)


def quantization_probe(w: np.ndarray, bits: int) -> np.ndarray:
    """Q_b(w): symmetric per-tensor b-bit round to nearest on [-(2^(b-1)-1), 2^(b-1)-1]·s (the paper's
    probe, deliberately simpler than any export tier), in w's dtype."""
    qmax = 2 ** (bits - 1) - 1
    scale = np.float32(probe_scale(w, bits)) or np.float32(1.0)
    codes = np.clip(np.rint(w.astype(np.float32, copy=False) / scale), -qmax, qmax)
    return (codes * scale).astype(w.dtype, copy=False)


def _reference_norm(w: np.ndarray, residual: np.ndarray, bits: int) -> float:
    """Frobenius norm the Gaussian probe matches: the quantization residual's,
    or, when w happens to be exactly representable, the expected rounding noise."""
    norm = float(np.linalg.norm(residual.astype(np.float64)))
    if norm > 0:
        return norm
    expected = probe_scale(w, bits) * np.sqrt(w.size / 12.0)
    return expected if expected > 0 else 1e-6 * np.sqrt(w.size)


def perturb(unit: Unit, weights: dict[str, np.ndarray], probe: str, draw: int, bits: int, seed: int) -> Perturbation:
    """The perturbed copy of every tensor in `unit` for one probe draw."""
    replaced, delta_sq = {}, 0.0
    rng = np.random.default_rng([seed, zlib.crc32(unit.name.encode()), draw]) if probe == "gauss" else None
    for name in unit.tensor_names:
        w = weights[name]
        quantized = quantization_probe(w, bits)
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
