"""The frontier report: tables and plots a person can look at.

Everything is rendered from `frontier.parquet` and the score run, as a list
of blocks (headings, paragraphs, tables, figures) written out twice: as
`report.md` next to PNG files, and as a self-contained `report.html` with the
figures embedded.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

import numpy as np
import polars as pl

GRIDS_FOR_WINS = ("W2", "W4")
MATCH_TOLERANCE = 0.05
"""A TQS-PTQ point is matched to a grid point when its compression is within 5%."""


def _metric(frame: pl.DataFrame) -> tuple[str, str]:
    """Column and label of the error shown: MAE vs truth when there is truth, else MAE vs the FP32 model."""
    if "mae_truth" in frame.columns and frame["mae_truth"].drop_nulls().len():
        return "mae_truth", "MAE vs truth"
    return "mae_ref", "MAE vs FP32 model"


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def buckets(model_path: Path, units: list[str], patterns: dict[str, str] | None = None) -> dict[str, str]:
    """Role of each unit: input / body / output.

    With `patterns` (bucket -> regex on the unit name) those decide; units
    matching none are 'body'. Otherwise structure decides: units in the first
    calibration wave (their input comes straight from the model input) are
    'input', those in the last wave 'output', embedding tables 'input', the
    rest 'body'.
    """
    if patterns:
        compiled = {k: re.compile(v) for k, v in patterns.items()}
        return {u: next((k for k, p in compiled.items() if p.search(u)), "body") for u in units}
    import graph_ops
    from graph_ops.calibration import waves

    proto = graph_ops.load_model(model_path).proto
    layouts = {name: layout for name, layout in graph_ops.weight_layouts(proto).items() if name in set(units)}
    stages = waves(proto, layouts)
    role = {}
    for unit in units:
        layout = layouts.get(unit)
        if stages and unit in stages[0]:
            role[unit] = "input"
        elif stages and unit in stages[-1]:
            role[unit] = "output"
        elif layout is not None and "Gather" in layout.op_types:
            role[unit] = "input"
        else:
            role[unit] = "body"
    return role


def concentration(gammas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lorenz-style curve: share of the total gamma shift (gamma - min) carried by the top k units."""
    shift = np.sort(gammas - gammas.min())[::-1]
    total = shift.sum()
    share = np.cumsum(shift) / total if total > 0 else np.linspace(0, 1, shift.size)
    return np.arange(1, shift.size + 1) / shift.size, share


def _plots(frame: pl.DataFrame, scores: pl.DataFrame, roles: dict[str, str], folder: Path, metric: str) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    overall = frame.filter((pl.col("variable") == "all") & pl.col(metric).is_not_null())
    first_output = overall["output"].drop_nulls().first() if overall.height else None
    overall = overall.filter(pl.col("output") == first_output)

    splits = overall["split"].unique(maintain_order=True).to_list()
    y_column, y_label = ("degradation_pct", "degradation % vs FP32 (against truth)") if metric == "mae_truth" else ("drift_pct", "drift % from the FP32 model")
    fig, axes = plt.subplots(1, max(len(splits), 1), figsize=(6.5 * max(len(splits), 1), 4.5), squeeze=False)
    for ax, split in zip(axes[0], splits):
        for method in overall["method"].unique(maintain_order=True):
            part = overall.filter((pl.col("split") == split) & (pl.col("method") == method)).sort("achieved_C")
            style = "-o" if part["family"].first() == "tqs" else "--s"
            ax.plot(part["achieved_C"], part[y_column], style, label=method, markersize=4)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=0.1)  # small differences stay visible next to collapses
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xlabel("compression C (log)")
        ax.set_ylabel(f"{y_label} ({first_output})")
        ax.set_title(f"{split} contexts")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "frontier.png", dpi=110)
    plt.close(fig)
    figures.append(("frontier.png", f"{y_label} against compression (symmetric-log scale), one line per method ({first_output}, all variables)."))

    live = scores.filter(~pl.col("dead"))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * scores.height), 4))
    colors = {"input": "tab:blue", "body": "tab:gray", "output": "tab:red"}
    ax.bar(range(scores.height), scores["gamma"].clip(lower_bound=live["gamma"].min() if live.height else None), color=[colors[roles.get(u, "body")] if not d else "black" for u, d in zip(scores["unit"], scores["dead"])])
    ax.set_xticks(range(scores.height), scores["unit"], rotation=90, fontsize=7)
    ax.set_ylabel("γ (nats/step)")
    from matplotlib.patches import Patch

    ax.set_title("TQS ranking")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colors.items()] + [Patch(color="black", label="dead")], fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "gamma_ranking.png", dpi=110)
    plt.close(fig)
    figures.append(("gamma_ranking.png", "γ per unit, most sensitive first; dead units drawn at the lowest live γ."))

    fig, ax = plt.subplots(figsize=(5.5, 4))
    names = ["input", "body", "output"]
    data = [live.filter(pl.col("unit").is_in([u for u, r in roles.items() if r == name]))["gamma"].to_numpy() for name in names]
    for i, values in enumerate(data):
        ax.scatter(np.full(values.size, i) + np.random.default_rng(i).uniform(-0.12, 0.12, values.size), values, color=colors[names[i]], alpha=0.8)
        if values.size:
            ax.hlines(np.median(values), i - 0.3, i + 0.3, color="black")
    ax.set_xticks(range(3), [f"{n} ({d.size})" for n, d in zip(names, data)])
    ax.set_ylabel("γ (nats/step)")
    ax.set_title("γ by role bucket (line: median)")
    fig.tight_layout()
    fig.savefig(folder / "gamma_buckets.png", dpi=110)
    plt.close(fig)
    figures.append(("gamma_buckets.png", "γ of live units by role bucket."))

    if live.height >= 2:
        x, y = concentration(live["gamma"].to_numpy())
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot(np.concatenate([[0], x]) * 100, np.concatenate([[0], y]) * 100, "-o", markersize=3, label="TQS γ-shift")
        ax.plot([0, 100], [0, 100], ":", color="gray", label="uniform")
        ax.set_xlabel("top k% of units")
        ax.set_ylabel("% of total γ-shift")
        ax.set_title("Concentration of sensitivity")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "concentration.png", dpi=110)
        plt.close(fig)
        figures.append(("concentration.png", "Share of the total γ shift (γ − min γ) carried by the most sensitive k% of units."))

    grid = _grid_points(overall.filter(pl.col("split") == splits[0])) if splits else {}
    if grid:
        setting, grid_c = ("W4", grid["W4"]) if "W4" in grid else next(iter(grid.items()))
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for row in _matched(overall.filter(pl.col("split") == splits[0]), setting, grid_c).iter_rows(named=True):
            curve = json.loads(row["mae_by_step"] or "null")
            if curve:
                ax.plot(range(1, len(curve) + 1), curve, "-o" if row["family"] == "tqs" else "--s", markersize=3, label=f"{row['method']} {row['setting']} (C={row['achieved_C']:.1f})")
        ax.set_yscale("log")
        ax.set_xlabel("rollout step")
        ax.set_ylabel(f"MAE ({'vs truth' if metric == 'mae_truth' else 'vs FP32 model'})")
        ax.set_title(f"Error growth over the horizon at the {setting} grid point")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "error_growth.png", dpi=110)
        plt.close(fig)
        figures.append(("error_growth.png", f"Error by rollout step, baselines at {setting} and TQS-PTQ at the nearest compression."))
    return figures


def _grid_points(frame: pl.DataFrame) -> dict[str, float]:
    """Uniform grid settings (W2, W4, ...) and their achieved compression."""
    base = frame.filter((pl.col("family") == "baseline") & pl.col("achieved_C").is_not_null())
    return {s: float(base.filter(pl.col("setting") == s)["achieved_C"].mean()) for s in sorted(base["setting"].unique(), key=lambda s: int(s[1:]))}


def _matched(frame: pl.DataFrame, setting: str, grid_c: float) -> pl.DataFrame:
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


def build_report(out_dir: str | Path, model: str | Path, buckets_patterns: dict[str, str] | None = None) -> tuple[Path, Path]:
    """Write report.md, report.html and the PNGs into `out_dir`."""
    out_dir = Path(out_dir)
    frame = pl.read_parquet(out_dir / "frontier.parquet")
    scores = pl.read_parquet(out_dir / "score" / "scores.parquet")
    meta = json.loads((out_dir / "frontier.json").read_text())
    metric, label = _metric(frame)
    roles = buckets(Path(model), scores["unit"].to_list(), buckets_patterns)
    figures = _plots(frame, scores, roles, out_dir, metric)

    blocks: list[tuple] = [("h1", f"Compression frontier: {Path(model).name}"), ("p", f"Error metric: {label}. Evaluated with {meta['runtime']}.")]
    blocks.append(("img", "frontier.png", figures[0][1]))

    ok = frame.filter(pl.col("variable") == "all")
    failed = frame.filter(~pl.col("status").str.starts_with("ok")).select("method", "setting", "status").unique(maintain_order=True)
    for split in ok["split"].unique(maintain_order=True):
        part = ok.filter(pl.col("split") == split)
        grid = _grid_points(part)
        blocks.append(("h2", f"Matched compression ({split} contexts)"))
        blocks.append(("p", f"Each uniform grid point (baselines at W bits) next to TQS-PTQ at the compression nearest to it, when that is within {MATCH_TOLERANCE:.0%} (an objective with no such point has no row). Lower is better; **bold** is the best in its block."))
        variables = frame.filter((pl.col("split") == split) & (pl.col("variable") != "all"))
        if variables.height == 0:  # no per-variable rows: count wins per output instead
            variables = part
        for setting, grid_c in grid.items():
            table = _matched(part, setting, grid_c).filter(pl.col(metric).is_not_null())
            if table.height == 0:
                continue
            best = table[metric].min()
            header = ["method", "setting", "C", "size (bytes)", label, "RMSE", "degradation %"]
            rows = [
                [r["method"], r["setting"], _fmt(r["achieved_C"], 3), _fmt(r["file_bytes"]), ("**" + _fmt(r[metric]) + "**") if r[metric] == best else _fmt(r[metric]), _fmt(r["rmse_truth"] if metric == "mae_truth" else r["rmse_ref"]), _fmt(r["degradation_pct"], 3)]
                for r in table.sort(metric).iter_rows(named=True)
            ]
            blocks.append(("table", f"{setting} grid (C ≈ {grid_c:.2f})", header, rows))
        if variables.height:
            blocks.append(("h3", f"Win counts ({split} contexts)"))
            header = ["TQS-PTQ objective", *[f"wins at {g}" for g in GRIDS_FOR_WINS if g in grid], "variables"]
            rows = []
            for method in variables.filter(pl.col("family") == "tqs")["method"].unique(maintain_order=True):
                cells, count = [], variables.select("output", "variable").n_unique()
                for g in GRIDS_FOR_WINS:
                    if g not in grid:
                        continue
                    matched = _matched(variables, g, grid[g])
                    if not (matched["method"] == method).any():
                        cells.append("n/a (no point within 5%)")
                        continue
                    wins = 0
                    for output, variable in matched.select("output", "variable").unique().iter_rows():
                        v = matched.filter((pl.col("output") == output) & (pl.col("variable") == variable))
                        mine = v.filter(pl.col("method") == method)[metric]
                        rivals = v.filter(pl.col("family") == "baseline")[metric].drop_nulls()
                        if mine.len() and rivals.len() and mine[0] is not None and mine[0] < rivals.min():
                            wins += 1
                    cells.append(str(wins))
                rows.append([method, *cells, str(count)])
            blocks.append(("table", "TQS-PTQ beats the best uniform method at the nearest compression", header, rows))

    blocks.append(("h2", "Time per Pareto point"))
    timing = ok.filter(pl.col("split") == ok["split"].first()).filter(pl.col("achieved_C").is_not_null())
    rows = []
    for method in timing["method"].unique(maintain_order=True):
        part = timing.filter(pl.col("method") == method)
        sweep = float(part["sweep_s"].fill_null(0).max())
        export, evaluate = float(part["export_s"].fill_null(0).mean()), float(part["eval_s"].fill_null(0).mean())
        amortised = sweep / part.height if part["family"].first() == "tqs" else 0.0
        rows.append([method, str(part.height), _fmt(sweep, 3), _fmt(export, 3), _fmt(evaluate, 3), _fmt(amortised + export + evaluate, 3)])
    blocks.append(("table", "Seconds; TQS-PTQ shares one score sweep over all its points and prices every slot once, in its first export (both amortised in the last column)", ["method", "points", "sweep (once)", "export / point", "eval / point", "total / point"], rows))
    if failed.height:
        blocks.append(("h2", "Points that did not run"))
        blocks.append(("table", "", ["method", "setting", "status"], [list(r) for r in failed.iter_rows()]))
    blocks.append(("h2", "Sensitivity"))
    for name, caption in figures[1:]:
        blocks.append(("img", name, caption))
    top = scores.head(10)
    blocks.append(("table", "Most sensitive units", ["rank", "unit", "role", "params", "γ", "γ gauss", "dead"], [[str(r["rank"]), r["unit"], roles.get(r["unit"], "body"), str(r["params"]), _fmt(r["gamma"]), _fmt(r.get("gamma_gauss")), str(r["dead"])] for r in top.iter_rows(named=True)]))
    md = _markdown(blocks)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(_html(blocks, out_dir))
    return out_dir / "report.md", out_dir / "report.html"


def _markdown(blocks) -> str:
    lines = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "img":
            lines += [f"![{block[2]}]({block[1]})", "", f"*{block[2]}*", ""]
        elif kind == "table":
            _, title, header, rows = block
            if title:
                lines += [f"**{title}**", ""]
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            lines.append("")
    return "\n".join(lines)


def _html(blocks, folder: Path) -> str:
    def inline(text: str) -> str:
        return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))

    body = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{html.escape(block[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{inline(block[1])}</p>")
        elif kind == "img":
            data = base64.b64encode((folder / block[1]).read_bytes()).decode()
            body.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(block[2])}"><figcaption>{html.escape(block[2])}</figcaption></figure>')
        elif kind == "table":
            _, title, header, rows = block
            head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
            cells = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>" for row in rows)
            caption = f"<caption>{html.escape(title)}</caption>" if title else ""
            body.append(f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")
    style = "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}caption{text-align:left;font-weight:bold;padding:4px 0}img{max-width:100%}figcaption{color:#555;font-size:90%}"
    return f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>tqsdeploy frontier</title><style>{style}</style></head><body>{''.join(body)}</body></html>"
