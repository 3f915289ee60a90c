"""A wave's statistics built with a Conv's rows deferred to its last sample, and grouped convs' rows built group-major:
the same H and G, bit for bit, as adding every sample's im2col column blocks as they come."""

from __future__ import annotations

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
        monkeypatch.setattr(WaveStatistics, "_waits", lambda self, use, groups, quantized: use.conv is not None)
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
