"""Weight perturbations for the TQS probes.

`quant`: the b-bit symmetric per-tensor quantization residual Q_b(w) - w.
`gauss`: isotropic Gaussian noise rescaled to the same Frobenius norm, one
independent draw per task. Draws are seeded from (seed, unit, draw), so any
task gives the same perturbation whenever and wherever it runs: that is what
makes sweeps resumable and distributable.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from tqsdeploy.errors import InternalError
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


def quantization_probe(w: np.ndarray, bits: int, scale: float | None = None) -> np.ndarray:
    """Q_b(w): symmetric per-tensor b-bit round to nearest on [-(2^(b-1)-1), 2^(b-1)-1]·s (the paper's
    probe, deliberately simpler than any export tier), in w's dtype. `scale`: the step of the whole
    tensor's grid when `w` is a part of it (some rows of a table)."""
    qmax = 2 ** (bits - 1) - 1
    scale = np.float32(probe_scale(w, bits) if scale is None else scale) or np.float32(1.0)
    codes = np.clip(np.rint(w.astype(np.float32, copy=False) / scale), -qmax, qmax)
    return (codes * scale).astype(w.dtype, copy=False)


def _reference_norm(w: np.ndarray, norm: float, bits: int, size: int) -> float:
    """Frobenius norm the Gaussian probe matches: the quantization residual's (`norm`),
    or, when w happens to be exactly representable, the expected rounding noise
    over the `size` entries perturbed."""
    if norm > 0:
        return norm
    expected = probe_scale(w, bits) * np.sqrt(size / 12.0)
    return expected if expected > 0 else 1e-6 * np.sqrt(size)


def _squared_difference(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b||² with float32 differences and a pairwise float64 sum: exact to ~1e-7 relative
    (differences of float32/float16 values), without float64 copies of large tensors."""
    delta = np.subtract(a, b, dtype=np.float32)
    np.square(delta, out=delta)
    return float(delta.sum(dtype=np.float64))


class UnitProbes:
    """The parts of a unit's perturbations that every draw shares (the quantized
    tensors and the reference norms), computed once per unit, not per task."""

    def __init__(
        self, unit: Unit, weights: dict[str, np.ndarray], bits: int, rows: dict[str, np.ndarray] | None = None
    ):
        self.unit = unit
        self.rows = {
            name: np.unique(np.asarray(touched, np.int64))
            for name, touched in (rows or {}).items()
            if name in unit.tensor_names
        }
        """Per tensor, the rows perturbed (a Gather table's rows the contexts read, see
        `units.gather_rows`), by both probes: rows never read change no output, so
        perturbing them would only inflate ||δθ||² and dilute γ."""
        self.weights = {name: weights[name] for name in unit.tensor_names}
        self.bits = bits
        self._quantized: dict[str, np.ndarray] = {}
        self._norms: dict[str, float] = {}
        self._residual_sq: dict[str, float] = {}

    def quantized(self, name: str) -> np.ndarray:
        if name not in self._quantized:
            w = self.weights[name]
            if name in self.rows:  # the touched rows on the whole table's grid, the rest as they are
                rows = self.rows[name]
                quantized = np.array(w, copy=True)
                quantized[rows] = quantization_probe(w[rows], self.bits, probe_scale(w, self.bits))
            else:
                quantized = quantization_probe(w, self.bits)
            self._quantized[name] = np.ascontiguousarray(quantized)
        return self._quantized[name]

    def residual_sq(self, name: str) -> float:
        """||Q_b(w) - w||² (over the probed rows of a table: the others are not changed)."""
        if name not in self._residual_sq:
            w, rows = self.weights[name], self.rows.get(name)
            self._residual_sq[name] = (
                _squared_difference(self.quantized(name), w)
                if rows is None
                else _squared_difference(self.quantized(name)[rows], w[rows])
            )
        return self._residual_sq[name]

    def reference_norm(self, name: str) -> float:
        if name not in self._norms:
            w = self.weights[name]
            size = w.size if name not in self.rows else len(self.rows[name]) * (w.size // max(w.shape[0], 1))
            self._norms[name] = _reference_norm(w, np.sqrt(self.residual_sq(name)), self.bits, size)
        return self._norms[name]

    def perturb(self, probe: str, draw: int, seed: int) -> Perturbation:
        """The perturbed copy of every tensor in the unit for one probe draw.

        Gaussian noise is drawn in float32 (half the work of float64, and the
        weights are float32 or narrower anyway), seeded by (seed, unit, draw);
        on a table probed at the rows the contexts read, only on those rows.
        """
        if probe not in PROBES:
            raise InternalError(f"unknown probe '{probe}'")  # tasks are planned with the probes of `PROBES` only
        replaced, delta_sq = {}, 0.0
        rng = np.random.default_rng([seed, zlib.crc32(self.unit.name.encode()), draw]) if probe == "gauss" else None
        for name in self.weights:
            if probe == "quant":
                replaced[name], change_sq = self.quantized(name), self.residual_sq(name)
            else:
                replaced[name], change_sq = self._noisy(name, rng)
            delta_sq += change_sq
        return Perturbation(weights=replaced, delta_sq=delta_sq)

    def _noisy(self, name: str, rng: np.random.Generator) -> tuple[np.ndarray, float]:
        """w plus Gaussian noise of the reference norm (on the probed rows of a table), and ||change||²."""
        w, rows = self.weights[name], self.rows.get(name)
        noise = rng.standard_normal(w.shape if rows is None else (len(rows), *w.shape[1:]), dtype=np.float32)
        flat = noise.reshape(
            -1
        )  # its norm by a float64 einsum: no BLAS threads fighting the sweep's lanes for the cores
        noise *= np.float32(
            self.reference_norm(name) / max(math.sqrt(float(np.einsum("i,i->", flat, flat, dtype=np.float64))), 1e-30)
        )
        if rows is None:
            new = np.add(w, noise, out=noise) if w.dtype == np.float32 else (w + noise).astype(w.dtype)
            return np.ascontiguousarray(new), _squared_difference(new, w)
        new = np.array(w, copy=True)
        new[rows] = (w[rows] + noise).astype(w.dtype, copy=False)
        return new, _squared_difference(new[rows], w[rows])


def perturb(
    unit: Unit,
    weights: dict[str, np.ndarray],
    probe: str,
    draw: int,
    bits: int,
    seed: int,
    rows: dict[str, np.ndarray] | None = None,
) -> Perturbation:
    """The perturbed copy of every tensor in `unit` for one probe draw (see `UnitProbes`)."""
    return UnitProbes(unit, weights, bits, rows).perturb(probe, draw, seed)
