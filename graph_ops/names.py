"""Readable names for weights whose stored names an exporter generated.

torch's default exporter (`torch.onnx.export(..., dynamo=True)`) stores a Linear weight it transposed for a MatMul
as `val_33`, the TorchScript one as `onnx::MatMul_123`: names a user never wrote. Both leave the module behind on
the node that reads the weight: the dynamo exporter in its metadata (`pkg.torch.onnx.name_scopes`, the module
path, and `pkg.torch.onnx.fx_node`, the parameter it read, `%p_layers_0_attn_q_weight`), the TorchScript one in
the node's name (`/layers.0/attn/q/MatMul`). A *label* is that path (`layers.0.attn.q.weight`); the stored name
stays the weight's identity everywhere, the label is what reports show beside it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

import onnx

GENERATED = re.compile(r"_?val_\d+|onnx::.+|\d+|(?:.*/)?Constant(?:_\d+)?_output_\d+|_v_\d+")
"""Stored names exporters make up (matched whole): dynamo's `val_N`, TorchScript's `onnx::Op_N` and numbers,
lifted Constant outputs."""
SCOPES = "pkg.torch.onnx.name_scopes"
"""Node metadata of torch's dynamo exporter: the module scopes the node ran in, outermost first, then the op."""
FX_NODE = "pkg.torch.onnx.fx_node"
"""Node metadata of torch's dynamo exporter: the FX node, whose arguments name the parameters it read (`%p_...`)."""
FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
PASSED = {"Transpose", "Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "DequantizeLinear"}
"""Ops between a weight and the node that says which module read it."""


def _metadata(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _from_scopes(node: onnx.NodeProto) -> str | None:
    """`layers.0.attn.q.weight` from a dynamo node: the innermost module, and the parameter it read there."""
    meta = _metadata(node)
    try:
        scopes = ast.literal_eval(meta[SCOPES])
    except (KeyError, ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or len(scopes) < 2 or not isinstance(scopes[-2], str) or not scopes[-2]:
        return None
    module = scopes[-2]
    prefix = "p_" + module.replace(".", "_") + "_"
    for argument in re.findall(r"%(p_\w+)", meta.get(FX_NODE, "")):  # in argument order: a weight comes first
        if argument.startswith(prefix) and len(argument) > len(prefix):
            return f"{module}.{argument[len(prefix) :]}"
    return f"{module}.{scopes[-1]}" if scopes[-1] else module


def _from_node_name(node: onnx.NodeProto) -> str | None:
    """`layers.0.attn.q.MatMul` from a TorchScript node named `/layers.0/attn/q/MatMul`."""
    parts = [p for p in node.name.split("/") if p]
    if not node.name.startswith("/") or len(parts) < 2:
        return None
    return ".".join(parts)


def _reader(name: str, consumers: dict[str, list[onnx.NodeProto]]) -> str | None:
    """The readable name the first node reading `name` (past layout-only ops) gives it."""
    seen, frontier = set(), [name]
    while frontier:
        current = frontier.pop(0)
        for node in consumers.get(current, []):
            found = _from_scopes(node) or (None if node.op_type in PASSED else _from_node_name(node))
            if found:
                return found
            if node.op_type in PASSED and node.output and node.output[0] not in seen:
                seen.add(node.output[0])
                frontier.append(node.output[0])
    return None


def weight_labels(graph: onnx.GraphProto, stored: Mapping[str, onnx.TensorProto] | None = None) -> dict[str, str]:
    """Every stored tensor's label: a readable name recovered from the nodes reading it where the stored name was
    generated (`GENERATED`), else the stored name. Unique across the graph and independent of which tensors a
    caller asks about, so a unit reads the same in inspect, score and export: a recovered name that two tensors
    share, or that another tensor is stored under, gets the stored name after it. Only float tensors are named
    (an integer shape read in the same module would claim its name). `stored`: the graph's stored tensors by name
    (as `layout.stored_tensors` finds them; default its initializers)."""
    if stored is None:
        stored = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                consumers.setdefault(name, []).append(node)
    found = {
        name: _reader(name, consumers)
        for name, tensor in stored.items()
        if tensor.data_type in FLOATS and GENERATED.fullmatch(name)
    }
    found = {name: label for name, label in found.items() if label}
    counts: dict[str, int] = {}
    for label in found.values():
        counts[label] = counts.get(label, 0) + 1
    labels = {name: name for name in stored}
    for name, label in found.items():
        labels[name] = label if counts[label] == 1 and label not in stored else f"{label} ({name})"
    return labels
