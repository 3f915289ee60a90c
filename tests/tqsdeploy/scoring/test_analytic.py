"""TQS on a linear map x_{t+1} = A x_t, where the divergence is known exactly."""

import math

import models
import numpy as np
import pytest

from tqsdeploy import ScoreSettings, UnitSelection, score
from tqsdeploy.sweep.probes import quantization_probe


def _exact_gamma(a: np.ndarray, x0: np.ndarray, bits: int, horizons, eps=1e-12) -> dict[int, float]:
    """gamma(T) computed in float64 from the closed-form trajectories."""
    w = a.T.astype(np.float32).astype(np.float64)
    dw = quantization_probe(a.T.astype(np.float32), bits).astype(np.float64) - w
    nominal, perturbed = x0.astype(np.float64), x0.astype(np.float64)
    cumulative = np.zeros(x0.shape[0])
    out = {}
    for t in range(1, max(horizons) + 1):
        nominal, perturbed = nominal @ w, perturbed @ (w + dw)
        cumulative += np.sum((perturbed - nominal) ** 2, axis=(1, 2))
        if t in horizons:
            out[t] = math.log(cumulative.mean() / (np.sum(dw**2) + eps)) / t
    return out


@pytest.fixture(scope="module")
def linear_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("linear")
    rng = np.random.default_rng(7)
    n = 8
    a = rng.standard_normal((n, n))
    a *= 1.1 / np.max(np.abs(np.linalg.eigvals(a)))  # spectral radius 1.1
    x0 = rng.standard_normal((6, 1, n)).astype(np.float32)
    np.savez(folder / "ctx.npz", x=x0)
    return models.linear_map(folder / "lin.onnx", a), folder / "ctx.npz", a, x0, folder


def test_gamma_matches_closed_form(linear_case):
    model, contexts, a, x0, folder = linear_case
    horizons = (1, 2, 4, 8, 16)
    table = score(
        model,
        contexts,
        steps=16,
        out=folder / "run",
        selection=UnitSelection(min_params=1),
        settings=ScoreSettings(gauss_draws=0, horizons=horizons),
    )
    row = table.frame.row(0, named=True)
    exact = _exact_gamma(a, x0, 6, horizons)
    for t in horizons:
        assert row[f"gamma_T{t}"] == pytest.approx(exact[t], abs=2e-4), t
    assert row["gamma_quant"] == pytest.approx(exact[16], abs=2e-4)
    assert not row["dead"]


def test_gamma_converges_to_twice_log_spectral_radius(tmp_path):
    """For a normal A the divergence grows like t*rho^t, so gamma(T) -> 2 ln rho(A) at rate ln(T)/T."""
    rng = np.random.default_rng(11)
    n = 8
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = q @ np.diag(np.linspace(0.5, 1.1, n)) @ q.T
    x0 = rng.standard_normal((6, 1, n)).astype(np.float32)
    np.savez(tmp_path / "ctx.npz", x=x0)
    model = models.linear_map(tmp_path / "normal.onnx", a)
    horizons = (16, 64, 200)
    table = score(
        model,
        tmp_path / "ctx.npz",
        steps=200,
        out=tmp_path / "run",
        selection=UnitSelection(min_params=1),
        settings=ScoreSettings(gauss_draws=0, horizons=horizons),
    )
    row = table.frame.row(0, named=True)
    limit = 2 * math.log(1.1)
    gaps = [row[f"gamma_T{t}"] - limit for t in horizons]
    assert gaps[0] > gaps[1] > gaps[2] > 0
    assert gaps[2] < 1.2 * 2 * math.log(200) / 200  # only the 2 ln(T)/T correction of t*rho^t growth remains
    exact = _exact_gamma(a, x0, 6, horizons)
    for t in horizons:
        assert row[f"gamma_T{t}"] == pytest.approx(exact[t], abs=1e-3)


def test_gauss_probe_matches_quant_norm_and_scale(linear_case):
    """The Gaussian probe has the quant residual's norm, so on a linear map its gamma is close."""
    model, contexts, _, _, folder = linear_case
    table = score(
        model,
        contexts,
        steps=16,
        out=folder / "gauss",
        selection=UnitSelection(min_params=1),
        settings=ScoreSettings(gauss_draws=8),
    )
    row = table.frame.row(0, named=True)
    assert row["gamma_gauss"] == pytest.approx(row["gamma_quant"], abs=0.1)
    assert row["gamma_gauss_std"] > 0
