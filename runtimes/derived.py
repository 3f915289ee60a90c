"""ONNX Runtime's own optimized graph as the fed session of a sweep (`graph_ops.derived`).

A 2-D Conv weight fed to ONNX Runtime's CPU kernels misses their NCHWc layout, which wants it constant;
fed in the layout the runtime rearranged it into, the session runs the kernels a constant one runs.
ONNX Runtime only: other engines feed the weights as stored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import onnx

import graph_ops
from runtimes.base import DerivedFeeds, Session
from runtimes.factories import RebuildFactory
from runtimes.ort import OrtRuntime


@dataclass
class DerivedFeed:
    """Opens ONNX Runtime's own optimized graph of the model with the initializers it rearranged the scored
    weights into overridable, fed from those weights (`graph_ops.derived`): the fed session then runs the
    kernels a constant one runs (NCHWc Conv), with no build per perturbation. The layouts are this machine's
    (its CPU's block size), so each process maps its own: a worker of another kind that cannot gets the
    weights fed as stored. Picklable."""

    rebuild: RebuildFactory
    weights: tuple[str, ...]

    def __post_init__(self):
        self._made: tuple[bytes, graph_ops.derived.WeightMap] | None = None

    def made(self) -> tuple[bytes, graph_ops.derived.WeightMap]:
        """The fed graph and the weights' map into it; GraphError when the runtime does more than rearrange them."""
        if self._made is None:
            runtime, derived = self.rebuild.runtime, graph_ops.derived
            stored = graph_ops.read_weights(self.rebuild.graph(), self.weights)
            values = {name: stored[name] for name in self.weights}
            nominal = onnx.load_model_from_string(runtime.optimized(self.rebuild.model))
            marked = onnx.load_model_from_string(
                runtime.optimized(graph_ops.model_bytes(derived.marked(self.rebuild.graph(), values)))
            )
            mapped = derived.weight_map(nominal, marked, values)
            self._made = (graph_ops.model_bytes(derived.fed_graph(nominal, mapped)), mapped)
        return self._made

    def __call__(self) -> Session:
        try:
            model, mapped = self.made()
        except Exception:  # this process's runtime lays the weights out otherwise: fed as stored
            return self.rebuild.overridable(self.weights)
        return DerivedFeeds(
            dataclasses.replace(self.rebuild.runtime, optimization="disable").open(model),
            frozenset(self.weights),
            mapped.derive,
        )

    def __getstate__(self):
        return {**self.__dict__, "_made": None}  # another process (or machine) maps its own runtime's layouts


FED_OPTIMIZED = "the runtime's optimized graph (weights in its layouts)"
"""run.json's `fed_session` when the fed session is ONNX Runtime's own optimized graph (`DerivedFeed`)."""


def _nchwc_conv(tensor) -> bool:
    """Whether a 2-D Conv reads this weight: the Conv ONNX Runtime's CPU NCHWc layout takes, when the weight is
    constant."""
    return "Conv" in tensor.op_types and len(tensor.shape) == 4


def fed_as_fast(tensor) -> bool:
    """Whether ONNX Runtime's CPU kernels run this weight fed as fast as constant: read only by Gather or by a Conv
    the NCHWc layout does not take (1-D, 3-D), which pre-pack nothing (a fed MatMul, Gemm or recurrent weight is
    not pre-packed; a fed 2-D Conv weight misses NCHWc): the same outputs, the calls slower only by the feeding
    itself (docs/design-notes/runtimes.md, 'Weights fed as fast as constant')."""
    return bool(tensor.op_types) and not _nchwc_conv(tensor) and set(tensor.op_types) <= {"Gather", "Conv"}


def derived_feed(rebuild: RebuildFactory, units: Sequence, names: list[str]) -> tuple[DerivedFeed | None, str]:
    """The fed session of the runtime's optimized graph when it keeps kernels a fed weight loses, else None;
    and what the sweep feeds, for run.json. Tried where it pays: a 2-D Conv reads a scored weight (ONNX
    Runtime's CPU NCHWc kernels need the weight constant, or in their own layout as here). `units`: the
    scored units (anything with `tensors`, graph_ops WeightTensors)."""
    runtime = rebuild.runtime
    if not isinstance(runtime, OrtRuntime) or runtime.provider != "cpu" or runtime.optimization != "all":
        return None, "weights as stored"
    if not any(_nchwc_conv(t) for u in units for t in u.tensors):
        return None, "weights as stored"
    feed = DerivedFeed(rebuild, tuple(names))
    try:
        feed.made()
    except graph_ops.GraphError as exc:
        return None, f"weights as stored ({exc})"
    except Exception as exc:  # the runtime cannot save or reload its optimized graph
        return None, f"weights as stored (ONNX Runtime's optimized graph: {str(exc).splitlines()[0]})"
    return feed, FED_OPTIMIZED
