"""Cut a model to the part downstream of some weights.

Perturbing a weight changes nothing upstream of its consumers, so a
single-step model can be scored by running only the downstream part, fed with
the nominal activations at the cut (computed once). `activation_outputs`
makes those activations graph outputs, `cut_downstream` builds the sub-model.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from graph_ops.io import GraphError, weights_as_inputs


def _subgraph_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read from the outer scope (an over-approximation)."""
    names: set[str] = set()
    for attribute in node.attribute:
        for graph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
            for inner in graph.node:
                names.update(inner.input)
                names.update(_subgraph_names(inner))
    return names


def _reads(node: onnx.NodeProto) -> set[str]:
    return {n for n in node.input if n} | _subgraph_names(node)


@dataclass(frozen=True)
class Cut:
    """The downstream part of a model for some weights."""

    model: onnx.ModelProto
    boundary: tuple[str, ...]
    """Tensors the cut reads that the weights do not affect: model inputs and upstream activations."""
    outputs: tuple[str, ...]
    """The wanted outputs the weights affect (the others keep their nominal values)."""


def downstream_nodes(graph: onnx.GraphProto, weights: set[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """Nodes that (transitively) read any of `weights`, in graph order, and every tensor they affect."""
    affected, nodes = set(weights), []
    for node in graph.node:  # ONNX graphs are topologically sorted
        if _reads(node) & affected:
            nodes.append(node)
            affected.update(o for o in node.output if o)
    return nodes, affected


def boundary_tensors(model: onnx.ModelProto, weights: list[str], outputs: list[str]) -> tuple[str, ...]:
    """The unaffected tensors the downstream part of `weights` reads (inputs and upstream activations)."""
    nodes, affected = downstream_nodes(model.graph, set(weights))
    initializers = {t.name for t in model.graph.initializer}
    reads = set().union(*(_reads(n) for n in nodes)) if nodes else set()
    wanted = [o for o in outputs if o in affected]
    return tuple(sorted(n for n in reads if n not in affected and n not in initializers)) if wanted else ()


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor shape inference can type."""
    return {v.name: v.type.tensor_type.elem_type for v in inferred_values(model) if v.type.tensor_type.elem_type}


def inferred_values(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Every value shape inference can type or shape, without copying large weights:
    big initializers are declared as inputs for the inference, small ones (shape constants) kept."""
    light = weights_as_inputs(model, lambda t: len(t.raw_data) <= 4096 and not t.HasField("data_location"))
    inferred = onnx.shape_inference.infer_shapes(light)
    return list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)


def activation_outputs(model: onnx.ModelProto, names: list[str] | set[str], types: dict[str, int] | None = None) -> bytes:
    """Serialised ModelProto declaring `names` as extra graph outputs (types from
    `element_types`); appended to the model's bytes it makes them come out of a run."""
    types = types if types is not None else element_types(model)
    present = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    suffix = onnx.ModelProto()
    for name in sorted(set(names) - present):
        if name not in types:
            raise GraphError(f"cannot infer the type of activation '{name}'")
        suffix.graph.output.append(helper.make_tensor_value_info(name, types[name], None))
    return suffix.SerializeToString()


def cut_downstream(model: onnx.ModelProto, weights: list[str], outputs: list[str], types: dict[str, int]) -> Cut:
    """The sub-model of the nodes downstream of `weights`, producing the `outputs` they affect.

    Its inputs are the boundary tensors (element types from `types`) and the
    weights themselves (overridable initializers, so perturbations are fed);
    other initializers stay constants. Does not modify `model`.
    """
    nodes, affected = downstream_nodes(model.graph, set(weights))
    kept_outputs = tuple(o for o in outputs if o in affected)
    if not kept_outputs:
        return Cut(model=onnx.ModelProto(), boundary=(), outputs=())
    initializers = {t.name: t for t in model.graph.initializer}
    reads = set().union(*(_reads(n) for n in nodes))
    boundary = tuple(sorted(n for n in reads if n not in affected and n not in initializers))
    missing = [n for n in boundary if n not in types]
    if missing:
        raise GraphError(f"no type known for boundary tensor '{missing[0]}'")
    graph = helper.make_graph(
        list(nodes),
        f"{model.graph.name}_downstream",
        [helper.make_tensor_value_info(n, types[n], None) for n in boundary],
        [helper.make_tensor_value_info(o, types[o], None) for o in kept_outputs],
        [initializers[n] for n in sorted(reads & initializers.keys())],
    )
    for name in weights:
        tensor = initializers[name]
        graph.input.append(helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
    cut = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=max(model.ir_version, 4))
    cut.functions.extend(model.functions)
    return Cut(model=cut, boundary=boundary, outputs=kept_outputs)
