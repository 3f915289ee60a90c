"""`export`: from a score run to deployable mixed-precision ONNX models.

`Planner` opens a score run once and composes the parts of an export, each given what it needs:

1. `PriceList`/`TierPricing` (pricing.py): every slot (a unit, or a group of a large unit's output channels)
   at every tier, its cost the bits its stored form puts in the file (`Sizing`), its loss the objective's;
   then the multiple-choice knapsack (Algorithm 1), fitted to the target as written (`Fitter`);
2. `Comparison` (compare.py): the mixed allocation (optionally refined, `Refiner`; calibrated as itself; near the
   lowest tier's size also one with the tier below it) against uniform models (`UniformModels`) rounded by every
   method that can still win, each measured by drift on the scoring contexts (`Measuring`);
3. `Writer` (writing.py): the best one, written with its allocation record.

Every encoding comes from one `Encoder`, so what is measured is what is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from runtimes import DEFAULT_RUNTIME, Runtime
from tiers import Tier, get_tiers
from tqsdeploy.encoding import checkpoints, run_cache
from tqsdeploy.encoding.calibrator import CalibrationRollout, Calibrator
from tqsdeploy.encoding.encoder import Encoder, EncodingProgress
from tqsdeploy.encoding.run_cache import CacheOptions, RunCache
from tqsdeploy.encoding.slots import check_group_size
from tqsdeploy.encoding.spill import Spill
from tqsdeploy.errors import InputError
from tqsdeploy.export.bounds import MemoryBound
from tqsdeploy.export.candidates import Candidate, MixedModels, UniformModels, relabelled
from tqsdeploy.export.compare import Comparison
from tqsdeploy.export.deployed import DeployedMemory
from tqsdeploy.export.folds import FoldOptions, Folds
from tqsdeploy.export.forms import WeightForms
from tqsdeploy.export.job import ExportJob, ScoredModel, SlotCut, load_scored
from tqsdeploy.export.measuring import Measuring
from tqsdeploy.export.pricing import PriceList, TierPricing
from tqsdeploy.export.roundings import Roundings
from tqsdeploy.export.settings import ExportSettings
from tqsdeploy.export.sizing import Sizing, output_opset
from tqsdeploy.export.validation import Validation, ValidationOptions
from tqsdeploy.export.writing import Outcome, Writer
from tqsdeploy.files import RunFolderShare
from tqsdeploy.scoring.runs import default_run_dir, score_runs


@dataclass(frozen=True)
class ExportProgress:
    """What an export reports as it goes (a command line's progress bars); every callback optional."""

    on_pass: Callable[[str, int, int, int], None] | None = None
    """A pass begins: its label, its weights, how many are done already, how many of them an earlier export left in
    the run's cache."""
    on_weight: Callable[[str], None] | None = None
    """A weight of a pass is encoded."""
    on_measuring: Callable[[int], None] | None = None
    """A reported batch of tier prices is about to run this many rollouts."""
    on_price: Callable[[object], None] | None = None
    """A tier price was measured (a `TaskResult`)."""


def find_run(model: Path | None, run: Path | None) -> Path:
    """The run folder: given, else the model's default run folder, else the only run in tqs-runs/.

    With several runs and no model, guessing (say, the newest) could export another model: refused."""
    if run is not None:
        return run
    if model is not None:
        return default_run_dir(model)
    runs = score_runs(Path("tqs-runs"))
    if not runs:
        raise InputError("no score run found in tqs-runs/", hint="run `tqsdeploy score MODEL` first or pass --run DIR")
    if len(runs) > 1:
        shown = ", ".join(str(r) for r in runs[:4]) + (", ..." if len(runs) > 4 else "")
        raise InputError(
            f"tqs-runs/ holds {len(runs)} score runs ({shown}); which model?",
            hint="name the model (tqsdeploy export MODEL ...) or pass --run DIR",
        )
    return runs[0]


class Planner:
    """Everything needed to allocate and export for one score run; `export` writes one target's model."""

    def __init__(
        self,
        run_dir: Path | str,
        model: Path | str | None = None,
        settings: ExportSettings = ExportSettings(),
        runtime: Runtime = DEFAULT_RUNTIME,
        cache: CacheOptions | None = None,
        progress: ExportProgress = ExportProgress(),
        memory: bool = False,
        validate: ValidationOptions | FoldOptions | None = None,
    ):
        """`cache`: keep every weight a pass encodes, every candidate's drift and every grid choice in the run
        folder's cache, and read back what earlier or interrupted exports of the run left there
        (`tqsdeploy.encoding.run_cache`); `finished` once every file is written. None: nothing is kept but the
        prices. `memory`: measure each written model's session memory in a fresh process beside the original's
        (`deployed.DeployedMemory`; ONNX Runtime targets). `validate`: windows held out from pricing and
        calibration that choose between the candidates (`validation.Validation`), or `FoldOptions`: the kind of
        model chosen on folds of the scoring windows instead (`folds.Folds`). Holds the run folder
        (`RunFolderShare`) until `close`."""
        self.run_dir = Path(run_dir)
        self.settings = settings
        self.progress, self._memory = progress, memory
        self.runtime, self._cache_options = runtime, cache
        self.validation: Validation | None = None
        self.folds: Folds | None = None
        self._share = RunFolderShare(self.run_dir)
        try:
            self._compose(model, runtime, cache)
        except BaseException:
            self._share.release()
            raise
        if isinstance(validate, ValidationOptions):
            try:
                self.validation = Validation(
                    validate, self.scored.model.path, self.run_dir / "rollout.toml", self.run_dir
                )
            except BaseException:
                self.close()
                raise
        if isinstance(validate, FoldOptions):
            try:
                scores, path = self.scored.scores, self.scored.model.path
                self.folds = Folds(scores, path, runtime, validate.folds, self._sub_planner, validate.settings)
            except BaseException:
                self.close()
                raise

    def _sub_planner(self, run_dir: Path, validate: ValidationOptions) -> "Planner":
        """A planner of a fold's sub-run (`Folds`): this export's settings, cache and progress, judged on its fold."""
        return Planner(
            run_dir,
            self.scored.model.path,
            self.settings,
            self.runtime,
            self._cache_options,
            self.progress,
            False,
            validate,
        )

    def _compose(self, model: Path | str | None, runtime: Runtime, cache: CacheOptions | None) -> None:
        settings = self.settings
        self.tiers: list[Tier] = get_tiers(list(settings.tier_names), settings.runtime, settings.group_size)
        self.scored: ScoredModel = load_scored(
            self.run_dir, model, settings, runtime, output_opset(self.tiers, settings)
        )
        check_group_size(settings.group_size, self.scored.layouts, self.tiers)
        forms = WeightForms(self.scored.model.proto, self.scored.layouts, settings.policy)
        self.cut = SlotCut(self.scored.units, self.scored.layouts, settings.split_fraction)
        if cache is not None and cache.fresh:
            run_cache.drop(self.run_dir)
            PriceList.drop(self.run_dir)
        self.cache = (
            RunCache(self.run_dir, run_cache.cap_bytes(cache.cap_bytes, sum(u.params for u in self.scored.units)))
            if cache is not None
            else None
        )
        self.encoder = self._encoder()
        deployed = (
            DeployedMemory(self.scored, runtime.provider)
            if self._memory and settings.engine.startswith("ort")
            else None
        )
        self.job = ExportJob(
            self.scored,
            settings,
            self.tiers,
            self.encoder,
            self.cut,
            {"rounding": 0.0, "pricing": 0.0, "refine": 0.0, "compare": 0.0},
            forms,
            self.cache,
            self._memory_bound(deployed),
        )
        self.sizing = Sizing(self.job)
        self.measuring = Measuring(self.job)
        if self.scored.one_session:
            self.encoder.before_calibration = self.measuring.release_runner
            self.encoder.spill = Spill(self.run_dir)  # kept passes in file pages, not beside the model's own
        self.uniforms = UniformModels(self.job, self.sizing, self.measuring)
        self.roundings = Roundings(self.job, self.uniforms)
        self.prices = PriceList(self.job, self.measuring, self.roundings, self.progress.on_measuring)
        self.pricing = TierPricing(self.job, self.tiers, self.prices, self.sizing)
        self.mixed = MixedModels(self.job, self.measuring)
        self.comparison = Comparison(
            self.job,
            self.sizing,
            self.pricing,
            self.roundings,
            self.uniforms,
            self.mixed,
            self.measuring,
            lambda tiers: TierPricing(self.job, tiers, self.prices, self.sizing),
        )
        self.writer = Writer(self.job, self.roundings, deployed)

    def _memory_bound(self, deployed: DeployedMemory | None) -> MemoryBound | None:
        """`--max-memory` in bytes: with memory measured, on the session's peak (the original's overhead beyond its
        weights measured once, in a fresh process); else on the weights alone."""
        if self.settings.max_memory is None:
            return None
        original = deployed.original() if deployed is not None else None
        sizes = self.scored.sizes
        return MemoryBound.of(
            self.settings.max_memory,
            sizes.reference_bits // 8,
            sizes.outside_bits // 8,
            original.peak_bytes if original is not None else None,
        )

    def _encoder(self) -> Encoder:
        """The one encoder of this export, its calibrator made on first use from the scored model."""
        scored = self.scored
        prepared = scored.prepared

        def calibrator() -> Calibrator:
            made = Calibrator(
                scored.model.proto,
                scored.layouts,
                CalibrationRollout(prepared.contexts, prepared.spec),
                scored.runtime,
                workdir=self.run_dir,
                data_dir=prepared.data_dir,
                weights=scored.weights,
                opset=scored.opset,
            )
            made.keep_statistics = not scored.one_session  # measured between its passes (`Calibrator.keep_statistics`)
            return made

        folder = (self.cache, scored.checkpoint_identity(self.settings)) if self.cache is not None else None
        progress = EncodingProgress(self.progress.on_pass, self.progress.on_weight)
        return Encoder(
            scored.units,
            scored.layouts,
            scored.weights,
            self.settings.group_size,
            calibrator=calibrator,
            checkpoints=folder,
            progress=progress,
        )

    # -- what the command line asks before any work -------------------------------------

    @property
    def model(self):
        return self.scored.model

    @property
    def layouts(self):
        return self.scored.layouts

    def check_targets(self, targets: list[float]) -> None:
        """Fail before any work when a target cannot be met."""
        self.sizing.check_targets(targets, self.tiers)

    def check_memory(self, uniform_tier: str | None = None) -> None:
        """Fail before any work when `--max-memory` is below every slot at its smallest resident form (or, for
        `uniform_tier`, below that uniform model's)."""
        bound = self.job.memory
        if bound is None:
            return
        if uniform_tier is not None:
            bound.check(self.sizing.resident_of({s.name: uniform_tier for s in self.cut.slots}))
            return
        bound.check(sum(min(held.values()) for held in self.sizing.residents(self.tiers).values()))

    def check_single_file(self, targets: list[float | None], uniform_tier: str | None = None) -> None:
        self.writer.check_single_file(targets, uniform_tier)

    def reachable(self, target: float) -> bool:
        return self.sizing.budget(self.tiers).reachable(self.sizing.floor_bits(self.tiers), target)

    def max_compression(self) -> float:
        """The largest compression reachable with these tiers (every slot at its cheapest)."""
        return self.sizing.budget(self.tiers).compression(self.sizing.floor_bits(self.tiers))

    def interrupted_outputs(self) -> set[Path]:
        """Output files an interrupted export of this run with these settings began writing: its rerun overwrites "
        "them."""
        return (
            checkpoints.interrupted_outputs(self.run_dir, self.writer.outputs_identity())
            if self.encoder.checkpoints
            else set()
        )

    # -- one target ----------------------------------------------------------------------

    def export(
        self,
        target: float | None,
        path: Path | str,
        uniform_tier: str | None = None,
        rounding: str | None = None,
        max_drift_pct: float | None = None,
        final: bool = False,
        record: dict | None = None,
    ) -> Outcome:
        """Write the model for `target` (or every unit at `uniform_tier`, codes chosen by `rounding`, default the
        export's) and its allocation record beside it, `record`'s fields added; write nothing when its drift exceeds
        `max_drift_pct` (percent, as `eval` reports drift: on the validation windows when the planner has them, else
        on the scoring contexts). `final`: no other target follows."""
        clock = (time.perf_counter(), self.encoder.profile.snapshot(), self.cache.counts() if self.cache else None)
        path = Path(path)
        chose, folded = None, None
        if uniform_tier is not None:
            compared = self._validated([self._uniform(uniform_tier, rounding, target)])
        elif self.folds is not None:
            self.folds.judged(target)  # the sub-runs first, each closed before the full run's candidates are built
            compared, chose, folded = self.folds.ranked(target, self.choose(target, final), self._by_label(target))
        else:
            compared = self.choose(target, final)
        chosen = compared[0]
        overshoot = None
        if target is not None and uniform_tier is None and chosen.allocation.compression > 1.05 * target:
            overshoot = self.comparison.overshoot(chosen, target)
        notes = self.writer.notes(chosen, compared, uniform_tier, overshoot, self.validation, folded)
        if max_drift_pct is not None and not self.within(chosen, max_drift_pct):
            return self.writer.refused(chosen, compared, path, notes, max_drift_pct, self.validation)
        if chose is None:
            chose = self.validation.record(compared) if self.validation is not None else {"windows": "scoring"}
        extra = {"chosen_on": chose, **(record or {})}
        return self.writer.ship(chosen, compared, target, path, notes, uniform_tier, clock, extra)

    def choose(self, target: float, final: bool = False) -> list[Candidate]:
        """Every candidate for `target`, best first: on the validation windows when the planner has them, else on
        the scoring contexts (`Comparison.candidates`); nothing is written."""
        return self._validated(self.comparison.candidates(target, self.progress.on_price, final))

    def _by_label(self, target: float) -> Callable[[str], Candidate | None]:
        """A uniform candidate by its label ('uniform TIER METHOD') for the folds' choice when the full run's
        comparison pruned it; None for another label."""

        def build(label: str) -> Candidate | None:
            words = label.split()
            if len(words) != 3 or words[0] != "uniform" or words[1] not in {t.name for t in self.tiers}:
                return None
            uniform = self._uniform(words[1], words[2], target)
            return relabelled(uniform, uniform.label)  # as the comparison names a uniform model shipped for a target

        return build

    def _validated(self, compared: list[Candidate]) -> list[Candidate]:
        if self.validation is None:
            return compared
        return self.validation.ranked(compared, lambda encodings, path: self.writer.write(encodings, path))

    def within(self, candidate: Candidate, max_drift_pct: float) -> bool:
        """Whether `candidate` drifts at most `max_drift_pct`: on the validation windows (what `--on` judges) when
        the planner has them, else on the scoring contexts (exact dequantization)."""
        if self.validation is not None and (drift := self.validation.known(candidate)) is not None:
            return drift.judged(self.validation.on) <= max_drift_pct
        return candidate.drift is None or candidate.drift.worst_pct <= max_drift_pct

    def _uniform(self, tier_name: str, rounding: str | None, target: float | None) -> Candidate:
        """`export --uniform`: every unit at one tier, rounded as asked (auto: the export's choice at that tier)."""
        tier = get_tiers([tier_name], self.settings.runtime, self.settings.group_size)[0]
        asked = rounding or self.settings.rounding
        chosen = self.roundings.at(tier.name) if asked == "auto" else self.roundings.measured_rounding(tier, asked)
        return self.uniforms.candidate(tier, chosen, target)

    def finished(self) -> None:
        """Every model is written: none is left for a rerun to overwrite (`interrupted_outputs`); the cache stays for
        the next export of the run."""
        if self.cache is not None:
            checkpoints.finished(self.run_dir, self.writer.outputs_identity())

    def close(self) -> None:
        """Sessions, solver threads and the hold on the run folder released (a score may then replace the run); the
        cache trimmed to its cap and its note written."""
        self.measuring.release_runner()
        self.encoder.close()
        self.writer.close()
        if self.validation is not None:
            self.validation.close()
        try:
            if self.cache is not None:
                self.cache.settle()
        finally:
            self._share.release()

    def __enter__(self) -> "Planner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
