"""The nominal rollout as a runner and its lanes share it: made once, by the first lane that asks."""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Iterator

import numpy as np

from tqsdeploy.rollout.engine import Nominal, RolloutEngine

HOLD_BYTES = 64 << 20
"""A lane holds at most this much of a task's outputs while the nominal it is compared with is being made."""


class SharedNominal:
    """The nominal rollout, made by the first thread that asks (or given made): the others wait for it, and an
    error in the making is raised to each of them."""

    def __init__(self, value: Nominal | Callable[[], Nominal]):
        self._make = value if callable(value) else None
        self._value = None if callable(value) else value
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self._value is not None

    def get(self) -> Nominal:
        if self._value is None:
            with self._lock:
                if self._value is None and self._error is None:
                    try:
                        self._value = self._make()
                    except BaseException as exc:
                        self._error = exc
                if self._error is not None:
                    raise self._error
        return self._value

    def totals(self, engine: RolloutEngine, steps: Iterable[list[dict[str, np.ndarray]]]) -> Iterator[float]:
        """Per step of the rollout `steps`, its squared divergence from the nominal summed over windows
        (`RolloutEngine.step_total`); steps that come before the nominal is made are held (`_held`)."""
        if not self.ready:
            steps = self._held(steps)
        return (engine.step_total(self.get(), t, outs) for t, outs in enumerate(steps))

    def _held(self, steps: Iterable[list[dict[str, np.ndarray]]]) -> Iterator[list[dict[str, np.ndarray]]]:
        """`steps` as they come once the nominal is made; before that they are held (up to `HOLD_BYTES`,
        then this waits for it), so a lane's first task runs while another lane makes the nominal."""
        held: list[list[dict[str, np.ndarray]]] = []
        size = 0
        for outs in steps:
            if not self.ready and size < HOLD_BYTES:
                held.append(outs)
                size += sum(np.asarray(v).nbytes for chunk_out in outs for v in chunk_out.values())
                continue
            self.get()
            yield from held
            held = []
            yield outs
        self.get()
        yield from held
