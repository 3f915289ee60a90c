"""Where an export's wall time goes, by kind of work.

An export alternates between rounding solvers, calibration statistics, ONNX Runtime rollouts (the
calibration's, and the measurements that price and compare candidates) and writing files. `Profile`
adds up the wall time of each kind in the thread that runs the export; sections nest, and a nested
section's time is its own, not its parent's, so the kinds add up to at most the wall time (the rest is
"other": allocation, bookkeeping, imports). Work that lanes do in their threads counts where the export
thread waits for it (the measurement section around them).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from time import perf_counter
from typing import Iterator, Mapping

KINDS = ("solver", "statistics", "calibration_rollouts", "measurement_rollouts", "write")
"""Rounding solvers (GPTQ/GPTAQ/QEP/RTN, grid search); Hessians and cross terms; ONNX Runtime runs that
feed calibration (sessions built and run); ONNX Runtime rollouts that measure drift (pricing, refinement,
comparison); writing the model."""


class Profile:
    """Exclusive wall seconds per kind of work, counted in the thread that made the profile."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._owner = threading.get_ident()
        self._open: list[list] = []
        """[kind, time its own share last resumed] of the sections open now, innermost last."""

    @contextmanager
    def section(self, kind: str) -> Iterator[None]:
        if threading.get_ident() != self._owner:  # a lane's thread: its time shows as the waiting section's
            yield
            return
        now = perf_counter()
        if self._open:
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([kind, now])
        try:
            yield
        finally:
            end = perf_counter()
            inner = self._open.pop()
            self.seconds[inner[0]] += end - inner[1]
            if self._open:
                self._open[-1][1] = end

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def split(self, since: Mapping[str, float], wall: float) -> dict[str, float]:
        """Seconds of each kind since `since` (a `snapshot`), with "other" the rest of `wall`, rounded to ms."""
        spent = {kind: self.seconds.get(kind, 0.0) - since.get(kind, 0.0) for kind in KINDS}
        spent["other"] = max(0.0, wall - sum(spent.values()))
        spent["total"] = wall
        return {kind: round(value, 3) for kind, value in spent.items()}


def describe(split: Mapping[str, float]) -> str:
    """One line: each kind's seconds and share of the total."""
    total = split.get("total") or 1.0
    parts = [
        f"{kind.replace('_', ' ')} {seconds:.1f} s ({seconds / total:.0%})"
        for kind, seconds in split.items()
        if kind != "total"
    ]
    return f"{split.get('total', 0.0):.1f} s: " + ", ".join(parts)
