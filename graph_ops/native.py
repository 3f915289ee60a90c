"""Weights ONNX Runtime runs compressed: a MatMul's or Gemm's weight as com.microsoft MatMulNBits, a Gather's table
as GatherBlockQuantized. Unlike every other stored form, these replace the weight's consumers, not the weight: the
float weight is never built, so the codes are what the session holds and its kernels read.

`native_uses` says which weights can go native (every consumer of one kind); a stored weight gives its `NativePlan`
(the parts along the output channels, each a MatMulNBits or a float weight); `rewrite_consumers` puts it in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

MATMUL = "matmul"
GATHER = "gather"
DOMAIN = "com.microsoft"
NATIVE_OPS = ("MatMulNBits", "GatherBlockQuantized")
"""The op types a native weight becomes: they read codes on every call by design, which is what keeps them small."""
GATHERED_CODES = "GatheredCodes"
"""A table part whose packed codes a plain Gather reads, the picked rows unpacked and dequantized after it (standard
ops: widths GatherBlockQuantized does not take); its inputs are codes, scale [and zero point]."""


@dataclass(frozen=True)
class NativeUse:
    """How every consumer of a weight reads it: `kind` MATMUL (the weight is B of MatMul or Gemm, its output channels
    along `n_axis`) or GATHER (the table of a Gather along axis 0)."""

    kind: str
    n_axis: int


@dataclass(frozen=True)
class NativePart:
    """Output channels (a table's rows) of a native weight: a MatMulNBits or GatherBlockQuantized node's inputs after
    the activation or indices (its tensors) and attributes, or (`op` 'MatMul', 'Gather') a float weight `inputs[0]`
    that `nodes` produce."""

    op: str
    inputs: tuple[str, ...]
    attributes: dict
    initializers: tuple[onnx.TensorProto, ...] = ()
    nodes: tuple[onnx.NodeProto, ...] = ()
    shape: tuple[int, ...] = ()
    """The part's weight shape: what a float part's `nodes` must produce, and a table part's rows."""


@dataclass(frozen=True)
class NativePlan:
    kind: str
    parts: tuple[NativePart, ...]
    nodes: tuple[onnx.NodeProto, ...] = field(default=())

    @property
    def initializers(self) -> list[onnx.TensorProto]:
        return [t for part in self.parts for t in part.initializers]

    @property
    def producers(self) -> list[onnx.NodeProto]:
        """Nodes that make the float parts' weights (folded at load, like the dequantized layout's)."""
        return [n for part in self.parts for n in part.nodes]


def native_uses(model: onnx.ModelProto) -> dict[str, NativeUse]:
    """The initializers whose every consumer can read a native form: a 2-D B of MatMul, or of Gemm with transA 0,
    alpha 1 and beta 1, or the data of a Gather along axis 0; consumers of different kinds, or any other reader
    (a graph output, a subgraph), leave the weight to the other layouts."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    found: dict[str, set] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in shapes:
                found.setdefault(name, set()).add(_use(node, index, len(shapes[name])))
    for node in model.graph.node:  # weights read inside a subgraph cannot be rewritten here
        for attribute in node.attribute:
            if attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                for graph in [attribute.g, *attribute.graphs]:
                    for inner in graph.node:
                        for name in inner.input:
                            found.setdefault(name, set()).add(None)
    return {
        name: next(iter(uses))
        for name, uses in found.items()
        if len(uses) == 1 and None not in uses and name not in outputs
    }


def _use(node: onnx.NodeProto, index: int, rank: int) -> NativeUse | None:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.domain not in ("", "ai.onnx") or rank != 2:
        return None
    if node.op_type == "MatMul" and index == 1:
        return NativeUse(MATMUL, 1)
    if node.op_type == "Gemm" and index == 1 and not attributes.get("transA", 0):
        if attributes.get("alpha", 1.0) == 1.0 and (
            len(node.input) < 3 or not node.input[2] or attributes.get("beta", 1.0) == 1.0
        ):
            return NativeUse(MATMUL, 0 if attributes.get("transB", 0) else 1)
    if node.op_type == "Gather" and index == 0 and attributes.get("axis", 0) == 0:
        return NativeUse(GATHER, 0)
    return None


def rewrite_consumers(graph: onnx.GraphProto, name: str, plan: NativePlan) -> list[onnx.NodeProto]:
    """Replace every consumer of weight `name` by the plan's nodes, in place; returns the nodes that produce its
    float parts' weights (for the caller to put first, with the other producers)."""
    nodes = []
    for node in graph.node:
        if name not in node.input:
            nodes.append(node)
            continue
        nodes += _gather(node, plan) if plan.kind == GATHER else _matmul(node, plan)
    del graph.node[:]
    graph.node.extend(nodes)
    return plan.producers


def _matmul(node: onnx.NodeProto, plan: NativePlan) -> list[onnx.NodeProto]:
    """`node` (MatMul or Gemm) as one node per part along the output channels, joined by Concat, plus Gemm's bias."""
    activation, output = node.input[0], node.output[0]
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    joined = output if bias is None else f"{output}__unbiased"
    pieces = [joined] if len(plan.parts) == 1 else [f"{output}__part{i}" for i in range(len(plan.parts))]
    transposed = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
    made = []
    for piece, part in zip(pieces, plan.parts):
        op, attributes = part.op, dict(part.attributes)
        if op == "MatMul" and transposed:  # a float part keeps the weight's [N, K] storage: Gemm reads it transposed
            op, attributes = "Gemm", {**attributes, "transB": 1}
        made.append(
            helper.make_node(
                op,
                [activation, *part.inputs],
                [piece],
                name=f"{node.name or output}__{piece}",
                domain=DOMAIN if op in NATIVE_OPS else "",
                **attributes,
            )
        )
    if len(pieces) > 1:
        made.append(helper.make_node("Concat", pieces, [joined], axis=-1, name=f"{node.name or output}__concat"))
    if bias is not None:
        made.append(helper.make_node("Add", [joined, bias], [output], name=f"{node.name or output}__bias"))
    return made


def _gather(node: onnx.NodeProto, plan: NativePlan) -> list[onnx.NodeProto]:
    """`node` as one GatherBlockQuantized per row group (a float Gather for a float group); with several groups each
    gathers its own rows at indices shifted and clipped into its range, and Where keeps, per index, the group that
    holds it. Indices are taken as non-negative (what a token table reads)."""
    ids, output, label = node.input[1], node.output[0], node.name or node.output[0]
    if len(plan.parts) == 1:
        return _gathered(plan.parts[0], ids, output, label)
    made, picked, end = [], [], 0
    zero = start = _index_constant(made, f"{output}__rows_zero", 0, ids)
    for index, part in enumerate(plan.parts):
        rows, piece = part.shape[0], f"{output}__rows{index}"
        local, last = f"{piece}__ids", _index_constant(made, f"{piece}__last", rows - 1, ids)
        made.append(helper.make_node("Sub", [ids, start], [f"{local}__shifted"], name=f"{label}__{piece}_sub"))
        made.append(helper.make_node("Clip", [f"{local}__shifted", zero, last], [local], name=f"{label}__{piece}_clip"))
        made += _gathered(part, local, piece, f"{label}__{piece}")
        end += rows
        start = _index_constant(made, f"{piece}__end", end, ids)  # the next group's first row
        picked.append((piece, start))
    chosen = picked[-1][0]
    for index in range(len(picked) - 2, -1, -1):
        piece, end = picked[index]
        inside = f"{piece}__inside"
        made.append(helper.make_node("Less", [ids, end], [f"{inside}__flat"], name=f"{label}__{piece}_less"))
        made.append(
            helper.make_node(
                "Unsqueeze",
                [f"{inside}__flat", _axes(made, f"{inside}__axes")],
                [inside],
                name=f"{label}__{piece}_unsqueeze",
            )
        )
        target = output if index == 0 else f"{piece}__chosen"
        made.append(helper.make_node("Where", [inside, piece, chosen], [target], name=f"{label}__{piece}_where"))
        chosen = target
    return made


def _gathered(part: NativePart, ids: str, output: str, label: str) -> list[onnx.NodeProto]:
    if part.op == "Gather":  # a float group: its rows as a float table, folded at load
        return [helper.make_node("Gather", [part.inputs[0], ids], [output], axis=0, name=label)]
    if part.op == GATHERED_CODES:
        return _unpacked(part, ids, output, label)
    return [
        helper.make_node(
            part.op,
            [part.inputs[0], ids, *part.inputs[1:]],
            [output],
            domain=DOMAIN,
            name=f"{label}__gbq",
            **part.attributes,
        )
    ]


def _unpacked(part: NativePart, ids: str, output: str, label: str) -> list[onnx.NodeProto]:
    """Gather the rows' packed bytes, shift each of the `8 / bits` planes out ([..., planes, bytes] -> [..., W]),
    then (codes - zero) * scale with the rows' own scale and zero point: the dequantized table's rows, exactly."""
    bits, width, dtype = part.attributes["bits"], part.attributes["width"], part.attributes["dtype"]
    per, p, made = 8 // bits, f"{output}__unpack", []
    codes = f"{p}_bytes"
    made.append(helper.make_node("Gather", [part.inputs[0], ids], [codes], axis=0, name=f"{label}__codes"))
    if per > 1:
        shifts = _constant(made, f"{p}_shifts", np.arange(per, dtype=np.uint8).reshape(per, 1) * bits)
        mask = _constant(made, f"{p}_mask", np.array((1 << bits) - 1, np.uint8))
        wide = _constant(made, f"{p}_width", np.array([per * -(-width // per)], np.int64))
        made += [
            helper.make_node("Unsqueeze", [codes, _axes(made, f"{p}_plane_axis", -2)], [f"{p}_planes"]),
            helper.make_node("BitShift", [f"{p}_planes", shifts], [f"{p}_shifted"], direction="RIGHT"),
            helper.make_node("BitwiseAnd", [f"{p}_shifted", mask], [f"{p}_masked"]),
            helper.make_node("Shape", [ids], [f"{p}_ids_shape"]),
            helper.make_node("Concat", [f"{p}_ids_shape", wide], [f"{p}_shape"], axis=0),
            helper.make_node("Reshape", [f"{p}_masked", f"{p}_shape"], [f"{p}_codes"]),
        ]
        codes = f"{p}_codes"
        if per * -(-width // per) != width:  # the padding columns of the last plane
            start = _constant(made, f"{p}_start", np.array([0], np.int64))
            end = _constant(made, f"{p}_end", np.array([width], np.int64))
            made.append(helper.make_node("Slice", [codes, start, end, _axes(made, f"{p}_last", -1)], [f"{p}_used"]))
            codes = f"{p}_used"
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    made.append(helper.make_node("Cast", [codes], [f"{p}_float"], to=to))
    if len(part.inputs) > 2:  # a zero point per row, gathered with it
        made.append(helper.make_node("Gather", [part.inputs[2], ids], [f"{p}_zero_codes"], axis=0))
        made.append(helper.make_node("Cast", [f"{p}_zero_codes"], [f"{p}_zero"], to=to))
    else:
        _constant(made, f"{p}_zero", np.array(part.attributes["offset"], np.dtype(dtype)))
    made += [
        helper.make_node("Sub", [f"{p}_float", f"{p}_zero"], [f"{p}_centred"]),
        helper.make_node("Gather", [part.inputs[1], ids], [f"{p}_scale"], axis=0),
        helper.make_node("Mul", [f"{p}_centred", f"{p}_scale"], [output], name=f"{label}__dequantize"),
    ]
    return made


def _constant(made: list, name: str, value: np.ndarray) -> str:
    made.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, f"{name}__v")))
    return name


def _index_constant(made: list, name: str, value: int, like: str) -> str:
    """A scalar `value` in the indices' own integer type (int32 or int64, whichever the model feeds)."""
    made.append(
        helper.make_node(
            "Constant",
            [],
            [f"{name}__int64"],
            value=helper.make_tensor(f"{name}__v", onnx.TensorProto.INT64, [], [value]),
        )
    )
    made.append(helper.make_node("CastLike", [f"{name}__int64", like], [name]))
    return name


def _axes(made: list, name: str, axis: int = -1) -> str:
    return _constant(made, name, np.array([axis], np.int64))


def with_domain(model: onnx.ModelProto) -> None:
    """Declare the com.microsoft domain the native ops come from (version 1), if the model does not yet."""
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


@dataclass(frozen=True)
class RuntimeForm:
    """What a session runs for one weight of a written model, and the bytes it holds for it after load."""

    form: str
    bytes: int


def runtime_forms(model: onnx.ModelProto) -> dict[str, RuntimeForm]:
    """Each stored weight of a written model (its codes, or its float initializer) by what ONNX Runtime makes of it:
    'MatMulNBits b-bit' / 'GatherBlockQuantized' (the kernels read the codes), 'DequantizeLinear every call', 'folded
    at load' (constant nodes ONNX Runtime turns into a float tensor), or 'float'. Read off the file alone."""
    from graph_ops.io import tensor_bits

    sizes = {t.name: tensor_bits(t) // 8 for t in model.graph.initializer}
    constant = _constant_nodes(model, set(sizes))
    found: dict[str, RuntimeForm] = {}
    seen: set[str] = set()
    for index, node in enumerate(model.graph.node):
        stored = [name for name in node.input if name in sizes]
        packed = _packed_codes(node.input[0]) if node.op_type == "Gather" and stored else None
        if node.op_type in NATIVE_OPS or packed is not None:
            label = _weight_label(node.input[1] if node.op_type == "MatMulNBits" else node.input[0])
            if packed is not None:  # a packed-codes table part's codes, or its scale or zero point ('')
                kind = f"Gather of {packed}-bit codes" if packed else ""
            else:
                kind = f"{node.op_type} {kernel_bits(node)}-bit"
            fresh = [name for name in stored if name not in seen]
            seen.update(fresh)
            previous = found.get(label)
            kinds = sorted({kind, *(previous.form.split(" + ") if previous else ())} - {""})
            found[label] = RuntimeForm(
                " + ".join(kinds), sum(sizes[n] for n in fresh) + (previous.bytes if previous else 0)
            )
        elif node.op_type == "DequantizeLinear" and index not in constant and stored:
            found[node.output[0]] = RuntimeForm("DequantizeLinear every call", sum(sizes[n] for n in stored))
            seen.update(stored)
    shapes = _shapes(model) if constant else {}
    for index in constant:
        node = model.graph.node[index]
        for output in node.output:
            if output in constant.values() or not output:
                continue
            count = shapes.get(output)
            found[output] = RuntimeForm("folded at load", 4 * count if count is not None else 0)
            seen.update(n for n in node.input if n in sizes)
    for node in model.graph.node:  # float weights read as they are
        for name in node.input:
            if name in sizes and name not in seen and sizes[name] >= 1024:
                found[name] = RuntimeForm("float", sizes[name])
                seen.add(name)
    return found


def _constant_nodes(model: onnx.ModelProto, initializers: set[str]) -> dict[int, str]:
    """Indices of the nodes computed from initializers alone (what ONNX Runtime folds at load, DequantizeLinear aside),
    mapped to outputs another constant node reads (the last outputs of each chain are the folded weights)."""
    known, chain = set(initializers), {}
    for index, node in enumerate(model.graph.node):
        if (
            node.op_type != "DequantizeLinear"
            and node.op_type not in NATIVE_OPS
            and node.input
            and all(not name or name in known for name in node.input)
        ):
            known.update(node.output)
            chain[index] = ""
    inner = {name for index in chain for name in model.graph.node[index].input}
    return {index: next((o for o in model.graph.node[index].output if o in inner), "") for index in chain}


def _shapes(model: onnx.ModelProto) -> dict[str, int]:
    """Element counts of the tensors shape inference can tell."""
    from graph_ops.prefix import inferred_values

    counts = {}
    for value in inferred_values(model):
        dims = value.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            total = 1
            for d in dims:
                total *= d.dim_value
            counts[value.name] = total
    return counts


PACKED_CODES = re.compile(r"__gcodes(\d|_scale|_zero)$")
"""The tensors of a table part `gathered_part` wrote: codes (`__gcodes<bits>`), scale and zero point."""


def _packed_codes(name: str) -> str | None:
    """'<bits>' for a gathered-codes part's codes, '' for its scale or zero point, None for any other tensor."""
    found = PACKED_CODES.search(name)
    return None if found is None else (found.group(1) if found.group(1).isdigit() else "")


def gathers_packed_codes(node: onnx.NodeProto) -> bool:
    """A Gather of a packed-codes table part's tensors: it reads only the rows its indices pick, on every call."""
    return node.op_type == "Gather" and bool(node.input) and _packed_codes(node.input[0]) is not None


def _weight_label(name: str) -> str:
    """The weight a native tensor stores: its name without the form's suffix and the channel group's."""
    name = PACKED_CODES.sub("", name)
    for suffix in ("__nbits", "__gbq"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    head, _, tail = name.rpartition("__part")
    return head if head and tail.isdigit() else name


def kernel_bits(node: onnx.NodeProto) -> int:
    """The code width a MatMulNBits or GatherBlockQuantized node reads (the contrib ops' default is 4)."""
    return next((int(a.i) for a in node.attribute if a.name == "bits"), 4)
