"""A new score run taking the place of the run its folder held, only once it has a result: `score --fresh`
never costs a finished run for nothing, whatever stops it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tqsdeploy.encoding.run_cache import FOLDER as CACHE
from tqsdeploy.files import REPLACED, write_json
from tqsdeploy.scoring.runs import RUN_FILES, RUN_FORMAT, read_record
from tqsdeploy.sweep import ResultLog


def holds_nothing(run_dir: Path, existing: dict) -> bool:
    """An unfinished run without one finished task (it failed or was stopped before its first result)."""
    return existing.get("status") != "complete" and not ResultLog(run_dir / "sweep.jsonl").load()


class Replacement:
    """A new run in a folder, taking the place of whatever run it held only once it has a result.

    On entry the previous run's files (`RUN_FILES`) and its export cache move into `.replaced/`; a run that fails
    or is stopped before its first task result (a nominal rollout that gives NaN, a model that fails on the
    contexts, Ctrl-C) removes what it wrote and moves them back, so `--fresh` never costs a finished run for nothing
    and the corrected command finds the folder as it was. The first result discards them."""

    def __init__(self, run_dir: Path, fresh: bool):
        self.run_dir, self.fresh, self.aside = run_dir, fresh, run_dir / REPLACED
        self.settled = not fresh

    @staticmethod
    def recover(run_dir: Path) -> None:
        """After a process killed while it replaced a run (kill -9: no `__exit__`): the run set aside comes back
        unless the new one got a result."""
        # killed before the set was whole: the run is still in place
        shutil.rmtree(run_dir / f"{REPLACED}.tmp", ignore_errors=True)
        aside = run_dir / REPLACED
        if not aside.is_dir():
            return
        replacing, new = Replacement(run_dir, True), read_record(run_dir)
        if new is not None and not holds_nothing(run_dir, new):
            replacing.recorded()
        else:
            replacing.restore()

    def __enter__(self) -> "Replacement":
        if self.fresh:  # linked into a folder renamed whole, then unlinked: a kill at any point leaves one whole copy
            gathering = self.run_dir / f"{REPLACED}.tmp"
            gathering.mkdir()
            present = [name for name in RUN_FILES if (self.run_dir / name).exists()]
            for name in present:
                try:
                    os.link(self.run_dir / name, gathering / name)
                except OSError:  # a file system without hard links
                    shutil.copy2(self.run_dir / name, gathering / name)
            if (self.run_dir / CACHE).is_dir():  # the export cache was made from the run set aside: it goes with it
                (self.run_dir / CACHE).rename(gathering / CACHE)
            gathering.rename(self.aside)
            for name in present:
                (self.run_dir / name).unlink()
            try:
                # a run folder from now on, whatever kills this
                write_json(self.run_dir / "run.json", {"format": RUN_FORMAT, "status": "starting"})
            except BaseException:  # a full disk here: no `__exit__` follows, so the run set aside comes back now
                self.restore()
                raise
        return self

    def recorded(self) -> None:
        """A result of the new run is in: the previous run is gone for good."""
        if not self.settled:
            self.settled = True
            shutil.rmtree(self.aside, ignore_errors=True)

    def __exit__(self, kind, value, traceback) -> None:
        if self.settled:
            return
        if kind is None:
            self.recorded()
        else:
            self.restore()

    def restore(self) -> None:
        """The new run's files go, the set-aside run's come back."""
        self.settled = True
        for name in RUN_FILES:
            (self.run_dir / name).unlink(missing_ok=True)
        for kept in self.aside.iterdir():
            if kept.is_dir():
                shutil.rmtree(self.run_dir / kept.name, ignore_errors=True)
            kept.replace(self.run_dir / kept.name)
        self.aside.rmdir()
