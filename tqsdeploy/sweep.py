"""The sweep: independent (unit, probe, draw) tasks run against one session.

Every task is self-describing and deterministic, so the same list can be run
in one process (here), split across processes or machines (a distributed
executor only needs `SweepJob`, which pickles), and resumed: results are
appended to a JSON-lines table as each task finishes, and tasks already in
the table are never run again.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from runtimes import Session, SessionFactory
from tqsdeploy.contexts import Contexts
from tqsdeploy.engine import RolloutEngine
from tqsdeploy.errors import RolloutError
from tqsdeploy.probes import perturb
from tqsdeploy.rollout import RolloutSpec, rollout
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


@dataclass(frozen=True)
class EarlyStop:
    """Stop a rollout once gamma(t) varies by at most `tol` over `window` consecutive steps."""

    tol: float = 0.01
    window: int = 3


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


class ResultLog:
    """Append-only JSON-lines table of task results; the resumable part of a run."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = None
        self._last_sync = 0.0

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
        if self._handle is None:
            self._handle = open(self.path, "a", encoding="utf-8")
        record = asdict(result)
        record["div_sq"] = [v if math.isfinite(v) else None for v in record["div_sq"]]
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        now = time.monotonic()
        if now - self._last_sync > 1.0:
            os.fsync(self._handle.fileno())
            self._last_sync = now

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None


STRATEGIES = ("auto", "feed", "rebuild")
"""How perturbed weights reach the runtime: fed to one session with overridable
weights, or baked into a fresh session per perturbation; 'auto' times both."""


@dataclass
class SweepJob:
    """Everything a worker needs to run tasks; picklable by design.

    `session_factory` opens the session whose scored weights are overridable
    feeds; `rebuild_factory(weights)` opens a session with those weights baked
    in as constants (all nominal when empty).
    """

    session_factory: SessionFactory
    contexts: Contexts
    spec: RolloutSpec
    units: dict[str, Unit]
    weights: dict[str, np.ndarray]
    probe_bits: int
    seed: int
    eps: float
    max_batch_windows: int = 64
    early_stop: EarlyStop | None = None
    rebuild_factory: Callable[[dict[str, np.ndarray]], Session] | None = None
    strategy: str = "auto"

    def open(self, session: Session | None = None) -> "SweepRunner":
        """A runner; `session` is an already open overridable session to reuse."""
        return SweepRunner(self, session)


@dataclass
class Nominal:
    """The unperturbed rollout every task is compared with."""

    trajectory: list[list[dict[str, np.ndarray]]]
    """[step][chunk] -> trajectory outputs."""
    norm_sq: list[float] = field(default_factory=list)
    """Per step: mean over windows of ||Y_nom(t)||^2."""
    abs_sum: dict[str, float] = field(default_factory=dict)
    """Per trajectory output: sum of |Y_nom| over windows and steps (the scale of drift %)."""
    batched: bool = False


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


class SweepRunner:
    """Holds a live session and the nominal trajectory; runs tasks one by one.

    The nominal rollout is made the same way as the perturbed ones: with the
    'feed' strategy by the same session (weights overridable, nothing fed),
    with 'rebuild' by a session with constant weights like every perturbed
    one. Either way both share kernels and prepacking, so an inert unit
    diverges by exactly zero. 'feed' avoids a session build per perturbation;
    'rebuild' keeps the runtime's constant-weight optimisations (ONNX
    Runtime's CPU convolutions, for one, cannot pre-pack fed weights), which
    wins when builds are cheap and rollouts long. 'auto' times both once.
    """

    def __init__(self, job: SweepJob, session: Session | None = None):
        self.job = job
        self.overridable: Session = session or job.session_factory()
        self.inputs = [s for s in self.overridable.inputs if s.name not in self.overridable.weights]
        missing = {n for u in job.units.values() for n in u.tensor_names} - self.overridable.weights
        if missing:
            raise RolloutError(f"the session cannot override weight '{sorted(missing)[0]}'")
        job.spec.check(self.inputs, self.overridable.outputs)
        if job.strategy not in STRATEGIES:
            raise RolloutError(f"unknown strategy '{job.strategy}'; choose one of {', '.join(STRATEGIES)}")
        self.engine = RolloutEngine(self.overridable, job.contexts, job.spec, job.max_batch_windows)
        self.strategy = job.strategy if job.strategy != "auto" else self._choose()
        if self.strategy == "rebuild" and job.rebuild_factory is None:
            self.strategy = "feed"
        self.session: Session = self.overridable if self.strategy == "feed" else job.rebuild_factory({})
        self.engine.session = self.session
        self.nominal = self._nominal()

    def _choose(self) -> str:
        """Time one step both ways and one session build; pick the cheaper sweep."""
        if self.job.rebuild_factory is None:
            return "feed"
        try:
            chunks = self.engine.chunks
        except Exception:
            return "feed"  # let the nominal rollout report what is wrong
        names = self.job.spec.run_outputs
        unit = next(iter(self.job.units.values()))
        started = time.perf_counter()
        plain = self.job.rebuild_factory({n: self.job.weights[n] for n in unit.tensor_names})
        build = time.perf_counter() - started

        def step(session) -> float:
            best = math.inf
            for _ in range(3):
                started = time.perf_counter()
                session.run(chunks[0][1], names)
                best = min(best, time.perf_counter() - started)
            return best

        try:
            fed, baked = step(self.overridable), step(plain)
        except Exception:
            return "feed"
        runs = self.job.spec.steps * len(chunks)
        return "rebuild" if build + runs * baked < 0.9 * runs * fed else "feed"

    def _steps(self, weights=None, steps=None):
        """Step-major rollout with `weights` replaced, the way this runner's strategy applies them."""
        if self.strategy == "rebuild" and weights:
            return self.engine.steps(None, steps, session=self.job.rebuild_factory(weights))
        return self.engine.steps(weights or None, steps)

    def _nominal(self) -> Nominal:
        try:
            steps = [list(outs) for outs in self._steps()]
        except RolloutError as exc:
            raise RolloutError(f"the model failed to run on the contexts: {exc}") from None
        norm_sq, abs_sum = [], {name: 0.0 for name in self.job.spec.trajectory}
        for t, outs in enumerate(steps):
            for name in self.job.spec.trajectory:
                for chunk_out in outs:
                    if not np.all(np.isfinite(chunk_out[name])):
                        raise RolloutError(f"the nominal rollout produced NaN or Inf in output '{name}' at step {t + 1}")
                    abs_sum[name] += float(np.abs(chunk_out[name].astype(np.float64)).sum())
            total = sum(self.engine.window_sq(c, outs[c]).sum() for c in range(len(outs)))
            norm_sq.append(float(total / self.job.contexts.count))
        return Nominal(trajectory=steps, norm_sq=norm_sq, abs_sum=abs_sum, batched=self.engine.batched)

    def run(self, task: Task) -> TaskResult:
        job = self.job
        started = time.perf_counter()
        change = perturb(job.units[task.unit], job.weights, task.probe, task.draw, job.probe_bits, job.seed)
        div_sq, nonfinite = self.divergence(change.weights, change.delta_sq)
        return TaskResult(
            unit=task.unit,
            probe=task.probe,
            draw=task.draw,
            delta_sq=change.delta_sq,
            div_sq=div_sq,
            nonfinite=nonfinite,
            seconds=time.perf_counter() - started,
        )

    def divergence(self, weights: dict[str, np.ndarray], delta_sq: float = 0.0, early_stop: bool = True) -> tuple[list[float], bool]:
        """Per-step mean squared trajectory divergence of the model with `weights`
        replaced, against the nominal rollout; and whether it went non-finite.

        Early stopping (when the job asks for it and `early_stop`) needs `delta_sq`.
        """
        job = self.job
        stop = job.early_stop if early_stop else None
        div_sq: list[float] = []
        gammas: list[float] = []
        cumulative = 0.0
        for t, outs in enumerate(self._steps(weights), start=1):
            reference = self.nominal.trajectory[t - 1]
            total = sum(self.engine.window_sq(c, outs[c], reference[c]).sum() for c in range(len(outs)))
            value = float(total / job.contexts.count)
            if not math.isfinite(value):
                div_sq.extend([math.inf] * (job.spec.steps - t + 1))
                return div_sq, True
            div_sq.append(value)
            cumulative += value
            if stop is not None and delta_sq > 0:
                gammas.append(math.log(max(cumulative, 1e-300) / (delta_sq + job.eps)) / t)
                window = gammas[-(stop.window + 1):]
                if len(window) == stop.window + 1 and max(window) - min(window) <= stop.tol:
                    break
        return div_sq, False

    def drift(self, weights: dict[str, np.ndarray]) -> Drift:
        """Divergence of the model with `weights` replaced over the full rollout, in every unit reports use."""
        div_sq: list[float] = []
        abs_diff = {name: 0.0 for name in self.job.spec.trajectory}
        for t, outs in enumerate(self._steps(weights), start=1):
            reference = self.nominal.trajectory[t - 1]
            total = 0.0
            for c, chunk_out in enumerate(outs):
                total += self.engine.window_sq(c, chunk_out, reference[c]).sum()
                for name in abs_diff:
                    abs_diff[name] += float(np.abs(chunk_out[name].astype(np.float64) - reference[c][name]).sum())
            div_sq.append(float(total / self.job.contexts.count))
        if not all(math.isfinite(v) for v in div_sq):
            return Drift(math.inf, {name: math.inf for name in abs_diff}, div_sq)
        relative = math.sqrt(sum(div_sq) / max(sum(self.nominal.norm_sq), 1e-300))
        pct = {name: 100 * value / max(self.nominal.abs_sum[name], 1e-300) for name, value in abs_diff.items()}
        return Drift(relative, pct, div_sq)

    def relative_drift(self, weights: dict[str, np.ndarray]) -> float:
        """RMS trajectory divergence over all steps relative to the RMS nominal trajectory."""
        return self.drift(weights).relative_rms

    def close(self) -> None:
        self.session.close()
        self.overridable.close()


def run_local(
    job: SweepJob,
    tasks: Sequence[Task],
    log: ResultLog,
    on_result: Callable[[TaskResult], None] | None = None,
    runner: SweepRunner | None = None,
) -> None:
    """Run the tasks in this process, one session, appending each result as it lands."""
    runner = runner or job.open()
    try:
        for task in tasks:
            result = runner.run(task)
            log.append(result)
            if on_result:
                on_result(result)
    finally:
        log.close()


_WORKER: SweepRunner | None = None
"""The runner of a worker process (one session per process)."""


def _start_worker(job: SweepJob, strategy: str) -> None:
    global _WORKER
    job.strategy = strategy  # every worker runs the way the main process chose
    _WORKER = job.open()


def _run_in_worker(task: Task) -> TaskResult:
    return _WORKER.run(task)


def run_parallel(
    job: SweepJob,
    tasks: Sequence[Task],
    log: ResultLog,
    workers: int,
    strategy: str,
    on_result: Callable[[TaskResult], None] | None = None,
) -> None:
    """Run the tasks in `workers` processes, each with its own session.

    The job travels by pickling, as it would to other machines; only this
    process writes the result log, in task order, so an interruption leaves
    the same resumable table as a local run.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # forking a process that runs ONNX Runtime threads is unsafe
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(job, strategy)) as pool:
            for result in pool.map(_run_in_worker, tasks, chunksize=1):
                log.append(result)
                if on_result:
                    on_result(result)
    finally:
        log.close()


class _RayWorker:
    """A Ray actor holding one session (see `run_ray`)."""

    def __init__(self, job: SweepJob, strategy: str):
        job.strategy = strategy
        self.runner = job.open()

    def run(self, task: Task) -> TaskResult:
        return self.runner.run(task)


def run_ray(
    job: SweepJob,
    tasks: Sequence[Task],
    log: ResultLog,
    workers: int,
    strategy: str,
    address: str | None = None,
    on_result: Callable[[TaskResult], None] | None = None,
) -> None:
    """Run the tasks on `workers` Ray actors, on this machine or a cluster.

    `address` is passed to `ray.init` ('auto' joins a running cluster, None
    starts a local one). The job is put in the object store once; each actor
    opens its own session and keeps two tasks in flight, and results are
    appended to the log here, as they complete.
    """
    try:
        import ray
    except ImportError:
        raise RolloutError("Ray is not installed", hint="pip install 'tqsdeploy[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    actor = ray.remote(_RayWorker)
    shared = ray.put(job)
    actors = [actor.remote(shared, strategy) for _ in range(workers)]
    queue = list(tasks)[::-1]
    in_flight: dict = {}
    try:
        for worker in actors:
            for _ in range(2):
                if queue:
                    in_flight[worker.run.remote(queue.pop())] = worker
        while in_flight:
            done, _ = ray.wait(list(in_flight), num_returns=1)
            worker = in_flight.pop(done[0])
            result = ray.get(done[0])
            log.append(result)
            if on_result:
                on_result(result)
            if queue:
                in_flight[worker.run.remote(queue.pop())] = worker
    finally:
        log.close()
        for worker in actors:
            ray.kill(worker)
