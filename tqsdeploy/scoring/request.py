"""A score as one object: what the CLI and `score(...)` build, and what `prepare` and `run_score` take."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from runtimes import DEFAULT_RUNTIME, Runtime
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.rollout.contexts import ContextOptions, Contexts
from tqsdeploy.scoring.gamma import ScoreSettings
from tqsdeploy.sweep import SweepSettings, TaskResult
from tqsdeploy.units import UnitSelection


@dataclass(frozen=True)
class ScoreRequest:
    """One score: the model and its contexts, the rollout, the run folder, and the settings of each stage."""

    model: str | Path
    contexts: str | Path | Contexts | None = None
    """An .npz or .csv of windows, windows already read, or None for random contexts (`context_options.random`)."""
    spec: RolloutSpec | str | Path | None = None
    """A rollout spec or its TOML file; None: detected from the model's shapes."""
    steps: int | None = None
    """Rollout steps, overriding the spec's."""
    out: str | Path | None = None
    """The run folder (None: `runs.default_run_dir`)."""
    resume: bool | None = None
    """None continues a matching interrupted run and refuses to overwrite a different one; True requires a
    match; False starts afresh."""
    settings: ScoreSettings = ScoreSettings()
    selection: UnitSelection = UnitSelection()
    context_options: ContextOptions = ContextOptions()
    sweep: SweepSettings = SweepSettings()
    runtime: Runtime = DEFAULT_RUNTIME
    validation: int = 0
    """Windows held out of the end of the contexts (`score --validation`): neither swept nor calibrated on, kept as
    the run's validation.npz for export to choose and judge models on."""
    held_out: tuple[int, ...] = ()
    """Windows held out by index instead (a fold of `export --select kfold`: the other windows scored); kept as
    validation.npz like `validation`'s, and their indices in run.json."""


@dataclass(frozen=True)
class ScoreProgress:
    """What a score reports as it runs, each optional: `on_start(total, done)` once its tasks are planned,
    `on_result(result)` per finished task, and `on_estimate(seconds)` the sweep's time when auto timed it,
    before any task ends (so a slow first rollout still shows an ETA)."""

    on_start: Callable[[int, int], None] | None = None
    on_result: Callable[[TaskResult], None] | None = None
    on_estimate: Callable[[float], None] | None = None
