"""The frontier report's figures, drawn from frontier.parquet and the score run's table.

Each figure is a PNG in the frontier's folder with a caption; `report` places them in report.md and embeds them in
report.html. Matplotlib draws off-screen (Agg), so a report is made without a display.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl

from tqsdeploy.evaluation.matching import grid_points, matched
from tqsdeploy.files import atomic_output

ROLE_COLORS = {"input": "tab:blue", "body": "tab:gray", "output": "tab:red"}


def concentration(gammas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lorenz-style curve: share of the total gamma shift (gamma - min) carried by the top k units."""
    shift = np.sort(gammas - gammas.min())[::-1]
    total = shift.sum()
    share = np.cumsum(shift) / total if total > 0 else np.linspace(0, 1, shift.size)
    return np.arange(1, shift.size + 1) / shift.size, share


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """A figure written as every output is (`tqsdeploy.files`): an interrupted report leaves the old plot or none;
    the figure is closed."""
    with atomic_output(path) as temporary:
        fig.savefig(temporary, dpi=110, format=path.suffix[1:])
    _pyplot().close(fig)


def plots(
    frame: pl.DataFrame, scores: pl.DataFrame, roles: dict[str, str], folder: Path, metric: str
) -> list[tuple[str, str]]:
    """Every figure as (file name, caption), the frontier first; `metric` is the error column the report shows."""
    overall = frame.filter((pl.col("variable") == "all") & pl.col(metric).is_not_null())
    first_output = overall["output"].drop_nulls().first() if overall.height else None
    overall = overall.filter(pl.col("output") == first_output)
    splits = overall["split"].unique(maintain_order=True).to_list()
    truth = metric == "mae_truth"
    figures = [_frontier(overall, splits, first_output, truth, folder)]
    live = scores.filter(~pl.col("dead"))
    figures.append(_gamma_ranking(scores, live, roles, folder))
    figures.append(_gamma_buckets(live, roles, folder))
    if live.height >= 2:
        figures.append(_concentration(live, folder))
    if splits and (growth := _error_growth(overall.filter(pl.col("split") == splits[0]), truth, folder)):
        figures.append(growth)
    return figures


def _envelope(part: pl.DataFrame, column: str) -> pl.DataFrame:
    """Per achieved size (within 1%), the point with the lowest `column`, sorted by size."""
    part = part.filter(pl.col(column).is_not_null()).sort("achieved_C")
    keep, last = [], None
    for index, c in enumerate(part["achieved_C"].to_list()):
        if last is not None and c <= last * 1.01:
            if part[column][index] < part[column][keep[-1]]:
                keep[-1] = index
            continue
        keep.append(index)
        last = c
    return part[keep] if keep else part


def _thin(ticks: list[float]) -> list[float]:
    """Tick positions at least 15% apart on the log axis, so labels do not overlap (the largest kept)."""
    kept = []
    for tick in sorted(ticks, reverse=True):
        if not kept or tick < kept[-1] / 1.15:
            kept.append(tick)
    return kept[::-1]


def _frontier(
    overall: pl.DataFrame, splits: list[str], output: str | None, truth: bool, folder: Path
) -> tuple[str, str]:
    """Drift (and, with truth, degradation) by compression: one panel per split and measure."""
    plt = _pyplot()
    panels = [("drift_pct", "drift_lo", "drift_hi", "drift from the FP32 model (% of mean |output|)")]
    if truth:
        panels.append(
            ("degradation_pct", "degradation_lo", "degradation_hi", "error vs truth, % worse than the FP32 model")
        )
    columns = max(len(splits), 1)
    fig, axes = plt.subplots(len(panels), columns, figsize=(6.5 * columns, 4.2 * len(panels)), squeeze=False)
    for row, panel in enumerate(panels):
        for ax, split in zip(axes[row], splits):
            _frontier_panel(ax, overall, split, panel)
            ax.set_title(f"{split} contexts ({output}); band: 95% bootstrap over windows")
    fig.tight_layout()
    _save(fig, folder / "frontier.png")
    measures = " (top) and error against the truth, in % of the FP32 model's own error (bottom)," if truth else ""
    return (
        "frontier.png",
        "Drift from the FP32 model" + measures + " by compression (logarithmic axis); one line per "
        "method through its best point at each size; shaded: 95% bootstrap interval over context windows.",
    )


def _frontier_panel(ax, overall: pl.DataFrame, split: str, panel: tuple[str, str, str, str]) -> None:
    """One split's methods on one measure: each point, and a line through each size's best."""
    import matplotlib.ticker

    y_column, low, high, y_label = panel
    for index, method in enumerate(overall["method"].unique(maintain_order=True)):
        part = overall.filter((pl.col("split") == split) & (pl.col("method") == method)).sort("achieved_C")
        tqs = part["family"].first() == "tqs"
        color = f"C{index % 10}"
        ax.plot(part["achieved_C"], part[y_column], "o" if tqs else "s", color=color, markersize=4)
        line = _envelope(part, y_column)  # one value per size: W3 and W4 at the same C draw no zig-zag
        ax.plot(line["achieved_C"], line[y_column], "-" if tqs else "--", color=color, label=method)
        if line[low].is_not_null().all() and line.height:
            ax.fill_between(line["achieved_C"], line[low], line[high], color=color, alpha=0.15, linewidth=0)
    ax.axhline(0, color="black", linewidth=1.0, label="FP32 model")
    ax.set_xscale("log")
    ticks = sorted({round(c, 1) for c in overall["achieved_C"].drop_nulls().to_list()})
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(_thin(ticks)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("compression (times smaller stored weights)")
    ax.set_ylabel(y_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _gamma_ranking(scores: pl.DataFrame, live: pl.DataFrame, roles: dict[str, str], folder: Path) -> tuple[str, str]:
    plt = _pyplot()
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(max(6, 0.35 * scores.height), 4))
    colors = [ROLE_COLORS[roles.get(u, "body")] if not d else "black" for u, d in zip(scores["unit"], scores["dead"])]
    floor = live["gamma"].min() if live.height else None
    ax.bar(range(scores.height), scores["gamma"].clip(lower_bound=floor), color=colors)
    names = (
        scores["label"] if "label" in scores.columns else scores["unit"]
    )  # module paths where the exporter made up names
    ax.set_xticks(range(scores.height), names.fill_null(scores["unit"]), rotation=90, fontsize=7)
    ax.set_ylabel("γ (nats/step)")
    negative = live.height > 0 and bool((live["gamma"] < 0).all())
    shrinking = ": every γ < 0, each perturbation's effect shrinks over the rollout" if negative else ""
    ax.set_title("TQS ranking" + shrinking)
    handles = [Patch(color=c, label=n) for n, c in ROLE_COLORS.items()] + [Patch(color="black", label="dead")]
    ax.legend(handles=handles, fontsize=8)
    fig.tight_layout()
    _save(fig, folder / "gamma_ranking.png")
    return (
        "gamma_ranking.png",
        "γ per unit (growth rate of a perturbation's effect, nats per rollout step; below 0 "
        "it shrinks), most sensitive first; dead units drawn at the lowest live γ.",
    )


def _gamma_buckets(live: pl.DataFrame, roles: dict[str, str], folder: Path) -> tuple[str, str]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    names = ["input", "body", "output"]
    data = [
        live.filter(pl.col("unit").is_in([u for u, r in roles.items() if r == name]))["gamma"].to_numpy()
        for name in names
    ]
    for i, values in enumerate(data):
        jitter = np.random.default_rng(i).uniform(-0.12, 0.12, values.size)
        ax.scatter(np.full(values.size, i) + jitter, values, color=ROLE_COLORS[names[i]], alpha=0.8)
        if values.size:
            ax.hlines(np.median(values), i - 0.3, i + 0.3, color="black")
    ax.set_xticks(range(3), [f"{n} ({d.size})" for n, d in zip(names, data)])
    ax.set_ylabel("γ (nats/step)")
    ax.set_title("γ by role bucket (line: median)")
    fig.tight_layout()
    _save(fig, folder / "gamma_buckets.png")
    return ("gamma_buckets.png", "γ of live units by role bucket.")


def _concentration(live: pl.DataFrame, folder: Path) -> tuple[str, str]:
    plt = _pyplot()
    x, y = concentration(live["gamma"].to_numpy())
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(np.concatenate([[0], x]) * 100, np.concatenate([[0], y]) * 100, "-o", markersize=3, label="TQS γ-shift")
    ax.plot([0, 100], [0, 100], ":", color="gray", label="uniform")
    ax.set_xlabel("top k% of units")
    ax.set_ylabel("% of total γ-shift")
    ax.set_title("Concentration of sensitivity")
    ax.legend()
    fig.tight_layout()
    _save(fig, folder / "concentration.png")
    return ("concentration.png", "Share of the total γ shift (γ − min γ) carried by the most sensitive k% of units.")


def _error_growth(first_split: pl.DataFrame, truth: bool, folder: Path) -> tuple[str, str] | None:
    """Error by rollout step at one grid point (W4 where there is one); None without grid points."""
    grid = grid_points(first_split)
    if not grid:
        return None
    setting, grid_c = ("W4", grid["W4"]) if "W4" in grid else next(iter(grid.items()))
    points = matched(first_split, setting, grid_c)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if truth else 1, figsize=(13 if truth else 6.5, 4.2), squeeze=False)
    for row in points.iter_rows(named=True):
        label = f"{row['method']} {row['setting']} (C = {row['achieved_C']:.3g})"
        style = "-o" if row["family"] == "tqs" else "--s"
        drift = json.loads(row.get("drift_by_step") or "null")
        if drift:
            axes[0][0].plot(range(1, len(drift) + 1), drift, style, markersize=3, label=label)
        curve = json.loads(row["mae_by_step"] or "null") if truth else None
        if curve:
            axes[0][1].plot(range(1, len(curve) + 1), curve, style, markersize=3, label=label)
    if truth:
        reference = json.loads(points["ref_mae_by_step"][0] or "null") if points.height else None
        if reference:
            axes[0][1].plot(
                range(1, len(reference) + 1), reference, "-", color="black", linewidth=1.5, label="FP32 model"
            )
        axes[0][1].set_ylabel("MAE against the truth")
        axes[0][1].set_title("Error against the truth, the FP32 model's own included")
    axes[0][0].axhline(0, color="black", linewidth=1.0, label="FP32 model")
    axes[0][0].set_ylabel("MAE from the FP32 model")
    axes[0][0].set_title(f"Drift from the FP32 model at the {setting} grid point")
    for ax in axes[0]:
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, folder / "error_growth.png")
    return (
        "error_growth.png",
        f"Error by rollout step, baselines at {setting} and TQS-PTQ at the nearest compression (linear scale).",
    )
