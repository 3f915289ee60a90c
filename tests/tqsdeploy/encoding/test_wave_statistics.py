"""A wave's statistics built with a Conv's rows deferred to its last sample, and grouped convs' rows built group-major:
the same H and G, bit for bit, as adding every sample's im2col column blocks as they come."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tqsdeploy.encoding.wave_statistics as wave_statistics
from graph_ops.calibration import grouped_im2col, im2col, layer_inputs
from graph_ops.weight_use import ConvGeometry, WeightUse
from tiers import Hessian
from tqsdeploy.encoding.wave_statistics import WaveStatistics

DEPTHWISE = ConvGeometry((5,), (1,), (3,), (6, 6), "NOTSET", 8)
GROUPED_2D = ConvGeometry((3, 3), (2, 1), (1, 2), (1, 0, 1, 2), "NOTSET", 4)
DENSE = ConvGeometry((3,), (2,), (1,), (1, 1), "NOTSET", 1)
TRANSPOSED = ConvGeometry((3,), (2,), (1,), (1, 1), "NOTSET", 1, (1,), True)


@pytest.mark.parametrize(
    "geometry, shape", [(DEPTHWISE, (3, 8, 11)), (GROUPED_2D, (2, 8, 9, 10)), (DEPTHWISE, (1, 8, 4))]
)
def test_grouped_im2col_is_im2cols_column_blocks(geometry, shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    grouped = grouped_im2col(x, geometry, geometry.group)
    split = np.split(im2col(x, geometry), geometry.group, axis=1)
    assert len(grouped) == len(split) == geometry.group
    for mine, theirs in zip(grouped, split):
        assert mine.flags.c_contiguous
        np.testing.assert_array_equal(mine, theirs)
    use = WeightUse("conv", 0, "Conv", "x", conv=geometry)
    for mine, theirs in zip(layer_inputs(use, x, geometry.group), split):
        np.testing.assert_array_equal(mine, theirs)


def _reference(uses, samples, cross):
    """Every sample's rows added as it comes (what the calibrator did before `WaveStatistics`)."""
    stats = {key: None for key in uses}
    for quantized, full in samples:
        for key, (use, groups) in uses.items():
            xs = layer_inputs(use, quantized[use.x], groups)
            xf = (xs if full is None else layer_inputs(use, full[use.x], groups)) if cross else [None] * groups
            if stats[key] is None:
                stats[key] = [Hessian(x.shape[1], cross) for x in xs]
            for part, x, x_fp in zip(stats[key], xs, xf):
                part.add(x, x_fp)
    return stats


def _wave(samples_count=4, seed=1):
    rng = np.random.default_rng(seed)
    uses = {
        "dw-a": (WeightUse("dw1", 0, "Conv", "a", conv=DEPTHWISE), 8),
        "dw-b": (WeightUse("dw2", 1, "Conv", "b", conv=DEPTHWISE), 8),
        "dense": (WeightUse("c", 2, "Conv", "a", conv=DENSE), 1),
        "mm": (WeightUse("mm", 3, "MatMul", "m"), 1),
        "up": (WeightUse("up", 4, "ConvTranspose", "b", conv=TRANSPOSED), 1),
    }
    samples = []
    for index in range(samples_count):
        quantized = {
            "a": rng.standard_normal((3, 8, 11)).astype(np.float32),
            "b": rng.standard_normal((3, 8, 11)).astype(np.float32),
            "m": rng.standard_normal((3, 5, 7)).astype(np.float32),
        }
        full = (
            None
            if index == 0
            else {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in quantized.items()}
        )
        samples.append((quantized, full))
    return uses, samples


@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize(
    "batch_bytes, held",
    [(wave_statistics.STATS_BATCH_BYTES, "estimated"), (4096, "estimated"), (4096, "always"), (2500, "always")],
)
def test_deferred_rows_give_the_same_bits(monkeypatch, cross, batch_bytes, held):
    """Held (the default threshold) or not (4096 bytes: nothing is held, and the statistics fold several times on
    the way, as the Hessian's own threshold is lowered with it), or held whatever their size (a later sample larger
    than the first: the held rows fold in the batches `Hessian.add` would), the statistics are the reference's bit
    for bit."""
    monkeypatch.setattr(wave_statistics, "STATS_BATCH_BYTES", batch_bytes)
    monkeypatch.setattr("tiers.hessian.STATS_BATCH_BYTES", batch_bytes)
    if held == "always":
        monkeypatch.setattr(WaveStatistics, "_waits", lambda self, key, quantized: self.uses[key][0].conv is not None)
    uses, samples = _wave()
    statistics = WaveStatistics(uses, cross, len(samples))
    for quantized, full in samples:
        statistics.add(quantized, full)
    kept = set(statistics._held)
    got, expected = statistics.finish(), _reference(uses, samples, cross)
    convs = {"dw-a", "dw-b", "dense", "up"}
    assert kept == (convs if held == "always" or batch_bytes > 4096 else set())
    for key in uses:
        assert len(got[key]) == len(expected[key]) == uses[key][1]
        for mine, theirs in zip(got[key], expected[key]):
            assert mine.count == theirs.count > 0
            np.testing.assert_array_equal(mine.H, theirs.H)
            if cross:
                np.testing.assert_array_equal(mine.G, theirs.G)
                assert np.any(mine.G != 0)
            else:
                assert mine.G is None
    assert all(not rows for rows in statistics._held.values())  # the held activations are let go


def test_batches_fold_where_hessian_add_would():
    """A fold once the pending rows reach `STATS_BATCH_BYTES` (as float64), empty chunks skipped, the rest together
    when the statistic is read."""
    rows = [4, 0, 6, wave_statistics.STATS_BATCH_BYTES // (8 * 8) - 10, 3, 2]
    assert wave_statistics._batches(rows, 8) == [[0, 2, 3], [4, 5]]
    assert wave_statistics._batches([0, 0], 8) == []


def test_no_samples_leave_no_statistics():
    uses, _ = _wave()
    assert WaveStatistics(uses, True, 0).finish() == {key: None for key in uses}


def _small_folds(monkeypatch, rows_per_input):
    """A cap of `rows_per_input` rows per input, and folds of 64 bytes: this wave's uses are past both."""
    monkeypatch.setattr(wave_statistics, "ROWS_PER_INPUT", rows_per_input)
    monkeypatch.setattr(wave_statistics, "STATS_BATCH_BYTES", 64)
    monkeypatch.setattr("tiers.hessian.STATS_BATCH_BYTES", 64)


def _statistics(uses, samples, cross=True, readers=None):
    statistics = WaveStatistics(uses, cross, len(samples), readers)
    for quantized, full in samples:
        statistics.add(quantized, full)
    return statistics, statistics.finish()


@pytest.mark.parametrize("cross", [True, False])
def test_rows_past_the_cap_are_every_rth_position_of_a_conv_and_row_of_a_matmul(monkeypatch, cross):
    """With 1 row per input wanted, each use keeps every r-th row (r = rows it would see // rows wanted): a Conv
    the rows of the same Conv strided r times more along its first axis, a MatMul every r-th row of X; both at
    least the rows wanted and not many more. A ConvTranspose keeps all its rows."""
    _small_folds(monkeypatch, 1)
    uses, samples = _wave()
    statistics, got = _statistics(uses, samples, cross)
    for key in ("dw-a", "dw-b", "dense"):
        use, groups = uses[key]
        rows = im2col(samples[0][0][use.x], use.conv).shape[0]
        columns = got[key][0].H.shape[0]
        step = rows * len(samples) // columns
        assert step > 1 and statistics.steps[key] == step
        strided = dataclasses.replace(use, conv=dataclasses.replace(use.conv, strides=(use.conv.strides[0] * step,)))
        expected = _reference({key: (strided, groups)}, samples, cross)[key]
        for mine, theirs in zip(got[key], expected):
            assert columns <= mine.count == theirs.count < 4 * columns
            np.testing.assert_array_equal(mine.H, theirs.H)
    use, _ = uses["mm"]
    step = statistics.steps["mm"]
    assert step == 15 * len(samples) // 7
    rows = [(q["m"].reshape(-1, 7)[::step], None if f is None else f["m"].reshape(-1, 7)[::step]) for q, f in samples]
    reference = Hessian(7, cross)
    for x, x_fp in rows:
        reference.add(x, x if x_fp is None or not cross else x_fp)
    assert got["mm"][0].count == reference.count == sum(len(x) for x, _ in rows)
    np.testing.assert_array_equal(got["mm"][0].H, reference.H)
    if cross:
        np.testing.assert_array_equal(got["mm"][0].G, reference.G)
    assert statistics.steps["up"] == 1
    assert got["up"][0].count == _reference({"up": uses["up"]}, samples, cross)["up"][0].count


def test_a_weight_read_many_times_shares_the_cap_between_its_uses(monkeypatch):
    """A weight with 4 uses wants a quarter of the rows from each: its merged statistic holds about the rows
    one use alone would have kept."""
    _small_folds(monkeypatch, 8)
    uses, samples = _wave()
    alone, _ = _statistics(uses, samples)
    shared, got = _statistics(uses, samples, readers={key: 4 for key in uses})
    assert shared.steps["dense"] >= 4 * alone.steps["dense"] - 3
    columns = got["dense"][0].H.shape[0]
    assert 2 * columns <= got["dense"][0].count < 8 * columns


@pytest.mark.parametrize("cap", [wave_statistics.ROWS_PER_INPUT, 1])
def test_uses_under_the_cap_or_one_fold_keep_every_row(monkeypatch, cap):
    """The default cap is far above this wave's rows, and with 1 row per input wanted every use's rows still fit
    one fold (the default `STATS_BATCH_BYTES`): nothing is thinned, every use is the reference's."""
    monkeypatch.setattr(wave_statistics, "ROWS_PER_INPUT", cap)
    uses, samples = _wave()
    statistics, got = _statistics(uses, samples)
    assert set(statistics.steps.values()) == {1}
    expected = _reference(uses, samples, True)
    for key in uses:
        for mine, theirs in zip(got[key], expected[key]):
            assert mine.count == theirs.count
            np.testing.assert_array_equal(mine.H, theirs.H)


def test_a_2d_conv_is_thinned_along_its_longest_output_axis(monkeypatch):
    """5 x 28 output positions: every r-th of the 28, the statistic of the same Conv strided r times more along
    that axis."""
    _small_folds(monkeypatch, 1)
    rng = np.random.default_rng(3)
    use = WeightUse("g2", 0, "Conv", "c", conv=GROUPED_2D)
    uses = {"g2": (use, GROUPED_2D.group)}
    samples = [({"c": rng.standard_normal((2, 8, 9, 30)).astype(np.float32)}, None) for _ in range(3)]
    statistics, got = _statistics(uses, samples, cross=False)
    step = statistics.steps["g2"]
    assert step == 2 * 5 * 28 * 3 // 18
    strided = dataclasses.replace(use, conv=dataclasses.replace(GROUPED_2D, strides=(2, step)))
    expected = _reference({"g2": (strided, GROUPED_2D.group)}, samples, False)["g2"]
    for mine, theirs in zip(got["g2"], expected):
        assert mine.count == theirs.count == 3 * 2 * 5 * -(-28 // step)
        np.testing.assert_array_equal(mine.H, theirs.H)
