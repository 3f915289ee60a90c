"""Validation windows: held-out windows an export judges its candidates on, not the ones it was priced and
calibrated on.

A candidate is written to a scratch file and evaluated as `tqsdeploy eval` would (`evaluate`: what ONNX Runtime
runs with its default session options, the drift's 95% interval over windows), so the number that chooses a model
is the number a user then measures. The original's trajectories are rolled out once for every candidate.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from tqsdeploy.errors import InputError, TqsError
from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate
from tqsdeploy.export.candidates import Candidate, rank

JUDGED = ("upper", "point")
"""What a drift budget judges on the validation windows: the upper end of the 95% interval over windows (the
default, as `gate --on upper`: a model meets it only when the noise of the windows cannot put it over) or the
point estimate."""


@dataclass(frozen=True)
class ValidationDrift:
    """The worst trajectory output's drift from the original on the validation windows (percent, as eval reports
    it) with its 95% interval over windows."""

    pct: float
    ci95: tuple[float, float]
    output: str

    def judged(self, on: str) -> float:
        return self.ci95[1] if on == "upper" else self.pct

    def record(self) -> dict:
        return {"drift_pct": self.pct, "drift_ci95": list(self.ci95), "output": self.output}

    def text(self) -> str:
        return f"{self.pct:.4g}% (95% interval {self.ci95[0]:.4g}-{self.ci95[1]:.4g}%)"


def worst_drift(report: dict, on: str = "upper") -> ValidationDrift:
    """The output that drifts most (by what `on` judges) in an `evaluate` report; a non-finite one drifts
    infinitely."""
    found = []
    for name, entry in report["outputs"].items():
        ref = entry.get("vs_reference")
        if ref is None:
            found.append(ValidationDrift(math.inf, (math.inf, math.inf), name))
            continue
        low, high = ref.get("drift_pct_ci95") or (ref["drift_pct"], ref["drift_pct"])
        found.append(ValidationDrift(ref["drift_pct"], (low, high), name))
    return max(found, key=lambda drift: (drift.judged(on), drift.pct))


@dataclass(frozen=True)
class ValidationOptions:
    """What `export --validate` asks: the windows and what a drift bound judges on them."""

    windows: Path
    on: str = "upper"
    settings: EvalSettings = EvalSettings()

    def __post_init__(self):
        if self.on not in JUDGED:
            raise InputError(f"--on takes {' or '.join(JUDGED)}, not '{self.on}'")


class Validation:
    """Judges an export's candidates on the validation windows (see the module); each candidate once."""

    def __init__(self, options: ValidationOptions, reference: Path, spec: Path, scratch: Path):
        """`reference`: the original model; `spec`: the score run's rollout (the same steps and feedback);
        `scratch`: a folder the candidates' scratch files go to (removed by `close`)."""
        self.options, self.reference, self.spec = options, Path(reference), Path(spec)
        self.settings = replace(options.settings, latency=None, memory=False)
        self._references: dict = {}
        self._drifts: dict[tuple, ValidationDrift] = {}
        self.windows = self._check()  # before the scratch folder is made: a refused file leaves none behind
        self._scratch = Path(tempfile.mkdtemp(prefix=".validate-", dir=scratch))

    def _check(self) -> int:
        """The original against itself on the windows: a file of the wrong inputs or shapes fails here, before any
        work (as eval would say it); the windows' count."""
        path = self.options.windows
        if not path.is_file():
            raise InputError(f"--validate {path}: no such file", hint="pass an .npz of windows (or a .csv)")
        try:
            report = evaluate(
                self.reference,
                self.reference,
                path,
                spec=self.spec,
                settings=self.settings,
                references=self._references,
            )
        except TqsError as exc:
            raise InputError(f"--validate {path}: {exc.args[0]}", hint=exc.hint) from exc
        return int(report["windows"])

    @property
    def on(self) -> str:
        return self.options.on

    def measure(self, path: Path) -> ValidationDrift:
        """A written model's drift on the validation windows."""
        report = evaluate(
            path,
            self.reference,
            self.options.windows,
            spec=self.spec,
            settings=self.settings,
            references=self._references,
        )
        return worst_drift(report, self.on)

    def drift(self, candidate: Candidate, write: Callable[[dict, Path], object]) -> ValidationDrift | None:
        """`candidate`'s drift on the validation windows, written by `write(encodings, path)` to a scratch file
        first; None for a candidate whose codes are gone (a large model keeps only the best one's)."""
        key = _key(candidate)
        if key not in self._drifts:
            if not candidate.encodings:
                return None
            folder = Path(tempfile.mkdtemp(dir=self._scratch))
            try:
                write(candidate.encodings, folder / "candidate.onnx")
                self._drifts[key] = self.measure(folder / "candidate.onnx")
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return self._drifts[key]

    def known(self, candidate: Candidate) -> ValidationDrift | None:
        return self._drifts.get(_key(candidate))

    def ranked(self, compared: list[Candidate], write: Callable[[dict, Path], object]) -> list[Candidate]:
        """`compared` (best first on the scoring contexts) ordered by drift on the validation windows (the point
        estimate, then the scoring order); a candidate that cannot be judged any more keeps its place after the
        judged ones."""
        judged = [(self.drift(c, write), index, c) for index, c in enumerate(compared)]
        order = sorted(
            judged, key=lambda item: (item[0] is None, item[0].pct if item[0] else 0.0, rank(item[2]), item[1])
        )
        return [c for _, _, c in order]

    def record(self, compared: list[Candidate]) -> dict:
        """What the allocation JSON says of the windows that chose the model, and of each candidate on them."""
        return {
            "windows": "validation",
            "source": str(self.options.windows),
            "count": self.windows,
            "judged": self.on,
            "measured_as": "tqsdeploy eval: ONNX Runtime with its default session options, the worst trajectory "
            "output's drift from the original and its 95% interval over windows",
            "candidates": [
                {"label": c.label, **(d.record() if (d := self.known(c)) is not None else {"drift_pct": None})}
                for c in compared
            ],
        }

    def note(self, chosen: Candidate, compared: list[Candidate]) -> str:
        """Which windows chose: these, and whether the scoring contexts would have chosen otherwise."""
        scoring = min(compared, key=rank)
        said = f"chosen on the {self.windows} validation windows ({self.options.windows})"
        if scoring is chosen or self.known(scoring) is None or self.known(chosen) is None:
            return f"{said}: {chosen.label} drifts least there too" + (
                f", {self.known(chosen).text()}" if self.known(chosen) is not None else ""
            )
        return (
            f"{said}: {chosen.label} drifts {self.known(chosen).text()} there, {scoring.label} "
            f"{self.known(scoring).text()}; on the scoring contexts {scoring.label} drifted less "
            f"({scoring.drift.worst_pct:.4g}% vs {chosen.drift.worst_pct:.4g}%)"
        )

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)


def _key(candidate: Candidate) -> tuple:
    """A candidate's identity within one export planner: its kind, rounding and tiers."""
    return candidate.label, candidate.rounding, tuple(sorted(candidate.allocation.tiers.items()))
