"""The solver's shortcuts give the codes of the long way round: the per-channel grid choice from one product per
statistic, the clip search's screen stopping early, a large solve split into row parts; and the uniform GPTAQ
and RTN passes run only while they can still win; strided matrices copied tile by tile."""

import math
from dataclasses import replace

import numpy as np
import pytest

import tiers.gptq as solvers
import tiers.hessian as statistics
from graph_ops.layout import Layout
from tiers import TIERS, factors, grid, quantizer
from tiers.gptq import Quantized
from tiers.grid import GridSpec
from tiers.hessian import Hessian
from tqsdeploy.encoding.choices import can_still_win

GRIDS = [
    GridSpec("int", 4, False, True),
    GridSpec("int", 2, False, True),
    GridSpec("int", 3, True, True),
    GridSpec("int", 8, False, True),
]


def _problem(seed: int, n: int, k: int, rows: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k)) * rng.uniform(0.1, 3, k)
    stats = Hessian(k, cross=True)
    stats.add(x, x + 0.2 * rng.standard_normal(x.shape))
    wt = rng.standard_normal((rows, k)) * rng.uniform(0.5, 2, (rows, 1))
    wt[:, :3] *= 6  # outlying inputs: the clip search shrinks those rows
    return wt, stats


def _two_objectives(rounding, original, wt, stats, spec):
    """`_better_rows` as it was: both grids solved, each row's objective worked out on each, the lower kept. On thin
    statistics (`rounding` shrunk by `quantizer.shrunk_rounding`) the objective is the shrunk H's: its ridge λ·‖q − w‖²
    added."""
    searched = quantizer._solve(rounding, np.array(wt), stats, spec, -1)
    plain = quantizer._solve(rounding, np.array(wt), stats, replace(spec, search=False), -1)
    aim = 1.0 if rounding.needs_cross and rounding.strength else 0.0
    ridge = statistics.ridge(stats)

    def objective(q):
        return statistics.row_objective(original, q, stats, aim) + ridge * np.sum((q - original) ** 2, axis=1)

    better = objective(plain.values) < objective(searched.values)
    fields = (np.where(better[:, None], getattr(plain, f), getattr(searched, f)) for f in ("codes", "scale", "zero"))
    return Quantized(*fields, spec, -1), better


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("method", ["gptq", "gptaq", "qep"])
def test_the_grid_choice_from_the_objectives_difference_keeps_every_code(seed, method):
    n, k, rows = [(40, 64, 48), (300, 96, 130), (1000, 200, 600)][seed % 3]  # thin statistics to well-posed ones
    wt, stats = _problem(seed, n, k, rows)
    rounding = quantizer.shrunk_rounding(quantizer.Rounding(method), stats)  # as `quantize` solves it
    solved = (
        solvers.qep_correct(np.array(wt), stats.H, stats.G, alpha=rounding.strength, percdampqep=rounding.percdampqep)
        if method == "qep"
        else np.array(wt)
    )
    for spec in GRIDS:
        slow, better = _two_objectives(rounding, wt, solved, stats, spec)
        fast = quantizer._better_rows(rounding, wt, np.array(solved), stats, spec, -1)
        np.testing.assert_array_equal(fast.codes, slow.codes)
        np.testing.assert_array_equal(fast.scale, slow.scale)
        np.testing.assert_array_equal(fast.zero, slow.zero)
        if (
            seed % 3 and spec.bits < 8
        ):  # where the statistics are not thin both grids win rows: the choice is exercised either way
            assert 0 < better.sum() < rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("method", ["gptq", "qep"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_grid_choice_from_the_loops_losses_keeps_every_code(seed, method, dtype, monkeypatch):
    """GPTQ and QEP choose each row's grid from the column loop's own losses (and QEP's W·G with its damping): no
    product with H or G, and the codes of both objectives worked out in full (in float32 solves, on 99% of the rows
    at least: both sides round differently there). A dead input leaves the choice to the products."""
    monkeypatch.setenv("TQS_SOLVER_DTYPE", dtype)
    n, k, rows = [(40, 64, 48), (300, 96, 130), (1000, 200, 600)][seed % 3]
    wt, stats = _problem(seed, n, k, rows)
    if seed == 5:
        stats.H[5, :] = stats.H[:, 5] = 0
    rounding = quantizer.shrunk_rounding(quantizer.Rounding(method), stats)  # as `quantize` solves it
    product: dict = {}
    solved = (
        solvers.qep_correct(
            np.array(wt),
            stats.H,
            stats.G,
            alpha=rounding.strength,
            percdampqep=rounding.percdampqep,
            cache=stats,
            product=product,
        )
        if method == "qep"
        else np.array(wt)
    )
    products = statistics.second_lower
    monkeypatch.setattr(
        statistics, "second_lower", lambda *a: products(*a) if seed == 5 else pytest.fail("the products decided")
    )
    for spec in GRIDS:
        slow, _ = _two_objectives(rounding, wt, solved, stats, spec)
        fast = quantizer._better_rows(rounding, wt, np.array(solved), stats, spec, -1, product)
        same = np.all(fast.codes == slow.codes, axis=1) & (fast.scale == slow.scale)[:, 0]
        if dtype == "float64":
            assert same.all(), spec
        else:
            assert same.mean() >= 0.99, (spec, same.mean())


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_the_search_left_on_min_max_are_solved_once_and_keep_their_codes(bits, monkeypatch):
    """One column loop: the weight's rows, then a copy of only those whose clip search left the min-max grid; rows
    with a dead input (its column zeroed before the grid is fitted) count as the solver fits them. Same codes as
    both grids solved whole, each in its own loop."""
    wt, stats = _problem(3, 300, 96, 130)
    stats.H[5, :] = stats.H[:, 5] = 0  # a dead input
    wt[7, 5] = 40.0  # the row's largest value sits on it: zeroed, its min-max grid is another
    spec = GridSpec("int", bits, False, True)
    rounding = quantizer.Rounding("gptaq")
    slow, _ = _two_objectives(rounding, wt, np.array(wt), stats, spec)
    solved_rows = []
    solve = quantizer._solve
    monkeypatch.setattr(quantizer, "_solve", lambda r, w, *a: solved_rows.append(w.shape[0]) or solve(r, w, *a))
    fast = quantizer._better_rows(rounding, wt, np.array(wt), stats, spec, -1)
    np.testing.assert_array_equal(fast.codes, slow.codes)
    np.testing.assert_array_equal(fast.scale, slow.scale)
    assert len(solved_rows) == 1 and (solved_rows[0] == 130 if bits == 8 else 130 < solved_rows[0] < 260)


def test_rows_on_the_same_values_keep_the_first():
    wt, stats = _problem(0, 300, 32, 20)
    one = solvers.rtn(wt, GridSpec("int", 4, False, False))
    assert not statistics.second_lower(wt, one, one, stats, 1.0).any()


def _exhaustive(rows, trials, spec, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(grid, "FLOOR_FROM_BITS", 99)  # no floors: every shrink of every row priced
        return grid._candidates(rows, trials, spec)


@pytest.mark.parametrize("seed", range(8))
def test_the_screen_stopping_early_leaves_the_same_candidates_and_grids(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    n, k = [(300, 64), (200, 768), (64, 3072), (100, 200)][seed % 4]
    rows = rng.standard_normal((n, k)) * rng.uniform(0.01, 10, (n, 1))
    if seed % 2:
        rows += rng.standard_t(3, (n, k)) * 0.3  # heavy tails
    rows[::7] *= 1e-11  # rows of extreme magnitude take the exact search
    for spec in GRIDS + [GridSpec("int", 4, True, True)]:
        lo, hi = np.minimum(rows.min(1), 0), np.maximum(rows.max(1), 0)
        trials = grid._trials(lo, hi, spec)
        np.testing.assert_array_equal(
            grid._candidates(rows, trials, spec), _exhaustive(rows, trials, spec, monkeypatch)
        )
        fast = [np.empty(n), np.empty(n)]
        grid._search(rows, lo, hi, spec, *fast)
        with monkeypatch.context() as patch:
            patch.setattr(grid, "FLOOR_FROM_BITS", 99)
            slow = [np.empty(n), np.empty(n)]
            grid._search(rows, lo, hi, spec, *slow)
        np.testing.assert_array_equal(fast[0], slow[0])
        np.testing.assert_array_equal(fast[1], slow[1])


def test_the_screen_stops_early_at_four_bits(monkeypatch):
    """Gaussian rows of 1024 at 4 bits: most rows leave the screen well before the last of its 80 shrinks."""
    rows = np.random.default_rng(0).standard_normal((64, 1024))
    spec = GridSpec("int", 4, False, True)
    trials = grid._trials(np.minimum(rows.min(1), 0), np.maximum(rows.max(1), 0), spec)
    priced = []
    residual = grid._residual
    monkeypatch.setattr(
        grid, "_residual", lambda work, *rest, **named: priced.append(len(work)) or residual(work, *rest, **named)
    )
    grid._candidates(rows, trials, spec)
    assert sum(priced) < 0.75 * 80 * len(rows)


def test_uniform_gptaq_and_rtn_are_run_only_while_they_can_still_win():
    asked = []

    def rival(method):
        asked.append(method)
        return drift[method]

    drift = {"qep": 10.0}
    assert can_still_win("qep", rival, 1.0) and not asked  # QEP has no rival: nothing measured
    for method in ("gptaq", "rtn"):
        asked.clear()
        assert not can_still_win(method, rival, 6.6) and asked == [
            "qep"
        ]  # QEP's uniform model at more than 1.5x the best
        assert can_still_win(method, rival, 6.7)
    asked.clear()
    assert (
        can_still_win("rtn", rival, 1.0, compared=("rtn",)) and not asked
    )  # an RTN export runs no QEP pass to rule RTN out
    drift["qep"] = math.nan  # a failed rival rules nothing out
    assert can_still_win("gptaq", rival, 1.0) and can_still_win("rtn", rival, 1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_screens_residual_is_the_grids_own_rounding(dtype):
    """|values(codes(w)) − w| as `codes_on` and `values` work it out, the zero point folded into the clip's bounds."""
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((40, 300)) * rng.uniform(0.01, 5, (40, 1))).astype(dtype)
    rows[3] = 0  # a row of zeros: scale 0, divisor 1
    for spec in GRIDS:
        lo, hi = np.minimum(rows.min(1), 0).astype(np.float64), np.maximum(rows.max(1), 0).astype(np.float64)
        for scale, zero in grid._trials(lo, hi, spec)[::7]:
            scale, zero = scale.astype(dtype).astype(np.float64), zero
            column_scale, column_zero = scale[:, None].astype(dtype), zero[:, None].astype(dtype)
            low, high = spec.code_range
            q = np.clip(np.rint(rows / np.where(column_scale > 0, column_scale, 1)) + column_zero, low, high)
            expected = np.abs(column_scale * (q - column_zero) - rows)
            np.testing.assert_array_equal(grid._residual(rows, scale, zero, spec, np.empty_like(rows)), expected)


def test_a_small_lapack_call_leaves_the_solvers_their_cores():
    """A LAPACK call of small order sets scipy's own OpenBLAS to one thread (`tiers.factors.lapack_for`); the cores the
    solvers may use still follow numpy's BLAS. Counted with scipy's copy, every calibration wave after the first
    small call solved its weights one at a time (on a quiet 2-core machine the same speed: BLAS threads filled the
    cores)."""
    from threadpoolctl import threadpool_info

    from tiers import solver_backend

    solvers.inverse_cholesky(np.eye(8) * 2.0, 0.01)
    numpy_blas = [
        lib["num_threads"]
        for lib in threadpool_info()
        if lib.get("user_api") == "blas" and "numpy" in lib.get("filepath", "")
    ]
    if not numpy_blas or numpy_blas[0] < 2:
        pytest.skip("numpy's BLAS runs one thread here: nothing to share")
    assert solver_backend.solver_threads() == numpy_blas[0]


@pytest.mark.parametrize("group_size, static", [(-1, False), (16, False), (16, True)])
def test_a_solve_split_into_row_parts_gives_the_codes_of_the_whole_solve(monkeypatch, group_size, static):
    """A weight solved alone in its wave runs its rows in parts on the idle cores (`_row_parts`): GPTQ and GPTAQ,
    per channel and per group (grids fitted in the loop, or static), give the whole solve's codes and grids."""
    wt, stats = _problem(7, 256, 64, 90)
    spec = GridSpec("int", 4, False, True)
    for method in ("gptq", "gptaq"):
        run = (
            (lambda w: solvers.gptq(w, stats.H, spec, solvers.GptqSettings(group_size, static_groups=static)))
            if method == "gptq"
            else (
                lambda w: solvers.gptaq(
                    w, stats.H, stats.G, spec, solvers.GptaqSettings(group_size, static_groups=static)
                )
            )
        )
        monkeypatch.setattr(solvers, "ROW_PART", 1 << 40)
        whole = run(np.array(wt))
        monkeypatch.setattr(solvers, "ROW_PART", 1)
        monkeypatch.setattr(solvers, "ROW_PART_ROWS", 1)
        monkeypatch.setattr(solvers.backend, "THREAD_CAP", 3)  # three cores to itself, whatever this machine has
        assert [(p.start, p.stop) for p in solvers._row_parts(90, 64)] == [(0, 30), (30, 60), (60, 90)]
        parts = run(np.array(wt))
        monkeypatch.setattr(solvers.backend, "THREAD_CAP", None)
        np.testing.assert_array_equal(parts.codes, whole.codes)
        np.testing.assert_array_equal(parts.scale, whole.scale)
        np.testing.assert_array_equal(parts.zero, whole.zero)


def test_only_a_large_weight_alone_in_its_wave_is_split():
    assert len(solvers._row_parts(1536, 384)) == 1  # BERT-size: two parts ran no faster than one
    solvers.backend.THREAD_CAP = 1  # its wave's weights already share the cores
    try:
        assert len(solvers._row_parts(4096, 4096)) == 1
    finally:
        solvers.backend.THREAD_CAP = None


@pytest.mark.parametrize("tile", [3, 256])
def test_a_tiled_copy_has_the_bytes_of_numpys_copy(tile, monkeypatch):
    """`c_order` (the Wt copy of a stored weight, GPTQ's U from LAPACK's factor, codes into their container): the
    same dtype, values and C layout as numpy's own copy, on transposed, reversed and sliced views whose sides are
    not multiples of the tile."""
    import ml_dtypes

    from tiers import solver_backend

    monkeypatch.setattr(solver_backend, "COPY_TILE", tile)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((517, 263)).astype(np.float32)
    factor = np.asfortranarray(np.tril(rng.standard_normal((300, 300))))
    codes = rng.integers(0, 16, (263, 517)).astype(np.float32)
    for view, dtype in (
        (weight.T, np.float64),
        (weight[::-1, 5:], None),
        (factor[::-1, ::-1], None),
        (codes.T, ml_dtypes.uint4),
        (codes.T - 8, ml_dtypes.int4),
        (codes.T, np.uint8),
        (weight.T[:, 0], np.float64),
    ):
        mine, numpys = solver_backend.c_order(view, dtype), np.array(view, dtype or view.dtype, order="C")
        assert mine.flags.c_contiguous and mine.dtype == numpys.dtype and mine.shape == numpys.shape
        assert mine.tobytes() == numpys.tobytes()


def test_small_statistics_products_run_on_one_thread_and_leave_the_threads_as_they_were():
    """`gram` below `ONE_THREAD_BELOW` columns: the product within rounding of numpy's, numpy's BLAS on one thread
    while it runs and on its own count after; not in a solve's thread, whose count `shared_cores` set."""
    import threading

    from threadpoolctl import threadpool_info

    from tiers import solver_backend

    def threads():
        return [lib["num_threads"] for lib in threadpool_info() if lib.get("user_api") == "blas"]

    before = threads()
    if max(before, default=1) < 2:
        pytest.skip("numpy's BLAS runs one thread here: nothing to limit")
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3000, 48)), rng.standard_normal((3000, 48))
    np.testing.assert_allclose(solver_backend.gram(a, b), a.T @ b, rtol=1e-12, atol=1e-10)
    with solver_backend.one_thread():
        assert min(threads()) == max(threads()) == 1
    assert threads() == before
    seen = []

    def in_a_solve_thread():
        with solver_backend.one_thread():
            seen.append(threads())

    worker = threading.Thread(target=in_a_solve_thread)
    worker.start()
    worker.join()
    assert seen == [before]


@pytest.mark.parametrize("method", ["qep", "gptq", "gptaq"])
def test_narrow_working_copies_give_the_codes_of_float64_ones(monkeypatch, method):
    """A float32 solve takes its stacked rows in float32 (not float64 cast again in the loop) and keeps the weight's
    values beside it in float32 (exact for a float32 weight), its row parts writing one codes array: the codes and
    grids of float64 copies, whole or in parts."""
    rng = np.random.default_rng(3)
    k, rows = 64, 90
    x = rng.standard_normal((400, k)) * rng.uniform(0.1, 3, k)
    stats = Hessian(k, cross=True)
    stats.add(x, x + 0.2 * rng.standard_normal(x.shape))
    weight = (rng.standard_normal((k, rows)) * rng.uniform(0.5, 2, rows)).astype(np.float32)
    weight[:3] *= 6  # outlying inputs: the clip search moves those rows to another grid than min-max
    layout = Layout.channels_on((k, rows), 1)  # a MatMul weight [K, N]: output channels on its last axis
    monkeypatch.setenv("TQS_SOLVER_DTYPE", "float32")
    monkeypatch.setattr(solvers, "ROW_PART", 1)
    monkeypatch.setattr(solvers, "ROW_PART_ROWS", 1)
    monkeypatch.setattr(solvers.backend, "THREAD_CAP", 3)
    tier = TIERS["int4-asym"]

    def solved():
        stats.factors.clear()
        return quantizer.quantize(weight, layout, tier, quantizer.Rounding(method), [stats])

    narrow = solved()
    monkeypatch.setattr(quantizer, "working_dtype", lambda columns: np.float64)
    monkeypatch.setattr(quantizer, "_exact_dtype", lambda weight: np.float64)
    wide = solved()
    monkeypatch.setattr(solvers, "ROW_PART", 1 << 40)
    whole = solved()
    for other in (wide, whole):
        np.testing.assert_array_equal(narrow.codes, other.codes)
        np.testing.assert_array_equal(narrow.scale, other.scale)
        np.testing.assert_array_equal(narrow.zero, other.zero)


@pytest.mark.parametrize("order", [7, 300, 601])
def test_the_inverse_cholesky_turned_in_place_has_the_bytes_of_the_reversed_copy(order, monkeypatch):
    """U = J·L⁻¹·J written into LAPACK's own buffer (a tiled transpose, then the buffer reversed) holds the bytes of
    the C-ordered copy of the reversed factor, at orders below, across and off the tile size."""
    monkeypatch.setattr(factors, "COPY_TILE", 128)
    rng = np.random.default_rng(order)
    x = rng.standard_normal((2 * order, order))
    H = x.T @ x / order
    lapack = factors.lapack_for(order)
    work = factors._damped(H[::-1, ::-1], 0.01 * float(np.mean(np.diag(H))))
    factor, info = lapack.dpotrf(work.T, lower=1, clean=1, overwrite_a=1)
    factor, info2 = lapack.dtrtri(factor, lower=1, overwrite_c=1)
    assert info == info2 == 0
    copied = factors.c_order(factor[::-1, ::-1])
    turned = solvers.inverse_cholesky(H, 0.01)
    assert turned.flags.c_contiguous and np.array_equal(turned, copied)
    assert np.array_equal(turned, np.triu(turned))  # upper triangular, as GPTQ's loop reads it


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_loops_codes_are_held_in_a_byte_and_are_the_float_loops_codes(symmetric):
    """Integer codes of at most 8 bits come out of the column loop as uint8 (int8 for signed grids): the integers a
    float32 array would hold, a quarter of its bytes."""
    from tiers.column_loop import LoopPlan, column_loop

    rng = np.random.default_rng(5)
    k, rows = 48, 20
    x = rng.standard_normal((200, k))
    U = solvers.inverse_cholesky(x.T @ x / 200, 0.01)
    weight = rng.standard_normal((rows, k))
    spec = GridSpec("int", 4, symmetric)
    plan = LoopPlan(spec, -1, 16)
    codes, _ = column_loop(np, weight.copy(), U, None, plan)
    floats, _ = column_loop(np, weight.copy(), U, None, plan, out=np.zeros((rows, k), np.float32))
    assert codes.dtype == (np.int8 if symmetric else np.uint8)
    assert np.array_equal(codes.astype(np.float32), floats) and (codes < 0).any() == symmetric


def test_a_float32_loop_keeps_no_float64_u_and_still_reads_its_damping(monkeypatch):
    """A GPTQ solve whose column loop runs in float32 keeps U in float32 only (no float64 copy beside it), the grid
    choice still reads the nominal damping from it, and the codes are those of a solve handed the float64 U."""
    monkeypatch.setenv("TQS_SOLVER_DTYPE", "float32")
    rng = np.random.default_rng(9)
    k, rows = 64, 40
    x = rng.standard_normal((300, k))
    stats = Hessian(k)
    stats.add(x)
    weight = rng.standard_normal((rows, k))
    spec = GridSpec("int", 4, False)
    narrow = solvers.gptq(weight, stats.H, spec, cache=stats)
    kept = {key: value for key, value in stats.factors.items() if isinstance(value, np.ndarray)}
    assert [value.dtype for value in kept.values()] == [np.float32]
    assert solvers.damping(stats, 0.01) == pytest.approx(0.01 * float(np.mean(np.diag(stats.H))), rel=1e-12)
    stats.factors.clear()
    stats.factors[("U", 0.01, False)] = solvers.inverse_cholesky(stats.H, 0.01)  # as a GPTAQ solve leaves it
    wide = solvers.gptq(weight, stats.H, spec, cache=stats)
    assert np.array_equal(narrow.codes, wide.codes) and np.array_equal(narrow.scale, wide.scale)


def test_a_float32_gptaq_loop_keeps_its_factors_in_float32_only(monkeypatch):
    """A GPTAQ solve whose column loop runs in float32 keeps U and P as float32 only (the casts the loop made of the
    float64 ones on every solve), U's corner for the damping, and gives the codes of a loop handed the float64 U
    and P; a second solve on the statistic reads them (a dead input among the columns)."""
    monkeypatch.setenv("TQS_SOLVER_DTYPE", "float32")
    wt, stats = _problem(8, 300, 64, 40)
    stats.H[5, :] = stats.H[:, 5] = 0
    spec, settings = GridSpec("int", 4, False, True), solvers.GptaqSettings()
    narrow = solvers.gptaq(np.array(wt), stats.H, stats.G, spec, settings, cache=stats)
    kept = {key: value.dtype for key, value in stats.factors.items() if isinstance(value, np.ndarray)}
    assert sorted(kept.values(), key=str) == [np.float32, np.float32] and ("U corner", 0.01, False) in stats.factors
    again = solvers.gptaq(np.array(wt), stats.H, stats.G, spec, settings, cache=stats)
    moved, H, dead, plan = solvers._prepare(np.array(wt), stats.H, spec, settings)
    upper = solvers.inverse_cholesky(H, settings.percdamp)
    wide = solvers._solve(moved, upper, solvers._asymmetric_terms(stats.G, upper, dead, None, settings.alpha), plan)
    for solved in (narrow, again):
        assert np.array_equal(solved.codes, wide.codes) and np.array_equal(solved.scale, wide.scale)


@pytest.mark.parametrize("method", ["qep", "gptq", "gptaq"])
def test_a_wide_weights_grids_solved_one_after_the_other_give_the_codes_of_one_loop(method, monkeypatch):
    """Past `ONE_LOOP_BYTES` the searched grid's rows and the min-max grid's are solved in two loops, holding one
    grid's rows at a time: every row is solved alone, so the codes, scales and zero points are those of one loop
    (a dead input among them)."""
    wt, stats = _problem(4, 400, 96, 130)
    stats.H[5, :] = stats.H[:, 5] = 0
    layout, tier = Layout((96, 130), (1, 0)), TIERS["int4-asym"]
    weight = np.ascontiguousarray(wt.T).astype(np.float32)
    one = quantizer.quantize(weight, layout, tier, quantizer.Rounding(method), [stats])
    loops = []
    solve = quantizer._solve
    monkeypatch.setattr(quantizer, "_solve", lambda r, w, *a: loops.append(w.shape[0]) or solve(r, w, *a))
    monkeypatch.setattr(quantizer, "ONE_LOOP_BYTES", 0)
    two = quantizer.quantize(weight, layout, tier, quantizer.Rounding(method), [stats])
    assert len(loops) == 2 and loops[0] == 130 and 0 < loops[1] <= 130
    for field in ("codes", "scale", "zero"):
        np.testing.assert_array_equal(getattr(two, field), getattr(one, field))


@pytest.mark.parametrize("act_order", [False, True])
def test_the_loop_factor_made_first_is_the_one_gptq_would_make(act_order):
    """`factor_first` makes GPTQ's U before the rows are built (the solve's largest moment apart from them): the
    same entry GPTQ reads from the statistic, the same codes, and GPTQ makes no factor of its own after it."""
    (wt, stats), (_, fresh) = (_problem(5, 400, 1100, 40) for _ in range(2))  # past 1024 inputs: a float32 U
    for statistic in (stats, fresh):  # the same statistic twice, a dead input in each
        statistic.H[7, :] = statistic.H[:, 7] = 0
    settings = solvers.GptqSettings(act_order=act_order)
    spec = GridSpec("int", 4, False, True)
    plain = solvers.gptq(np.array(wt), stats.H, spec, settings, cache=stats)
    solvers.factor_first(fresh.H, settings, fresh)
    made = set(fresh.factors)
    first = solvers.gptq(np.array(wt), fresh.H, spec, settings, cache=fresh)
    assert set(fresh.factors) == made == set(stats.factors)
    np.testing.assert_array_equal(first.codes, plain.codes)


@pytest.mark.parametrize("method", ["qep", "gptaq"])
def test_the_grid_choice_compares_against_the_callers_weight_unchanged(method):
    """The grid choice reads the weight's values from the caller's own float32 array (a view, no copy): the codes of
    the same values handed over as float64, and the caller's array is not written."""
    wt, stats = _problem(6, 300, 64, 48)
    layout, tier = Layout((64, 48), (1, 0)), TIERS["int2-asym"]
    weight = np.ascontiguousarray(wt.T).astype(np.float32)
    before = weight.copy()
    narrow = quantizer.quantize(weight, layout, tier, quantizer.Rounding(method), [stats])
    wide = quantizer.quantize(weight.astype(np.float64), layout, tier, quantizer.Rounding(method), [stats])
    np.testing.assert_array_equal(weight, before)
    for field in ("codes", "scale", "zero"):
        np.testing.assert_array_equal(getattr(narrow, field), getattr(wide, field))
