"""The frontier's steps, each with an estimate of its seconds by kind of work, so its ETA is honest from the start.

A frontier's steps differ by orders of magnitude: the score and the calibrated baselines run rollouts and
calibration passes, the first TQS-PTQ export prices every slot, the later ones add one calibrated pass, and the
evaluations (most of the steps) roll out two models once. Counting steps made the first ETA several times too long
(a user's frontier: 3 of 11 steps after 17 minutes, "ETA 62 minutes"). Here each step's cost is estimated in
rollouts of the model on the scoring contexts (`ROLLOUTS`: a calibration pass, a price, a sweep task, an
evaluation), one rollout timed before the first step (the frontier evaluates the model against itself on every
split to check its inputs), and every estimate of a kind is scaled by how long that kind's finished steps took
against their estimates (by all finished steps where none of the kind has finished yet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

PASS = 4.0
"""Rollouts one calibration pass costs (its calibration rollouts, statistics and solves), before any is timed."""
EVAL = 1.0
"""An evaluation's cost in units of the model-against-itself check it repeats."""
WRITE = 1.0
"""Rollouts the report takes to write."""


@dataclass
class Step:
    key: str
    kind: str
    rollouts: float
    """The estimate in rollouts of the model on the scoring contexts (an evaluation: checks of the model against
    itself)."""


@dataclass
class StepPlan:
    """Steps planned in order, the one in progress, and what the finished ones took by kind."""

    rollout_s: float
    """Seconds of one rollout of the model on the scoring contexts (about a third of the check's)."""
    check_s: float
    """Seconds of one evaluation of the model against itself (what an evaluation step repeats)."""
    clock: Callable[[], float] = time.monotonic
    pending: dict[str, Step] = field(default_factory=dict)
    current: tuple[Step, float] | None = None
    spent: dict[str, list[float]] = field(default_factory=dict)
    """Per kind: [seconds taken, seconds estimated] over its finished steps."""
    finished: int = 0

    def plan(self, kind: str, key: str, rollouts: float) -> None:
        """A step to come (planned again with the same key: its new estimate)."""
        self.pending[key] = Step(key, kind, rollouts)

    def drop(self, key: str) -> None:
        """A planned step that will not run (an unreachable target)."""
        self.pending.pop(key, None)

    def begin(self, key: str, kept: bool = False) -> None:
        """The step `key` starts (and the one before it is done); `kept`: taken from an earlier run, at no cost."""
        self.end()
        step = self.pending.pop(key, None) or Step(key, "other", 0.0)
        self.current = (Step(key, "kept", 0.0) if kept else step), self.clock()

    def end(self) -> None:
        if self.current is None:
            return
        step, started = self.current
        self.current = None
        self.finished += 1
        if step.kind != "kept" and step.rollouts > 0:
            taken = self.spent.setdefault(step.kind, [0.0, 0.0])
            taken[0] += self.clock() - started
            taken[1] += self.seconds(step, scaled=False)

    @property
    def total(self) -> int:
        """Every step: finished, in progress and to come."""
        return self.finished + (self.current is not None) + len(self.pending)

    def seconds(self, step: Step, scaled: bool = True) -> float:
        """The step's estimate, scaled by how its kind's finished steps (or all finished steps) compared."""
        unit = self.check_s if step.kind == "eval" else self.rollout_s
        estimate = step.rollouts * unit
        return estimate * self.ratio(step.kind) if scaled else estimate

    def ratio(self, kind: str) -> float:
        taken, estimated = self.spent.get(kind) or [sum(s[i] for s in self.spent.values()) for i in (0, 1)]
        return taken / estimated if estimated > 0 else 1.0

    def remaining(self) -> float:
        """Seconds left: the steps to come, and what the one in progress should still take."""
        left = sum(self.seconds(step) for step in self.pending.values())
        if self.current is not None:
            step, started = self.current
            left += max(0.0, self.seconds(step) - (self.clock() - started))
        return left


def baseline_rollouts(calibrated: bool, grids: int) -> float:
    """A uniform baseline: one pass per grid it is measured on (RTN: none worth counting), a rollout for each."""
    return grids * ((PASS if calibrated else 0.0) + 1.0)


def export_rollouts(prices: int, passes: int) -> float:
    """A TQS-PTQ export: the prices not measured before, the calibrated passes it runs, a few measurements."""
    return prices + passes * (PASS + 1.0) + 2.0


@dataclass(frozen=True)
class ModelShape:
    """What the estimates read off the model before it is scored: its units and the slots they are cut into."""

    units: int
    slots: int


def model_shape(model, min_params: int, split_fraction: float) -> ModelShape:
    """Units (float initializers of at least `min_params` values) and slots (a unit past `split_fraction` of the
    units' parameters is cut into groups of about that share, as `encoding.slots.make_slots` cuts), read from the
    graph alone."""
    import math

    import onnx

    from tqsdeploy.encoding.slots import MAX_PARTS

    proto = onnx.load(str(model), load_external_data=False)
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    sizes = [
        math.prod(t.dims) for t in proto.graph.initializer if t.data_type in floats and math.prod(t.dims) >= min_params
    ]
    limit = split_fraction * sum(sizes)
    slots = sum(min(MAX_PARTS, math.ceil(s / limit)) if split_fraction > 0 and s > limit else 1 for s in sizes)
    return ModelShape(max(1, len(sizes)), max(1, slots))


class FrontierSteps:
    """The frontier's steps on its progress display: each one logged, timed, and counted done when the next begins;
    the display's ETA is the plan's (`StepPlan.remaining`)."""

    def __init__(self, log: Callable[[str], None], progress, plan: StepPlan):
        self.log, self.progress, self.plan = log, progress, plan
        self.started = self.kept = 0  # steps begun, and of them those kept from an earlier run
        if progress is not None:
            progress.remaining = plan.remaining

    def expect(self, kind: str, key: str, rollouts: float) -> None:
        self.plan.plan(kind, key, rollouts)

    def drop(self, key: str) -> None:
        self.plan.drop(key)
        self.show()

    def show(self) -> None:
        """The display's total made the plan's."""
        if self.progress is not None:
            self.progress.start(self.plan.total, self.plan.finished)

    def begin(self, key: str, message: str, kept: bool = False) -> None:
        self.log(message)
        self.started += 1
        self.kept += kept
        first = self.plan.current is None and not self.plan.finished
        self.plan.begin(key, kept)
        if self.progress is not None:
            self.progress.start(self.plan.total, self.progress.done)
            if first:
                self.progress.detail = message
            else:
                self.progress.advance(detail=message)

    def done(self) -> None:
        self.plan.end()
        if self.progress is not None:
            self.progress.advance()


def expect_start(steps: FrontierSteps, settings, score_settings, shape: ModelShape, splits: list[str]) -> None:
    """Every step a frontier of `settings` (`FrontierSettings`) will take, estimated before the first: the score,
    each baseline, each TQS-PTQ point (the matched ones guessed, one per baseline width), each evaluation, the
    report."""
    from tiers import METHOD_LABELS, METHODS, tier_for_bits
    from tqsdeploy.encoding.choices import grid_options

    steps.expect("score", "score", shape.units * (score_settings.quant_probe + score_settings.gauss_draws))
    for bits in settings.bits:
        tier = tier_for_bits(bits, settings.symmetric_baselines)
        for method in settings.baselines:
            name = f"{METHOD_LABELS[method]} W{bits}"
            grids = len(grid_options(tier, method, settings.export.grids))
            steps.expect("baseline", f"export {name}", baseline_rollouts(METHODS[method].stats, grids))
            for split in splits:
                steps.expect("eval", f"eval {name} {split}", EVAL)
    guessed = [(float(t), f"C{t:g}") for t in settings.targets] + [(None, f"C?@W{bits}") for bits in settings.bits]
    expect_points(steps, settings, shape, guessed, splits, [])
    steps.expect("write", "write", WRITE)
    steps.show()


def expect_points(steps: FrontierSteps, settings, shape: ModelShape, targets, splits: list[str], guessed) -> None:
    """The TQS-PTQ points at `targets` ((C, setting) pairs) of every line and their evaluations, in place of the
    `guessed` ones: a line's first export prices every slot and runs the passes of its tiers that no baseline ran,
    the later ones a calibrated pass each (two near the lowest tier's size)."""
    from tiers import get_tiers, tier_for_bits
    from tqsdeploy.encoding.choices import grid_options

    for _, setting in guessed:
        for label in _lines(settings):
            steps.plan.drop(f"export {label} {setting}")
            for split in splits:
                steps.plan.drop(f"eval {label} {setting} {split}")
    for (label, export), line in zip(_lines(settings, True), range(1 + len(settings.variants))):
        tiers = get_tiers(list(export.tier_names), export.runtime, export.group_size)
        done = {tier_for_bits(b, settings.symmetric_baselines).name for b in settings.bits}
        methods = ("gptq", "gptaq", "qep") if export.rounding == "auto" else (export.rounding,)
        passes = sum(
            len(grid_options(t, m, export.grids))
            for t in tiers
            if t.calibratable
            for m in methods
            if not (t.name in done and m in settings.baselines)
        )
        eager = sum(t.bits < 16 for t in tiers if t.name != "fp32")
        for index, (target, setting) in enumerate(sorted(targets, key=lambda t: t[0] or 0.0)):
            first = index == 0
            rollouts = export_rollouts(shape.slots * eager if first else 0, (passes if first else 0) + 1)
            steps.expect("export first" if first else "export", f"export {label} {setting}", rollouts)
            for split in splits:
                steps.expect("eval", f"eval {label} {setting} {split}", EVAL)


def _lines(settings, with_settings: bool = False) -> list:
    """The TQS-PTQ lines' labels (with their `ExportSettings`)."""
    lines = [("TQS-PTQ", settings.export), *settings.variants]
    return lines if with_settings else [label for label, _ in lines]
