"""Probe batching: one session call runs all P probes of a unit.

The unit's weights become graph inputs with a leading probe axis [P, *shape];
the caller tiles the other inputs P times along the batch axis, probe-major
(rows p·B .. (p+1)·B-1 are probe p's), and every node reading one of the
weights is rewritten so that probe p's rows meet weight p. One call then does
the work of P, which pays where calls are dominated by per-call overhead
rather than arithmetic.

Consumers handled: MatMul (weight on either side), Gemm (weight B and/or bias
C), Gather (the weight is the table) and Conv (weight and/or bias; probes are
folded into groups). Anything else raises `BatchError`: the caller then runs
that unit probe by probe. The rewrite assumes each row of the batch is
computed independently; whether a model keeps to that is for the caller to
check (by comparing a batched run with an unbatched one).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graph_ops.io import GraphError, runtime_compatible
from graph_ops.prefix import _subgraph_names, inferred_values

MIN_OPSET = 10
"""Slice and Mod with inputs, which the rewrite emits."""


class BatchError(GraphError):
    """The weights are read in a way the probe-batching rewrite does not handle."""


def tensor_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Rank of every tensor shape inference can shape (the MatMul rewrite needs its operand's)."""
    ranks = {t.name: len(t.dims) for t in model.graph.initializer}
    try:
        values = inferred_values(model)
    except Exception:  # a graph shape inference cannot follow: MatMuls are then refused
        return ranks
    for value in values:
        if value.type.tensor_type.HasField("shape"):
            ranks[value.name] = len(value.type.tensor_type.shape.dim)
    return ranks


def refusal(model: onnx.ModelProto, names, ranks: dict[str, int] | None = None) -> str | None:
    """Why `batch_probes` would refuse these weights, or None when it would not (builds no model)."""
    try:
        _rewrite(model, list(names), 2, ranks)
    except BatchError as exc:
        return str(exc)
    return None


def batch_probes(model: onnx.ModelProto, names, probes: int, ranks: dict[str, int] | None = None) -> onnx.ModelProto:
    """A copy of `model` in which the weights `names` are inputs [probes, *shape] and the rows of
    probe p (the p-th of `probes` equal blocks of the batch axis) are computed with weight p.

    Every other weight stays a constant. Raises `BatchError` for a read it cannot batch.
    Does not modify `model`.
    """
    nodes, constants = _rewrite(model, list(names), probes, ranks)
    old = model.graph
    weights = {t.name: t for t in old.initializer if t.name in set(names)}
    result = onnx.ModelProto(ir_version=max(model.ir_version, 4))  # filled in place: the weights are copied once
    result.opset_import.extend(model.opset_import)
    result.functions.extend(model.functions)
    graph = result.graph
    graph.name = old.name
    graph.node.extend(nodes)
    graph.input.extend(i for i in old.input if i.name not in weights)
    graph.input.extend(
        helper.make_tensor_value_info(n, weights[n].data_type, [probes, *weights[n].dims]) for n in names
    )
    graph.output.extend(old.output)
    graph.initializer.extend(t for t in old.initializer if t.name not in weights)
    graph.initializer.extend(constants)
    graph.sparse_initializer.extend(old.sparse_initializer)
    # value_info is left out: the batch of every rewritten tensor changed
    return runtime_compatible(result)


def _rewrite(
    model: onnx.ModelProto, names: list[str], probes: int, ranks: dict[str, int] | None
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The graph's nodes with every read of `names` rewritten, and the constants the new nodes use."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise BatchError(f"probe batching needs opset {MIN_OPSET} or later; the model uses {opset}")
    initializers = {t.name: t for t in graph.initializer}
    wanted = set(names)
    for name in names:
        if name not in initializers:
            raise BatchError(f"weight '{name}' is not an initializer")
    if wanted & {o.name for o in graph.output}:
        raise BatchError(f"weight '{sorted(wanted & {o.name for o in graph.output})[0]}' is a graph output")
    builder = _Builder(
        graph, probes, {n: list(initializers[n].dims) for n in names}, {n: initializers[n].data_type for n in names}
    )
    rewrites = {"MatMul": builder.matmul, "Gemm": builder.gemm, "Gather": builder.gather, "Conv": builder.conv}
    for node in graph.node:
        read = wanted & ({n for n in node.input if n} | _subgraph_names(node))
        if not read:
            builder.nodes.append(node)
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in rewrites or wanted & _subgraph_names(node):
            raise BatchError(
                f"weight '{sorted(read)[0]}' is read by {_label(node)}, which probe batching does not rewrite"
            )
        if ranks is None and node.op_type == "MatMul":
            ranks = tensor_ranks(model)
        rewrites[node.op_type](node, ranks or {}, initializers)
    return builder.nodes, builder.constants


def _label(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node '{node.name}'" if node.name else f"the {node.op_type} node making '{node.output[0]}'"


class _Builder:
    """Emits the rewritten nodes, with fresh names that cannot clash with the graph's."""

    def __init__(self, graph: onnx.GraphProto, probes: int, shapes: dict[str, list[int]], types: dict[str, int]):
        self.taken = {n for node in graph.node for n in [node.name, *node.input, *node.output]}
        self.taken |= (
            {t.name for t in graph.initializer} | {v.name for v in graph.input} | {v.name for v in graph.output}
        )
        self.probes, self.shapes, self.types = probes, shapes, types
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self._count = 0

    def _fresh(self, hint: str) -> str:
        while True:
            self._count += 1
            name = f"{hint}__probes{self._count}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def op(self, op_type: str, inputs: list[str], hint: str, output: str | None = None, **attributes) -> str:
        output = output or self._fresh(hint)
        self.nodes.append(
            helper.make_node(op_type, inputs, [output], name=self._fresh(f"{hint}_{op_type}"), **attributes)
        )
        return output

    def const(self, values, hint: str, dtype=np.int64) -> str:
        name = self._fresh(hint)
        self.constants.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def shape_from(self, head: list[int], x: str, start: int) -> str:
        """The shape `head` + x.shape[start:], built at run time (x's dims may be dynamic)."""
        tail = self.op(
            "Slice", [self.op("Shape", [x], x), self.const([start], x), self.const([np.iinfo(np.int64).max], x)], x
        )
        return self.op("Concat", [self.const(head, x), tail], x, axis=0)

    def split(self, x: str) -> str:
        """[P·B, ...] -> [P, B, ...]."""
        return self.op("Reshape", [x, self.shape_from([self.probes, -1], x, 1)], x)

    def merge(self, y: str, output: str) -> str:
        """[P, B, ...] -> [P·B, ...], written to `output`."""
        return self.op("Reshape", [y, self.shape_from([-1], y, 2)], y, output)

    def stacked(self, weight: str, shape: list[int]) -> str:
        """The fed [P, *weight] reshaped to `shape` (a constant-shape Reshape)."""
        return self.op("Reshape", [weight, self.const(shape, weight)], weight)

    def scale(self, x: str, factor: float, dtype: int) -> str:
        return (
            x
            if factor == 1.0
            else self.op("Mul", [x, self.const(factor, x, helper.tensor_dtype_to_np_dtype(dtype))], x)
        )

    def matmul(self, node: onnx.NodeProto, ranks: dict[str, int], initializers) -> None:
        """X [P·B, ..., K] @ W [K, N] (or W @ X): X split to [P, B, ...], W [P, 1, ..., K, N] broadcast per probe."""
        a, b = node.input
        if a in self.shapes and b in self.shapes:
            raise BatchError(f"{_label(node)} multiplies two scored weights")
        side = 1 if b in self.shapes else 0
        x, w = (a, b) if side else (b, a)
        shape, rank = self.shapes[w], ranks.get(x)
        if rank is None:
            raise BatchError(f"cannot infer the rank of '{x}', the operand of {_label(node)}")
        # the batch must be X's row axis (X rank 2, W on the right) or a broadcast axis W does not reach
        if len(shape) < 2 or not ((side == 1 and rank == 2 and len(shape) == 2) or (rank >= 3 and len(shape) < rank)):
            raise BatchError(
                f"{_label(node)} reads weight '{w}' {shape} with an operand of rank {rank}: "
                "its batch axis is not a broadcast axis"
            )
        weight = self.stacked(w, [self.probes] + [1] * (rank - len(shape)) + shape)
        parts = [self.split(x), weight] if side else [weight, self.split(x)]
        self.merge(self.op("MatMul", parts, node.output[0]), node.output[0])

    def gemm(self, node: onnx.NodeProto, ranks, initializers) -> None:
        """alpha·A'·B' + beta·C as a MatMul of A' [P, B, K] with B' [P, K, N] (or a shared B'), plus C."""
        a, b, c = (list(node.input) + ["", ""])[:3]
        attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
        if a in self.shapes:
            raise BatchError(f"{_label(node)} reads weight '{a}' as its operand A")
        out = node.output[0]
        dtype = self.types[b] if b in self.shapes else self.types[c]
        x = self.op("Transpose", [a], a, perm=[1, 0]) if attributes.get("transA") else a
        if b in self.shapes:
            k, n = self.shapes[b]
            weight = self.stacked(b, [self.probes, k, n])
            weight = self.op("Transpose", [weight], b, perm=[0, 2, 1]) if attributes.get("transB") else weight
        else:
            weight = self.op("Transpose", [b], b, perm=[1, 0]) if attributes.get("transB") else b
        y = self.scale(self.op("MatMul", [self.split(x), weight], out), attributes.get("alpha", 1.0), dtype)
        if c in self.shapes:
            shape = self.shapes[c]
            if len(shape) > 2 or (len(shape) == 2 and shape[0] != 1):
                raise BatchError(f"{_label(node)} reads bias '{c}' {shape}, which fixes the batch")
            bias = self.scale(
                self.stacked(c, [self.probes] + [1] * (2 - len(shape)) + shape), attributes.get("beta", 1.0), dtype
            )
            self.merge(self.op("Add", [y, bias], out), out)
        elif c:
            self.op(
                "Add", [self.merge(y, self._fresh(out)), self.scale(c, attributes.get("beta", 1.0), dtype)], out, out
            )
        else:
            self.merge(y, out)

    def gather(self, node: onnx.NodeProto, ranks, initializers) -> None:
        """Rows of a table [P·V, ...] (the probes' tables stacked), indices shifted by p·V for probe p."""
        table, indices = node.input
        shape = self.shapes.get(table)
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        if shape is None or indices in self.shapes or axis % len(shape) != 0:
            raise BatchError(f"{_label(node)} reads a scored weight other than as its table along axis 0")
        rows = shape[0]
        flat = self.stacked(table, [self.probes * rows] + shape[1:])
        wide = self.op("Cast", [indices], indices, to=TensorProto.INT64)
        wrapped = self.op("Mod", [wide, self.const(rows, indices)], indices)  # negative indices count from the end
        per_probe = self.op("Reshape", [wrapped, self.const([self.probes, -1], indices)], indices)
        shifted = self.op(
            "Add", [per_probe, self.const(np.arange(self.probes).reshape(-1, 1) * rows, indices)], indices
        )
        restored = self.op("Reshape", [shifted, self.op("Shape", [indices], indices)], indices)
        self.op("Gather", [flat, restored], node.output[0], node.output[0], axis=0)

    def conv(self, node: onnx.NodeProto, ranks, initializers) -> None:
        """Probes folded into groups: X [P·B, C, ...] -> [B, P·C, ...], weight [P·O, C/g, ...], group P·g."""
        x, w, bias = (list(node.input) + [""])[:3]
        if x in self.shapes:
            raise BatchError(f"{_label(node)} reads weight '{x}' as its input")
        if w in self.shapes:
            shape = self.shapes[w]
        elif w in initializers:
            shape = list(initializers[w].dims)
        else:
            raise BatchError(f"{_label(node)} computes its weight '{w}' in the graph")
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "group"}
        group = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "group"), 1)
        p, out, (o, per_group), kernel = self.probes, node.output[0], shape[:2], shape[2:]
        swap = [1, 0] + list(range(2, len(shape) + 1))
        folded = self.op(
            "Reshape",
            [self.op("Transpose", [self.split(x)], x, perm=swap), self.shape_from([0, p * per_group * group], x, 2)],
            x,
        )
        if w in self.shapes:
            weight = self.stacked(w, [p * o, per_group] + kernel)
        else:
            weight = self.op("Tile", [w, self.const([p] + [1] * (len(shape) - 1), w)], w)
        inputs = [folded, weight]
        if bias in self.shapes:
            inputs.append(self.stacked(bias, [p * o]))
        elif bias:
            inputs.append(self.op("Tile", [bias, self.const([p], bias)], bias))
        y = self.op("Conv", inputs, out, group=p * group, **attributes)  # [B, P·O, ...]
        unfolded = self.op("Reshape", [y, self.shape_from([0, p, o], y, 2)], out)
        self.merge(self.op("Transpose", [unfolded], out, perm=swap), out)
