"""The frontier report: tables and plots a person can look at.

Everything is rendered from `frontier.parquet` and the score run, as a list
of blocks (headings, paragraphs, tables, figures) written out twice: as
`report.md` next to PNG files, and as a self-contained `report.html` with the
figures embedded.
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import polars as pl

from tqsdeploy.files import atomic_output, write_text

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


def _save(fig, path: Path) -> None:
    """A figure written as every output is (`tqsdeploy.files`): an interrupted report leaves the old plot or none."""
    with atomic_output(path) as temporary:
        fig.savefig(temporary, dpi=110, format=path.suffix[1:])


def _plots(frame: pl.DataFrame, scores: pl.DataFrame, roles: dict[str, str], folder: Path, metric: str) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figures = []
    overall = frame.filter((pl.col("variable") == "all") & pl.col(metric).is_not_null())
    first_output = overall["output"].drop_nulls().first() if overall.height else None
    overall = overall.filter(pl.col("output") == first_output)

    splits = overall["split"].unique(maintain_order=True).to_list()
    panels = [("drift_pct", "drift_lo", "drift_hi", "drift from the FP32 model (% of mean |output|)")]
    if metric == "mae_truth":
        panels.append(("degradation_pct", "degradation_lo", "degradation_hi", "error vs truth, % worse than the FP32 model"))
    columns = max(len(splits), 1)
    fig, axes = plt.subplots(len(panels), columns, figsize=(6.5 * columns, 4.2 * len(panels)), squeeze=False)
    for row, (y_column, low, high, y_label) in enumerate(panels):
        for ax, split in zip(axes[row], splits):
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
            ax.set_title(f"{split} contexts ({first_output}); band: 95% bootstrap over windows")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, folder / "frontier.png")
    plt.close(fig)
    figures.append(("frontier.png", "Drift from the FP32 model" + (" (top) and error against the truth, in % of the FP32 model's own error (bottom)," if metric == "mae_truth" else "")
                    + " by compression (logarithmic axis); one line per method through its best point at each size; shaded: 95% bootstrap interval over context windows."))

    live = scores.filter(~pl.col("dead"))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * scores.height), 4))
    colors = {"input": "tab:blue", "body": "tab:gray", "output": "tab:red"}
    ax.bar(range(scores.height), scores["gamma"].clip(lower_bound=live["gamma"].min() if live.height else None), color=[colors[roles.get(u, "body")] if not d else "black" for u, d in zip(scores["unit"], scores["dead"])])
    ax.set_xticks(range(scores.height), scores["unit"], rotation=90, fontsize=7)
    ax.set_ylabel("γ (nats/step)")
    from matplotlib.patches import Patch

    negative = live.height > 0 and bool((live["gamma"] < 0).all())
    ax.set_title("TQS ranking" + (": every γ < 0, each perturbation's effect shrinks over the rollout" if negative else ""))
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colors.items()] + [Patch(color="black", label="dead")], fontsize=8)
    fig.tight_layout()
    _save(fig, folder / "gamma_ranking.png")
    plt.close(fig)
    figures.append(("gamma_ranking.png", "γ per unit (growth rate of a perturbation's effect, nats per rollout step; below 0 it shrinks), most sensitive first; dead units drawn at the lowest live γ."))

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
    _save(fig, folder / "gamma_buckets.png")
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
        _save(fig, folder / "concentration.png")
        plt.close(fig)
        figures.append(("concentration.png", "Share of the total γ shift (γ − min γ) carried by the most sensitive k% of units."))

    grid = _grid_points(overall.filter(pl.col("split") == splits[0])) if splits else {}
    if grid:
        setting, grid_c = ("W4", grid["W4"]) if "W4" in grid else next(iter(grid.items()))
        matched = _matched(overall.filter(pl.col("split") == splits[0]), setting, grid_c)
        truth = metric == "mae_truth"
        fig, axes = plt.subplots(1, 2 if truth else 1, figsize=(13 if truth else 6.5, 4.2), squeeze=False)
        for row in matched.iter_rows(named=True):
            label = f"{row['method']} {row['setting']} (C = {row['achieved_C']:.3g})"
            style = "-o" if row["family"] == "tqs" else "--s"
            drift = json.loads(row.get("drift_by_step") or "null")
            if drift:
                axes[0][0].plot(range(1, len(drift) + 1), drift, style, markersize=3, label=label)
            if truth:
                curve = json.loads(row["mae_by_step"] or "null")
                if curve:
                    axes[0][1].plot(range(1, len(curve) + 1), curve, style, markersize=3, label=label)
        if truth:
            reference = json.loads(matched["ref_mae_by_step"][0] or "null") if matched.height else None
            if reference:
                axes[0][1].plot(range(1, len(reference) + 1), reference, "-", color="black", linewidth=1.5, label="FP32 model")
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
        plt.close(fig)
        figures.append(("error_growth.png", f"Error by rollout step, baselines at {setting} and TQS-PTQ at the nearest compression (linear scale)."))
    return figures


def _verdict(low: float | None, high: float | None, against_truth: bool) -> str:
    """Words for an interval: is the difference from the FP32 model more than noise?"""
    if low is None or high is None:
        return "-"
    if not against_truth:
        return "drifts from FP32" if low > 0 else "within noise of FP32"
    if low > 0:
        return "worse than FP32"
    if high < 0:
        return "better than FP32"
    return "within noise of FP32"


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
        blocks.append(("p", f"Each uniform grid point (baselines at W bits) next to TQS-PTQ at the compression nearest to it, when that is within {MATCH_TOLERANCE:.0%} (an objective with no such point has no row). Lower is better; **bold**: the best in its block and every method whose 95% interval reaches the best's (their difference is within the noise of these windows)."))
        variables = frame.filter((pl.col("split") == split) & (pl.col("variable") != "all"))
        if variables.height == 0:  # no per-variable rows: count wins per output instead
            variables = part
        for setting, grid_c in grid.items():
            table = _matched(part, setting, grid_c).filter(pl.col(metric).is_not_null())
            if table.height == 0:
                continue
            low, high, value = ("degradation_lo", "degradation_hi", "degradation_pct") if metric == "mae_truth" else ("drift_lo", "drift_hi", "drift_pct")
            outputs = table["output"].unique(maintain_order=True).to_list()
            for output in outputs:  # each output its own block and best: a best on one output once decided another's ties
                block = table.filter(pl.col("output") == output).sort(metric)
                best_high = block[high][0] if block[high][0] is not None else block[value][0]
                header = ["method", "setting", "C", "size (bytes)", label, "RMSE", f"{'degradation' if metric == 'mae_truth' else 'drift'} % [95% CI]", "verdict"]
                rows = []
                for r in block.iter_rows(named=True):
                    tied = r[low] is not None and r[low] <= best_high
                    interval = f"{_fmt(r[value], 3)} [{_fmt(r[low], 3)}, {_fmt(r[high], 3)}]" if r[low] is not None else _fmt(r[value], 3)
                    fell_back = (r.get("shipped") or "").startswith("uniform ")  # TQS-PTQ shipped a uniform model: say which
                    rows.append([r["method"], r["setting"] + (f" ({r['shipped']})" if fell_back else ""), _fmt(r["achieved_C"], 3), _fmt(r["file_bytes"]), ("**" + _fmt(r[metric]) + "**") if tied else _fmt(r[metric]),
                                 _fmt(r["rmse_truth"] if metric == "mae_truth" else r["rmse_ref"]), interval, _verdict(r[low], r[high], metric == "mae_truth")])
                blocks.append(("table", f"{setting} grid (C ≈ {grid_c:.2f})" + (f", output {output}" if len(outputs) > 1 else ""), header, rows))
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
                    wins, fallback_wins, fallbacks = 0, 0, set()
                    for output, variable in matched.select("output", "variable").unique().iter_rows():
                        v = matched.filter((pl.col("output") == output) & (pl.col("variable") == variable))
                        mine = v.filter(pl.col("method") == method)
                        rivals = v.filter(pl.col("family") == "baseline")[metric].drop_nulls()
                        if mine.height and rivals.len() and mine[metric][0] is not None and mine[metric][0] < rivals.min():
                            shipped = mine["shipped"][0] if "shipped" in mine.columns else None
                            if shipped and shipped.startswith("uniform "):
                                fallback_wins += 1  # a uniform model of a method this frontier did not run: not the allocator's win
                                fallbacks.add(shipped)
                            else:
                                wins += 1
                    cells.append(str(wins) + (f" (+{fallback_wins} by shipping {', '.join(sorted(fallbacks))}, a method not among these baselines)" if fallbacks else ""))
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
        rows.append([method, str(part.height), f"{sweep:.2f}", f"{export:.2f}", f"{evaluate:.2f}", f"{amortised + export + evaluate:.2f}"])
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
    write_text(out_dir / "report.md", md)
    write_text(out_dir / "report.html", _html(blocks, out_dir))
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


def _numeric(cell: str) -> bool:
    """Numbers (bold or with an interval) align right; names and words left."""
    return bool(re.fullmatch(r"[*]*[-+0-9.e]+[*]*( \[.*\])?", cell.strip()))


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>tqsdeploy frontier</title>
<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}table{border-collapse:collapse;margin:1em 0}\
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}\
caption{text-align:left;font-weight:bold;padding:4px 0}img{max-width:100%}figcaption{color:#555;font-size:90%}</style></head>
<body>
{%- macro text(parts) %}{% for part in parts %}{% if loop.index is even %}<b>{{ part }}</b>{% else %}{{ part }}{% endif %}{% endfor %}{% endmacro %}
{%- for block in blocks %}
{%- if block.kind in ("h1", "h2", "h3") %}
<{{ block.kind }}>{{ block.text }}</{{ block.kind }}>
{%- elif block.kind == "p" %}
<p>{{ text(block.parts) }}</p>
{%- elif block.kind == "img" %}
<figure><img src="data:image/png;base64,{{ block.data }}" alt="{{ block.caption }}"><figcaption>{{ block.caption }}</figcaption></figure>
{%- elif block.kind == "table" %}
<table>{% if block.title %}<caption>{{ block.title }}</caption>{% endif %}
<thead><tr>{% for h in block.header %}<th>{{ h }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in block.rows %}<tr>{% for cell in row %}<td{% if cell.numeric %} class="num"{% endif %}>{{ text(cell.parts) }}</td>{% endfor %}</tr>{% endfor %}</tbody></table>
{%- endif %}
{%- endfor %}
</body></html>
"""


def _html(blocks, folder: Path) -> str:
    """The blocks as one self-contained page (jinja2, autoescaped; `**x**` marks bold)."""
    from jinja2 import Environment

    items = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            items.append({"kind": kind, "text": block[1]})
        elif kind == "p":
            items.append({"kind": kind, "parts": block[1].split("**")})
        elif kind == "img":
            items.append({"kind": kind, "data": base64.b64encode((folder / block[1]).read_bytes()).decode(), "caption": block[2]})
        elif kind == "table":
            _, title, header, rows = block
            cells = [[{"parts": c.split("**"), "numeric": _numeric(c)} for c in row] for row in rows]
            items.append({"kind": kind, "title": title, "header": header, "rows": cells})
    return Environment(autoescape=True).from_string(PAGE).render(blocks=items)
