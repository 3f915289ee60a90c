"""Export's speed-ups change no result: shared factorizations, batched statistics, parallel solves, the profile."""

import json
import platform
import subprocess
import sys

import models
import numpy as np
import pytest
from conftest import REPO, cli, scored_run
from scipy.linalg import lapack

import tiers.gptq as solvers
import tiers.hessian as statistics
from graph_ops.layout import Layout
from tiers import TIERS, Hessian, Rounding, solver_backend
from tiers.quantizer import quantize
from tqsdeploy import ScoreSettings, score
from tqsdeploy.encoding.choices import comparison_methods
from tqsdeploy.encoding.profiling import KINDS, Profile
from tqsdeploy.export import ExportSettings, Planner

# The export tests' scored MLP (tests/tqsdeploy/export/test_export.py).
scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", n=128, hidden=256),
    (6, 2, 128),
    seed=5,
    steps=6,
    name="export",
)


def _official_inverse_cholesky(H, percdamp):
    """potrf / potri / potrf, as the reference implementations run it."""
    damped = H + percdamp * np.mean(np.diag(H)) * np.eye(len(H))
    lower, _ = lapack.dpotrf(damped, lower=1, clean=1)
    inverse, _ = lapack.dpotri(lower, lower=1)
    inverse = np.tril(inverse) + np.tril(inverse, -1).T
    return np.linalg.cholesky(inverse).T


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows", [400, 40])  # well-posed, and rank-deficient (damping carries it)
def test_inverse_cholesky_is_the_official_one(rows, dtype, monkeypatch):
    """In float64 whatever the solvers' dtype (a float32 U moved a chaotic model's codes too far)."""
    monkeypatch.setenv("TQS_SOLVER_DTYPE", dtype)
    x = np.random.default_rng(0).standard_normal((rows, 96))
    H = 2 / rows * x.T @ x
    U = solvers.inverse_cholesky(H, 0.01)
    assert U.dtype == np.float64
    np.testing.assert_allclose(U, _official_inverse_cholesky(H, 0.01), rtol=1e-7, atol=1e-9 * np.abs(U).max())
    assert np.allclose(np.tril(U, -1), 0)


def test_batched_statistics_equal_the_formula(monkeypatch):
    monkeypatch.setattr(statistics, "STATS_BATCH_BYTES", 8 * 16 * 30)  # a fold every few adds
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (7, 13, 1, 25, 9)]
    fulls = [x + 0.1 * rng.standard_normal(x.shape).astype(np.float32) for x in xs]
    stats = Hessian(16, cross=True)
    for x, full in zip(xs, fulls):
        stats.add(x, full)
    X, F = np.concatenate(xs).astype(np.float64), np.concatenate(fulls).astype(np.float64)
    np.testing.assert_allclose(stats.H, 2 / len(X) * X.T @ X, rtol=1e-12)
    np.testing.assert_allclose(stats.G, 2 / len(X) * (F - X).T @ X, rtol=1e-10, atol=1e-14)
    same = Hessian(16, cross=True)
    same.add(xs[0], xs[0])  # nothing quantized yet: no cross term
    assert same.count == 7 and not same.G.any()


@pytest.mark.parametrize("method", ["gptq", "gptaq", "qep"])
def test_a_shared_factorization_gives_the_same_codes(method):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((48, 64)).astype(np.float32)
    x = rng.standard_normal((300, 64))
    layout = Layout((48, 64), (0, 1))
    rounding = Rounding(method)

    def statistic():
        stats = Hessian(64, cross=True)
        stats.add(x, x + 0.05 * rng.standard_normal(x.shape) if method != "gptq" else x)
        return stats

    stats = statistic()
    for tier in (
        "int4-asym",
        "int2-asym",
        "int8-asym",
    ):  # every tier of one weight on one statistic, as a mixed pass solves it
        alone = quantize(weight, layout, TIERS[tier], rounding, [_copy(stats)])
        shared = quantize(weight, layout, TIERS[tier], rounding, [stats])
        np.testing.assert_array_equal(shared.codes, alone.codes)
        np.testing.assert_array_equal(shared.scale, alone.scale)
    assert ("U", 0.01, False) in stats.factors


def _copy(stats: Hessian) -> Hessian:
    fresh = Hessian(stats.H.shape[0], stats.G is not None)
    fresh.add(np.zeros((0, stats.H.shape[0])))
    fresh._H, fresh._G, fresh.count = stats.H.copy(), None if stats.G is None else stats.G.copy(), stats.count
    return fresh


def test_parallel_wave_solves_equal_one_at_a_time(tmp_path, monkeypatch):
    model = models.two_branch(tmp_path / "two.onnx", n=64)  # three weights reading x: one wave, solved side by side
    contexts = tmp_path / "ctx.npz"
    np.savez(contexts, x=np.random.default_rng(3).standard_normal((4, 2, 64)).astype(np.float32))
    score(model, contexts, steps=3, out=tmp_path / "run", settings=ScoreSettings(gauss_draws=1))
    encoded = {}
    for threads in (1, 3):
        monkeypatch.setattr("tqsdeploy.encoding.calibrator.solver_threads", lambda threads=threads: threads)
        planner = Planner(tmp_path / "run", model, ExportSettings())
        assert max(len(wave) for wave in planner.encoder.calibrator.waves) == 3
        encoded[threads] = planner.encoder.uniform("int4-asym", Rounding("qep"))
        planner.close()
    assert encoded[1].keys() == encoded[3].keys() and len(encoded[1]) == 3
    for name in encoded[1]:
        np.testing.assert_array_equal(encoded[1][name].dequantize(), encoded[3][name].dequantize())


def test_export_records_and_prints_where_its_time_went(scored):
    model, _, folder = scored
    result = cli(
        "export",
        model,
        "--run",
        folder / "run",
        "--C",
        "4",
        "--out-dir",
        folder,
        "--force",
        "--verbose",
        "--refine",
        "0",
    )
    assert result.exit_code == 0, result.output
    assert "time:" in result.output and "solver" in result.output
    record = json.loads((folder / "mlp.C4.allocation.json").read_text())
    profile = record["profile_s"]
    assert set(profile) == {*KINDS, "other", "total"}
    assert sum(profile[k] for k in KINDS) <= profile["total"] + 0.01
    assert profile["solver"] > 0 and profile["measurement_rollouts"] > 0 and profile["write"] > 0
    assert profile["total"] == record["timings_s"]["total"]
    labels = [c["label"] for c in record["compared"]]
    assert not any("gptq" in label for label in labels)  # GPTQ dominated by QEP: never computed
    drifts = {c["label"]: c["drift_pct"] for c in record["compared"]}
    qep = next(d for label, d in drifts.items() if label.startswith("uniform") and label.endswith(" qep"))
    mixed = min(d for label, d in drifts.items() if not label.startswith("uniform"))
    rtn = [d for label, d in drifts.items() if label.startswith("uniform") and label.endswith(" rtn")]
    assert bool(rtn) == (qep <= 2 * mixed)  # RTN, then GPTAQ, only while they can still win (OUTRUN_BY)
    assert any("gptaq" in label for label in labels) == (qep <= 2 * min([mixed, *rtn]))


def test_nested_sections_count_their_own_time():
    profile = Profile()
    with profile.section("solver"):
        with profile.section("write"):
            pass
    assert set(profile.seconds) == {"solver", "write"}
    split = profile.split({}, wall=1.0)
    assert split["total"] == 1.0 and split["other"] == pytest.approx(1.0 - split["solver"] - split["write"], abs=2e-3)


def test_only_what_can_still_win_is_compared():
    assert comparison_methods(Rounding("qep"), TIERS["int4-asym"]) == ("rtn", "gptaq", "qep")
    assert comparison_methods(Rounding("gptq"), TIERS["int4-asym"]) == ("rtn", "gptq", "gptaq", "qep")
    assert comparison_methods(Rounding("qep"), TIERS["fp8"]) == ("rtn",)


def test_the_array_module_is_numpy_without_a_device(monkeypatch):
    monkeypatch.setattr(solver_backend, "_ARRAY_MODULE", None)
    monkeypatch.setenv("TQS_ARRAYS", "numpy")
    assert solver_backend.array_module() is np
    x = np.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(solver_backend.gram(x, x), x.T @ x)


def test_float32_solves_give_the_float64_codes_on_a_trained_models_layers(tmp_path, monkeypatch):
    """TQS_SOLVER_DTYPE=float32 (the default: the column loop, QEP's correction and the grid choice's products
    in float32): on the ETTh1 example's trained weights and the statistics of its own contexts (a sequential QEP
    pass, every weight solved both ways on the same statistics), >= 99% of the codes are float64's (rows whose
    per-channel grid choice flips aside, at most 1% of rows) and each layer's reconstruction error is within 1%
    of float64's."""

    from tiers.hessian import output_error
    from tiers.quantizer import encode

    example = REPO / "examples" / "etth1_patchtst"
    score(
        example / "model.onnx",
        example / "contexts.npz",
        spec=example / "rollout.toml",
        out=tmp_path / "run",
        settings=ScoreSettings(gauss_draws=0),
    )
    planner = Planner(tmp_path / "run")
    encoder, rounding, tier = planner.encoder, Rounding("qep"), TIERS["int4-asym"]
    solved = {}

    def both(name, stats):
        weight, layout = encoder.weights[name], encoder.layouts[name]
        if stats is not None and layout.perm is not None:
            original = layout.to_wt(np.asarray(weight, np.float64))
            for dtype in ("float32", "float64"):
                monkeypatch.setenv("TQS_SOLVER_DTYPE", dtype)
                codes = quantize(weight, layout, tier, rounding, stats)
                solved.setdefault(name, {})[dtype] = (codes.codes, output_error(original, codes.values, stats[0]))
        return encode(weight, layout, tier, rounding, stats)  # float64: the pass goes on from its codes

    encoder.calibrator.run(both, rounding.needs_cross)
    planner.close()
    assert len(solved) >= 12
    # a row whose grid choice (clip-searched or min-max) is a near tie may land on the other grid: all its codes
    # differ (one 2048-wide head row on this model, the head's error 0.07% lower in float32); count such rows apart
    flipped = [np.mean(r["float32"][0] != r["float64"][0], axis=1) > 0.25 for r in solved.values()]
    assert sum(int(f.sum()) for f in flipped) <= 0.01 * sum(len(f) for f in flipped)
    same = sum(int(np.sum(r["float32"][0][~f] == r["float64"][0][~f])) for r, f in zip(solved.values(), flipped))
    assert same >= 0.99 * sum(r["float64"][0][~f].size for r, f in zip(solved.values(), flipped))
    for name, r in solved.items():
        assert r["float32"][1] == pytest.approx(r["float64"][1], rel=0.01), name


def test_auto_precision_is_float64_below_its_width_and_float32_from_it(monkeypatch):
    """TQS_SOLVER_DTYPE=auto (the default): a weight narrower than FLOAT32_FROM is solved in float64 bit for bit
    (the examples' layers keep their codes); from FLOAT32_FROM on in float32, as 'float32' solves it. QEP's
    corrected weights tell the two apart (their low bits differ)."""
    monkeypatch.delenv("TQS_SOLVER_DTYPE", raising=False)
    assert solver_backend.solver_dtype() == "auto"
    wide = solver_backend.FLOAT32_FROM
    assert (solver_backend.solve_dtype(wide - 1), solver_backend.solve_dtype(wide)) == ("float64", "float32")
    rng = np.random.default_rng(4)
    for columns, same, other in ((64, "float64", "float32"), (wide, "float32", "float64")):
        wt = rng.standard_normal((32, columns))
        x = rng.standard_normal((2 * columns, columns))
        stats = Hessian(columns, cross=True)
        stats.add(x, x + 0.05 * rng.standard_normal(x.shape))
        corrected = {}
        for setting in ("auto", same, other):
            monkeypatch.setenv("TQS_SOLVER_DTYPE", setting)
            corrected[setting] = solvers.qep_correct(wt, stats.H, stats.G, alpha=0.5)
        np.testing.assert_array_equal(corrected["auto"], corrected[same])
        assert not np.array_equal(corrected["auto"], corrected[other])
        np.testing.assert_allclose(corrected["auto"], corrected[other], rtol=1e-4, atol=1e-5)


def test_a_model_swept_in_cuts_is_priced_in_cuts_at_the_same_prices(tmp_path):
    """A one-step model whose score ran fastest in cuts ('prefix') prices each slot on the graph downstream of its
    unit: the same prices as whole rollouts on a run scored whole ('feed'), the same codes priced."""
    from tqsdeploy.units import UnitSelection

    model, contexts, spec = models.shared_weight_case(tmp_path, 1)
    planners = {}
    for strategy in ("prefix", "feed"):
        score(
            model,
            contexts,
            spec=spec,
            out=tmp_path / strategy,
            settings=ScoreSettings(gauss_draws=1),
            strategy=strategy,
            selection=UnitSelection(min_params=100),
        )
        planners[strategy] = Planner(
            tmp_path / strategy, settings=ExportSettings(rounding="rtn", tiers=("fp32", "int8", "int4", "int2"))
        )
    cut, whole = planners["prefix"], planners["feed"]
    assert cut.scored.prices_cut and not whole.scored.prices_cut
    priced = {}
    for strategy, planner in planners.items():
        measured = planner.pricing.measured()
        priced[strategy] = {
            (slot.name, tier.name): measured[planner.prices.key(slot, tier)].div_sq
            for slot, tier in planner.pricing.measured_tasks()
        }
        planner.close()
    assert len(priced["prefix"]) >= 6 and priced["prefix"].keys() == priced["feed"].keys()
    assert any(sum(v) > 0 for v in priced["feed"].values())
    for key, div_sq in priced["feed"].items():
        np.testing.assert_allclose(priced["prefix"][key], div_sq, rtol=1e-4, atol=1e-12, err_msg=str(key))


@pytest.mark.skipif(
    not (sys.platform == "linux" and platform.libc_ver()[0] == "glibc"), reason="glibc's heap tuning only"
)
def test_the_command_keeps_freed_temporaries_instead_of_faulting_them_back_in():
    """After `keep_freed_memory` (what `tqsdeploy` runs first) a process that frees 160 MiB of 8 MiB temporaries keeps
    those pages for the next ones; by glibc's defaults most of them go back to the kernel at once."""
    probe = (
        "import sys, numpy as np\n"
        "from tqsdeploy.cli import keep_freed_memory\n"
        "if sys.argv[1] == 'tuned': keep_freed_memory()\n"
        "blocks = [np.ones(1 << 20) for _ in range(20)]\n"
        "del blocks\n"
        "print(next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmRSS')))\n"
    )
    resident = {
        mode: int(
            subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True).stdout
        )
        for mode in ("plain", "tuned")
    }
    assert resident["tuned"] - resident["plain"] > 100_000, resident  # kB
