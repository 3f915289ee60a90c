"""Find, read and replace the weight tensors that quantization can act on.

Discovery is `graph_ops.layout.weight_layouts` (one walk from each stored
float tensor to its consumers); this module adds the caller-facing list and
the value access.
"""

from __future__ import annotations

import copy
import mmap
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from graph_ops.io import GraphError
from graph_ops.layout import FLOAT_TYPES, WeightLayout, stored_tensors, weight_layouts

WeightTensor = WeightLayout
"""A stored float tensor as units see it (name, shape, dtype, consumers, layout)."""


def find_weight_tensors(model: onnx.ModelProto) -> list[WeightLayout]:
    """Every float tensor stored in the main graph, with the weight ops it feeds.

    Callers decide which count as quantizable (usually: feeds a weight operand
    and is large enough).
    """
    return list(weight_layouts(model).values())


def _view(tensor: onnx.TensorProto) -> np.ndarray:
    """A read-only numpy array over a float tensor's raw bytes (one copy: protobuf
    hands out raw_data as a new bytes object), else numpy_helper's conversion."""
    if tensor.raw_data and tensor.data_type in FLOAT_TYPES:
        dtype = np.dtype(FLOAT_TYPES[tensor.data_type]).newbyteorder("<")
        return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(tuple(tensor.dims))
    return numpy_helper.to_array(tensor)


def read_weights(model: onnx.ModelProto, names: list[str] | set[str]) -> dict[str, np.ndarray]:
    """The stored values of the named tensors, as read-only numpy arrays."""
    wanted = set(names)
    stored = stored_tensors(model.graph)
    missing = wanted - stored.keys()
    if missing:
        raise KeyError(f"no stored tensor named {sorted(missing)[0]!r}")
    return {name: _view(stored[name][0]) for name in wanted}


def model_weights(
    model: onnx.ModelProto, names: list[str] | set[str], data_dir: Path | None
) -> Mapping[str, np.ndarray]:
    """The named weights of a model loaded without its external data: read from the files in `data_dir` on
    demand (`FileWeights`, never the whole model in memory) where it has some, else views of the proto."""
    return FileWeights(model, names, data_dir) if data_dir is not None else read_weights(model, names)


class FileWeights(Mapping):
    """Named tensors of a model loaded without its external data, each a read-only view
    of its file through a memory map (nothing read until used, nothing copied: the
    pages are the operating system's file cache, shared by every view and with
    ONNX Runtime fed from them): the weights of a large model without a second copy
    of them in memory. A tensor whose offset its type cannot be aligned on is read
    into a fresh array instead. Picklable (paths only; each process maps its own)."""

    def __init__(self, model: onnx.ModelProto, names, folder: Path):
        stored = stored_tensors(model.graph)
        missing = set(names) - stored.keys()
        if missing:
            raise KeyError(f"no stored tensor named {sorted(missing)[0]!r}")
        self._inline: dict[str, np.ndarray] = {}
        self._files: dict[str, tuple[Path, int, np.dtype, tuple[int, ...]]] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for name in names:
            tensor = stored[name][0]
            if not external_data_helper.uses_external_data(tensor):
                self._inline[name] = _view(tensor)
                continue
            info = external_data_helper.ExternalDataInfo(tensor)
            dtype = np.dtype(FLOAT_TYPES[tensor.data_type]).newbyteorder("<")
            self._files[name] = (Path(folder) / info.location, int(info.offset or 0), dtype, tuple(tensor.dims))

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._inline:
            return self._inline[name]
        path, offset, dtype, shape = self._files[name]
        count = int(np.prod(shape, dtype=np.int64))
        if offset % dtype.itemsize:  # a misaligned view would slow every kernel reading it
            values = np.fromfile(path, dtype=dtype, count=count, offset=offset)
        else:
            mapped = self._map(path)
            values = np.frombuffer(
                mapped,
                dtype=dtype,
                count=min(count, max(0, (len(mapped) - offset) // dtype.itemsize)),
                offset=min(offset, len(mapped)),
            )
        if values.size != count:
            raise GraphError(f"external data file {path} is truncated: tensor '{name}' needs {count} values")
        values = values.reshape(shape)
        values.flags.writeable = False
        return values

    def release(self, names=None) -> None:
        """Hand the pages read so far (of the named tensors, default all) back to the operating system
        (madvise DONTNEED): a memory map keeps every page it touched in the process's resident memory,
        up to the whole model, where the next read of a weight only faults it in again from the file cache."""
        if names is None:
            for mapped in self._maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)
            return
        for name in names:
            if name not in self._files or self._files[name][0] not in self._maps:
                continue
            path, offset, dtype, shape = self._files[name]
            mapped = self._maps[path]
            start = offset - offset % mmap.PAGESIZE
            stop = min(len(mapped), offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
            if stop > start:
                mapped.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with open(path, "rb") as handle:
                self._maps[path] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[path]

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def __iter__(self):
        return iter([*self._inline, *self._files])

    def __len__(self) -> int:
        return len(self._inline) + len(self._files)


def release_pages(weights: Mapping, names=None) -> None:
    """Drop the resident pages of memory-mapped weights (`FileWeights.release`; the named ones, default
    all); other mappings hold nothing to drop."""
    if isinstance(weights, FileWeights):
        weights.release(names)


def replace_weights(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` whose named initializers / Constant values hold `values`."""
    result = copy.deepcopy(model)
    stored = stored_tensors(result.graph)
    for name, value in values.items():
        if name not in stored:
            raise KeyError(f"no stored tensor named {name!r}")
        tensor = stored[name][0]
        tensor.CopyFrom(
            numpy_helper.from_array(np.asarray(value, dtype=numpy_helper.to_array(tensor).dtype), tensor.name)
        )
    return result
