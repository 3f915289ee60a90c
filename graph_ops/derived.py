"""Feed weights to the graph ONNX Runtime really runs, in the layout it rearranged them into.

ONNX Runtime rewrites a model as it loads it, and some rewrites need the
weights to be constants: on the CPU its NCHWc layout transformer reorders each
2-D Conv weight into blocks for its fastest kernels, and constant folding
transposes MatMul weights once instead of on every call. A weight declared
overridable keeps neither, so a session fed its weights runs slower kernels
than a constant one (docs/design-notes/graph-ops.md, 'Fed weights in the
runtime's own layout'). The optimized graph
the runtime saves holds the rearranged copies, and each copy is a
rearrangement of the original elements: optimizing the model once more with
every weight replaced by the numbers of its elements (1, 2, 3, ... across
all the weights, exact in float32 up to 2^24) gives, in each copy, the number
of the element each position took (0 where the layout pads). Feeding a
perturbed weight is then a gather into each of its copies, and the session
of the optimized graph, with those copies overridable, runs the kernels a
constant session runs, to the same outputs.

`weight_map` refuses, with the reason, whatever is not such a gather: a
weight scaled or fused into another value (a BatchNorm folded into a Conv),
a graph whose structure depends on the values, a copy the nominal weights
do not reproduce exactly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graph_ops.io import GraphError, runtime_compatible
from graph_ops.weights import replace_weights

MARKER_LIMIT = 1 << 24
"""Element numbers are exact in float32 up to here: the weights mapped together hold fewer elements."""


def _numbering(weights: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The weights in the order given, and where each one's element numbers start (0-based) and end."""
    order = list(weights)
    sizes = np.array([int(np.size(weights[n])) for n in order], np.int64)
    ends = np.cumsum(sizes)
    return order, ends - sizes, ends


def marked(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` with each of `weights` holding the numbers of its elements, counted on across them
    in the order given (the first weight's first element is 1)."""
    order, starts, ends = _numbering(weights)
    total = int(ends[-1]) if order else 0
    if total >= MARKER_LIMIT:
        raise GraphError(f"{total} weight elements: element numbers past 2^24 are not exact in float32")
    for name in order:
        if np.asarray(weights[name]).dtype != np.float32:
            raise GraphError(f"weight '{name}' is {np.asarray(weights[name]).dtype}, not float32")
    return replace_weights(
        model,
        {
            name: np.arange(start + 1, end + 1, dtype=np.float32).reshape(np.shape(weights[name]))
            for name, start, end in zip(order, starts, ends)
        },
    )


@dataclass
class Part:
    """Elements of one weight in a rearranged copy: copy.flat[positions] = weight.flat[indices]
    (`positions` None: the whole copy, in order)."""

    weight: str
    indices: np.ndarray
    positions: np.ndarray | None = None


@dataclass
class Copy:
    """An initializer of the optimized graph made of weight elements (and zeros where the layout pads)."""

    name: str
    shape: tuple[int, ...]
    parts: list[Part]
    nominal: np.ndarray | None = None
    """The copy as the nominal weights make it, kept where a fed weight fills only part of it."""

    def filled(self, values: Mapping[str, np.ndarray]) -> np.ndarray:
        if len(self.parts) == 1 and self.parts[0].positions is None:
            part = self.parts[0]
            return np.asarray(values[part.weight]).reshape(-1)[part.indices].reshape(self.shape)
        flat = self.nominal.reshape(-1).copy()
        for part in self.parts:
            if part.weight in values:
                flat[part.positions] = np.asarray(values[part.weight]).reshape(-1)[part.indices]
        return flat.reshape(self.shape)


UNPACKED_READERS = frozenset(
    {("com.microsoft.nchwc", "Conv"), ("", "Gather"), ("", "Add"), ("", "Sub"), ("", "Mul"), ("", "Div")}
)
"""(domain, op) of the nodes whose CPU kernels read a weight at run time, pre-packing nothing: fed, it runs as fast as
constant (NCHWc Conv takes its weight in its own layout, which a fed copy already is; a table lookup and elementwise
arithmetic have nothing to pack). MatMul, Gemm and their fusions pre-pack a constant weight and not a fed one."""


@dataclass
class WeightMap:
    """Where each weight's elements sit in the optimized graph's initializers."""

    copies: list[Copy]
    readers: frozenset[tuple[str, str]] = frozenset()
    """(domain, op) of every node of the optimized graph that reads a copy."""

    @property
    def keeps_kernels(self) -> bool:
        """Whether every copy is read only by kernels that run a fed weight as fast as a constant one."""
        return self.readers <= UNPACKED_READERS

    def derive(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The copies to feed for `values` (weight name -> array): those holding any of these weights."""
        return {c.name: c.filled(values) for c in self.copies if any(p.weight in values for p in c.parts)}

    @property
    def weights(self) -> set[str]:
        return {p.weight for c in self.copies for p in c.parts}


def _signature(node: onnx.NodeProto) -> tuple:
    attributes = sorted((a.name, a.SerializeToString()) for a in node.attribute)
    return node.op_type, node.domain, len(node.input), len(node.output), tuple(attributes)


def _aligned(nominal: onnx.GraphProto, marked_graph: onnx.GraphProto) -> dict[str, str]:
    """The marked graph's value names -> the nominal graph's, node by node (the runtime numbers the names it
    makes per process, so they differ between the two); GraphError when the two graphs differ in structure."""
    if len(nominal.node) != len(marked_graph.node):
        raise GraphError("the optimized graph's structure depends on the weights' values")
    names: dict[str, str] = {}
    for a, b in zip(nominal.node, marked_graph.node):
        if _signature(a) != _signature(b):
            raise GraphError(f"the optimized graph's structure depends on the weights' values (node '{a.name}')")
        for x, y in zip(list(a.input) + list(a.output), list(b.input) + list(b.output)):
            if names.setdefault(y, x) != x:
                raise GraphError("the optimized graph's structure depends on the weights' values")
    return names


def weight_map(nominal: onnx.ModelProto, marked_model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> WeightMap:
    """The map from `weights` (in `marked`'s order) to the initializers of `nominal`, the runtime's optimized
    graph of the model, found in `marked_model`, its optimized graph of `marked(model, weights)`."""
    names = _aligned(nominal.graph, marked_model.graph)
    nominal_inits = {t.name: t for t in nominal.graph.initializer}
    order, starts, ends = _numbering(weights)
    copies: list[Copy] = []
    for tensor in marked_model.graph.initializer:
        target = names.get(tensor.name)
        if target is None or target not in nominal_inits:
            continue  # read by no node
        numbers = numpy_helper.to_array(tensor)
        expected = numpy_helper.to_array(nominal_inits[target])
        if (
            numbers.dtype == expected.dtype
            and numbers.shape == expected.shape
            and numbers.tobytes() == expected.tobytes()
        ):
            continue  # holds no weight element
        if numbers.dtype != np.float32 or expected.shape != numbers.shape:
            raise GraphError(f"initializer '{target}' of the optimized graph is not float32 weight elements")
        flat = numbers.reshape(-1).astype(np.float64)
        if not np.array_equal(flat, np.round(flat)) or flat.min(initial=0) < 0 or flat.max(initial=0) > ends[-1]:
            raise GraphError(
                f"initializer '{target}' of the optimized graph is computed from the weights, not rearranged from them"
            )
        element = flat.astype(np.int64) - 1
        held = np.flatnonzero(element >= 0)
        which = np.searchsorted(ends, element[held], side="right")
        parts = []
        for w in np.unique(which):
            rows = held[which == w]
            indices = (element[rows] - starts[w]).astype(np.int32)  # below 2^24: half the memory of intp
            whole = rows.size == flat.size
            parts.append(Part(order[w], indices, None if whole else rows.astype(np.int32)))
        partial = len(parts) > 1 or parts[0].positions is not None
        made = Copy(target, tuple(expected.shape), parts, np.zeros(expected.shape, np.float32) if partial else None)
        if not np.array_equal(made.filled(weights), expected):  # padding zeros and every weight's elements
            raise GraphError(f"initializer '{target}' of the optimized graph is not the weights' elements rearranged")
        if partial:
            made.nominal = expected  # what a fed weight that fills only part of it leaves in the rest
        copies.append(made)
    held = {c.name for c in copies}
    mapped = WeightMap(
        copies, frozenset((n.domain, n.op_type) for n in nominal.graph.node if held.intersection(n.input))
    )
    missing = set(order) - mapped.weights
    if missing:
        raise GraphError(f"weight '{sorted(missing)[0]}' is in no initializer of the optimized graph")
    return mapped


def fed_graph(nominal: onnx.ModelProto, weight_map: WeightMap) -> onnx.ModelProto:
    """The optimized graph with every initializer holding weight elements declared an input (overridable)."""
    result = copy.deepcopy(nominal)
    initializers = {t.name: t for t in result.graph.initializer}
    for c in weight_map.copies:
        tensor = initializers[c.name]
        result.graph.input.append(helper.make_tensor_value_info(c.name, tensor.data_type, list(tensor.dims)))
    if result.ir_version < 4:
        result.ir_version = 4
    return runtime_compatible(result)
