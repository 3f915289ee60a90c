"""Channel groups priced from their unit's rollout (`--group-prices shared`): as many rollouts at any cut, and the
exact prices wherever output channels add."""

import shutil

import models
import numpy as np
import pytest
from conftest import scored_run

from tiers import TIERS
from tqsdeploy import ScoreSettings, score
from tqsdeploy.export import ExportSettings, Planner

scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", n=32, hidden=64),
    (4, 2, 32),
    seed=7,
    steps=4,
    name="groups",
)


def _fresh_run(folder, name):
    """A copy of the score run without its price list: every price it needs is rolled out again."""
    run = folder / name
    shutil.copytree(folder / "run", run, ignore=shutil.ignore_patterns("measured.jsonl", ".measured.lock", "export-*"))
    return run


def _priced(run, **settings):
    """(planner, the rollouts its first pricing ran, its losses by (slot, tier)) for these settings."""
    planner = Planner(run, settings=ExportSettings(rounding="rtn", **settings))
    rolled = []
    choices = planner.pricing.choices(on_result=rolled.append)
    return planner, rolled, {(c.unit, tier): loss for c in choices for tier, loss in c.loss.items()}


@pytest.mark.parametrize("mode", ["shared", "exact"])
def test_pricing_rollouts_do_not_grow_with_the_groups_when_shared(scored, mode):
    _, _, folder = scored
    counts, slots = {}, {}
    for fraction in (0.3, 0.05):
        planner, rolled, _ = _priced(
            _fresh_run(folder, f"{mode}-{fraction}"), split_fraction=fraction, group_prices=mode
        )
        counts[fraction], slots[fraction] = len(rolled), len(planner.cut.slots)
        eager = {t.name for _, t in planner.pricing.eager_tasks()}
        units = len(planner.scored.units)
        planner.close()
    assert slots[0.05] > 3 * slots[0.3] > 3 * units  # the finer cut has many more slots
    if mode == "shared":
        assert counts[0.3] == counts[0.05] == units * len(eager)  # one rollout per unit and tier at any cut
    else:
        assert counts[0.05] == slots[0.05] * len(eager) > counts[0.3]


def test_shared_group_prices_split_their_units_price(scored):
    _, _, folder = scored
    planner, _, losses = _priced(_fresh_run(folder, "split"), split_fraction=0.05)
    whole = {(s.unit, t.name): s for s, t in planner.pricing.eager_tasks()}
    measured = planner.prices.measure(planner.pricing.eager_tasks())
    for unit, slots in planner.cut.slots_of.items():
        assert len(slots) > 1
        for tier in {t for (u, t) in whole if u == unit}:
            unit_price = sum(measured[planner.prices.task(*planner.prices.rolled(slots[0], TIERS[tier])).key].div_sq)
            groups = [losses[(s.name, tier)] for s in slots]
            assert min(groups) >= 0 and len(set(groups)) > 1
            assert sum(groups) == pytest.approx(unit_price, rel=1e-9)
    planner.close()


def test_shared_prices_are_the_exact_ones_where_output_channels_add(tmp_path):
    """One linear layer whose outputs are the trajectory, one step: a group's divergence is the sum of its output
    channels' ‖x·δw_c‖², so its share of the layer-output error on the rollout's own inputs is its exact price."""
    rng = np.random.default_rng(11)
    model = models.linear_map(tmp_path / "linear.onnx", rng.standard_normal((64, 64)) / 8)
    contexts = tmp_path / "ctx.npz"
    mixed = rng.standard_normal((6, 3, 64)) @ rng.standard_normal((64, 64))  # correlated inputs: H is not diagonal
    np.savez(contexts, x=mixed.astype(np.float32))
    score(model, contexts, steps=1, out=tmp_path / "run", settings=ScoreSettings(gauss_draws=1))
    prices = {}
    for mode in ("shared", "exact"):
        planner, _, losses = _priced(
            _fresh_run(tmp_path, mode), split_fraction=0.1, group_prices=mode, tiers=("fp32", "int4-asym", "int2-asym")
        )
        assert len(planner.cut.slots) == 10
        prices[mode] = {key: value for key, value in losses.items() if key[1] != "fp32"}
        planner.close()
    assert prices["shared"].keys() == prices["exact"].keys() and len(prices["exact"]) == 20
    for key, exact in prices["exact"].items():
        assert exact > 0 and prices["shared"][key] == pytest.approx(exact, rel=1e-5), key


@pytest.mark.parametrize("moments", ["none", "full", "diagonal"])
def test_channel_errors_from_one_float64_array_are_those_of_float64_copies(moments):
    """Per-channel layer-output errors made from one float64 array per row group (a grouped Conv's two here),
    squared in place, are the bytes of the products of float64 copies of the original and the encoding."""
    from tqsdeploy.export import shares

    rng = np.random.default_rng(4)
    rows, k = 2 * 37, 12
    original = rng.standard_normal((rows, k)).astype(np.float32)
    encoded = (original + 0.01 * rng.standard_normal((rows, k))).astype(np.float32)
    x = rng.standard_normal((50, k))
    moment = {"none": None, "full": [x.T @ x / 50] * 2, "diagonal": [np.mean(x * x, axis=0)] * 2}[moments]
    delta = encoded.astype(np.float64) - original.astype(np.float64)
    if moment is None:
        whole = np.einsum("ij,ij->i", delta, delta)
    else:
        halves = [delta[:37], delta[37:]]
        whole = np.concatenate(
            [np.einsum("ij,ij->i", h @ m, h) if m.ndim == 2 else np.square(h) @ m for h, m in zip(halves, moment)]
        )
    assert np.array_equal(shares.channel_errors(original, encoded, moment), whole)
