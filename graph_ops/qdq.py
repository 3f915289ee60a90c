"""Write quantized weights into a graph as standard ONNX ops.

Each replaced weight keeps its tensor name; what produces it changes. The
stored weight says how (`StoredWeight.emit`: its stored format's emitter, see
`tiers.formats`), this module only builds the file around it: the opset
conversion, Constant weights lifted, the emitted nodes type-checked, tensors
streamed to external data. New nodes go first in the node list: they read
only initializers, so the graph stays topologically sorted, and every
consumer keeps reading the same name. Consumers are never edited, so shared
weights are stored once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper, version_converter

from graph_ops.io import MAX_IR_VERSION, MAX_OPSET, GraphError, tensor_bits
from graph_ops.native import NATIVE_OPS, NativePlan, gathers_packed_codes, rewrite_consumers, with_domain
from graph_ops.overridable import lift_in_place


class StoredWeight(Protocol):
    """What `tiers.Encoded` provides; graph_ops needs nothing else from a tier."""

    form: str
    values: object
    """Stored payload (floats or codes; 'raw' form: the weight itself)."""
    dtype: str
    """numpy name of the float type consumers expect ('float32', 'float16')."""

    @property
    def opset(self) -> int:
        """Lowest default-domain opset the emitted nodes need."""

    def emit(self, name: str, layout: str) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
        """Initializers and nodes that produce tensor `name`, in runtime `layout` (`LAYOUTS`)."""

    def fed(self, name: str) -> tuple[list[onnx.ValueInfoProto], dict[str, np.ndarray], list[onnx.NodeProto]] | None:
        """Graph inputs, their values and the nodes that rebuild the weight from its codes; None: fed as floats."""

    def dequantize(self) -> np.ndarray:
        """The weight the runtime computes from the stored form, as `dtype`."""


def required_opset(stored: Mapping[str, StoredWeight]) -> int:
    """Lowest default-domain opset that can express every stored form."""
    return max([1] + [value.opset for value in stored.values()])


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain (ai.onnx) opset."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Convert the default-domain opset up to `opset` (no-op when already there)."""
    current = default_opset(model)
    if current >= opset:
        return model
    if opset > MAX_OPSET:
        raise GraphError(f"the chosen tiers need opset {opset}, above the supported {MAX_OPSET}")
    try:
        converted = version_converter.convert_version(model, opset)
    except Exception as exc:
        raise GraphError(
            f"cannot convert the model from opset {current} to {opset} (needed by the chosen tiers): "
            f"{str(exc).splitlines()[0]}"
        ) from None
    return converted


HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def computes_in_half(model: onnx.ModelProto) -> bool:
    """Whether the graph holds or makes 16-bit float tensors (initializers, declared values, Casts to them). ONNX
    Runtime optimizes such a graph differently at a declared opset of 20 or more, so an export measures it at the
    opset it writes (docs/design-notes/graph-ops.md, 'Half-precision graphs are measured at the written opset')."""
    graph = model.graph
    declared = [*graph.input, *graph.output, *graph.value_info]
    return (
        any(t.data_type in HALF_TYPES for t in graph.initializer)
        or any(v.type.tensor_type.elem_type in HALF_TYPES for v in declared)
        or any(
            n.op_type == "Cast" and any(a.name == "to" and a.i in HALF_TYPES for a in n.attribute) for n in graph.node
        )
    )


def at_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`model` converted up to `opset` exactly as the writer converts it (`_skeleton`: the structure alone, then
    the initializers joined): what the sessions that measure a file at that opset run, so ONNX Runtime optimizes
    both graphs alike (a float16 graph declared at opset 20 or later gains and loses nodes). `model` itself when
    already there; else a new model, `model` untouched (its tensors copied, external-data references as such)."""
    if default_opset(model) >= opset:
        return model
    converted, _ = _skeleton(model, set(), opset)
    converted.graph.initializer.extend(model.graph.initializer)
    converted.ir_version = min(
        max(converted.ir_version, helper.find_min_ir_version_for(list(converted.opset_import), ignore_unknown=True)),
        MAX_IR_VERSION,
    )
    return converted


LAYOUTS = ("native", "dequantized", "fused")
"""How integer and FP8 codes reach their consumers (`export --runtime-layout`):
- 'native': ONNX Runtime's own low-bit kernels where they take the weight (MatMulNBits for MatMul/Gemm weights,
  GatherBlockQuantized for embedding tables: `graph_ops.native`, the consumers rewritten), the 'dequantized'
  layout for every other weight;
- 'fused': DequantizeLinear, which ONNX Runtime fuses with a MatMul into MatMulNBits (weights stay compressed in
  memory; fast for few rows, slower than float for batched calls; DequantizeLinear before other ops runs on every
  call) and which TensorRT's explicit quantization reads;
- 'dequantized': plain ops that ONNX Runtime folds into a float weight when the session is created (the small
  file, the original's kernels and speed, float-size weights in memory after load).
Float16/bfloat16 Casts and INT1's unpack subgraph are folded at load in both."""


def _emit(name: str, value: StoredWeight, layout: str = "fused") -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """Initializers and nodes that produce tensor `name` from its stored form, in `layout` (see `LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise GraphError(f"unknown runtime layout '{layout}'; choose one of {', '.join(LAYOUTS)}")
    return value.emit(name, "dequantized" if layout == "native" else layout)


def _layout_of(layout: str | Mapping[str, str], name: str) -> str:
    """One layout for every weight, or one per weight (a runtime that takes a form for some weights only)."""
    return layout if isinstance(layout, str) else layout[name]


def emitted_bits(name: str, value: StoredWeight, layout: str = "fused") -> int:
    """Bits of every tensor the weight's stored form puts in the file (what eval and gate count)."""
    return sum(tensor_bits(t) for t in _emit(name, value, layout)[0])


STREAM_THRESHOLD = 1 << 30
"""Models with at least this many bytes of tensors are written with external data, streamed."""


def _copy_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model's structure (nodes, I/O, metadata) without initializer data."""
    skeleton = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name == "graph":
            continue
        target = getattr(skeleton, field.name)
        if field.is_repeated:
            target.extend(value)
        elif field.type == field.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(skeleton, field.name, value)
    for field, value in model.graph.ListFields():
        if field.name == "initializer":
            continue
        target = getattr(skeleton.graph, field.name)
        if field.is_repeated:
            target.extend(value)
        elif field.type == field.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(skeleton.graph, field.name, value)
    return skeleton


def _tensor_bytes(tensor: onnx.TensorProto, source: Path | None = None) -> bytes | memoryview:
    """A tensor's payload; one that points into an external-data file is read from it (`source`: the input
    model's folder)."""
    if external_data_helper.uses_external_data(tensor):
        if source is None:
            raise GraphError(f"tensor '{tensor.name}' lives in external data, but no folder to read it from was given")
        info = external_data_helper.ExternalDataInfo(tensor)
        with open(Path(source) / info.location, "rb") as handle:
            handle.seek(int(info.offset or 0))
            payload = handle.read(int(info.length)) if info.length else handle.read()
        return payload
    if tensor.raw_data:
        return tensor.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name).raw_data


def _loaded(
    tensor: onnx.TensorProto, source: Path | None, payload: bytes | memoryview | None = None
) -> onnx.TensorProto:
    """`tensor` with its payload inside it (read from its external-data file when it points to one, unless given)."""
    if not external_data_helper.uses_external_data(tensor):
        return tensor
    inline = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))
    inline.raw_data = bytes(payload if payload is not None else _tensor_bytes(tensor, source))
    return inline


class _DataFile:
    """Appends tensor payloads to one external-data file and returns reference protos."""

    ALIGN = 64
    INLINE_BELOW = 1024
    """Tensors smaller than this stay inside the .onnx file, as onnx.save does."""

    def __init__(self, path: Path, location: str, source: Path | None = None):
        self.path = path
        self.location = location
        """The name model files refer to (the data is written under a temporary name first)."""
        self.source = source
        """The input model's folder, for kept tensors that live in its external data."""
        self.handle = open(path, "wb")
        self.offset = 0

    def reference(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        payload = _tensor_bytes(tensor, self.source)
        if len(payload) < self.INLINE_BELOW:
            return _loaded(tensor, self.source, payload)
        padding = -self.offset % self.ALIGN
        self.handle.write(b"\0" * padding)
        self.offset += padding
        self.handle.write(payload)
        ref = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(len(payload)))):
            ref.external_data.add(key=key, value=value)
        ref.data_location = onnx.TensorProto.EXTERNAL
        self.offset += len(payload)
        return ref

    def close(self) -> None:
        self.handle.close()


def _skeleton(
    model: onnx.ModelProto, lift: set[str], opset: int
) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """The model's structure at `opset`, without initializers, and the Constant weights in `lift` as tensors.

    The opset is converted before new ops join. The converter wants every
    tensor defined, so the (data-less) initializers stand in as graph inputs
    meanwhile.
    """
    skeleton = _copy_without_initializers(model)
    lift_in_place(skeleton.graph, lift)
    lifted = {t.name: t for t in skeleton.graph.initializer}  # weights that were Constant nodes
    del skeleton.graph.initializer[:]
    declared = {i.name for i in skeleton.graph.input}
    stand_ins = [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in list(model.graph.initializer) + list(lifted.values())
        if t.name not in declared
    ]
    skeleton.graph.input.extend(stand_ins)
    annotated = list(skeleton.graph.value_info)
    skeleton = upgrade_opset(skeleton, opset)
    # The converter infers shapes and records them as value_info; ONNX Runtime fuses more with them, into kernels
    # that can be slower than the ops they replace (docs/design-notes/graph-ops.md, 'The converter's shapes are
    # dropped'), so the output keeps the annotations the model came with, and runs the graph the original runs.
    del skeleton.graph.value_info[:]
    skeleton.graph.value_info.extend(annotated)
    temporary = {v.name for v in stand_ins}
    kept_inputs = [i for i in skeleton.graph.input if i.name not in temporary]
    del skeleton.graph.input[:]
    skeleton.graph.input.extend(kept_inputs)
    return skeleton, lifted


def conversion_overhead_bits(model: onnx.ModelProto, opset: int) -> int:
    """Stored bits the opset conversion adds (attributes that become constant inputs)."""
    from graph_ops.io import weight_bits

    before = _copy_without_initializers(model)
    after, _ = _skeleton(model, set(), max(default_opset(model), opset))
    return max(0, weight_bits(after) - weight_bits(before))


def _build(
    model: onnx.ModelProto,
    stored: Mapping[str, StoredWeight],
    sink: Callable[[onnx.TensorProto], onnx.TensorProto],
    layout: str = "fused",
    opset: int = 1,
    native: Mapping[str, NativePlan] | None = None,
) -> onnx.ModelProto:
    """The model with `stored` weights in `layout`, at `opset` or the lowest above it that holds them; every
    initializer passes through `sink` (kept, or moved to external data). `native`: the weights whose consumers are
    rewritten to ONNX Runtime's low-bit kernels (`graph_ops.native`), their plans."""
    native = native or {}
    skeleton, lifted = _skeleton(model, set(stored), max(default_opset(model), required_opset(stored), opset))
    present = {t.name for t in model.graph.initializer} | set(lifted)
    missing = set(stored) - present
    if missing:
        raise GraphError(f"no weight named '{sorted(missing)[0]}' in the model")
    new_nodes, emitted, replaced = [], [], []
    for tensor in list(model.graph.initializer) + list(lifted.values()):
        if tensor.name in native:
            skeleton.graph.initializer.extend(sink(t) for t in native[tensor.name].initializers)
            producers = rewrite_consumers(skeleton.graph, tensor.name, native[tensor.name])
            if producers:  # the float parts' weights, checked as the other layouts' are
                read = {name for node in producers for name in node.input}
                emitted += [
                    helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                    for t in native[tensor.name].initializers
                    if t.name in read
                ]
                replaced += [
                    helper.make_tensor_value_info(part.inputs[0], tensor.data_type, list(part.shape))
                    for part in native[tensor.name].parts
                    if part.nodes
                ]
            new_nodes.extend(producers)
        elif tensor.name in stored:
            initializers, nodes = _emit(tensor.name, stored[tensor.name], _layout_of(layout, tensor.name))
            if nodes:
                emitted += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in initializers]
                replaced.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            skeleton.graph.initializer.extend(sink(t) for t in initializers)
            new_nodes.extend(nodes)
        else:
            skeleton.graph.initializer.append(sink(tensor))
    _check_emitted(new_nodes, emitted, replaced, skeleton)
    inputs = [i for i in skeleton.graph.input if i.name not in stored]  # old-style models list initializers as inputs
    del skeleton.graph.input[:]
    skeleton.graph.input.extend(inputs)
    nodes = new_nodes + list(skeleton.graph.node)
    del skeleton.graph.node[:]
    skeleton.graph.node.extend(nodes)
    if native:
        with_domain(skeleton)
    minimum_ir = helper.find_min_ir_version_for(list(skeleton.opset_import), ignore_unknown=True)
    skeleton.ir_version = min(max(skeleton.ir_version, minimum_ir), MAX_IR_VERSION)
    return skeleton


def _check_emitted(
    nodes: list[onnx.NodeProto],
    stored: list[onnx.ValueInfoProto],
    weights: list[onnx.ValueInfoProto],
    model: onnx.ModelProto,
) -> None:
    """Type-check the nodes that now produce the weights, alone (their stored tensors declared, not copied):
    each must be valid at the model's opset and yield its weight's original type and shape. A form a runtime
    cannot load must fail here, not when the user opens the file."""
    if not nodes:
        return
    graph = helper.make_graph(nodes, "emitted", stored, weights)
    check = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    try:
        onnx.checker.check_model(check, full_check=True)
    except Exception as exc:
        kinds = sorted({onnx.helper.tensor_dtype_to_np_dtype(w.type.tensor_type.elem_type).name for w in weights})
        raise GraphError(
            f"the quantized weights cannot be written as valid ONNX for this model's {'/'.join(kinds)} weights: "
            f"{str(exc).strip().splitlines()[0]}"
        ) from None


def apply_storage(
    model: onnx.ModelProto,
    stored: Mapping[str, StoredWeight],
    source: Path | None = None,
    layout: str = "fused",
    opset: int = 1,
    native: Mapping[str, NativePlan] | None = None,
) -> onnx.ModelProto:
    """A new model whose named weights are stored as given, in `layout` (`LAYOUTS`), at `opset` at least, every
    tensor inside it (kept ones that point into the input's external data, in folder `source`, are read in). Input
    untouched."""
    return _build(model, stored, lambda tensor: _loaded(tensor, source), layout, opset, native)


@dataclass(frozen=True)
class Written:
    """A model on disk: its files (the model, then its external data) and its stored-tensor bits."""

    files: tuple[Path, ...]
    weight_bits: int
    opset: int = 0
    """The default-domain opset it was written at."""

    @property
    def path(self) -> Path:
        return self.files[0]

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def write_storage(
    model: onnx.ModelProto,
    stored: Mapping[str, StoredWeight],
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    source: Path | None = None,
    layout: str = "fused",
    opset: int = 1,
    native: Mapping[str, NativePlan] | None = None,
) -> Written:
    """Write `model` with `stored` weights to `path`, atomically (external data together with its model).

    Small models are built in memory into one file (`external_data=False` insists on one file, and
    fails when it would pass protobuf's 2 GiB). Large ones (or `external_data=True`) are
    written tensor by tensor into `<name>.<token>.data`: each emitted or kept tensor
    goes to disk before the next, kept tensors straight from the input's
    bytes, so peak memory stays near the input model's own copy plus one tensor.
    `opset`: the least opset to write at (the one the export measured at, `at_opset`), raised where the
    stored forms need more.
    A `model` loaded without its external data names its folder in `source`:
    kept tensors are then read from the input's data files one at a time.
    """
    from graph_ops.io import PROTOBUF_LIMIT, OutputError, stored_bytes, weight_bits
    from graph_ops.output import atomic_output, data_location, publish_model, save_model

    path = Path(path)
    if external_data is None:  # an input that keeps its weights outside gets an output that does too
        external_data = source is not None or stored_bytes(model) >= STREAM_THRESHOLD
    if not external_data:
        built = apply_storage(model, stored, source, layout, opset, native)
        if stored_bytes(built) >= PROTOBUF_LIMIT:  # only when one file was asked for: the default streams from 1 GiB
            raise OutputError(
                f"cannot write {path} as one file: it holds {stored_bytes(built) / 2**30:.2f} GiB, "
                "past protobuf's 2 GiB limit"
            )
        return Written((save_model(built, path, external_data=False),), weight_bits(built), default_opset(built))
    location = data_location(path)
    with atomic_output(path.with_name(location)) as partial:  # the data lands under its final name first ...
        data = _DataFile(partial, location, source)
        try:
            built = _build(model, stored, data.reference, layout, opset, native)
        finally:
            data.close()
    publish_model(
        path, location, lambda temporary: onnx.save_model(built, str(temporary))
    )  # ... then the model that points to it
    return Written((path, path.with_name(location)), weight_bits(built), default_opset(built))


CODE_TYPES = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT4,
    onnx.TensorProto.UINT4,
    onnx.TensorProto.INT2,
    onnx.TensorProto.UINT2,
    onnx.TensorProto.FLOAT8E4M3FN,
    onnx.TensorProto.FLOAT8E4M3FNUZ,
    onnx.TensorProto.FLOAT8E5M2,
    onnx.TensorProto.FLOAT8E5M2FNUZ,
}
"""Element types of stored codes (MatMulNBits' packed weights are UINT8)."""


def per_call_dequantization(optimized: onnx.ModelProto) -> dict[str, int]:
    """Nodes of the graph a runtime saved after optimizing (`SessionOptions.optimized_model_filepath`) that read
    stored codes, by op type: dequantization that runs on every call. Empty when every weight was folded into a
    float initializer at load (the 'dequantized' layout, fp16/bf16 Casts, INT1's unpacking)."""
    codes = {t.name for t in optimized.graph.initializer if t.data_type in CODE_TYPES}
    found: dict[str, int] = {}
    for node in optimized.graph.node:
        if node.op_type in NATIVE_OPS or gathers_packed_codes(node):  # reading codes every call keeps them small
            continue
        if any(i in codes for i in node.input):
            found[node.op_type] = found.get(node.op_type, 0) + 1
    return found
