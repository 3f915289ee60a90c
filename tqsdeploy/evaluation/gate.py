"""`gate`: fail a CI build when a compressed model drifts too far.

Bounds are checked on an `evaluate` report; every bound becomes one JUnit
test case, so CI systems show which one failed.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqsdeploy.errors import InputError
from tqsdeploy.evaluation.eval_report import markdown
from tqsdeploy.evaluation.evaluate import EvalRequest, evaluate_request
from tqsdeploy.files import json_text, write_texts

SIZE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_percent(text: str, option: str) -> float:
    """'1%' or '1' -> 1.0 (percent); '0.5%' -> 0.5."""
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*%?\s*", text)
    if not match or match.group(1).count(".") > 1 or match.group(1) == ".":
        raise InputError(f"{option} takes a percentage such as 1% or 0.5, not '{text}'")
    value = float(match.group(1))
    if not math.isfinite(value):  # '1e400' reads as inf: a bound every model passes
        raise InputError(f"{option} takes a finite percentage, not '{text}'")
    return value


def parse_size(text: str, option: str = "--max-size") -> float:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(1).count(".") > 1 or match.group(1) == "." or match.group(2).lower() not in SIZE_UNITS:
        raise InputError(f"{option} takes a size such as 12MB or 500KiB, not '{text}'")
    size = float(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
    # as --min-compression 0: a bound no model can be meant to meet (0.1B: no file has a fraction of a byte)
    if not 1 <= size < math.inf:
        raise InputError(f"{option} must be a finite size of at least 1 byte, not '{text}'")
    return size


def parse_memory(text: str) -> tuple[float | None, float | None]:
    """`--max-memory`: (bytes, None) for a size such as 64MB, (None, ratio) for a ratio to the reference such as
    0.5x."""
    ratio = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*x\s*", text)
    if ratio:
        value = float(ratio.group(1))
        if not 0 < value < math.inf:
            raise InputError(f"--max-memory as a ratio must be positive, not '{text}'")
        return None, value
    return parse_size(text, "--max-memory"), None


JUDGED = {
    "upper": "upper end of the 95% interval",
    "point": "point estimate",
    "lower": "lower end of the 95% interval",
}
"""What a degradation or drift bound judges (`gate --on`): the interval's upper end (the default: a model passes
only when the windows show it within the bound), the estimate alone (exactly as asked), or the interval's lower end
(a model fails only when the windows show it past the bound, beyond their noise)."""
ENDS = {"upper": 1, "lower": 0}
"""The interval's end each judgement of one reads."""
DEFAULT_ON = "upper"


@dataclass(frozen=True)
class Bounds:
    max_degradation: float | None = None
    """Percent, on every trajectory output."""
    on: str = DEFAULT_ON
    """What the degradation and drift bounds judge: 'upper' or 'lower' (that end of the 95% interval over windows)
    or 'point' (the estimate); `JUDGED`."""
    max_drift_std: float | None = None
    """Percent of the reference's standard deviation (`drift_std_pct`, offset-free), on every trajectory output."""
    min_compression: float | None = None
    max_size: float | None = None
    """Bytes of the candidate file (external data included)."""
    per_output: dict[str, float] = field(default_factory=dict)
    """Output name -> max degradation percent."""
    min_cosine: float | None = None
    """Smallest cosine similarity of any vector, on every output with cosine metrics."""
    max_slowdown: float | None = None
    """Largest candidate/reference median latency, at every batch size measured."""
    max_memory: tuple[float | None, float | None] = (None, None)
    """The candidate session's peak memory (fresh process): at most these bytes, or this ratio to the reference's."""


@dataclass(frozen=True)
class GateRequest:
    """One `gate`: the evaluation, the bounds it must meet, and the folder of gate.json, gate.md and junit.xml."""

    evaluation: EvalRequest
    bounds: Bounds
    report_dir: Path


@dataclass(frozen=True)
class GateResult:
    report: dict
    checks: list
    """Every bound's `Check`, in the order gate.md lists them."""
    paths: dict[str, Path]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


@dataclass
class Check:
    name: str
    passed: bool
    measured: float
    bound: str
    """Readable, e.g. '<= 2%'."""
    limit: float | None = None
    """The bound's number, in `unit`."""
    operator: str = "<="
    unit: str = ""
    """'%', 'x' or 'bytes': the unit of `measured` and `limit`."""
    on: str | None = None
    """For a degradation or drift bound: what `measured` is (the 'upper' or 'lower' end of the interval, or the
    'point' estimate)."""
    estimate: float | None = None
    """For a degradation or drift bound: the point estimate, whichever `on` judged."""
    interval: list[float] | None = None
    """For a degradation or drift bound: its 95% interval over windows."""

    @property
    def shown(self) -> str:
        """The measured value with its unit (and for a bound on an interval, the estimate and the interval)."""
        value = f"{self.measured:.6g}{self.unit if self.unit in ('%', 'x') else ' ' + self.unit}".rstrip()
        if self.on in ENDS and self.interval is not None:
            low, high = self.interval
            return f"{value} ({self.on} of [{low:.4g}, {high:.4g}]; estimate {self.estimate:.4g}{self.unit})"
        if self.on == "point" and self.interval is not None:
            low, high = self.interval
            return f"{value} (estimate; interval [{low:.4g}, {high:.4g}])"
        return value


def check(report: dict, bounds: Bounds) -> list[Check]:
    """Every bound as a `Check` on the report, in the order gate.md lists them; a candidate's NaN or Inf output
    fails a check of its own where no degradation bound covers it."""
    if bounds.on not in JUDGED:
        raise InputError(f"--on must be {', '.join(JUDGED)}, not '{bounds.on}'")
    checks = [
        *_degradation_checks(report, bounds),
        *_drift_checks(report, bounds),
        *_cosine_checks(report, bounds),
        *_file_checks(report, bounds),
        *_memory_checks(report, bounds),
    ]
    if not checks:
        raise InputError(
            "gate has no bounds to check",
            hint="pass --max-degradation, --max-drift-std, --min-compression, --max-size, --min-cosine, "
            "--max-slowdown or --max-memory",
        )
    for name, output in report["outputs"].items():  # NaN or Inf out of the candidate fails whatever was bounded
        if output.get("nonfinite") and bounds.per_output.get(name, bounds.max_degradation) is None:
            checks.append(Check(f"finite[{name}]", False, math.inf, "finite (no NaN or Inf)", None, "finite"))
    return checks


def _degradation_checks(report: dict, bounds: Bounds) -> list[Check]:
    """--max-degradation and --max-degradation-output, one check per bounded trajectory output."""
    for name in bounds.per_output:
        if name not in report["outputs"]:
            raise InputError(
                f"--max-degradation-output names '{name}', "
                f"which is not a trajectory output ({', '.join(report['outputs'])})"
            )
    checks = []
    for name, output in report["outputs"].items():
        limit = bounds.per_output.get(name, bounds.max_degradation)
        if limit is not None:
            checks.append(
                _judged(
                    f"degradation[{name}] ({output['degradation_basis']}",
                    output["degradation_pct"],
                    output.get("degradation_ci95"),
                    limit,
                    bounds.on,
                )
            )
    return checks


def _drift_checks(report: dict, bounds: Bounds) -> list[Check]:
    """--max-drift-std, one check per trajectory output: the drift as % of the reference's standard deviation."""
    if bounds.max_drift_std is None:
        return []
    checks = []
    for name, output in report["outputs"].items():
        drift = output.get("vs_reference")
        if drift is None:  # a non-finite candidate: no drift to speak of
            checks.append(
                Check(f"drift_std[{name}]", False, math.inf, f"<= {bounds.max_drift_std:g}%", None, "<=", "%")
            )
            continue
        checks.append(
            _judged(
                f"drift_std[{name}] (% of the reference's std",
                drift["drift_std_pct"],
                drift.get("drift_std_pct_ci95"),
                bounds.max_drift_std,
                bounds.on,
            )
        )
    return checks


def _judged(name: str, estimate: float, interval: list[float] | None, limit: float, on: str) -> Check:
    """A bound on a measurement with an interval over windows, judged on one of its ends or its estimate (`on`);
    `name` is closed with what was judged, e.g. 'degradation[y] (truth, upper 95%)'."""
    end = on if on in ENDS and interval is not None else None
    value = interval[ENDS[end]] if end else estimate
    return Check(
        f"{name}, {f'{end} 95%' if end else 'estimate'})",
        value <= limit,
        value,
        f"<= {limit:g}%",
        limit,
        "<=",
        "%",
        end or "point",
        estimate,
        interval,
    )


def _cosine_checks(report: dict, bounds: Bounds) -> list[Check]:
    """--min-cosine, one check per output read as vectors."""
    if bounds.min_cosine is None:
        return []
    vectors = {name: output["cosine"] for name, output in report["outputs"].items() if "cosine" in output}
    if not vectors:
        raise InputError(
            f"--min-cosine: no output of {report['candidate']} was read as vectors",
            hint="pass --cosine to read every output's last axis as a vector",
        )
    return [
        Check(
            f"cosine_min[{name}]",
            v["min"] >= bounds.min_cosine,
            v["min"],
            f">= {bounds.min_cosine:g}",
            bounds.min_cosine,
            ">=",
        )
        for name, v in vectors.items()
    ]


def _file_checks(report: dict, bounds: Bounds) -> list[Check]:
    """--min-compression, --max-size and --max-slowdown (one check per batch size timed)."""
    checks = []
    if bounds.min_compression is not None:
        checks.append(
            Check(
                "compression",
                report["compression"] >= bounds.min_compression,
                report["compression"],
                f">= {bounds.min_compression:g}x",
                bounds.min_compression,
                ">=",
                "x",
            )
        )
    if bounds.max_size is not None:
        size = report["candidate_file_bytes"]
        checks.append(
            Check(
                "size_bytes",
                size <= bounds.max_size,
                size,
                f"<= {bounds.max_size:.0f} bytes",
                bounds.max_size,
                "<=",
                "bytes",
            )
        )
    if bounds.max_slowdown is not None:
        for row in (report.get("latency") or {}).get("batches", []):
            checks.append(
                Check(
                    f"slowdown[{row['windows']} windows]",
                    row["slowdown"] <= bounds.max_slowdown,
                    row["slowdown"],
                    f"<= {bounds.max_slowdown:g}x",
                    bounds.max_slowdown,
                    "<=",
                    "x",
                )
            )
    return checks


def _memory_checks(report: dict, bounds: Bounds) -> list[Check]:
    """--max-memory: the candidate session's peak in a fresh process; a gate that could not measure it fails."""
    most, ratio = bounds.max_memory
    if most is None and ratio is None:
        return []
    memory = report.get("memory")
    if not memory:
        bound = f"<= {most:.0f} bytes" if most is not None else f"<= {ratio:g}x the reference's peak"
        return [Check("memory_peak", False, math.nan, f"{bound} (not measured: needs Linux's /proc)", None)]
    peak = memory["candidate"]["peak_bytes"]
    if most is not None:
        return [Check("memory_peak_bytes", peak <= most, peak, f"<= {most:.0f} bytes", most, "<=", "bytes")]
    return [
        Check(
            "memory_peak_ratio",
            memory["peak_ratio"] <= ratio,
            memory["peak_ratio"],
            f"<= {ratio:g}x the reference's peak",
            ratio,
            "<=",
            "x",
        )
    ]


def junit(checks: list[Check], candidate: str) -> str:
    """JUnit XML, one test case per bound (built with ElementTree, which escapes once)."""
    import xml.etree.ElementTree as ET

    suite = ET.Element(
        "testsuite",
        name=f"tqsdeploy gate: {candidate}",
        tests=str(len(checks)),
        failures=str(sum(not c.passed for c in checks)),
    )
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname="tqsdeploy.gate", name=c.name)
        ET.SubElement(case, "properties")
        judged = (("on", c.on), ("estimate", c.estimate), ("interval", c.interval)) if c.on else ()
        for key, value in (
            ("measured", c.measured),
            ("limit", c.limit),
            ("operator", c.operator),
            ("unit", c.unit),
            *judged,
        ):
            ET.SubElement(case.find("properties"), "property", name=key, value=str(value))
        if not c.passed:
            ET.SubElement(case, "failure", message=f"{c.shown} violates {c.bound}")
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def judged_line(checks: list[Check]) -> str | None:
    """Which number the degradation and drift bounds judged, in words (None when there are no such bounds)."""
    on = next((c.on for c in checks if c.on), None)
    if on is None:
        return None
    others = "; ".join(f"--on {k} judges the {JUDGED[k]}" for k in JUDGED if k != on)
    return (
        f"Degradation and drift bounds judge the {JUDGED[on]} over the context windows (--on {on}"
        f"{', the default' if on == DEFAULT_ON else ''}; {others})."
    )


def gate_markdown(report: dict, checks: list[Check]) -> str:
    verdict = "passed" if all(c.passed for c in checks) else "FAILED"
    lines = [
        f"## tqsdeploy gate {verdict}: `{Path(report['candidate']).name}`",
        "",
        "| check | measured | bound | result |",
        "|---|---|---|---|",
    ]
    for c in checks:
        lines.append(f"| {c.name} | {c.shown} | {c.bound} | {'pass' if c.passed else '**fail**'} |")
    judged = judged_line(checks)
    return "\n".join(lines + (["", judged] if judged else [])) + "\n\n" + markdown(report)


def write_outputs(report: dict, checks: list[Check], folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "gate.json", "markdown": folder / "gate.md", "junit": folder / "junit.xml"}
    on = next((c.on for c in checks if c.on), None)
    payload = {
        "passed": all(c.passed for c in checks),
        "on": on,
        "judged": JUDGED.get(on),
        "checks": [c.__dict__ for c in checks],
        "report": report,
    }
    text = gate_markdown(report, checks)
    write_texts(
        {paths["json"]: json_text(payload), paths["markdown"]: text, paths["junit"]: junit(checks, report["candidate"])}
    )
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return paths


def run_gate(request: GateRequest, warn: Callable[[list[str]], None] = lambda warnings: None) -> GateResult:
    """`gate`: evaluate, tell the report's warnings (`warn`), check every bound and write the verdict's files."""
    report = evaluate_request(request.evaluation)
    warn(report.get("warnings", []))
    checks = check(report, request.bounds)
    return GateResult(report, checks, write_outputs(report, checks, request.report_dir))
