"""Executors: where a sweep's tasks run. In this process on one lane or several side by side (`run_local`,
`Lanes`), in worker processes (`run_parallel`) or on Ray actors (`run_ray`); only the calling thread writes
the result log, so an interruption leaves the same resumable table whichever runs them."""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Sequence

from runtimes import on_gpu
from tqsdeploy.errors import InputError, RolloutError
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.sweep.runner import SweepRunner
from tqsdeploy.sweep.tasks import ResultLog, Task, TaskResult


def run_local(
    job: SweepJob,
    tasks: Sequence[Task],
    log: ResultLog,
    on_result: Callable[[TaskResult], None] | None = None,
    runner: SweepRunner | None = None,
    lanes: int = 1,
) -> int:
    """Run the tasks in this process, appending each result as it lands; with `lanes` > 1, up to that
    many tasks at once (`run_lanes`: no more lanes than work items). Returns the lanes it ran."""
    runner = runner or SweepRunner(job)
    try:
        items = runner.work_items(tasks)
        lanes = max(1, min(lanes, len(items) + (not runner.nominal_made)))  # the nominal is a lane's work too
        if lanes > 1:
            run_lanes(runner, items, lanes, log, on_result)
        else:
            runner.expect(tasks)
            for i, task in enumerate(tasks):
                result = runner.run(task, tasks[i + 1] if i + 1 < len(tasks) else None)
                log.append(result)
                if on_result:
                    on_result(result)
        runner.nominal  # noqa: B018 - made even when no task was left to run (a resumed, finished sweep)
        return lanes
    finally:
        log.close()


LANES_MAX = 8
"""At most this many lanes by default: each holds a rollout's activations (and per-unit sessions)."""
LANE_EXTRA_BYTES = 512 << 20
"""By default the lanes after the first may hold this much between them: a lane's own sessions ('unit',
'batch', 'prefix' cuts) are up to a model copy each, so a model of M bytes gets at most 1 + this / M lanes
(one from 512 MiB on: its calls are large enough for ONNX Runtime's own threads anyway), and a run stays
within the memory the benchmarks hold score to (1.5 x model + 0.5 GB)."""


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def sweep_lanes(lanes: int | None, provider: str, threads: int | None, model_bytes: int) -> int:
    """How many tasks a sweep runs at once in this process.

    `lanes` None (auto): on the CPU provider one per core (or per `threads` cores when those are fixed), at
    most `LANES_MAX` and 1 + `LANE_EXTRA_BYTES` / `model_bytes`; one on a GPU, where one lane's calls
    keep it busy. An explicit number is taken as given (more lanes than cores only share them, and each
    lane holds its own per-unit sessions); more than one on a GPU provider is refused.
    """
    if lanes is not None and lanes < 1:
        raise InputError(f"--lanes must be 1 or more, not {lanes}")
    if on_gpu(provider):
        if lanes not in (None, 1):
            raise InputError(
                f"--lanes {lanes} runs tasks side by side on the CPU provider only; "
                f"on '{provider}' the sweep runs one lane",
                hint="drop --lanes",
            )
        return 1
    if lanes is None:
        return max(1, min(LANES_MAX, usable_cores() // (threads or 1), 1 + LANE_EXTRA_BYTES // max(model_bytes, 1)))
    return lanes


def interleaved(items: Sequence[Sequence[Task]], lanes: int) -> list[Task]:
    """The order `lanes` lanes ask for the tasks of `items` when each takes the next item as it finishes
    one and tasks cost alike: the first tasks of `lanes` items, then their second ones, and so on."""
    order: list[Task] = []
    for start in range(0, len(items), lanes):
        batch = items[start : start + lanes]
        for depth in range(max(len(item) for item in batch)):
            order.extend(item[depth] for item in batch if depth < len(item))
    return order


def run_lanes(
    runner: SweepRunner,
    items: Sequence[Sequence[Task]],
    lanes: int,
    log: ResultLog,
    on_result: Callable[[TaskResult], None] | None,
) -> None:
    """Run the work items on `lanes` threads (`Lanes`): `runner` and `lanes` - 1 of its `SweepRunner.lane`s.

    On the CPU provider a small model's call gains little from ONNX Runtime's intra-op threads, while
    independent tasks on one thread each scale with the cores (docs/design-notes/sweep.md, 'Lanes'): the
    sweep's tasks are independent, so they run side by side in one process, sharing the session (feed), the
    nominal and the probe builds. Only this thread writes the log and reports progress, so an interruption
    leaves a resumable table as a one-lane run does.
    """
    runner.probes.share(lanes)
    runner.expect(interleaved(items, lanes))

    def work(lane: SweepRunner, item: Sequence[Task]) -> Iterator[TaskResult]:
        if item is _NOMINAL:
            lane.nominal  # noqa: B018 - made here, on the first lane free, while the others run tasks
            return
        for i, task in enumerate(item):
            yield lane.run(task, item[i + 1] if i + 1 < len(item) else None)

    runners = [runner] + [runner.lane() for _ in range(lanes - 1)]
    try:
        with Lanes(runners, ([_NOMINAL] if not runner.nominal_made else []) + list(items), work) as results:
            for result in results:
                log.append(result)
                if on_result:
                    on_result(result)
    finally:
        for lane in runners[1:]:
            lane.close()


_NOMINAL = object()
"""The work item that makes the nominal rollout on a lane (`run_lanes`)."""
_LANE_DONE = object()
"""What a lane puts on the result queue as it ends."""


class Lanes:
    """Runs `work(lane, item)` for every item, one thread per runner in `runners`, each taking the next item
    as it frees; iterating gives what the work yields, in the iterating thread, as it lands. The first
    error a lane raises is raised there; leaving the `with` block (finished, an error, Ctrl-C) stops every
    lane once the result in hand is done. ONNX Runtime's `run` is thread-safe and releases the GIL, and on
    the CPU provider a one-thread session runs a call on the caller's thread: lanes over sessions of one
    thread each use one core each."""

    def __init__(
        self,
        runners: Sequence[SweepRunner],
        items: Sequence[object],
        work: Callable[[SweepRunner, object], Iterable[object]],
    ):
        self._runners, self._work = list(runners), work
        self._pending = deque(items)
        self._taken = threading.Lock()
        self._stop = threading.Event()
        self._results: queue.Queue = queue.Queue()
        self._pool: ThreadPoolExecutor | None = None

    def _lane(self, runner: SweepRunner) -> None:
        try:
            while not self._stop.is_set():
                with self._taken:
                    if not self._pending:
                        return
                    item = self._pending.popleft()
                for result in self._work(runner, item):
                    self._results.put((None, result))
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001 - handed to the iterating thread, which raises it
            self._results.put((exc, None))
        finally:
            self._results.put((_LANE_DONE, None))  # the iterator ends the moment the last lane does, not at a poll

    def __enter__(self) -> "Lanes":
        self._pool = ThreadPoolExecutor(len(self._runners), thread_name_prefix="tqs-lane")
        for runner in self._runners:
            self._pool.submit(self._lane, runner)  # a lane reports its end and its errors on the result queue
        return self

    def __iter__(self) -> Iterator[object]:
        running = len(self._runners)
        while running:
            try:
                error, result = self._results.get(timeout=0.5)  # a timeout keeps Ctrl-C prompt on every platform
            except queue.Empty:
                continue
            if error is _LANE_DONE:
                running -= 1
            elif error is not None:
                raise error  # the first lane's error ends the run; the others stop after their result
            else:
                yield result

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


_WORKER: SweepRunner | None = None
"""The runner of a worker process (one session per process)."""


def _start_worker(job: SweepJob, strategy: str) -> None:
    global _WORKER
    job.strategy = strategy  # every worker runs the way the main process chose
    _WORKER = SweepRunner(job)


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
        with ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker, initargs=(job, strategy)
        ) as pool:
            # Sessions and probes are built per unit: keep a unit's tasks on one worker unless weights are fed.
            chunk = 1 if strategy == "feed" else max(1, job.tasks_per_unit)
            for result in pool.map(_run_in_worker, tasks, chunksize=chunk):
                log.append(result)
                if on_result:
                    on_result(result)
    finally:
        log.close()


class _RayWorker:
    """A Ray actor holding one session (see `run_ray`)."""

    def __init__(self, job: SweepJob, strategy: str):
        job.strategy = strategy
        self.runner = SweepRunner(job)

    def run(self, task: Task) -> TaskResult:
        return self.runner.run(task)


RAY_CONNECT_S = 5.0
"""How long a cluster address may take to accept a connection before the score gives up on it."""


def check_ray_address(address: str | None) -> None:
    """A cluster address ('HOST:PORT' or 'ray://HOST:PORT') must accept a connection within `RAY_CONNECT_S`:
    ray.init retries an unreachable one for minutes, in silence."""
    if address in (None, "auto", "local"):
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--ray takes 'local', 'auto' or a cluster address HOST:PORT, not '{address}'")
    try:
        socket.create_connection(
            (host.strip("[]"), int(port)), timeout=RAY_CONNECT_S
        ).close()  # [::1]:6379: IPv6 in brackets
    except OSError as exc:
        raise InputError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc})",
            hint="check the address ('ray status' on the head node prints it)",
        ) from None


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
    if not ray.is_initialized():  # the address was checked (`check_ray_address`) before the score's work began
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
        except (
            ConnectionError,
            RuntimeError,
            ValueError,
        ) as exc:  # 'auto' with no cluster running, a malformed address
            raise RolloutError(
                f"could not join a Ray cluster at '{address}' ({str(exc).splitlines()[0]})",
                hint="start one with 'ray start --head', or pass --ray local for one on this machine",
            ) from None
    actor = ray.remote(_RayWorker)
    shared = ray.put(job)
    actors = [actor.remote(shared, strategy) for _ in range(workers)]
    waiting = list(tasks)[::-1]
    in_flight: dict = {}
    try:
        for worker in actors:
            for _ in range(2):
                if waiting:
                    in_flight[worker.run.remote(waiting.pop())] = worker
        while in_flight:
            done, _ = ray.wait(list(in_flight), num_returns=1)
            worker = in_flight.pop(done[0])
            result = ray.get(done[0])
            log.append(result)
            if on_result:
                on_result(result)
            if waiting:
                in_flight[worker.run.remote(waiting.pop())] = worker
    finally:
        log.close()
        for worker in actors:
            ray.kill(worker)
