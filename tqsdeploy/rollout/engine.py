"""The one rollout engine: a rollout spec run on a session over context windows.

Sweep, eval/gate, export's measurements and calibration all roll models out
the same way, so the rules live here once: windows run as one batch when
every input's leading axis is dynamic and the model keeps that batch (its
outputs' leading axis is a multiple of the window count), and one window at
a time otherwise; the decision is made on the first step of the first chunk
and kept. Per-step outputs come back per chunk; `window_sq` and
`trajectories` turn them into per-window numbers.

What a perturbed rollout is compared with lives here too, once for every
sweep strategy and for export's measurements: the nominal rollout
(`RolloutEngine.nominal`, `Nominal`), a step's divergence from it
(`step_total`), the per-step series with its early stopping (`Divergence`)
and the drift reports use (`drift`, `Drift`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from runtimes import Session, kept
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import RolloutSpec, next_feeds, rollout
from tqsdeploy.rollout.contexts import Contexts


@dataclass(frozen=True)
class EarlyStop:
    """Stop a rollout once gamma(t) varies by at most `tol` over `window` consecutive steps."""

    tol: float = 0.01
    window: int = 3


class Divergence:
    """One perturbed rollout's per-step mean squared divergence from the nominal, fed each step's total over
    the windows as it comes: it ends at the first non-finite step (the steps left count as inf) or, with
    `stop` and a perturbation of `delta_sq` > 0, once gamma settles. Every strategy stops the same way."""

    def __init__(
        self, windows: int, steps: int, delta_sq: float = 0.0, eps: float = 0.0, stop: EarlyStop | None = None
    ):
        self.windows, self.steps = windows, steps
        self.delta_sq, self.eps, self.stop = delta_sq, eps, stop
        self.div_sq: list[float] = []
        """Per step: mean over windows of ||Y_pert(t) - Y_nom(t)||^2."""
        self.nonfinite = False
        self._gammas: list[float] = []
        self._cumulative = 0.0

    def add(self, total: float) -> bool:
        """Records the next step's squared divergence summed over windows; True once the series has ended."""
        t = len(self.div_sq) + 1
        value = float(total / self.windows)
        if not math.isfinite(value):
            self.div_sq.extend([math.inf] * (self.steps - t + 1))
            self.nonfinite = True
            return True
        self.div_sq.append(value)
        self._cumulative += value
        return self._settled(t)

    def _settled(self, t: int) -> bool:
        """Early stopping: records step t's gamma; True once the last `window` + 1 of them vary by at most `tol`."""
        stop = self.stop
        if stop is None or self.delta_sq <= 0:
            return False
        self._gammas.append(math.log(max(self._cumulative, 1e-300) / (self.delta_sq + self.eps)) / t)
        window = self._gammas[-(stop.window + 1) :]
        return len(window) == stop.window + 1 and max(window) - min(window) <= stop.tol


STACK_BYTES = 1 << 20
"""A model run window by window has its step's divergence taken over all windows at once when the step's
outputs hold at most this much: numpy's per-call cost, not the arithmetic, is then what a window costs, and it
holds the GIL the other lanes wait for (docs/design-notes/rollout.md, 'Small steps stacked')."""


@dataclass
class Nominal:
    """The unperturbed rollout every perturbed one is compared with."""

    trajectory: list[list[dict[str, np.ndarray]]]
    """[step][chunk] -> trajectory outputs."""
    norm_sq: list[float] = field(default_factory=list)
    """Per step: mean over windows of ||Y_nom(t)||^2."""
    abs_sum: dict[str, float] = field(default_factory=dict)
    """Per trajectory output: sum of |Y_nom| over windows and steps (the scale of drift %)."""
    batched: bool = False
    _stacked: dict[int, dict[str, np.ndarray] | None] = field(default_factory=dict, repr=False)

    def stacked(self, t: int) -> dict[str, np.ndarray] | None:
        """Step t's trajectory outputs of every chunk stacked into one array per output (made once), or None
        when they are too large to copy for so little (`STACK_BYTES`) or differ in shape."""
        if t not in self._stacked:
            outs, stacked = self.trajectory[t], None
            if sum(np.asarray(v).nbytes for o in outs for v in o.values()) <= STACK_BYTES:
                try:
                    stacked = {name: np.stack([o[name] for o in outs]) for name in outs[0]}
                except ValueError:  # windows whose outputs differ in shape
                    pass
            self._stacked[t] = stacked
        return self._stacked[t]


@dataclass(frozen=True)
class Drift:
    """How far a perturbed model's rollout strays from the nominal one."""

    relative_rms: float
    """RMS trajectory divergence over all steps relative to the RMS nominal trajectory."""
    pct: dict[str, float]
    """Per trajectory output: mean |divergence| / mean |nominal| in percent (what `eval` reports as drift)."""
    div_sq: list[float]
    """Per step: mean over windows of ||Y(t) - Y_nom(t)||^2 (additive, what the knapsack prices)."""

    @property
    def worst_pct(self) -> float:
        return max(self.pct.values()) if self.pct else 0.0


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
                if all(
                    np.ndim(v) > 0 and np.shape(v)[0] % count == 0 for v in produced.values()
                ) and self._rows_independent(count, produced):
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
            batched = np.asarray(values)[(count - 1) * rows :]
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

    def window_sq(
        self, chunk: int, outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None = None
    ) -> np.ndarray:
        """Squared norm per window of a chunk's trajectory outputs (or of their difference from `reference`)."""
        return row_sq(self.spec.trajectory, outputs, reference, self.chunks[chunk][0])

    def total_sq(self, outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
        """Squared norm of a chunk's trajectory outputs' difference from `reference`, summed over its windows
        (`window_sq(...).sum()` in one float64 dot product per output: a sweep of a model run window by window
        makes this call for every step of every window)."""
        return diff_sq(self.spec.trajectory, outputs, reference)

    def trajectories(
        self, weights: Mapping[str, np.ndarray] | None = None, session: Session | None = None
    ) -> dict[str, np.ndarray]:
        """Every trajectory output as (windows, steps, *per-window shape), float64."""
        collected: dict[str, list[list[np.ndarray]]] = {
            name: [[] for _ in self.chunks] for name in self.spec.trajectory
        }
        for outs in self.steps(weights, session=session):
            for c, chunk_out in enumerate(outs):
                for name in self.spec.trajectory:
                    collected[name][c].append(chunk_out[name])
        result = {}
        first = collected[self.spec.trajectory[0]]
        for name, per_chunk in collected.items():
            if self.batched and any(
                steps[0].ndim == 0 or steps[0].shape[0] != lead[0].shape[0] for steps, lead in zip(per_chunk, first)
            ):  # an output without the windows' batch axis (a side output of fixed shape) cannot be split by window
                continue
            parts = []
            for (count, _), steps in zip(self.chunks, per_chunk):
                stacked = np.stack(steps, axis=0)  # (T, rows, ...) or (T, *output)
                if self.batched:
                    stacked = stacked.reshape(stacked.shape[0], count, -1, *stacked.shape[2:]).swapaxes(
                        0, 1
                    )  # (count, T, per, ...)
                else:
                    stacked = stacked[None]
                parts.append(stacked)
            result[name] = np.concatenate(parts).astype(np.float64)
        return result

    def nominal(self, earlier: Sequence[FirstRun | None] = ()) -> Nominal:
        """The nominal rollout on the engine's session; on a single chunk it goes on from a first step already
        run on that session (`earlier`, or the batching decision's run): the same call, so the same values."""
        try:
            chunks = self.chunks  # the batching decision (a run of the first chunk), unless made
            made = next((r for r in (*earlier, self.first_run) if r is not None and r.session is self.session), None)
            steps = (
                self._continued(made.outputs)
                if made is not None and len(chunks) == 1
                else [list(outs) for outs in self.steps()]
            )
        except RolloutError as exc:
            raise RolloutError(f"the model failed to run on the contexts: {exc}") from None
        return self.summarize(steps)

    def _continued(self, first: dict[str, np.ndarray]) -> list[list[dict[str, np.ndarray]]]:
        """The nominal rollout's steps ([step][chunk]) of a single-chunk sweep whose first step `first` already ran."""
        steps = [[{n: first[n] for n in self.spec.trajectory}]]
        if self.spec.steps > 1:
            start = next_feeds(self.chunks[0][1], first, self.spec)
            steps += [list(outs) for outs in self.steps(None, self.spec.steps - 1, starts=[start])]
        return steps

    def summarize(self, steps: list[list[dict[str, np.ndarray]]]) -> Nominal:
        """The nominal rollout of these [step][chunk] outputs, with the norms scores and drift are relative to."""
        norm_sq, abs_sum = [], {name: 0.0 for name in self.spec.trajectory}
        for t, outs in enumerate(steps):
            for name in self.spec.trajectory:
                for chunk_out in outs:
                    if not np.all(np.isfinite(chunk_out[name])):
                        raise RolloutError(
                            f"the nominal rollout produced NaN or Inf in output '{name}' at step {t + 1}"
                        )
                    abs_sum[name] += float(np.abs(chunk_out[name].astype(np.float64)).sum())
            total = sum(self.window_sq(c, outs[c]).sum() for c in range(len(outs)))
            norm_sq.append(float(total / self.contexts.count))
        return Nominal(trajectory=steps, norm_sq=norm_sq, abs_sum=abs_sum, batched=self.batched)

    def step_total(self, nominal: Nominal, t: int, outs: list[dict[str, np.ndarray]]) -> float:
        """Squared divergence of step `t` (from 0) from the nominal, summed over every window of every chunk."""
        stacked = nominal.stacked(t) if len(outs) > 1 and not self.batched else None
        if stacked is not None:  # window by window: one difference over all the step's windows
            try:
                return self.total_sq({name: np.stack([o[name] for o in outs]) for name in stacked}, stacked)
            except ValueError:  # this rollout's windows differ in shape from the nominal's
                pass
        return sum(self.total_sq(outs[c], nominal.trajectory[t][c]) for c in range(len(outs)))

    def series(self, delta_sq: float = 0.0, eps: float = 0.0, stop: EarlyStop | None = None) -> Divergence:
        """An empty per-step divergence series over these contexts and steps."""
        return Divergence(self.contexts.count, self.spec.steps, delta_sq, eps, stop)

    def divergence(
        self, totals: Iterable[float], delta_sq: float = 0.0, eps: float = 0.0, stop: EarlyStop | None = None
    ) -> tuple[list[float], bool]:
        """Per-step mean divergence of the per-step totals over windows, and whether it went non-finite;
        the totals are read no further than the series goes (`Divergence`: early stopping)."""
        series = self.series(delta_sq, eps, stop)
        for total in totals:
            if series.add(total):
                break
        return series.div_sq, series.nonfinite

    def drift(self, nominal: Nominal, steps: Iterable[list[dict[str, np.ndarray]]]) -> Drift:
        """Divergence of the rollout `steps` ([step][chunk] outputs) from the nominal, over every step, in every unit
        reports use."""
        div_sq: list[float] = []
        abs_diff = {name: 0.0 for name in self.spec.trajectory}
        for t, outs in enumerate(steps, start=1):
            reference = nominal.trajectory[t - 1]
            total = 0.0
            for c, chunk_out in enumerate(outs):
                total += self.window_sq(c, chunk_out, reference[c]).sum()
                for name in abs_diff:
                    abs_diff[name] += float(np.abs(chunk_out[name].astype(np.float64) - reference[c][name]).sum())
            div_sq.append(float(total / self.contexts.count))
        if not all(math.isfinite(v) for v in div_sq):
            return Drift(math.inf, {name: math.inf for name in abs_diff}, div_sq)
        relative = math.sqrt(sum(div_sq) / max(sum(nominal.norm_sq), 1e-300))
        pct = {name: 100 * value / max(nominal.abs_sum[name], 1e-300) for name, value in abs_diff.items()}
        return Drift(relative, pct, div_sq)

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
    BLAS dot: OpenBLAS's own threads would fight the sweep's lanes for the cores (docs/design-notes/rollout.md,
    'Divergence by einsum')."""
    total = 0.0
    for name in trajectory:
        values = _difference(np.asarray(outputs[name]), np.asarray(reference[name])).reshape(-1)
        total += float(np.einsum("i,i->", values, values, dtype=np.float64))
    return total


def row_sq(
    trajectory: Sequence[str], outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None, rows: int
) -> np.ndarray:
    """Squared norm per row (window, or probe x window of a probe-batched call) of the trajectory
    outputs, or of their difference from `reference`, summed over the outputs."""
    total = None
    for name in trajectory:
        # differences in the outputs' own float precision (exact for nearby values), squared and summed in
        # float64 by one einsum, not three float64 copies: the host's share of a GPU sweep
        values = np.asarray(outputs[name])
        if reference is not None:
            values = _difference(values, np.asarray(reference[name]))
        values = values.reshape(rows, -1)
        part = np.einsum("ij,ij->i", values, values, dtype=np.float64)
        total = part if total is None else total + part
    return total if total is not None else np.zeros(rows)
