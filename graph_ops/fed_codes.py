"""A model cut down to what computes some outputs, its quantized weights rebuilt from codes fed at run time.

What runs a quantized candidate at a byte per weight instead of a float copy of every weight: a calibration
wave and a large model's measured candidates (`fed_codes_model`). Each weight's stored format says how its
codes become the weight again (`StoredWeight.fed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np
import onnx
from onnx import helper

from graph_ops.io import GraphError

if TYPE_CHECKING:
    from graph_ops.qdq import StoredWeight


def fed_weight(
    name: str, value: StoredWeight
) -> tuple[list[onnx.ValueInfoProto], dict[str, np.ndarray], list[onnx.NodeProto]] | None:
    """Graph inputs, their values and the nodes that rebuild weight `name` from its codes at run time (the
    stored format's `fed`): what a calibration run feeds instead of a float copy of every weight quantized so
    far. None for a form better fed as floats."""
    return value.fed(name)


def node_reads(node: onnx.NodeProto) -> set[str]:
    """Every name a node reads, those its subgraphs read from the outer scope included (over-approximated)."""
    names = {i for i in node.input if i}
    for attribute in node.attribute:
        graphs = list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else [])
        for graph in graphs:
            for inner in graph.node:
                names |= node_reads(inner)
    return names


def needed_nodes(
    model: onnx.ModelProto, outputs: list[str], given: Mapping[str, object] | set[str] = frozenset()
) -> list[int]:
    """Indices (in graph order) of the nodes that compute `outputs` from the graph's inputs and the `given`
    tensors: a walk back from the outputs that stops at a given tensor."""
    given = set(given) - set(outputs)
    needed = set(outputs)
    kept = []
    for index in range(len(model.graph.node) - 1, -1, -1):
        node = model.graph.node[index]
        if any(o in needed for o in node.output):
            kept.append(index)
            needed |= node_reads(node) - given
    kept.reverse()
    return kept


def fed_codes_model(
    model: onnx.ModelProto,
    stored: Mapping[str, StoredWeight],
    outputs: list[str] | None = None,
    given: Mapping[str, onnx.ValueInfoProto] | None = None,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`model` (weights as graph inputs) cut down to what computes `outputs` (default: its own outputs),
    with every weight of `stored` it reads rebuilt from its codes (`fed_weight`). Returns the model
    and what to feed for the weights of `stored` it reads: their codes, or the floats they stand for
    where a form is not rebuilt; the other weights stay inputs, for the caller to feed.

    The cut matters to a calibration wave: ONNX Runtime runs the whole graph whatever a run fetches.
    The rebuilding nodes go first in the node list, which ONNX Runtime's default order runs just before
    each consumer (docs/design-notes/graph-ops.md, 'Rebuilding nodes go first').

    `given`: intermediate tensors the caller feeds (name -> their value info, e.g. a calibration wave's
    activations kept from the wave before): they become inputs, and what only computes them is cut too.
    An output may be any tensor the kept nodes compute when `given` holds its value info."""
    graph = model.graph
    given = dict(given or {})
    outputs = list(outputs) if outputs is not None else [v.name for v in graph.output]
    kept_indices = needed_nodes(model, outputs, given)
    kept = [graph.node[i] for i in kept_indices]
    needed = set(outputs).union(*(node_reads(node) for node in kept))
    rebuilt, feeds, inputs = [], {}, []
    for value in graph.input:
        form = (
            stored.get(value.name) if value.name in needed else None
        )  # an unused input stays declared (ONNX Runtime wants every input fed; it reads no unused one)
        fed = fed_weight(value.name, form) if form is not None else None
        if fed is None:
            inputs.append(value)
            if form is not None:  # fed as the float it stands for (raw: the weight itself, no copy)
                feeds[value.name] = (
                    np.asarray(form.values).astype(form.dtype, copy=False) if form.form == "raw" else form.dequantize()
                )
            continue
        new_inputs, new_feeds, nodes = fed
        inputs += new_inputs
        feeds.update(new_feeds)
        rebuilt += nodes
    made = {o for node in kept for o in node.output}  # a given tensor that a kept node makes anyway is not fed
    inputs += [given[name] for name in given if name in needed and name not in made]
    infos = {**given, **{v.name: v for v in graph.output}}
    missing = [name for name in outputs if name not in infos]
    if missing:
        raise GraphError(f"tensors {missing[:3]} are not outputs of the graph")
    cut = helper.make_graph(
        rebuilt + kept,
        graph.name,
        inputs,
        [infos[name] for name in dict.fromkeys(outputs)],
        [t for t in graph.initializer if t.name in needed],
        value_info=[v for v in graph.value_info if v.name in needed and v.name not in given],
    )
    cut.sparse_initializer.extend(t for t in graph.sparse_initializer if t.values.name in needed)
    result = helper.make_model(cut, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    result.functions.extend(model.functions)
    return result, feeds
