"""The session contract every runtime implements.

A sweep only ever needs three things from a runtime: the model's input and
output signatures, a way to run it on a feed dict, and a way to override some
of its weights per run without rebuilding it (the expensive part). Keeping the
contract this small is what lets ONNX Runtime (CPU/CUDA/TensorRT EP) and native
TensorRT engines sit behind the same sweep, locally or on Ray workers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence, Union

import numpy as np

Dim = Union[int, str, None]
"""A dimension: a fixed size, a symbolic name, or unknown."""


class RuntimeUnavailable(RuntimeError):
    """The requested runtime or execution provider is not installed here."""


@dataclass(frozen=True)
class IOSpec:
    """Name, shape and numpy dtype of one model input or output."""

    name: str
    shape: tuple[Dim, ...]
    dtype: np.dtype

    @property
    def rank(self) -> int:
        return len(self.shape)

    def is_dynamic(self, axis: int) -> bool:
        return not isinstance(self.shape[axis], int)


class Session(Protocol):
    """One loaded model, reusable for many runs.

    ``weights`` are the names of weight tensors the session accepts as feeds
    (overridable initializers); feeding one replaces that weight for that run
    only. Everything else in the feed dict must be a model input.
    """

    name: str
    inputs: Sequence[IOSpec]
    outputs: Sequence[IOSpec]
    weights: frozenset[str]

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]: ...

    def keep(self, values: Mapping[str, np.ndarray]) -> Mapping[str, object]:
        """`values` that many runs will feed unchanged (a rollout's perturbed weights), put where
        the runtime reads them from: a GPU session copies them to the device once instead of on
        every run; a host session returns them as they are. The result is fed like the arrays."""
        ...

    def close(self) -> None: ...


class Runtime(Protocol):
    """How to open sessions of one inference engine (ONNX Runtime with its providers, native TensorRT):
    what every command holds instead of a concrete class, made by `runtimes.for_provider`. Immutable and
    picklable, so sweep workers and Ray actors receive it as it is."""

    name: str
    """The engine, for reports ('onnxruntime', 'tensorrt')."""
    provider: str
    """The `--provider` name it serves."""
    threads: int | None
    """CPU threads per session; None: the engine's default (always None where CPU threads do not apply)."""

    def check(self) -> None:
        """Raise RuntimeUnavailable when this engine or provider cannot run here."""
        ...

    def for_model(self, proto) -> "Runtime":
        """This runtime made safe for the model `proto` (itself when nothing needs changing)."""
        ...

    def with_threads(self, threads: int) -> "Runtime":
        """This runtime with `threads` CPU threads per session, for sessions sharing the cores (itself where
        they do not apply)."""
        ...

    def yielding(self) -> "Runtime":
        """This runtime with sessions whose idle threads sleep instead of spinning, for calls that alternate with
        numpy work."""
        ...

    def open(self, model: "ModelSource", external_data_dir: Path | None = None) -> Session:
        """A session of `model` (serialised bytes or a file; `external_data_dir`: where its external data files are)."""
        ...


def kept(session: Session, values: Mapping[str, np.ndarray]) -> Mapping[str, object]:
    """`session.keep(values)`, or the values themselves for a session without `keep`."""
    keep = getattr(session, "keep", None)
    return keep(values) if keep is not None and values else values


class WithDefaults:
    """A session whose weights are plain inputs (the runtime keeps no copy of them), fed
    from `defaults` whenever a run does not feed its own: a read-only view of the model's
    file serves every run, and a perturbed run feeds just what it changes. With several
    mappings, an input is fed from the first that holds it."""

    def __init__(self, session: Session, *defaults: Mapping[str, np.ndarray]):
        self._session = session
        self.name = session.name
        self.inputs, self.outputs = session.inputs, session.outputs
        self._fill = {}
        for spec in session.inputs:
            source = next((mapping for mapping in defaults if spec.name in mapping), None)
            if source is not None:
                self._fill[spec.name] = source
        self.weights = frozenset(session.weights) | frozenset(self._fill)
        if (
            getattr(session, "device", None) is not None
        ):  # a GPU session: the defaults go to the device once, not every run
            resident = session.keep({name: source[name] for name, source in self._fill.items()})
            self._fill = dict.fromkeys(resident, resident)
        self.device = getattr(session, "device", None)

    def keep(self, values: Mapping[str, np.ndarray]) -> Mapping[str, object]:
        return kept(self._session, values)

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        missing = {name: source[name] for name, source in self._fill.items() if name not in feeds}
        return self._session.run({**feeds, **missing} if missing else feeds, output_names)

    def close(self) -> None:
        self._session.close()


class DerivedFeeds:
    """A session of a graph whose initializers are the model's weights rearranged (ONNX Runtime's own
    optimized graph, `graph_ops.derived`): it takes the model's weights as feeds and feeds the session
    the initializers `derive` makes of them. A rollout feeds the same weights on every step, so each
    thread (a sweep lane) keeps the initializers of the last weights it fed, for as long as it feeds
    those very arrays (held here, so no other array can take their identity)."""

    def __init__(
        self,
        session: Session,
        weights: frozenset[str],
        derive: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]],
    ):
        self._session, self._derive = session, derive
        self.name = session.name
        self.weights = frozenset(weights)
        self.inputs = [s for s in session.inputs if s.name not in session.weights]
        self.outputs = session.outputs
        self._local = threading.local()

    def keep(self, values: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        return values

    def _derived(self, fed: list[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
        last, made = getattr(self._local, "last", ([], {}))
        if len(last) != len(fed) or any(a != c or b is not d for (a, b), (c, d) in zip(last, fed)):
            made = self._derive(dict(fed))
            self._local.last = (fed, made)
        return made

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        fed = [(name, value) for name, value in feeds.items() if name in self.weights]
        if not fed:
            return self._session.run(feeds, output_names)
        inputs = {name: value for name, value in feeds.items() if name not in self.weights}
        return self._session.run({**inputs, **self._derived(fed)}, output_names)

    def close(self) -> None:
        self._local = threading.local()
        self._session.close()


ModelSource = Union[bytes, Path]

SessionFactory = Callable[[], Session]
"""Zero-argument callable that opens a session: what a sweep worker receives.

It must be cheap to pickle (a path and options, never a live session), so that
a distributed executor can ship it to other processes or machines.
"""
