"""The sweep's unit of work and its resumable record.

Every task is self-describing and deterministic (a unit, a probe, a draw), so the same list can be run in
one process, split across processes or machines, and resumed: results are appended to a JSON-lines table
as each task finishes, and tasks already in the table are never run again.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from graph_ops.io import OutputError
from tqsdeploy.units import Unit


@dataclass(frozen=True)
class Task:
    """Perturb one unit with one probe draw and roll out."""

    unit: str
    probe: str
    draw: int = 0

    @property
    def key(self) -> str:
        return f"{self.unit}\x1f{self.probe}\x1f{self.draw}"


@dataclass
class TaskResult:
    """What one task measured: enough to recompute every score offline."""

    unit: str
    probe: str
    draw: int
    delta_sq: float
    div_sq: list[float]
    """Per step: mean over context windows of ||Y_pert(t) - Y_nom(t)||^2."""
    nonfinite: bool = False
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return Task(self.unit, self.probe, self.draw).key

    @property
    def steps(self) -> int:
        return len(self.div_sq)


def plan_tasks(units: Sequence[Unit], quant: bool, gauss_draws: int) -> list[Task]:
    tasks = []
    for unit in units:
        if quant:
            tasks.append(Task(unit.name, "quant", 0))
        tasks.extend(Task(unit.name, "gauss", d) for d in range(gauss_draws))
    return tasks


FLUSH_EVERY_S = 0.1
"""How often the result log hands its lines to the OS: a kill -9 loses at most this much finished work
(an interrupt, an error or the end of the sweep closes the log, which writes everything)."""


class ResultLog:
    """Append-only JSON-lines table of task results; the resumable part of a run."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = None
        self._last_sync = self._last_flush = 0.0

    def load(self) -> dict[str, TaskResult]:
        """Results written so far; a half-written last line (a killed run) is dropped."""
        results: dict[str, TaskResult] = {}
        if not self.path.exists():
            return results
        valid_bytes = 0
        with open(self.path, "rb") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                    record["div_sq"] = [math.inf if v is None else float(v) for v in record["div_sq"]]
                    result = TaskResult(**record)
                except (ValueError, TypeError):
                    break
                results[result.key] = result
                valid_bytes += len(line)
        if valid_bytes < self.path.stat().st_size:
            with open(self.path, "r+b") as handle:
                handle.truncate(valid_bytes)
        return results

    def append(self, result: TaskResult) -> None:
        record = dict(vars(result))  # flat fields: no deep copy (dataclasses.asdict) per task
        record["div_sq"] = [v if math.isfinite(v) else None for v in result.div_sq]
        try:  # a full disk names this file (load drops a half-written last line on resume)
            if self._handle is None:
                self._handle = open(self.path, "a", encoding="utf-8")
            self._handle.write(json.dumps(record) + "\n")
            now = time.monotonic()
            if now - self._last_flush > FLUSH_EVERY_S:  # not a write call per task (docs/design-notes/sweep.md)
                self._handle.flush()
                self._last_flush = now
            if now - self._last_sync > 1.0:
                self._handle.flush()
                os.fsync(self._handle.fileno())
                self._last_sync = now
        except OSError as exc:
            handle, self._handle = self._handle, None
            try:
                handle and handle.close()
            except OSError:
                pass  # the buffered line is lost with the disk; the error below says why
            raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None
