"""What a written model takes where it runs: its session's resident memory, measured in a fresh process
(`runtimes.memory`) beside the original's, on the first context window of the score run.

A fresh process because the exporting one holds the original, the encodings and its own sessions: only a child
that does nothing else sees what a deployment pays (the peak while ONNX Runtime folds constants included).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from runtimes import IOSpec
from runtimes.memory import SessionMemory, measure_each
from tqsdeploy.evaluation.latency import LatencySettings
from tqsdeploy.evaluation.latency import measure as measure_latency
from tqsdeploy.export.job import ScoredModel

BASIS = (
    "resident-set growth of a fresh process from just before the session is created to after 3 calls on the "
    "first scoring window"
)


class DeployedMemory:
    """Peak and steady memory of each written model's session and of the original's (measured once)."""

    def __init__(self, scored: ScoredModel, provider: str):
        self.scored, self.provider = scored, provider
        self._folder = Path(tempfile.mkdtemp(prefix="tqs-memory-"))
        self._feeds: Path | None = None
        self._original = None
        self._measured_original = False

    def measure(self, path: Path) -> dict | None:
        """The model at `path` against the original, or None where memory cannot be read (not Linux, or the
        child failed). The original's child runs beside the first written model's (one start-up waited for)."""
        if self._measured_original:
            written = measure_each([path], self._feed_file(), self.provider)[0]
        else:
            written, self._original = measure_each([path, self.scored.model.path], self._feed_file(), self.provider)
            self._measured_original = True
        if written is None or self._original is None:
            return None
        return {
            "peak_bytes": written.peak_bytes,
            "steady_bytes": written.steady_bytes,
            "original_peak_bytes": self._original.peak_bytes,
            "original_steady_bytes": self._original.steady_bytes,
            "peak_ratio": written.peak_bytes / max(self._original.peak_bytes, 1),
            "basis": BASIS,
        }

    def original(self) -> SessionMemory | None:
        """The original's session memory, measured once (None where it cannot be read)."""
        if not self._measured_original:
            self._original = measure_each([self.scored.model.path], self._feed_file(), self.provider)[0]
            self._measured_original = True
        return self._original

    def _feed_file(self) -> Path:
        if self._feeds is None:
            arrays = self.scored.prepared.contexts.arrays
            self._feeds = self._folder / "feeds.npz"
            np.savez(self._feeds, **{name: values[0] for name, values in arrays.items()})
        return self._feeds

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


def timed_against_original(scored: ScoredModel, path: Path) -> dict:
    """The written model and the original timed in paired rounds on the first scoring window, one window per call,
    as `eval` times a candidate against its reference (`evaluation.latency`)."""
    contexts, runtime = scored.prepared.contexts, scored.runtime
    inputs = [IOSpec(name, values.shape[1:], values.dtype) for name, values in contexts.arrays.items()]
    return measure_latency(
        lambda: runtime.open(path),
        lambda: runtime.open(scored.model.path),
        contexts,
        inputs,
        False,
        1,
        LatencySettings(),
    )
