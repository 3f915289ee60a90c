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

import polars as pl

from tqsdeploy.evaluation.matching import MATCH_TOLERANCE, grid_points, matched
from tqsdeploy.evaluation.plots import plots
from tqsdeploy.files import write_text

GRIDS_FOR_WINS = ("W2", "W4")


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


def build_report(
    out_dir: str | Path, model: str | Path, buckets_patterns: dict[str, str] | None = None
) -> tuple[Path, Path]:
    """Write report.md, report.html and the PNGs into `out_dir`."""
    out_dir = Path(out_dir)
    frame = pl.read_parquet(out_dir / "frontier.parquet")
    scores = pl.read_parquet(out_dir / "score" / "scores.parquet")
    meta = json.loads((out_dir / "frontier.json").read_text())
    metric, label = _metric(frame)
    roles = buckets(Path(model), scores["unit"].to_list(), buckets_patterns)
    figures = plots(frame, scores, roles, out_dir, metric)

    blocks: list[tuple] = [
        ("h1", f"Compression frontier: {Path(model).name}"),
        ("p", f"Error metric: {label}. Evaluated with {meta['runtime']}."),
        ("img", "frontier.png", figures[0][1]),
    ]
    if meta.get("budget"):
        blocks.append(("p", budget_line(meta["budget"])))
    ok = frame.filter(pl.col("variable") == "all")
    failed = frame.filter(~pl.col("status").str.starts_with("ok")).select("method", "setting", "status")
    failed = failed.unique(maintain_order=True)
    for split in ok["split"].unique(maintain_order=True):
        blocks += _split_blocks(frame, ok, split, metric, label)
    blocks += _timing_blocks(ok)
    if failed.height:
        blocks.append(("h2", "Points that did not run"))
        blocks.append(("table", "", ["method", "setting", "status"], [list(r) for r in failed.iter_rows()]))
    blocks.append(("h2", "Sensitivity"))
    for name, caption in figures[1:]:
        blocks.append(("img", name, caption))
    top = scores.head(10)
    rows = [
        [
            str(r["rank"]),
            r["unit"] if r.get("label") in (None, r["unit"]) else f"{r['label']} ({r['unit']})",
            roles.get(r["unit"], "body"),
            str(r["params"]),
            _fmt(r["gamma"]),
            _fmt(r.get("gamma_gauss")),
            str(r["dead"]),
        ]
        for r in top.iter_rows(named=True)
    ]
    blocks.append(("table", "Most sensitive units", ["rank", "unit", "role", "params", "γ", "γ gauss", "dead"], rows))
    md = _markdown(blocks)
    write_text(out_dir / "report.md", md)
    write_text(out_dir / "report.html", _html(blocks, out_dir))
    return out_dir / "report.md", out_dir / "report.html"


def budget_line(budget: dict) -> str:
    """`frontier --budget`: the most compressed point within the drift budget, in one sentence."""
    judged = "the upper end of its 95% interval over windows" if budget["judged"] == "upper" else "its estimate"
    said = f"Drift budget {budget['max_drift_pct']:g}% on the {budget['split']} contexts ({judged} judged)"
    point = budget["point"]
    if point is None:
        return f"{said}: no point meets it (meets_budget in frontier.csv)."
    return (
        f"{said}: the most compressed point within it is **{point['method']} {point['setting']}** at "
        f"{_fmt(point['achieved_C'], 3)}x, drift {_fmt(point['drift_pct'])}% (95% interval "
        f"{_fmt(point['drift_lo'])}-{_fmt(point['drift_hi'])}%); meets_budget in frontier.csv marks every point."
    )


def _split_blocks(frame: pl.DataFrame, ok: pl.DataFrame, split: str, metric: str, label: str) -> list[tuple]:
    """One split's matched tables (each grid point, each output) and its win counts."""
    part = ok.filter(pl.col("split") == split)
    grid = grid_points(part)
    blocks: list[tuple] = [
        ("h2", f"Matched compression ({split} contexts)"),
        (
            "p",
            "Each uniform grid point (baselines at W bits) next to TQS-PTQ at the compression nearest to it, when "
            f"that is within {MATCH_TOLERANCE:.0%} (an objective with no such point has no row). Lower is better; "
            "**bold**: the best in its block and every method whose 95% interval reaches the best's (their "
            "difference is within the noise of these windows).",
        ),
    ]
    variables = frame.filter((pl.col("split") == split) & (pl.col("variable") != "all"))
    if variables.height == 0:  # no per-variable rows: count wins per output instead
        variables = part
    for setting, grid_c in grid.items():
        table = matched(part, setting, grid_c).filter(pl.col(metric).is_not_null())
        blocks += _matched_tables(table, setting, grid_c, metric, label)
    if variables.height:
        blocks.append(("h3", f"Win counts ({split} contexts)"))
        blocks.append(_win_table(variables, grid, metric))
    return blocks


def _matched_tables(table: pl.DataFrame, setting: str, grid_c: float, metric: str, label: str) -> list[tuple]:
    """The points matched at one grid point, one table per output, best first: each output has its own best (one
    output's best must not decide another's ties)."""
    truth = metric == "mae_truth"
    measure = "degradation" if truth else "drift"
    columns = (f"{measure}_lo", f"{measure}_hi", f"{measure}_pct")
    outputs = table["output"].unique(maintain_order=True).to_list()
    header = ["method", "setting", "C", "size (bytes)", label, "RMSE", f"{measure} % [95% CI]", "verdict"]
    blocks = []
    for output in outputs:
        block = table.filter(pl.col("output") == output).sort(metric)
        low, high, value = columns
        best_high = block[high][0] if block[high][0] is not None else block[value][0]
        rows = [_matched_row(r, metric, columns, best_high) for r in block.iter_rows(named=True)]
        title = f"{setting} grid (C ≈ {grid_c:.2f})" + (f", output {output}" if len(outputs) > 1 else "")
        blocks.append(("table", title, header, rows))
    return blocks


def _matched_row(r: dict, metric: str, columns: tuple[str, str, str], best_high: float) -> list[str]:
    """A matched point's cells; its error in bold when its interval reaches the best's (a tie within the noise)."""
    low, high, value = columns
    truth = metric == "mae_truth"
    tied = r[low] is not None and r[low] <= best_high
    interval = _fmt(r[value], 3) + (f" [{_fmt(r[low], 3)}, {_fmt(r[high], 3)}]" if r[low] is not None else "")
    fell_back = (r.get("shipped") or "").startswith("uniform ")  # TQS-PTQ shipped a uniform model: say which
    error = ("**" + _fmt(r[metric]) + "**") if tied else _fmt(r[metric])
    return [
        r["method"],
        r["setting"] + (f" ({r['shipped']})" if fell_back else ""),
        _fmt(r["achieved_C"], 3),
        _fmt(r["file_bytes"]),
        error,
        _fmt(r["rmse_truth"] if truth else r["rmse_ref"]),
        interval,
        _verdict(r[low], r[high], truth),
    ]


def _win_table(variables: pl.DataFrame, grid: dict[str, float], metric: str) -> tuple:
    """How many variables (or outputs) each TQS-PTQ objective beats every baseline on, at the W2 and W4 grid points."""
    header = ["TQS-PTQ objective", *[f"wins at {g}" for g in GRIDS_FOR_WINS if g in grid], "variables"]
    count = variables.select("output", "variable").n_unique()
    rows = []
    for method in variables.filter(pl.col("family") == "tqs")["method"].unique(maintain_order=True):
        cells = [_wins(matched(variables, g, grid[g]), method, metric) for g in GRIDS_FOR_WINS if g in grid]
        rows.append([method, *cells, str(count)])
    return ("table", "TQS-PTQ beats the best uniform method at the nearest compression", header, rows)


def _wins(points: pl.DataFrame, method: str, metric: str) -> str:
    """`method`'s wins among `points` (one grid point's matches): a uniform model it shipped of a method this
    frontier did not run is counted apart, as it is not the allocator's win."""
    if not (points["method"] == method).any():
        return "n/a (no point within 5%)"
    wins, fallback_wins, fallbacks = 0, 0, set()
    for output, variable in points.select("output", "variable").unique().iter_rows():
        v = points.filter((pl.col("output") == output) & (pl.col("variable") == variable))
        mine = v.filter(pl.col("method") == method)
        rivals = v.filter(pl.col("family") == "baseline")[metric].drop_nulls()
        if mine.height and rivals.len() and mine[metric][0] is not None and mine[metric][0] < rivals.min():
            shipped = mine["shipped"][0] if "shipped" in mine.columns else None
            if shipped and shipped.startswith("uniform "):
                fallback_wins += 1
                fallbacks.add(shipped)
            else:
                wins += 1
    if not fallbacks:
        return str(wins)
    return f"{wins} (+{fallback_wins} by shipping {', '.join(sorted(fallbacks))}, a method not among these baselines)"


def _timing_blocks(ok: pl.DataFrame) -> list[tuple]:
    """Seconds per point of each method, on the first split (the sweep once; TQS-PTQ's amortised over its points)."""
    timing = ok.filter(pl.col("split") == ok["split"].first()).filter(pl.col("achieved_C").is_not_null())
    rows = []
    for method in timing["method"].unique(maintain_order=True):
        part = timing.filter(pl.col("method") == method)
        sweep = float(part["sweep_s"].fill_null(0).max())
        export, evaluate = float(part["export_s"].fill_null(0).mean()), float(part["eval_s"].fill_null(0).mean())
        amortised = sweep / part.height if part["family"].first() == "tqs" else 0.0
        total = amortised + export + evaluate
        rows.append([method, str(part.height), f"{sweep:.2f}", f"{export:.2f}", f"{evaluate:.2f}", f"{total:.2f}"])
    caption = (
        "Seconds; TQS-PTQ shares one score sweep over all its points and prices every slot once, in its first "
        "export (both amortised in the last column)"
    )
    header = ["method", "points", "sweep (once)", "export / point", "eval / point", "total / point"]
    return [("h2", "Time per Pareto point"), ("table", caption, header, rows)]


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
<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}\
table{border-collapse:collapse;margin:1em 0}\
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}\
td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}\
caption{text-align:left;font-weight:bold;padding:4px 0}img{max-width:100%}\
figcaption{color:#555;font-size:90%}</style></head>
<body>
{%- macro text(parts) %}{% for part in parts %}\
{% if loop.index is even %}<b>{{ part }}</b>{% else %}{{ part }}{% endif %}\
{% endfor %}{% endmacro %}
{%- for block in blocks %}
{%- if block.kind in ("h1", "h2", "h3") %}
<{{ block.kind }}>{{ block.text }}</{{ block.kind }}>
{%- elif block.kind == "p" %}
<p>{{ text(block.parts) }}</p>
{%- elif block.kind == "img" %}
<figure><img src="data:image/png;base64,{{ block.data }}" alt="{{ block.caption }}">\
<figcaption>{{ block.caption }}</figcaption></figure>
{%- elif block.kind == "table" %}
<table>{% if block.title %}<caption>{{ block.title }}</caption>{% endif %}
<thead><tr>{% for h in block.header %}<th>{{ h }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in block.rows %}<tr>{% for cell in row %}\
<td{% if cell.numeric %} class="num"{% endif %}>{{ text(cell.parts) }}</td>\
{% endfor %}</tr>{% endfor %}</tbody></table>
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
            items.append(
                {"kind": kind, "data": base64.b64encode((folder / block[1]).read_bytes()).decode(), "caption": block[2]}
            )
        elif kind == "table":
            _, title, header, rows = block
            cells = [[{"parts": c.split("**"), "numeric": _numeric(c)} for c in row] for row in rows]
            items.append({"kind": kind, "title": title, "header": header, "rows": cells})
    return Environment(autoescape=True).from_string(PAGE).render(blocks=items)
