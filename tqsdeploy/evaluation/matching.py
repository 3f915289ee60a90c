"""Points of different methods set side by side at one size: the uniform grid points and the TQS-PTQ point nearest
each, as the report's matched tables, win counts and error-growth figure compare them."""

from __future__ import annotations

import math

import polars as pl

MATCH_TOLERANCE = 0.05
"""A TQS-PTQ point is matched to a grid point when its compression is within 5%."""


def grid_points(frame: pl.DataFrame) -> dict[str, float]:
    """Uniform grid settings (W2, W4, ...) and their achieved compression."""
    base = frame.filter((pl.col("family") == "baseline") & pl.col("achieved_C").is_not_null())
    settings = sorted(base["setting"].unique(), key=lambda s: int(s[1:]))
    return {s: float(base.filter(pl.col("setting") == s)["achieved_C"].mean()) for s in settings}


def matched(frame: pl.DataFrame, setting: str, grid_c: float) -> pl.DataFrame:
    """Baselines at `setting` plus, per TQS objective, its point whose C is nearest
    `grid_c`, if that is within MATCH_TOLERANCE (otherwise the sizes differ too
    much to compare and the objective has no row)."""
    rows = [frame.filter((pl.col("family") == "baseline") & (pl.col("setting") == setting))]
    tqs = frame.filter((pl.col("family") == "tqs") & pl.col("achieved_C").is_not_null())
    for method in tqs["method"].unique(maintain_order=True):
        part = tqs.filter(pl.col("method") == method)
        ranked = part.with_columns((pl.col("achieved_C").log() - math.log(grid_c)).abs().alias("gap")).sort("gap")
        if ranked.height and ranked["gap"][0] <= math.log(1 + MATCH_TOLERANCE):
            rows.append(part.filter(pl.col("setting") == ranked["setting"][0]))
    return pl.concat(rows, how="diagonal_relaxed") if rows else frame.head(0)
