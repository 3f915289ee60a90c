"""The eval report's files: PREFIX.json as measured, PREFIX.md as tables (outputs, side outputs, vectors,
latency)."""

from __future__ import annotations

from pathlib import Path

from tqsdeploy.files import json_text, write_texts
from tqsdeploy.progress import counted


def _series(columns: list[str] | None) -> str:
    """' × 2 series each (CSV columns HUFL, OT)' where a univariate model read several CSV columns: every metric
    averages over them, which the window count alone would not say."""
    return f" × {len(columns)} series each (CSV columns {', '.join(columns)})" if columns and len(columns) > 1 else ""


def _output_row(name: str, o: dict) -> str:
    if o.get("nonfinite"):
        return f"| {name} | non-finite | | | | | | | | inf |"
    r, t = o["vs_reference"], o.get("vs_truth")
    growth = f"{r['growth_rate']:.4f}" if r["growth_rate"] is not None else "-"
    if t:
        low, high = t["degradation_ci95"]
        truth_cells = f"{t['mae']:.5g} | {t['reference_mae']:.5g} | {t['degradation_pct']:.3f} [{low:.3f}, {high:.3f}]"
    else:
        truth_cells = "- | - | " + f"{o['degradation_pct']:.3f} (drift)"
    return (
        f"| {name} | {r['mae']:.5g} | {r['rmse']:.5g} | [{r['mae_ci95'][0]:.4g}, {r['mae_ci95'][1]:.4g}] | "
        f"{r['drift_pct']:.3f} | {_std_cell(r)} | {growth} | {truth_cells} |"
    )


def _std_cell(r: dict) -> str:
    """The offset-free drift (% of the reference's standard deviation) with its interval; '-' in reports made
    before it existed."""
    if "drift_std_pct" not in r:
        return "-"
    low, high = r["drift_std_pct_ci95"]
    return f"{r['drift_std_pct']:.3f} [{low:.3f}, {high:.3f}]"


def _side_lines(side: dict) -> list[str]:
    moved = ", ".join(
        f"{name} " + ("non-finite" if o.get("nonfinite") else f"{o['vs_reference']['drift_pct']:.3f}%")
        for name, o in side.items()
    )
    return [
        "",
        "Outputs outside the trajectory (drift from the reference; not scored, not gated: units feeding only "
        "them score dead and go to the lowest tier; list them in the rollout spec's `trajectory` to protect "
        f"them): {moved}.",
    ]


def _vector_lines(vectors: dict) -> list[str]:
    lines = ["", "| output (vectors) | cosine mean | cosine min | same nearest neighbour |", "|---|---|---|---|"]
    for name, v in vectors.items():
        same = (
            f"{v['same_neighbour']}/{v['neighbour_vectors']}" if "same_neighbour" in v else "- (fewer than 3 vectors)"
        )
        lines.append(f"| {name} ({v['vectors']} × {v['dim']}) | {v['mean']:.6f} | {v['min']:.6f} | {same} |")
    return lines


def markdown(report: dict) -> str:
    runtime = report["runtime"]
    lines = [
        f"### Evaluation of `{Path(report['candidate']).name}` against `{Path(report['reference']).name}`",
        "",
        f"{counted(report['windows'], 'context window')}{_series(report.get('series'))} × "
        f"{counted(report['steps'], 'step')}; "
        f"compression {report['compression']:.2f}×; "
        f"{report['candidate_file_bytes'] / 1e6:.3f} MB vs {report['reference_file_bytes'] / 1e6:.3f} MB.",
        f"Runtime: {runtime['provider']}, {runtime['mode']}; MatMulNBits nodes: {runtime['matmulnbits_nodes']}.",
        (
            f"Truth: {report['truth']}."
            if report.get("truth")
            else "No truth: degradation is the drift from the reference."
        ),
        "Drift is the MAE from the reference as % of the reference's mean |value| (moves with the series' offset) "
        "and as % of its standard deviation over every window, step and value (offset-free).",
        "",
        "| output | MAE vs ref | RMSE vs ref | MAE 95% CI | drift % of mean abs(ref) | drift % of ref std [95% CI] "
        "| growth/step | MAE vs truth | ref MAE vs truth | degradation % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_output_row(name, o) for name, o in report["outputs"].items()]
    if report.get("side_outputs"):
        lines += _side_lines(report["side_outputs"])
    vectors = {name: o["cosine"] for name, o in report["outputs"].items() if "cosine" in o}
    if vectors:
        lines += _vector_lines(vectors)
    lines += forms_lines(report)
    if report.get("latency"):
        from tqsdeploy.evaluation.latency import markdown as latency_lines

        mode = f"{runtime['provider']}, {runtime['mode']}"
        lines += latency_lines(report["latency"], mode, fresh_memory=bool(report.get("memory")))
    return "\n".join(lines) + "\n"


def write_report(report: dict, prefix: Path) -> tuple[Path, Path]:
    """PREFIX.json and PREFIX.md; a prefix named like either file (--report r.json) is taken as that file's
    prefix, not written as r.json.json and r.json.md."""
    prefix = Path(prefix)
    if prefix.suffix.lower() in (".json", ".md"):
        prefix = prefix.with_suffix("")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = Path(f"{prefix}.json"), Path(f"{prefix}.md")
    write_texts({json_path: json_text(report), md_path: markdown(report)})
    return json_path, md_path


def forms_lines(report: dict) -> list[str]:
    """What the runtime runs for the candidate's weights, and the memory it takes, in a sentence each."""
    lines = []
    totals = (report.get("forms") or {}).get("totals") or {}
    if totals:
        parts = ", ".join(
            f"{t['tensors']} {form} ({t['bytes'] / 1e6:.2f} MB)"
            for form, t in sorted(totals.items(), key=lambda item: -item[1]["bytes"])
        )
        lines += ["", f"Weights as ONNX Runtime runs them (bytes held after load): {parts}."]
    oldest = report.get("oldest_onnxruntime")
    if oldest:
        because = f" ({'; '.join(oldest['because'])})" if oldest["because"] else ""
        lines += ["", f"Loads on ONNX Runtime {oldest['release']} or later{because}."]
    memory = report.get("memory")
    if memory:
        lines += [
            "",
            f"Memory ({memory['basis']}): candidate peak {memory['candidate']['peak_bytes'] / 1e6:.1f} MB, "
            f"steady {memory['candidate']['steady_bytes'] / 1e6:.1f} MB; reference peak "
            f"{memory['reference']['peak_bytes'] / 1e6:.1f} MB, "
            f"steady {memory['reference']['steady_bytes'] / 1e6:.1f} MB "
            f"({memory['peak_ratio']:.2f}x the reference's peak).",
        ]
    return lines
