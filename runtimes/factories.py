"""Session factories: how a sweep opens sessions of one model, picklable so workers open their own.

`RebuildFactory` keeps the model's one serialisation in memory and opens whole-model sessions (weights
replaced as constants, or some of them overridable) and the cut sessions the 'prefix' strategy runs;
`StreamedCuts` opens cut sessions of a model read from its own files; `open_fed` a session whose weights
are plain inputs fed from those files. All of them open through a `Runtime`, whatever its engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import graph_ops
from runtimes.base import Runtime, Session, WithDefaults


class CutSessions:
    """Sessions of parts of a model for the 'prefix' strategy: the whole model with some activations
    as extra outputs, or the part downstream of some weights (those weights overridable)."""

    model: bytes
    """The serialised model the sessions are cut from."""

    def _open(self, model: bytes) -> Session:
        raise NotImplementedError

    def graph(self):
        """The model proto, parsed once per process."""
        import onnx

        if not hasattr(self, "_proto"):
            self._proto = onnx.load_model_from_string(self.model)
        return self._proto

    def activations(self, names) -> Session:
        """A session that also outputs the named intermediate tensors."""
        if not hasattr(self, "_types"):
            self._types = graph_ops.prefix.element_types(self.graph())
        return self._open(self.model + graph_ops.prefix.activation_outputs(self.graph(), names, self._types))

    def downstream(self, weights, outputs, types) -> tuple[Session | None, "graph_ops.prefix.Cut"]:
        """A session of the part downstream of `weights` (fed as overridable), or None when no output depends on
        them."""
        cut = graph_ops.prefix.cut_downstream(self.graph(), list(weights), list(outputs), types)
        return (self._open(graph_ops.model_bytes(cut.model)) if cut.outputs else None), cut

    def __getstate__(self):
        return {
            k: v for k, v in self.__dict__.items() if k not in ("_proto", "_types", "_ranks")
        }  # workers parse their own


@dataclass
class RebuildFactory(CutSessions):
    """Opens sessions of the original model from its one serialisation.

    Called with weights: a session with those weights replaced as constants.
    `overridable(names)`: a session in which just those weights can be fed
    (the rest stay constant, so the runtime pre-packs them). Picklable: it
    carries the serialized model (Constant-node weights lifted to
    initializers), one input declaration per scored weight, and the runtime.
    """

    model: bytes
    runtime: Runtime
    declarations: dict[str, bytes] = field(default_factory=dict)

    def __call__(self, weights: dict[str, np.ndarray]):
        # Not SessionOptions.add_initializer: ONNX Runtime constant-folds a Transpose
        # of a stored weight from the stored value, ignoring the added one.
        if not weights:
            return self.runtime.open(self.model)
        proto = graph_ops.replace_weights(self.graph(), weights) if weights else self.graph()
        return self.runtime.open(graph_ops.model_bytes(proto))

    def _open(self, model: bytes) -> Session:
        return self.runtime.open(model)

    def overridable(self, names) -> Session:
        return self.runtime.open(self.model + b"".join(self.declarations[n] for n in sorted(set(names))))

    def batch_refusal(self, weights) -> str | None:
        """Why `batched` cannot batch these weights' probes, or None when it can."""
        return graph_ops.batch.refusal(self.graph(), weights, self._tensor_ranks())

    def batched(self, weights, probes: int) -> Session:
        """A session running `probes` probes of `weights` in one call (`graph_ops.batch`); raises BatchError when it
        cannot."""
        return self.runtime.open(
            graph_ops.model_bytes(graph_ops.batch.batch_probes(self.graph(), weights, probes, self._tensor_ranks()))
        )

    def _tensor_ranks(self) -> dict[str, int]:
        if not hasattr(self, "_ranks"):
            self._ranks = graph_ops.batch.tensor_ranks(self.graph())
        return self._ranks


@dataclass
class StreamedCuts(CutSessions):
    """Cut sessions of a model swept from its files: `model` is its graph alone, its tensors references
    into the model's own data files (in `data_dir`), which ONNX Runtime reads as it builds each session."""

    model: bytes
    runtime: Runtime
    data_dir: Path

    def _open(self, model: bytes) -> Session:
        return self.runtime.open(model, external_data_dir=self.data_dir)


def open_fed(runtime: Runtime, source: Path, data_dir: Path, weights) -> Session:
    """A session of a graph whose weights are plain inputs, fed from `weights` (views of the
    model's own files) unless a run feeds its own: the runtime holds no copy of them."""
    return WithDefaults(runtime.open(source, external_data_dir=data_dir), weights)
