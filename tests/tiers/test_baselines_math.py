"""The quick checks of the baselines spec (§7) on the numpy solvers alone."""

import numpy as np
import pytest

from tiers.gptq import (
    GptaqSettings,
    GptqSettings,
    gptaq,
    gptq,
    inverse_cholesky,
    qep_correct,
    rtn,
)
from tiers.grid import GridSpec, find_grid
from tiers.hessian import Hessian, output_error


def asym(bits, search=False):
    """GPTQ's default grid (asymmetric min-max), optionally MSE-searched."""
    return GridSpec("sign", 1) if bits == 1 else GridSpec("int", bits, symmetric=False, search=search)


def sym(bits, search=False):
    return GridSpec("int", bits, symmetric=True, search=search)


def _problem(seed=0, n=512, k=64, rows=24, drift=0.0):
    """Correlated inputs X̂, full-precision inputs X_fp = X̂ + drift·noise, weights Wt [rows, k]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k)) @ (np.eye(k) + 0.4 * rng.standard_normal((k, k)) / np.sqrt(k))
    x[:, 3] = 0.0  # a dead input feature
    x_fp = x + drift * rng.standard_normal((n, k))
    x_fp[:, 3] = 0.0
    wt = rng.standard_normal((rows, k)) / np.sqrt(k)
    stats = Hessian(k, cross=True)
    for chunk in np.array_split(np.arange(n), 5):  # several batches: the running average must not care
        stats.add(x[chunk], x_fp[chunk])
    return x, x_fp, wt, stats


def test_hessian_is_running_average_of_two_over_n_xtx():
    x, x_fp, _, stats = _problem(drift=0.3)
    n = x.shape[0]
    np.testing.assert_allclose(stats.H, 2 / n * x.T @ x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stats.G, 2 / n * (x_fp - x).T @ x, rtol=1e-12, atol=1e-12)
    halves = [Hessian(x.shape[1]), Hessian(x.shape[1])]
    halves[0].add(x[:100])
    halves[1].add(x[100:])
    np.testing.assert_allclose(Hessian.merge(halves).H, stats.H, rtol=1e-12, atol=1e-12)


def test_rows_added_in_strided_float32_parts_fold_to_the_bits_of_one_float64_batch():
    """A grouped conv's rows arrive as strided float32 column slices, some without a full-precision counterpart
    (`x_fp is x`): folded together they give H and G bit for bit as one add of the float64 rows and differences."""
    rng = np.random.default_rng(4)
    wide = rng.standard_normal((90, 3 * 7)).astype(np.float32)
    wide_fp = wide + 0.1 * rng.standard_normal(wide.shape).astype(np.float32)
    parts = [(slice(0, 30), True), (slice(30, 55), False), (slice(55, 90), True)]
    folded = Hessian(7, cross=True)
    for rows, has_fp in parts:
        x = wide[rows, 7:14]  # a strided view: the middle group's columns
        folded.add(x, wide_fp[rows, 7:14] if has_fp else x)
    x = np.asarray(wide[:, 7:14], np.float64)
    delta = np.asarray(wide_fp[:, 7:14], np.float64) - x
    delta[30:55] = 0.0
    np.testing.assert_array_equal(folded.H, 2 / 90 * (x.T @ x))
    np.testing.assert_array_equal(folded.G, 2 / 90 * (delta.T @ x))
    assert folded.count == 90


@pytest.mark.parametrize("spec", [asym(3), sym(3), asym(3, search=True), GridSpec("sign", 1)])
def test_gptq_same_codes_for_any_block_size(spec):
    _, _, wt, stats = _problem()
    results = [gptq(wt, stats.H, spec, GptqSettings(block_size=b)) for b in (1, 32, 128)]
    for other in results[1:]:
        np.testing.assert_array_equal(other.codes, results[0].codes)
        np.testing.assert_allclose(other.values, results[0].values, rtol=0, atol=1e-12)


def test_groupwise_gptq_independent_of_block_size_even_when_groups_straddle_blocks():
    _, _, wt, stats = _problem()
    codes = [gptq(wt, stats.H, asym(3), GptqSettings(group_size=24, block_size=b)).codes for b in (1, 32, 128)]
    np.testing.assert_array_equal(codes[0], codes[1])
    np.testing.assert_array_equal(codes[0], codes[2])


def test_gptaq_with_alpha_zero_is_gptq():
    _, _, wt, stats = _problem(drift=0.5)
    for kwargs in ({}, {"group_size": 16, "act_order": True}):
        a = gptaq(wt, stats.H, stats.G, asym(3), GptaqSettings(alpha=0.0, **kwargs))
        b = gptq(wt, stats.H, asym(3), GptqSettings(**kwargs))
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.values, b.values)


def _official_gptaq(W, H, dXXT, bits, percdamp=0.01, blocksize=128, alpha=0.25):
    """A literal numpy transcription of GPTAQ's `fasterquant` (per channel, asymmetric)."""
    W, H, dXXT = W.copy(), H.copy(), dXXT.copy()
    grid = find_grid(W, asym(bits))
    scale, zero, maxq = grid.scale[:, None], grid.zero[:, None], 2**bits - 1
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    dXXT[:, dead] = 0
    H[np.diag_indices_from(H)] += percdamp * np.mean(np.diag(H))
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T
    P = alpha * np.triu(dXXT @ Hinv.T, 1) @ Hinv
    Q = np.zeros_like(W)
    for i1 in range(0, W.shape[1], blocksize):
        i2 = min(i1 + blocksize, W.shape[1])
        W1, Err1 = W[:, i1:i2].copy(), np.zeros((W.shape[0], i2 - i1))
        for i in range(i2 - i1):
            w = W1[:, i].copy()
            q = (scale * (np.clip(np.rint(w[:, None] / scale) + zero, 0, maxq) - zero))[:, 0]
            Q[:, i1 + i] = q
            err = (w - q) / Hinv[i1 + i, i1 + i]
            W1[:, i:] -= np.outer(err, Hinv[i1 + i, i1 + i : i2]) - np.outer(w, P[i1 + i, i1 + i : i2])
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:] - W1 @ P[i1:i2, i2:]
    return Q


def test_gptaq_matches_a_transcription_of_the_official_loop():
    _, _, wt, stats = _problem(drift=0.5, k=160)  # two blocks, so the lazy update with P is exercised
    ours = gptaq(wt, stats.H, stats.G, asym(3))
    np.testing.assert_allclose(ours.values, _official_gptaq(wt, stats.H, stats.G, 3), rtol=0, atol=1e-9)


def test_gptaq_lowers_the_asymmetric_objective():
    x, x_fp, wt, stats = _problem(drift=0.3, n=2048)
    target = x_fp @ wt.T
    plain = np.linalg.norm(target - x @ gptq(wt, stats.H, asym(4)).values.T)
    calibrated = np.linalg.norm(target - x @ gptaq(wt, stats.H, stats.G, asym(4)).values.T)
    assert calibrated < plain


def test_qep_with_alpha_zero_is_the_base_method():
    _, _, wt, stats = _problem(drift=0.5)
    corrected = qep_correct(wt, stats.H, stats.G, alpha=0.0)
    np.testing.assert_array_equal(gptq(corrected, stats.H, asym(3)).codes, gptq(wt, stats.H, asym(3)).codes)
    np.testing.assert_array_equal(rtn(corrected, asym(3)).codes, rtn(wt, asym(3)).codes)


def test_qep_full_strength_without_damping_is_the_least_squares_fit(monkeypatch):
    monkeypatch.setenv(
        "TQS_SOLVER_DTYPE", "float64"
    )  # undamped, the system is as ill-posed as X's columns: float64 to check the algebra
    x, x_fp, wt, stats = _problem(drift=0.5, n=1024)
    corrected = qep_correct(wt, stats.H, stats.G, alpha=1.0, percdampqep=1e-12)
    live = np.any(x != 0, axis=0)
    fit, *_ = np.linalg.lstsq(x[:, live], x_fp @ wt.T, rcond=None)
    np.testing.assert_allclose(corrected[:, live], fit.T, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "spec,kwargs",
    [
        (asym(3), {}),
        (asym(4), {"group_size": 16}),
        (sym(2), {}),
        (asym(3), {"act_order": True, "group_size": 16}),
        (asym(1), {}),
        (asym(2, search=True), {}),
        (sym(4, search=True), {"group_size": 16}),
        (asym(8), {}),
    ],
)
def test_gptq_output_error_not_above_rtn(spec, kwargs):
    x, _, wt, stats = _problem(seed=1)
    ours = gptq(wt, stats.H, spec, GptqSettings(**kwargs))
    base = rtn(wt, spec, kwargs.get("group_size", -1))
    assert output_error(wt, ours.values, stats) <= output_error(wt, base.values, stats)
    np.testing.assert_allclose(
        output_error(wt, ours.values, stats), np.linalg.norm(x @ (wt - ours.values).T), rtol=1e-9
    )


def _expand(per_group, group_size, columns):
    return np.repeat(per_group, group_size if group_size > 0 else columns, axis=1)[:, :columns]


def test_values_are_exactly_the_float32_dequantization_of_the_codes():
    _, _, wt, stats = _problem()
    k = wt.shape[1]
    for result in (
        gptq(wt, stats.H, asym(4), GptqSettings(group_size=16, act_order=True)),
        rtn(wt, sym(3), 16),
        gptq(wt, stats.H, asym(1)),
        rtn(wt, asym(8, search=True)),
        rtn(wt, GridSpec("fp8", 8)),
    ):
        scale = _expand(result.scale, result.group_size, k).astype(np.float32)
        zero = _expand(result.zero, result.group_size, k).astype(np.float32)
        float32 = (result.codes.astype(np.float32) - zero) * scale
        np.testing.assert_array_equal(float32, result.values.astype(np.float32))


def test_grids_follow_the_spec_formulas():
    w = np.array([[-1.0, 0.5, 2.0], [0.0, 0.0, 0.0], [0.25, 0.5, 1.0]])
    grid = find_grid(w, asym(2))
    np.testing.assert_allclose(grid.scale, [1.0, 2 / 3, 1 / 3], rtol=1e-7)  # lo forced <= 0; empty row -> [-1, 1]
    np.testing.assert_array_equal(grid.zero[[0, 2]], [1, 0])
    np.testing.assert_array_equal(rtn(w, asym(2)).values[1], 0.0)
    symmetric = find_grid(w, sym(2))
    np.testing.assert_allclose(
        symmetric.scale, [4 / 3, 2 / 3, 2 / 3], rtol=1e-7
    )  # 2·max|w| / 3: levels {-2, -1, 0, 1}·s
    codes = rtn(w, sym(2)).codes
    assert codes.min() >= -2 and codes.max() <= 1
    sign = rtn(w, asym(1))
    np.testing.assert_allclose(np.abs(sign.values), np.abs(w).mean(axis=1, keepdims=True) * np.ones_like(w), rtol=1e-7)
    assert set(np.unique(sign.codes)) <= {-1, 1}


def test_act_order_with_groups_keeps_groups_contiguous():
    _, _, wt, stats = _problem()
    result = gptq(wt, stats.H, asym(3), GptqSettings(group_size=16, act_order=True))
    assert result.scale.shape == (wt.shape[0], wt.shape[1] // 16)
    for g in range(result.scale.shape[1]):
        cols = slice(16 * g, 16 * (g + 1))
        np.testing.assert_array_equal(
            result.values[:, cols], result.scale[:, g : g + 1] * (result.codes[:, cols] - result.zero[:, g : g + 1])
        )


def test_cholesky_guard_raises_damping_instead_of_failing():
    x = np.random.default_rng(0).standard_normal((3, 10))  # rank 3 of 10
    h = 2 / 3 * x.T @ x
    upper = inverse_cholesky(h, percdamp=0.0)
    assert np.all(np.isfinite(upper)) and np.allclose(upper, np.triu(upper))
    assert np.all(np.isfinite(gptq(np.ones((2, 10)), h, asym(4), GptqSettings(percdamp=0.0)).values))


@pytest.mark.parametrize("method", ["gptq", "gptaq", "qep"])
@pytest.mark.parametrize("bits", [4, 2])
def test_each_channel_keeps_the_grid_its_solve_does_best_on(method, bits):
    """On a clip-searched tier a calibrated solve runs on the searched and on the min-max grid, and each
    output channel keeps the result whose output is nearer what the next layer should see: ‖X̂q − X_fp·w‖²
    for GPTAQ and QEP (not their α's half-way target X̂ + α(X_fp − X̂), which let the choice keep clipped
    grids further from full precision: lorenz96's uniform QEP W2 drifted 1.09x more than on min-max grids
    alone), ‖X̂(q − w)‖² for GPTQ; computed here from X̂ and X_fp themselves. Few rows (128 for 64 inputs, the
    fewest that are not shrunk: `tiers.hessian.shrinkage`) are where the searched grid alone lost on some
    channels."""
    from tiers import TIERS, Layout, Rounding, quantize

    x, x_fp, wt, stats = _problem(seed=3, n=128, k=64, rows=48, drift=0.2)  # not thin: 2 rows per input
    spec, layout, tier = asym(bits, search=True), Layout((48, 64), (0, 1)), TIERS[f"int{bits}-asym"]
    target = x if method == "gptq" else x_fp

    def objective(q):
        return np.sum((x @ q.T - target @ wt.T) ** 2, axis=0)

    searched = {
        "gptq": lambda: gptq(wt, stats.H, spec),
        "gptaq": lambda: gptaq(wt, stats.H, stats.G, spec),
        "qep": lambda: gptq(qep_correct(wt, stats.H, stats.G), stats.H, spec),
    }[method]().values
    plain = quantize(wt, layout, tier, Rounding(method), [stats], search=False).values
    chosen = quantize(wt, layout, tier, Rounding(method), [stats]).values
    assert (objective(plain) < objective(searched)).any() and (objective(searched) < objective(plain)).any()
    best = np.minimum(objective(plain), objective(searched))
    np.testing.assert_allclose(objective(chosen), best, rtol=1e-9)
    assert all(np.array_equal(c, p) or np.array_equal(c, s) for c, p, s in zip(chosen, plain, searched))
    on_min_max = quantize(wt, layout, tier, Rounding(method, grids="min-max"), [stats])
    np.testing.assert_array_equal(on_min_max.values, plain)  # the rounding's grids say it: the min-max grid alone
    assert not np.array_equal(chosen, plain)


@pytest.mark.parametrize("method", ["gptq", "gptaq", "qep"])
@pytest.mark.parametrize("bits", [4, 2])
def test_thin_statistics_are_solved_and_judged_on_one_shrunk_hessian(method, bits):
    """40 rows for 64 inputs are thin: H is shrunk by ρ toward μ·I (`tiers.hessian.shrinkage`), which the solves
    see as their dampings raised to (p + ρ)/(1 − ρ) (`shrunk_damping`) and the grid choice as a ridge λ·‖q − w‖²
    added to its objective. Every channel keeps the grid whose result is lower on that shrunk objective, computed
    here from X̂ and X_fp themselves, by the closed form (GPTQ, QEP) and by the products (GPTAQ) alike."""
    from tiers import TIERS, Layout, Rounding, quantize
    from tiers.hessian import ridge, shrinkage, shrunk_damping

    x, x_fp, wt, stats = _problem(seed=3, n=40, k=64, rows=48, drift=0.2)
    spec, layout, tier = asym(bits, search=True), Layout((48, 64), (0, 1)), TIERS[f"int{bits}-asym"]
    target = x if method == "gptq" else x_fp
    rho, lam = shrinkage(stats), ridge(stats)
    assert 0 < rho < 1 and lam == pytest.approx(rho / (1 - rho) * np.mean(np.diag(stats.H)))

    def objective(q):
        return np.sum((x @ q.T - target @ wt.T) ** 2, axis=0) + x.shape[0] / 2 * lam * np.sum((q - wt) ** 2, axis=1)

    damped = GptqSettings(percdamp=shrunk_damping(0.01, rho))
    searched = {
        "gptq": lambda: gptq(wt, stats.H, spec, damped),
        "gptaq": lambda: gptaq(wt, stats.H, stats.G, spec, GptaqSettings(percdamp=damped.percdamp)),
        "qep": lambda: gptq(
            qep_correct(wt, stats.H, stats.G, percdampqep=shrunk_damping(1.0, rho)), stats.H, spec, damped
        ),
    }[method]().values
    plain = quantize(wt, layout, tier, Rounding(method), [stats], search=False).values
    chosen = quantize(wt, layout, tier, Rounding(method), [stats]).values
    np.testing.assert_allclose(objective(chosen), np.minimum(objective(plain), objective(searched)), rtol=1e-9)
    assert all(np.array_equal(c, p) or np.array_equal(c, s) for c, p, s in zip(chosen, plain, searched))


def test_an_unknown_grid_choice_is_refused():
    from tiers import Rounding

    with pytest.raises(ValueError, match="unknown grids 'clipped'"):
        Rounding("qep", grids="clipped")
    assert Rounding("qep").label == "qep" and Rounding("gptq", grids="min-max").label == "gptq/min-max"


def test_error_feedback_past_the_fp8_range_saturates_instead_of_writing_nan():
    """GPTQ's feedback can push a weight beyond its row's max|w| = 448·s; E4M3FN has no infinity, so an
    unclipped cast made NaN codes (seed 2 here gave 76 of them) that a fp8 tier would have shipped."""
    rng = np.random.default_rng(2)
    k, n = 160, 48
    x = rng.standard_normal((600, k)) @ rng.standard_normal((k, k))
    stats = Hessian(k, cross=True)
    stats.add(x + 0.1 * rng.standard_normal(x.shape), x)
    w = rng.standard_normal((n, k))
    quantized = gptq(w, stats.H, GridSpec("fp8", 8))
    assert np.isfinite(quantized.codes).all()
    assert np.abs(quantized.codes).max() <= 448
    assert np.abs(quantized.values - w).max() < 0.5
