"""The only place ONNX files are read (`graph_ops.output` puts written ones in place).

Loading validates what users get wrong (not ONNX, truncated files, external
data that is missing or escapes the model folder) and turns each case into a
`GraphError` with a one-line message, so callers never show a protobuf
traceback. The input file is only ever read.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import external_data_helper

MAX_IR_VERSION = 13
"""ONNX Runtime 1.31 refuses IR 14, which onnx 1.23 writes by default."""
MAX_OPSET = 26
PROTOBUF_LIMIT = 2**31 - 1
"""Protobuf cannot serialise a message at or above 2 GiB."""


class GraphError(ValueError):
    """The model file or graph is unusable; the message says why."""


class OutputError(GraphError):
    """An output could not be written (read-only folder, full disk); the message names the file."""


@dataclass
class LoadedModel:
    """A model (weights in memory, or referenced in its external-data files), plus where it came from."""

    proto: onnx.ModelProto
    path: Path
    digest: Future
    """The SHA-256 of the model's files, worked out on a background thread (`sha256` waits for it)."""
    file_bytes: int
    external_files: tuple[Path, ...]
    weights_declared_as_inputs: tuple[str, ...] = ()
    """Float initializers the file also lists as graph inputs; they are treated as weights
    (`undeclare_weight_inputs`)."""

    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def sha256(self) -> str:
        try:
            return self.digest.result()
        except OSError as exc:
            raise GraphError(f"cannot read {self.path}: {exc.strerror or exc}") from None


def _sha256_files(paths: list[Path]) -> Future:
    """Hash `paths` on a background thread: reading and hashing release the GIL, so a large model's
    digest overlaps its session build and the checks that follow the load. A daemon thread: a command
    that never asks for the digest (or is interrupted) does not wait for it at exit."""
    future: Future = Future()

    def digest() -> None:
        try:
            value = hashlib.sha256()
            for path in paths:
                with open(path, "rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        value.update(block)
            future.set_result(value.hexdigest())
        except BaseException as exc:  # noqa: BLE001 - raised where the digest is asked for
            future.set_exception(exc)

    threading.Thread(target=digest, name="tqs-sha256", daemon=True).start()
    return future


def iter_tensors(graph: onnx.GraphProto):
    """Every TensorProto stored in a graph: initializers and Constant/attribute
    tensors, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from iter_tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from iter_tensors(subgraph)


def stored_bytes(proto: onnx.ModelProto) -> int:
    """Approximate serialised size without asking protobuf (which fails at 2 GiB)."""
    total = 0
    for tensor in iter_tensors(proto.graph):
        total += len(tensor.raw_data) or tensor.ByteSize()
    return total + 1_000_000  # headroom for the graph structure itself


@functools.lru_cache(maxsize=None)
def element_bits(dtype) -> int:
    """Bits one element of a numpy (or ml_dtypes) type takes in an ONNX file, read off the type itself:
    INT4, UINT4, FLOAT4E2M1 are packed two per byte and INT2/UINT2 four, so a new code type is counted
    right without a list to extend here; other types take their whole bytes."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
        try:
            return int(info(dtype).bits)
        except (TypeError, ValueError):
            continue
    return dtype.itemsize * 8


def tensor_bits(tensor: onnx.TensorProto) -> int:
    """Bits a tensor's values take when stored (no protobuf overhead)."""
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * element_bits(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))


def tensor_sizes(proto: onnx.ModelProto) -> dict[str, int]:
    """Stored bits of every tensor in the model (initializers and Constant values), by name."""
    return {tensor.name: tensor_bits(tensor) for tensor in iter_tensors(proto.graph)}


def weight_bits(proto: onnx.ModelProto) -> int:
    """Bits of stored tensor data (initializers and Constant values, scales and zero
    points included): the one size every compression ratio divides."""
    return sum(tensor_bits(t) for t in iter_tensors(proto.graph))


def _external_files(proto: onnx.ModelProto, folder: Path, own_name: str = "") -> list[Path]:
    """Check every external-data reference and return the files they use (the model file itself not included)."""
    folder = folder.resolve()
    files: dict[Path, None] = {}
    for tensor in iter_tensors(proto.graph):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = external_data_helper.ExternalDataInfo(tensor)
        location = Path(info.location)
        target = (folder / location).resolve()
        if location.is_absolute() or not target.is_relative_to(folder):
            raise GraphError(
                f"tensor '{tensor.name}' points to external data '{info.location}' outside the model's folder {folder}"
            )
        if target == folder / own_name:
            continue  # a skeleton's reference into the model file itself (`graph_ops.wire`)
        if not target.is_file():
            raise GraphError(f"external data file '{info.location}' for tensor '{tensor.name}' is missing")
        size = target.stat().st_size
        end = (info.offset or 0) + (info.length or 0)
        if end > size:
            raise GraphError(
                f"external data file '{info.location}' is truncated: tensor '{tensor.name}' needs bytes up to {end}, "
                f"file has {size}"
            )
        files[target] = None
    return list(files)


SKELETON_BYTES = 64 * 2**20
"""Without `load_external`, a model file this large is read as a skeleton (`graph_ops.wire`): its
in-file weights become references into the file, read on demand like external data."""


def has_external_data(proto: onnx.ModelProto) -> bool:
    return any(external_data_helper.uses_external_data(t) for t in iter_tensors(proto.graph))


def _check(model: str | onnx.ModelProto) -> str | None:
    """The ONNX checker's first complaint about a model (a path or a proto), or None."""
    try:
        onnx.checker.check_model(model)
        return None
    except Exception as exc:  # reported after the parse, whose errors say more
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def weights_as_inputs(proto: onnx.ModelProto, keep: Callable[[onnx.TensorProto], bool]) -> onnx.ModelProto:
    """A light model of `proto`: initializers that `keep` rejects are declared graph inputs instead
    (type and shape, no data), the rest kept. What shape inference and the checker need of a model
    without a copy of its weights. Does not modify `proto`."""
    graph = proto.graph
    declared = {i.name for i in graph.input}
    kept = [t for t in graph.initializer if keep(t)]
    kept_names = {t.name for t in kept}
    inputs = [
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in graph.initializer
        if t.name not in kept_names and t.name not in declared
    ]
    light = onnx.helper.make_graph(
        list(graph.node),
        graph.name,
        list(graph.input) + inputs,
        list(graph.output),
        kept,
        value_info=list(graph.value_info),
    )
    light.sparse_initializer.extend(graph.sparse_initializer)
    model = onnx.helper.make_model(light, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    model.functions.extend(proto.functions)
    return model


UNSORTED = "must be topologically sorted"
"""The checker's complaint about a node list out of order, which ONNX Runtime runs anyway."""


def sort_nodes(proto: onnx.ModelProto) -> None:
    """Put the top-level nodes in an order where each reads only what came before, in place.

    ONNX requires that order and our graph walks rely on it, but ONNX Runtime
    does not, so graphs edited by hand often break it. onnx-graphsurgeon finds
    the order (on a copy without weights); the NodeProtos themselves are kept.
    """
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.logger import G_LOGGER

    with G_LOGGER.suppress(G_LOGGER.CRITICAL + 1):  # its failures reach the user as our one-line error
        structure = gs.import_onnx(weights_as_inputs(proto, lambda t: False))
        structure.toposort(recurse_subgraphs=False, recurse_functions=False)
    by_outputs = {tuple(node.output): node for node in proto.graph.node}
    order = [by_outputs[tuple(v.name for v in node.outputs)] for node in structure.nodes]
    if len(order) != len(proto.graph.node) or len(by_outputs) != len(order):
        raise GraphError("the graph's nodes cannot be put in order (two nodes make the same outputs)")
    del proto.graph.node[:]
    proto.graph.node.extend(order)


def load_model(path: str | os.PathLike, load_external: bool = True) -> LoadedModel:
    """Read and validate an ONNX model, external data included unless `load_external`
    is False (then tensors stored outside keep their references: shapes and types
    without a copy of the weights; `graph_ops.weights.FileWeights` reads them on demand;
    a file of SKELETON_BYTES or more holds its own weights by reference too)."""
    path = Path(path)
    if not path.exists():
        raise GraphError(f"model file {path} does not exist")
    if not path.is_file():
        raise GraphError(f"model path {path} is not a file")
    with open(path, "rb") as handle:
        head = handle.read(1)
    if head != b"\x08":  # every ONNX file opens with field 1, ir_version, as a varint
        raise GraphError(f"{path} is not an ONNX model (it does not start like an ONNX protobuf file)")
    light = not load_external and path.stat().st_size >= SKELETON_BYTES
    # the checker reads the file itself, before this process holds its own copy: the two never coexist;
    # a skeleton is checked instead of the file, which the checker would read whole (bytes and message)
    invalid = None if light else _check(str(path))
    try:
        if light:
            from graph_ops.wire import skeleton

            proto = skeleton(path)
        else:
            proto = onnx.load_model(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and friends, the wire reader ValueError/IndexError
        raise GraphError(f"{path} is truncated or corrupt (protobuf: {exc})") from None
    if proto.ir_version <= 0 or not proto.HasField("graph") or len(proto.opset_import) == 0:
        raise GraphError(f"{path} is not an ONNX model (no graph, IR version or opset)")

    def checkable() -> onnx.ModelProto:  # weights stored outside are declared, not read
        return weights_as_inputs(proto, lambda t: not external_data_helper.uses_external_data(t))

    if light:  # the weights' offsets and lengths come from the file's own structure
        invalid = _check(checkable())
    if invalid is not None and UNSORTED in invalid:  # sorted in this process's copy only: the file is never written
        try:
            sort_nodes(proto)
        except Exception as exc:  # a cycle, or names the sort cannot follow
            raise GraphError(
                f"{path} is not a valid ONNX model: its nodes are out of order and cannot be sorted "
                f"({str(exc).splitlines()[0]})"
            ) from None
        invalid = _check(checkable())
    externals = _external_files(proto, path.parent, path.name)
    if invalid is not None:
        raise GraphError(f"{path} is not a valid ONNX model (truncated or corrupt): {invalid}")
    if externals and load_external:
        external_data_helper.load_external_data_for_model(proto, str(path.parent))
    return LoadedModel(
        proto=proto,
        path=path,
        digest=_sha256_files([path, *externals]),
        file_bytes=path.stat().st_size + sum(f.stat().st_size for f in externals),
        external_files=tuple(externals),
        weights_declared_as_inputs=undeclare_weight_inputs(proto),
    )


def undeclare_weight_inputs(proto: onnx.ModelProto) -> tuple[str, ...]:
    """Drop, in place, the graph inputs that only restate a float initializer, and name them.

    Exporters that keep initializers as inputs (`torch.onnx.export(keep_initializers_as_inputs=True)`,
    older converters) list every weight as an input too. From IR 4 on that makes each an input the
    caller may override, so nothing would count as a weight and the rollout would look for contexts
    of them. They are the model's weights: this process's copy treats them so (ONNX Runtime still
    accepts them fed), and a model written from it no longer declares them. Below IR 4 every
    initializer must be listed, so those models are left as they are."""
    if proto.ir_version < 4:
        return ()
    from graph_ops.layout import FLOAT_TYPES

    weights = {t.name for t in proto.graph.initializer if t.data_type in FLOAT_TYPES}
    declared = [value for value in proto.graph.input if value.name in weights]
    if not declared:
        return ()
    kept = [value for value in proto.graph.input if value.name not in weights]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    return tuple(value.name for value in declared)


def runtime_compatible(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Clamp the IR version in place so current ONNX Runtime accepts the model."""
    if proto.ir_version > MAX_IR_VERSION:
        proto.ir_version = MAX_IR_VERSION
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            raise GraphError(f"model uses opset {opset.version}; ONNX Runtime here runs at most opset {MAX_OPSET}")
    return proto


def session_source(
    proto: onnx.ModelProto, folder: str | os.PathLike | None = None, name: str = "session.onnx"
) -> bytes | Path:
    """What to hand a runtime: the serialised model below protobuf's 2 GiB, else
    a copy with external data written into `folder` (a new temporary folder when None)."""
    if stored_bytes(proto) < PROTOBUF_LIMIT:
        return model_bytes(proto)
    import tempfile

    from graph_ops.output import save_model

    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="tqs-session-"))
    return save_model(proto, folder / name, external_data=True)


def runnable_path(loaded: "LoadedModel") -> Path | None:
    """The model's own file when ONNX Runtime can open it as it is (no copy, no
    serialisation: the only way past protobuf's 2 GiB without writing a copy); else None."""
    proto = loaded.proto
    if proto.ir_version > MAX_IR_VERSION:
        return None
    runtime_compatible(proto)  # raises on an opset the runtime cannot run
    return loaded.path


def model_bytes(proto: onnx.ModelProto) -> bytes:
    """Serialise a model below the protobuf limit (callers check the size first)."""
    return proto.SerializeToString()
