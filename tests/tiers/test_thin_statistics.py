"""Thin calibration statistics (fewer rows than twice the inputs) are shrunk toward μ·I before a solve fits them
(`tiers.hessian.shrinkage`): judged on rows the solve did not see, as a model is judged on held-out windows."""

import numpy as np
import pytest

from tiers import TIERS, Layout, Rounding, quantize
from tiers.gptq import GptqSettings, gptq
from tiers.grid import GridSpec
from tiers.hessian import Hessian, shrinkage
from tiers.quantizer import shrunk_rounding, to_encoded

K, N = 256, 64
LAYOUT = Layout((K, N), (1, 0))  # a MatMul weight [K, N]: one row of Wt per output column
TIER = TIERS["int4-asym"]


def _inputs(rng, rows: int, spectrum: np.ndarray, basis: np.ndarray) -> np.ndarray:
    return (rng.standard_normal((rows, K)) * spectrum) @ basis.T


def _case(rows: int, structured: bool, seed: int = 0):
    """Weights, the statistic of `rows` calibration rows, and 2048 other rows of the same distribution: white
    (identity covariance, nothing for a solve to learn) or with a power-law spectrum in a random basis."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((K, K)))[0]
    spectrum = (1.0 + np.arange(K)) ** -0.75 if structured else np.ones(K)
    weight = rng.standard_normal((K, N)) / np.sqrt(K)
    stats = Hessian(K, cross=True)
    calibration = _inputs(rng, rows, spectrum, basis)
    stats.add(calibration, calibration + 0.05 * rng.standard_normal(calibration.shape))  # X_fp a little off X̂
    return weight, stats, _inputs(rng, 2048, spectrum, basis)


def _error(weight, codes, rows) -> float:
    """Relative output error of the dequantized codes on `rows`."""
    return float(np.linalg.norm(rows @ (codes - weight)) / np.linalg.norm(rows @ weight))


def _codes(weight, stats, method: str) -> np.ndarray:
    return to_encoded(quantize(weight, LAYOUT, TIER, Rounding(method), [stats]), LAYOUT, TIER).dequantize()


def test_enough_rows_are_not_shrunk_and_their_rounding_is_the_same_object():
    weight, stats, _ = _case(2 * K, structured=True)
    rounding = Rounding("qep")
    assert shrinkage(stats) == 0.0 and shrunk_rounding(rounding, stats) is rounding


@pytest.mark.parametrize("method", ["gptq", "qep"])
def test_a_few_white_rows_shrink_all_the_way_to_rounding_to_nearest(method):
    """8 rows of white inputs for 256 inputs: the oracle shrinkage is all but 1, and the solve's codes do as well
    as rounding to nearest on other rows (the unshrunk solve fits the 8 rows and does worse elsewhere)."""
    weight, stats, other = _case(8, structured=False)
    assert shrinkage(stats) > 0.99
    rtn = _error(weight, _codes(weight, stats, "rtn"), other)
    shrunk = _codes(weight, stats, method)
    assert _error(weight, shrunk, other) <= 1.001 * rtn
    raw = gptq(LAYOUT.to_wt(weight), stats.H, GridSpec("int", 4, symmetric=False, search=True), GptqSettings())
    assert _error(weight, raw.values.T, other) > 1.02 * rtn


@pytest.mark.parametrize("rows", [32, 128, 384])
def test_structured_thin_rows_are_shrunk_part_way_and_still_beat_rounding_to_nearest(rows):
    """Inputs with a decaying spectrum: the rows carry information, so the shrinkage stops short of 1, and the
    shrunk solve's codes beat both rounding to nearest and the unshrunk solve on rows it did not see."""
    weight, stats, other = _case(rows, structured=True)
    rho = shrinkage(stats)
    assert 0.0 < rho < 0.99
    raw = gptq(LAYOUT.to_wt(weight), stats.H, GridSpec("int", 4, symmetric=False, search=True), GptqSettings())
    unshrunk = _error(weight, raw.values.T, other)
    shrunk = _error(weight, _codes(weight, stats, "gptq"), other)
    assert shrunk < _error(weight, _codes(weight, stats, "rtn"), other)
    assert shrunk < unshrunk
