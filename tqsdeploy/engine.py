"""The one rollout engine: a rollout spec run on a session over context windows.

Sweep, eval/gate, export's measurements and calibration all roll models out
the same way, so the rules live here once: windows run as one batch when
every input's leading axis is dynamic and the model keeps that batch (its
outputs' leading axis is a multiple of the window count), and one window at
a time otherwise; the decision is made on the first step of the first chunk
and kept. Per-step outputs come back per chunk; `window_sq` and
`trajectories` turn them into per-window numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np

from runtimes import Session, kept
from tqsdeploy.contexts import Contexts
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import RolloutSpec, next_feeds, rollout


@dataclass(frozen=True)
class FirstRun:
    """One step of the first chunk, as a rollout on `session` would make it, and how long it took."""

    session: Session
    outputs: dict[str, np.ndarray]
    seconds: float


@dataclass
class RolloutEngine:
    """Rolls `spec` out from every context window on `session` (or a session passed per call)."""

    session: Session
    contexts: Contexts
    spec: RolloutSpec
    max_batch: int = 64
    _chunks: list[tuple[int, dict[str, np.ndarray]]] | None = field(default=None, init=False, repr=False)
    batched: bool = field(default=False, init=False)
    first_run: "FirstRun | None" = field(default=None, init=False, repr=False)
    """The batching decision's run (the first step of the first chunk), for whoever would make it again."""

    @property
    def inputs(self):
        return [s for s in self.session.inputs if s.name not in self.session.weights]

    @property
    def chunks(self) -> list[tuple[int, dict[str, np.ndarray]]]:
        """(window count, feeds) per chunk, batching decided on first use."""
        if self._chunks is None:
            self._chunks = self._decide()
        return self._chunks

    def assume(self, batched: bool) -> None:
        """Take the batching decision an earlier engine of the same session and contexts made (no run)."""
        self.batched = batched
        self._chunks = self._chunked(batched)

    def _chunked(self, batched: bool) -> list[tuple[int, dict[str, np.ndarray]]]:
        """The contexts as batched chunks of up to `max_batch` windows, or one window per chunk."""
        return list(self.contexts.chunks(self.inputs, batched, self.max_batch if batched else 1))

    def _decide(self) -> list[tuple[int, dict[str, np.ndarray]]]:
        if self.contexts.count > 1 and all(s.rank > 0 and s.is_dynamic(0) for s in self.inputs):
            chunks = self._chunked(True)
            count, feeds = chunks[0]
            try:
                started = time.perf_counter()
                produced = self.session.run(feeds, self.spec.run_outputs)
                seconds = time.perf_counter() - started
                if all(np.ndim(v) > 0 and np.shape(v)[0] % count == 0 for v in produced.values()) and self._rows_independent(count, produced):
                    self.batched = True
                    self.first_run = FirstRun(self.session, produced, seconds)
                    return chunks
            except Exception:  # a model whose batch axis is dynamic in name only
                pass
        self.batched = False
        return self._chunked(False)

    def _rows_independent(self, count: int, produced: Mapping[str, np.ndarray]) -> bool:
        """Whether the last window of the batched chunk, run alone, gives its rows of the batched outputs.
        A leading axis that is dynamic but is not a batch (a time-first LSTM's [seq, batch, F]) keeps the
        shapes right while carrying state from one window into the next."""
        _, last = self._chunked(False)[count - 1]
        alone = self.session.run(last, self.spec.run_outputs)
        for name, values in produced.items():
            rows = np.shape(values)[0] // count
            batched = np.asarray(values)[(count - 1) * rows:]
            single = np.asarray(alone[name])
            if batched.shape != single.shape:
                return False
            if batched.dtype.kind == "f":
                scale = float(np.max(np.abs(np.where(np.isfinite(single), single, 0)))) if single.size else 0.0
                if not np.allclose(batched, single, rtol=1e-4, atol=1e-5 * scale + 1e-30, equal_nan=True):
                    return False
            elif not np.array_equal(batched, single):
                return False
        return True

    def steps(
        self,
        weights: Mapping[str, np.ndarray] | None = None,
        steps: int | None = None,
        session: Session | None = None,
        starts: Sequence[Mapping[str, np.ndarray]] | None = None,
    ) -> Iterator[list[dict[str, np.ndarray]]]:
        """Step-major rollout of all chunks: one list of chunk outputs (trajectory names) per step;
        from `starts` (each chunk's feeds at a later step) instead of the contexts when given."""
        session = session or self.session
        weights = kept(session, weights) if weights else weights  # once for every chunk
        starts = starts if starts is not None else [feeds for _, feeds in self.chunks]
        generators = [rollout(session, feeds, self.spec, weights, steps) for feeds in starts]
        try:
            yield from zip(*generators)
        except RolloutError:
            raise
        except Exception as exc:
            raise RolloutError(f"{session.name} failed to run the rollout: {str(exc).splitlines()[0]}") from None

    def window_sq(self, chunk: int, outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Squared norm per window of a chunk's trajectory outputs (or of their difference from `reference`)."""
        return row_sq(self.spec.trajectory, outputs, reference, self.chunks[chunk][0])

    def total_sq(self, outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
        """Squared norm of a chunk's trajectory outputs' difference from `reference`, summed over its windows
        (`window_sq(...).sum()` in one float64 dot product per output: a sweep of a model run window by window
        makes this call for every step of every window)."""
        return diff_sq(self.spec.trajectory, outputs, reference)

    def trajectories(self, weights: Mapping[str, np.ndarray] | None = None, session: Session | None = None) -> dict[str, np.ndarray]:
        """Every trajectory output as (windows, steps, *per-window shape), float64."""
        collected: dict[str, list[list[np.ndarray]]] = {name: [[] for _ in self.chunks] for name in self.spec.trajectory}
        for outs in self.steps(weights, session=session):
            for c, chunk_out in enumerate(outs):
                for name in self.spec.trajectory:
                    collected[name][c].append(chunk_out[name])
        result = {}
        for name, per_chunk in collected.items():
            parts = []
            for (count, _), steps in zip(self.chunks, per_chunk):
                stacked = np.stack(steps, axis=0)  # (T, rows, ...) or (T, *output)
                if self.batched:
                    stacked = stacked.reshape(stacked.shape[0], count, -1, *stacked.shape[2:]).swapaxes(0, 1)  # (count, T, per, ...)
                else:
                    stacked = stacked[None]
                parts.append(stacked)
            result[name] = np.concatenate(parts).astype(np.float64)
        return result

    def states(self, steps: int | None = None) -> list[dict[str, np.ndarray]]:
        """The feeds of every chunk at every step of the nominal rollout (teacher-forced inputs)."""
        steps = steps or self.spec.steps
        collected = []
        for _, feeds in self.chunks:
            state = dict(feeds)
            for t in range(steps):
                collected.append(state)
                if t + 1 < steps:
                    produced = self.session.run(state, self.spec.run_outputs)
                    state = next_feeds(state, produced, self.spec)
        return collected


def _difference(values: np.ndarray, other: np.ndarray) -> np.ndarray:
    """values - other in the outputs' own float precision (exact for nearby values)."""
    if values.dtype == other.dtype and values.dtype.kind == "f" and values.dtype.itemsize >= 4:
        return values - other  # the common case, without working out a result type on every step
    return np.subtract(values, other, dtype=np.result_type(values.dtype, other.dtype, np.float32))


def diff_sq(trajectory: Sequence[str], outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """Sum over the trajectory outputs of ||output - reference||^2, accumulated in float64. By einsum, not a
    BLAS dot: OpenBLAS's own threads would fight the sweep's lanes for the cores (era5_downscale's rebuild
    sweep ran 1.4x slower with `@`)."""
    total = 0.0
    for name in trajectory:
        values = _difference(np.asarray(outputs[name]), np.asarray(reference[name])).reshape(-1)
        total += float(np.einsum("i,i->", values, values, dtype=np.float64))
    return total


def row_sq(trajectory: Sequence[str], outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None, rows: int) -> np.ndarray:
    """Squared norm per row (window, or probe x window of a probe-batched call) of the trajectory
    outputs, or of their difference from `reference`, summed over the outputs."""
    total = None
    for name in trajectory:
        # differences in the outputs' own float precision (exact for nearby values), squared and summed in
        # float64 by one einsum: 8x faster than three float64 copies, the host's share of a GPU sweep
        values = np.asarray(outputs[name])
        if reference is not None:
            values = _difference(values, np.asarray(reference[name]))
        values = values.reshape(rows, -1)
        part = np.einsum("ij,ij->i", values, values, dtype=np.float64)
        total = part if total is None else total + part
    return total if total is not None else np.zeros(rows)
