"""`export --select kfold[:K]`: the kind of model shipped (mixed as priced, mixed calibrated, mixed with int1, a
uniform tier and method) chosen on windows the prices and codes were not fitted to, where the contexts are too few
to hold a validation set out for good.

The run's scoring windows are cut into K contiguous folds. Per fold, a score run of the other windows (a sub-run in
run_dir/folds/k<K>/<fold>/, the fold held out as its validation.npz; scored once and kept, so a second export reuses
it and an interrupted one resumes it) is exported as usual, and every candidate it compares is judged on the fold
(`Validation`). The kind with the lowest drift pooled over the folds is then built from the full run, every window
priced and calibrated on, and shipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from tqsdeploy.errors import InputError
from tqsdeploy.evaluation.evaluate import EvalSettings
from tqsdeploy.export.candidates import Candidate
from tqsdeploy.export.validation import ValidationOptions
from tqsdeploy.files import write_json
from tqsdeploy.scoring.request import ScoreRequest
from tqsdeploy.scoring.runs import ScoreRun, read_record
from tqsdeploy.scoring.score import run_score

SELECTIONS = ("scoring", "validation", "kfold")
"""What chooses between an export's candidates (`export --select`)."""
DEFAULT_FOLDS = 3
"""`kfold` without a count: three folds (8 windows: each sub-run fitted on 5 or 6, judged on the other 3 or 2)."""
FOLDS_FOLDER = "folds"


@dataclass(frozen=True)
class Selection:
    """`export --select`: `how` ('scoring', 'validation' or 'kfold') and, for kfold, the number of folds."""

    how: str
    folds: int = 0

    @classmethod
    def parse(cls, text: str) -> "Selection":
        """'scoring', 'validation', 'kfold' or 'kfold:K' (K >= 2); InputError (one line) for anything else."""
        how, _, count = text.partition(":")
        if how not in SELECTIONS or (count and how != "kfold"):
            raise InputError(f"--select takes scoring, validation or kfold[:K], not '{text}'")
        if how != "kfold":
            return cls(how)
        if not count:
            return cls(how, DEFAULT_FOLDS)
        if not count.isdigit() or int(count) < 2:
            raise InputError(f"--select {text}: K must be a whole number of folds, at least 2")
        return cls(how, int(count))

    @classmethod
    def asked(cls, text: str | None, held: bool, validate_given: bool, with_c: bool) -> "Selection":
        """`--select` read and checked against the rest of the command: `held`, there are validation windows
        (`validate_given`: --validate named them); `with_c`: --C was given. Default: validation when there are
        validation windows, else scoring."""
        if text is None:
            return cls("validation" if held else "scoring")
        selection = cls.parse(text)
        if selection.how == "validation" and not held:
            raise InputError(
                "--select validation needs validation windows",
                hint="pass --validate FILE or score with --validation N",
            )
        if selection.how != "validation" and validate_given:
            raise InputError(f"--validate windows choose the model: they cannot go with --select {text}")
        if selection.how == "kfold" and not with_c:
            raise InputError("--select kfold chooses between the candidates of --C: pass --C")
        return selection


@dataclass(frozen=True)
class FoldOptions:
    """What `export --select kfold:K` asks of a planner: K folds, each judged as `tqsdeploy eval` would with
    `settings`."""

    folds: int
    settings: EvalSettings = EvalSettings()


def fold_windows(count: int, folds: int) -> list[list[int]]:
    """`count` windows cut into `folds` contiguous folds of near-equal size (neighbouring windows of a series
    overlap, so a fold is a stretch of them, not every K-th); InputError when there are fewer windows than folds."""
    if folds > count:
        raise InputError(
            f"--select kfold:{folds} needs at least {folds} scoring windows; the run has {count}",
            hint="pass fewer folds, or score more contexts",
        )
    return [part.tolist() for part in np.array_split(np.arange(count), folds)]


def kind_of(label: str) -> str:
    """A candidate's kind: its label, a uniform model's grids left out ('uniform int2-asym qep/min-max' is 'uniform
    int2-asym qep'): the grids are measured per run, as the allocation is, so each fold and the full run pick theirs."""
    words = label.split()
    if words and words[0] == "uniform" and len(words) == 3:
        return " ".join([*words[:2], words[2].split("/")[0]])
    return label


@dataclass(frozen=True)
class FoldJudgment:
    """One fold: its windows, its sub-run, and each candidate kind's drift on the fold (point estimate, percent;
    kinds whose codes could not be judged are absent)."""

    windows: list[int]
    run: Path
    drifts: dict[str, float]


class Folds:
    """The folds of one export (see the module): sub-runs scored on demand, each judged per target."""

    def __init__(
        self,
        run: ScoreRun,
        model: Path,
        runtime,
        folds: int,
        open_planner: Callable[[Path, ValidationOptions], object],
        eval_settings: EvalSettings = EvalSettings(),
    ):
        """`open_planner(run_dir, validate)`: a planner of a sub-run with the export's settings, judging on
        `validate`'s windows."""
        self.run, self.model, self.runtime, self.count = run, Path(model), runtime, folds
        self.open_planner, self.eval_settings = open_planner, eval_settings
        self.windows = fold_windows(int(run.meta["contexts"]["windows"]), folds)
        self.folder = run.run_dir / FOLDS_FOLDER / f"k{folds}"
        self._judged: dict[float, list[FoldJudgment]] = {}

    def sub_run(self, index: int) -> Path:
        """Fold `index`'s score run: the one kept in the folder when it scored these windows of this run, else
        scored now (an interrupted one resumed)."""
        folder, windows = self.folder / str(index), self.windows[index]
        meta = read_record(folder) if (folder / "run.json").exists() else None
        recorded = (meta or {}).get("fold", {})
        if meta is not None and meta.get("status") == "complete" and recorded == self._record(index):
            return folder
        ours = meta is None or not recorded or recorded == self._record(index)
        run = self.run
        request = ScoreRequest(
            self.model,
            run.contexts_file,
            run.spec_file,
            out=folder,
            resume=None if ours else False,
            settings=run.settings,
            selection=run.selection,
            runtime=self.runtime,
            held_out=tuple(windows),
        )
        try:
            scored = run_score(request)
        except InputError:
            if request.resume is False:
                raise
            scored = run_score(replace(request, resume=False))  # an interrupted sub-run of another run: afresh
        write_json(folder / "run.json", {**scored.meta, "fold": self._record(index)})
        return folder

    def _record(self, index: int) -> dict:
        """What a sub-run's run.json says of its fold: which run's windows, which of them held out."""
        return {"of_run": self.run.identity, "fold": index, "folds": self.count, "held_out": self.windows[index]}

    def judged(self, target: float) -> list[FoldJudgment]:
        """Every fold's candidates for `target` judged on the fold (each sub-run exported once per target)."""
        if target not in self._judged:
            self._judged[target] = [self._judge(index, target) for index in range(self.count)]
        return self._judged[target]

    def _judge(self, index: int, target: float) -> FoldJudgment:
        folder = self.sub_run(index)
        validate = ValidationOptions(folder / "validation.npz", "upper", self.eval_settings)
        with self.open_planner(folder, validate) as planner:
            compared = planner.choose(target, final=True)
            drifts = {kind_of(c.label): d.pct for c in compared if (d := planner.validation.known(c)) is not None}
        return FoldJudgment(self.windows[index], folder, drifts)

    def pooled(self, target: float) -> dict[str, float]:
        """Each kind judged on every fold: its drift averaged over the folds, weighted by their windows."""
        judged = self.judged(target)
        kinds = set.intersection(*(set(j.drifts) for j in judged))
        total = sum(len(j.windows) for j in judged)
        return {k: sum(j.drifts[k] * len(j.windows) for j in judged) / total for k in sorted(kinds)}

    def ranked(
        self, target: float, compared: list[Candidate], build: Callable[[str], Candidate | None]
    ) -> tuple[list[Candidate], dict, str]:
        """The full run's `compared` with the kind the folds chose first (`build(label)` makes one the full run's
        comparison skipped: a uniform method it pruned), the allocation JSON's `chosen_on`, and a note."""
        pooled = self.pooled(target)
        order = sorted(pooled, key=lambda k: (pooled[k], k))
        by_kind: dict[str, Candidate] = {}
        for candidate in compared:
            by_kind.setdefault(kind_of(candidate.label), candidate)
        shipped, fallback = None, None
        for kind in order:
            shipped = by_kind.get(kind) or build(kind)
            if shipped is not None:
                break
            fallback = fallback or kind
        if shipped is None:
            shipped = compared[0]
        ranked = [shipped, *(c for c in compared if c is not shipped)]
        return ranked, self.record(target, order[0] if order else None, shipped), self._note(pooled, shipped, fallback)

    def record(self, target: float, chosen: str | None, shipped: Candidate) -> dict:
        """`chosen_on` for a model chosen on the folds."""
        judged = self.judged(target)
        pooled = self.pooled(target)
        return {
            "windows": "kfold",
            "folds": self.count,
            "fold_windows": [j.windows for j in judged],
            "fold_runs": [str(j.run.relative_to(self.run.run_dir)) for j in judged],
            "judged": "point",
            "pooled_as": "each kind's drift on each fold (fitted on the other windows), averaged weighted by windows",
            "measured_as": "tqsdeploy eval: ONNX Runtime with its default session options, the worst trajectory "
            "output's drift from the original",
            "kinds": [
                {"label": k, "pooled_drift_pct": pooled.get(k), "drift_pct_by_fold": [j.drifts.get(k) for j in judged]}
                for k in sorted({k for j in judged for k in j.drifts}, key=lambda k: (pooled.get(k, math.inf), k))
            ],
            "chosen": chosen,
            "shipped": shipped.label,
            "kind": "a candidate's label, a uniform model's grids left out (each run measures its own)",
            "built_on": "every scoring window of the run",
        }

    def _note(self, pooled: dict[str, float], shipped: Candidate, fallback: str | None) -> str:
        said = f"chosen on {self.count} folds of the scoring windows"
        kind = kind_of(shipped.label)
        drift = f"{pooled[kind]:.4g}%" if kind in pooled else "not judged on every fold"
        text = f"{said}: {shipped.label} drifted least pooled over the folds ({drift}), built on every window"
        if fallback is not None:
            text += f"; {fallback} drifted less there but the full run has no such candidate"
        return text
