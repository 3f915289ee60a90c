"""Rewrite a model so chosen weights can be replaced per run.

Each chosen weight stays an initializer and is also declared a graph input
(an *overridable initializer*, ONNX IR >= 4): a runtime session built once can
then run the nominal model (feed nothing) or any perturbed variant (feed the
replacement) without being rebuilt, far cheaper per perturbation than building
a session per variant (docs/design-notes/graph-ops.md, 'Overridable
initializers'). Constant nodes holding weights become
initializers first so they can be overridden too.
"""

from __future__ import annotations

import copy

import onnx
from onnx import helper

from graph_ops.io import GraphError, runtime_compatible, weights_as_inputs


def lift_in_place(graph: onnx.GraphProto, wanted: set[str]) -> bool:
    """Turn the Constant nodes holding any of `wanted` into initializers, in place; whether any was.
    The one place Constant weights become initializers (overridable ones, and those a file stores quantized)."""
    kept_nodes = []
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] in wanted:
            value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
            if value is None:
                raise GraphError(f"Constant node '{node.name}' has no tensor value to lift")
            lifted = copy.deepcopy(value)
            lifted.name = node.output[0]
            graph.initializer.append(lifted)
        else:
            kept_nodes.append(node)
    if len(kept_nodes) == len(graph.node):
        return False
    del graph.node[:]
    graph.node.extend(kept_nodes)
    return True


def _checked(model: onnx.ModelProto, wanted: set[str], present: set[str]) -> onnx.ModelProto:
    missing = wanted - present
    if missing:
        raise GraphError(f"no initializer or Constant named '{sorted(missing)[0]}'")
    if model.ir_version < 4:
        model.ir_version = 4
    return runtime_compatible(model)


def lift_constants(model: onnx.ModelProto, names: list[str] | set[str]) -> onnx.ModelProto:
    """A copy of `model` in which every tensor in `names` is an initializer (Constant
    nodes lifted), nothing declared overridable yet, IR >= 4 so any of them can be."""
    wanted = set(names)
    result = copy.deepcopy(model)
    lift_in_place(result.graph, wanted)
    return _checked(result, wanted, {t.name for t in result.graph.initializer})


def weights_as_graph_inputs(model: onnx.ModelProto, names: list[str] | set[str]) -> onnx.ModelProto:
    """A light copy of `model` in which every tensor in `names` (initializer or Constant output) is a
    plain graph input, the other tensors kept: the graph of a session that is fed those weights at run
    time. Built without copying the named initializers' data (`lift_constants` copies the model)."""
    wanted = set(names)
    keep = lambda t: t.name not in wanted  # noqa: E731
    light = weights_as_inputs(model, keep)
    if lift_in_place(light.graph, wanted):  # Constant weights: initializers first, then inputs like the rest
        light = weights_as_inputs(light, keep)
    return _checked(light, wanted, {v.name for v in light.graph.input})


def input_declarations(model: onnx.ModelProto, names: list[str] | set[str]) -> bytes:
    """Serialised ModelProto holding only graph-input declarations for the named initializers.

    Protobuf merges concatenated messages (repeated fields append), so
    `model_bytes + input_declarations(...)` is the model with those weights
    overridable: a session per group of overridable weights without
    re-serialising (or copying) a large model.
    """
    initializers = {t.name: t for t in model.graph.initializer}
    declared = {value.name for value in model.graph.input}
    suffix = onnx.ModelProto()
    for name in sorted(set(names) - declared):
        tensor = initializers[name]
        suffix.graph.input.append(helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
    return suffix.SerializeToString()


def make_weights_overridable(model: onnx.ModelProto, names: list[str] | set[str]) -> onnx.ModelProto:
    """Return a copy of `model` in which every tensor in `names` can be fed.

    Does not modify `model`.
    """
    result = lift_constants(model, names)
    result.MergeFromString(input_declarations(result, names))
    return result
