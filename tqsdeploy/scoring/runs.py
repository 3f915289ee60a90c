"""Score runs: the folder `score` fills, read back as one typed object by the stages after it.

A run folder is self-sufficient: besides the scores it keeps the resolved
rollout spec (rollout.toml) and the contexts (contexts.npz), so later steps
(export, frontier) need nothing else. It is also the resume point: `run.json`
carries a fingerprint of everything that determines the results, and
`sweep.jsonl` the finished tasks. `ScoreRun` is the only reader of run.json:
later stages take the model, spec, settings and selection from its fields,
and `ScoreRun.prepare` makes the run's sweep ready again for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from runtimes import Runtime
from tqsdeploy._version import __version__
from tqsdeploy.errors import InputError
from tqsdeploy.files import REPLACED, file_identity
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.scoring.gamma import ScoreSettings
from tqsdeploy.scoring.prepare import Prepared, SessionOptions, prepare
from tqsdeploy.scoring.request import ScoreRequest
from tqsdeploy.sweep import SweepSettings
from tqsdeploy.units import UnitSelection

RUN_FORMAT = 1
"""The layout of run.json this version writes and reads; a run of a newer layout is refused, not misread."""
RUN_FILES = (
    "run.json",
    "sweep.jsonl",
    "measured.jsonl",
    "scores.parquet",
    "scores.csv",
    "rollout.toml",
    "contexts.npz",
    "validation.npz",
)
GENERIC_STEMS = ("model",)
"""File names exporters give every model; default output names add the folder's name to them."""


SCORE_COLUMNS = ("unit", "tensors", "params", "gamma", "dead")
"""Columns of scores.parquet that allocation and export read: a table without them is not a score run's."""


@dataclass(frozen=True)
class ScoredModel:
    """The model a run scored, as run.json keeps it."""

    path: Path
    sha256: str
    bytes: int = 0
    """The model file's size (0 in runs that did not record it)."""


@dataclass
class ScoreRun:
    """One score run: the ranked score table, and run.json as typed fields (`meta` keeps it as written,
    for reports). Made by `score` and by `ScoreRun.load`; a record this version cannot read is refused
    with one line."""

    frame: pl.DataFrame
    run_dir: Path
    meta: dict = field(default_factory=dict)
    model: ScoredModel = field(init=False)
    spec: RolloutSpec = field(init=False)
    """The rollout the run scored with (also in rollout.toml)."""
    settings: ScoreSettings = field(init=False)
    """The probe settings."""
    selection: UnitSelection = field(init=False)
    strategy: str = field(init=False)
    """How the sweep ran ('feed', 'prefix', ...; 'auto' in runs that did not record it)."""
    fingerprint: str | None = field(init=False)
    contexts_sha256: str | None = field(init=False)
    versions: dict[str, str] = field(init=False)
    """The versions of tqsdeploy and its libraries that made the run."""
    timings_s: dict = field(init=False)
    """Seconds per phase ('prepare', 'sweep', 'total'; empty while the run is unfinished)."""
    stamp: tuple | None = field(default=None, init=False, repr=False, compare=False)
    """run.json's file identity when `load` read it (`check_unchanged`)."""

    def __post_init__(self):
        self.run_dir = Path(self.run_dir)
        meta, where = self.meta, self.run_dir / "run.json"
        found = meta.get("format", 1)
        if not isinstance(found, int) or found > RUN_FORMAT:
            raise InputError(
                f"{where} is from a newer tqsdeploy (run format {found}; this version reads {RUN_FORMAT})",
                hint="upgrade tqsdeploy, or score the model again with --fresh",
            )
        try:
            probe = dict(meta["probe"])
            probe["horizons"] = tuple(probe["horizons"]) if probe.get("horizons") else None
            self.model = ScoredModel(
                Path(meta["model"]["path"]), meta["model"]["sha256"], meta["model"].get("bytes", 0)
            )
            self.spec = RolloutSpec.from_dict(meta["rollout"])
            self.settings = ScoreSettings(**probe)
            self.selection = UnitSelection(**meta["selection"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{where} is not a score run this version of tqsdeploy can read ({type(exc).__name__}: {exc})",
                hint="score the model again with --fresh",
            ) from None
        self.strategy = meta.get("strategy", "auto")
        self.fingerprint = meta.get("fingerprint")
        self.contexts_sha256 = meta.get("contexts", {}).get("sha256")
        self.versions = meta.get("versions", {})
        self.timings_s = meta.get("timings_s", {})

    @classmethod
    def load(cls, run_dir: str | Path) -> "ScoreRun":
        """A finished run's folder read back; InputError (one line) for a folder without a run this version reads."""
        run_dir = Path(run_dir)
        stamp = file_identity(run_dir / "run.json")  # before reading: a run.json replaced meanwhile reads as changed
        meta, scores = read_record(run_dir), run_dir / "scores.parquet"
        if (run_dir / REPLACED).is_dir():
            raise InputError(
                f"{run_dir} holds a run that a score --fresh was replacing when it was stopped",
                hint="run that score again: it restores the earlier run if the new one has no result yet, "
                "or finishes the new one",
            )
        if meta is None or not scores.exists():
            raise InputError(f"{run_dir} is not a finished score run (no run.json / scores.parquet)")
        try:
            frame = pl.read_parquet(scores)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise InputError(
                f"{scores} is not a readable score table ({str(exc).splitlines()[0]})",
                hint="score the model again with --fresh",
            ) from None
        missing = [column for column in SCORE_COLUMNS if column not in frame.columns]
        if missing:
            raise InputError(
                f"{scores} is not a score table this version of tqsdeploy can read (no column '{missing[0]}')",
                hint="score the model again with --fresh",
            )
        run = cls(frame=frame, run_dir=run_dir, meta=meta)
        run.stamp = stamp
        return run

    @property
    def identity(self) -> str:
        """Which run this is (`run_identity`): what export keys its prices by, and checks before writing them."""
        return run_identity(self.meta)

    def check_unchanged(self) -> None:
        """Refuse to go on writing for this run once its folder holds another: a score --fresh replaced it (one
        that did not wait for the export's `RunFolderShare`: an older tqsdeploy, a folder without locks)."""
        path = self.run_dir / "run.json"
        stamp = file_identity(path)
        if stamp is not None and stamp == self.stamp:
            return
        try:
            now = read_record(self.run_dir)
        except InputError:
            now = None
        if now is None or (self.run_dir / REPLACED).is_dir() or run_identity(now) != self.identity:
            raise InputError(
                f"the score run in {self.run_dir} was replaced while this export ran",
                hint="export again: it prices the run the folder holds now",
            )
        self.stamp = stamp

    @property
    def complete(self) -> bool:
        return self.meta.get("status") == "complete"

    @property
    def contexts_file(self) -> Path:
        return self.run_dir / "contexts.npz"

    @property
    def validation_file(self) -> Path | None:
        """The windows `score --validation` held out, or None."""
        path = self.run_dir / "validation.npz"
        return path if path.exists() else None

    @property
    def spec_file(self) -> Path:
        return self.run_dir / "rollout.toml"

    def top(self, k: int = 5) -> pl.DataFrame:
        return self.frame.head(k)

    def bottom(self, k: int = 5) -> pl.DataFrame:
        return self.frame.tail(k)

    def check_model(self, model: Path, sha256: str) -> None:
        """Refuse a model other than the one the run scored (run.json keeps its SHA-256)."""
        if sha256 != self.model.sha256:
            raise InputError(
                f"{model} is not the model the run in {self.run_dir} was scored on: "
                f"that run was made for a different model ({self.model.path}), their SHA-256 differ",
                hint="score this model first, or pass --run DIR of its own run",
            )

    def prepare(
        self,
        model: Path,
        runtime: Runtime,
        *,
        strategy: str,
        lanes: int | None,
        runtime_keeps_weights: bool,
        opset=None,
    ) -> Prepared:
        """This run's sweep made ready again on `model` and `runtime` for a later stage: the run's own contexts,
        rollout, units and probe settings, its session files kept in the run folder; `opset`: the opset its
        sessions run the model at, from the model and its units (`SessionOptions.opset`)."""
        request = ScoreRequest(
            model,
            self.contexts_file,
            self.spec_file,
            settings=self.settings,
            selection=self.selection,
            sweep=SweepSettings(strategy=strategy, lanes=lanes),
            runtime=runtime,
        )
        sessions = SessionOptions(
            workdir=self.run_dir, stream=True, runtime_keeps_weights=runtime_keeps_weights, opset=opset
        )
        return prepare(request, sessions)


def read_record(run_dir: Path) -> dict | None:
    """run.json of the folder as written, or None when it has none."""
    path = Path(run_dir) / "run.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not valid JSON ({exc})", hint="score the model again with --fresh") from None


def run_identity(meta: dict) -> str:
    """What tells a score run from another in its folder: its fingerprint (model, contexts, rollout, settings,
    units, provider: everything its rollouts depend on), or for a run recorded without one the same read from
    run.json. A run replaced by one of other settings (--steps, say) has another."""
    if meta.get("fingerprint"):
        return meta["fingerprint"]
    kept = {key: meta.get(key) for key in ("model", "contexts", "rollout", "probe", "selection", "provider")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def score_runs(folder: Path) -> list[Path]:
    """The run folders directly inside `folder`, sorted."""
    return sorted(p.parent for p in Path(folder).glob("*/run.json"))


def run_fingerprint(prepared: Prepared, settings: ScoreSettings, runtime: Runtime) -> str:
    """What determines a run's results (model, rollout, contexts, settings, units, provider): a run resumes only into
    its own."""
    spec = prepared.spec.to_dict()
    spec.pop("origin")
    identity = {
        "model": prepared.model.sha256,
        "spec": spec,
        "contexts": prepared.contexts.sha256,
        "settings": asdict(settings),
        "units": [u.tensor_names for u in prepared.units],
        "provider": runtime.provider,
    }
    if getattr(runtime, "tf32", False):  # TF32 moves γ by up to nats/step on a GPU: never resumed into an exact run
        identity["tf32"] = True
    if prepared.job.rows:
        identity["gather_rows"] = {name: rows.tolist() for name, rows in sorted(prepared.job.rows.items())}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def current_versions() -> dict:
    """The versions of tqsdeploy and its libraries in this process, as run.json records them."""
    import onnx
    import onnxruntime

    return {
        "tqsdeploy": __version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "polars": pl.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def model_label(model: str | Path) -> str:
    """The name default outputs use: the file's stem, prefixed by its folder's name when the stem is
    generic, so examples/a/model.onnx and examples/b/model.onnx get different runs and exports. The path as
    given, links not followed: a Hugging Face snapshot's model.onnx links to blobs/<hash>, which every model shares."""
    path = Path(model)
    if path.stem.lower() in GENERIC_STEMS:
        folder = Path(
            os.path.abspath(path)
        ).parent.name  # abspath: '..' and a bare name resolved lexically, not through links
        return f"{folder}_{path.stem}" if folder else path.stem
    return path.stem


def default_run_dir(model: str | Path) -> Path:
    return Path("tqs-runs") / model_label(model)
