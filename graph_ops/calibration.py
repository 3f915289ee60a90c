"""Where each weight's calibration inputs come from, and in which order to collect them.

GPTQ-family methods need, for every weight, the activation X whose rows
multiply its Wt [N, K] (read off the graph by `graph_ops.layout`). This
module orders the weight nodes into waves so that each wave's inputs depend
only on earlier waves (`waves`), adds the needed activations as graph outputs
(`expose_tensors`) and unfolds them into rows (`im2col`, `layer_inputs`); each
wave runs on `graph_ops.fed_codes.fed_codes_model`, the graph cut down to its inputs.
Numpy and onnx only.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper

from graph_ops.fed_codes import node_reads
from graph_ops.io import GraphError
from graph_ops.layout import WeightLayout
from graph_ops.recurrent import recurrent_rows
from graph_ops.weight_use import ConvGeometry, WeightUse


def waves(model: onnx.ModelProto, layouts: dict[str, WeightLayout]) -> list[list[str]]:
    """Calibratable weights grouped into stages that can be quantized together.

    level(node) = 0 without a weight node upstream of its X input, else 1 + the
    highest such level; equal levels form a wave. Siblings (q/k/v, up/gate)
    and independent branches thus share a wave with no architecture knowledge.
    A weight shared by nodes of different levels joins the wave of its last use.
    """
    node_weights: dict[int, list[WeightUse]] = defaultdict(list)
    for layout in layouts.values():
        if layout.calibratable:
            for use in layout.uses:
                node_weights[use.node_index].append(use)
    tensor_level: dict[str, int] = {}
    node_level: dict[int, int] = {}
    for index, node in enumerate(model.graph.node):
        upstream = max((tensor_level.get(i, -1) for i in node.input if i), default=-1)
        if index in node_weights:
            level = 1 + max(tensor_level.get(u.placed_after, -1) for u in node_weights[index])
            node_level[index] = level
            upstream = max(upstream, level)
        for output in node.output:
            tensor_level[output] = upstream
    grouped: dict[int, list[str]] = defaultdict(list)
    for name, layout in layouts.items():
        if layout.calibratable:
            grouped[max(node_level[u.node_index] for u in layout.uses)].append(name)
    return [grouped[level] for level in sorted(grouped)]


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    graph = model.graph
    found = {t.name: helper.make_tensor_value_info(t.name, t.data_type, None) for t in graph.initializer}
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            found[value.name] = value
    return found


def expose_tensors(model: onnx.ModelProto, names: list[str] | set[str]) -> onnx.ModelProto:
    """A copy of `model` that also outputs the named intermediate tensors.

    Only the element type is declared (from value_info, or shape inference
    when missing): a stale static shape could clash with the batch a
    calibration run feeds, and the runtime needs no more. Graph inputs and
    existing outputs are left as they are: read those from the feeds or the
    normal outputs.
    """
    result = copy.deepcopy(model)
    present = {v.name for v in result.graph.output} | {v.name for v in result.graph.input}
    wanted = [n for n in dict.fromkeys(names) if n not in present]
    result.graph.output.extend(tensor_infos(model, wanted).values())
    return result


def tensor_infos(model: onnx.ModelProto, names, required: bool = True) -> dict[str, onnx.ValueInfoProto]:
    """Value infos of the named tensors that declare only the element type (from value_info, or shape
    inference when missing): a stale static shape could clash with the batch a calibration run feeds.
    With `required`, a tensor whose type cannot be told is an error; else it is left out."""
    infos = _value_infos(model)
    if any(n not in infos for n in names):
        try:
            infos = {**_value_infos(onnx.shape_inference.infer_shapes(model)), **infos}
        except Exception:  # inference is best effort; the check below names what is missing
            pass
    found = {}
    for name in dict.fromkeys(names):
        if name not in infos:
            if required:
                raise GraphError(f"cannot tell the element type of tensor '{name}' to expose it as an output")
            continue
        found[name] = helper.make_tensor_value_info(name, infos[name].type.tensor_type.elem_type, None)
    return found


def tensor_graph(model: onnx.ModelProto, weights) -> tuple[dict[str, frozenset[str]], dict[str, set[int]]]:
    """For every tensor the nodes make: the `weights` upstream of it; and for every tensor: the indices of
    the nodes that read it. What a calibration wave needs to know whether an activation kept from an
    earlier wave still holds (no weight upstream of it was quantized since) and whether a later node still reads it."""
    weights = set(weights)
    upstream: dict[str, frozenset[str]] = {}
    readers: dict[str, set[int]] = defaultdict(set)
    for index, node in enumerate(model.graph.node):
        reads = node_reads(node)
        above = frozenset(reads & weights).union(*(upstream.get(name, frozenset()) for name in reads))
        for name in reads:
            readers[name].add(index)
        for output in node.output:
            upstream[output] = above
    return upstream, dict(readers)


def im2col(x: np.ndarray, geometry: ConvGeometry) -> np.ndarray:
    """Rows of Conv windows: x [B, C, *spatial] -> [B·prod(out), C·prod(kernel)], columns (c, k...).

    The column order matches weight.reshape(M, -1) (and nn.Unfold), so for
    group g the columns g·(C/g)·prod(k) ... (g+1)·(C/g)·prod(k) are its inputs.
    """
    rank = len(geometry.kernel)
    spatial = tuple(x.shape[2:])
    if len(spatial) != rank:
        raise GraphError(f"Conv input has {len(spatial)} spatial axes, kernel has {rank}")
    if geometry.transposed:
        return _transposed_im2col(x, geometry)
    windows = _windows(x, geometry)  # [B, C, *out, *kernel]
    order = (0,) + tuple(range(2, 2 + rank)) + (1,) + tuple(range(2 + rank, 2 + 2 * rank))
    moved = windows.transpose(order)  # [B, *out, C, *kernel]
    columns = x.shape[1] * int(np.prod(geometry.kernel))
    return moved.reshape(-1, columns)


def _windows(x: np.ndarray, geometry: ConvGeometry) -> np.ndarray:
    """A view of x's Conv windows, [B, C, *out, *kernel] (padding copied once)."""
    rank = len(geometry.kernel)
    pads = geometry.resolved_pads(tuple(x.shape[2:]))
    padded = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + rank]) for i in range(rank)])
    spans = [d * (k - 1) + 1 for k, d in zip(geometry.kernel, geometry.dilations)]
    windows = np.lib.stride_tricks.sliding_window_view(padded, spans, axis=tuple(range(2, 2 + rank)))
    picks = tuple(slice(None, None, s) for s in geometry.strides) + tuple(
        slice(None, None, d) for d in geometry.dilations
    )
    return windows[(slice(None), slice(None)) + picks]


def grouped_im2col(x: np.ndarray, geometry: ConvGeometry, groups: int) -> list[np.ndarray]:
    """`im2col`'s rows split into `groups` equal column blocks, each block contiguous: the same values as
    np.split(im2col(x), groups, axis=1) in one copy, group-major. A depthwise conv's 64 blocks of 17 columns were
    strided views of one row of 1088, and their casts and subtractions in every fold most of its statistics."""
    moved = np.ascontiguousarray(grouped_windows(x, geometry, groups))
    return list(moved.reshape(groups, -1, (x.shape[1] // groups) * int(np.prod(geometry.kernel))))


def grouped_windows(x: np.ndarray, geometry: ConvGeometry, groups: int) -> np.ndarray:
    """A view [groups, B, *out, C/groups, *kernel] of x's Conv windows: group g's rows of `im2col` (its columns
    g·(C/groups)·prod(kernel) onwards) are view[g] flattened to two axes, (B, *out) and (C/groups, *kernel)."""
    rank = len(geometry.kernel)
    windows = _windows(x, geometry)
    batch, channels = x.shape[:2]
    split = windows.reshape((batch, groups, channels // groups) + windows.shape[2:])  # [B, g, C/g, *out, *kernel]
    order = (1, 0) + tuple(range(3, 3 + rank)) + (2,) + tuple(range(3 + rank, 3 + 2 * rank))
    return split.transpose(order)


def _transposed_im2col(x: np.ndarray, geometry: ConvGeometry) -> np.ndarray:
    """ConvTranspose's rows, columns (c, k...) in its weight's order: output q sums x[p]·W[k] over q = p·s + k·d −
    pad, which is a stride-1 Conv over x with s − 1 zeros between elements, padded by d·(k − 1) − pad at each
    end (output_padding more at the end; a negative pad crops), whose kernel is W's flipped."""
    rank, channels = len(geometry.kernel), x.shape[1]
    upsampled = np.zeros(
        x.shape[:2] + tuple((n - 1) * s + 1 for n, s in zip(x.shape[2:], geometry.strides)), dtype=x.dtype
    )
    upsampled[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in geometry.strides)] = x
    pads = geometry.pads if geometry.auto_pad in ("NOTSET", "") else (0,) * (2 * rank)
    extra = geometry.output_padding or (0,) * rank
    begins = [d * (k - 1) - pads[i] for i, (k, d) in enumerate(zip(geometry.kernel, geometry.dilations))]
    ends = [
        d * (k - 1) - pads[rank + i] + extra[i] for i, (k, d) in enumerate(zip(geometry.kernel, geometry.dilations))
    ]
    padded = np.pad(upsampled, [(0, 0), (0, 0)] + [(max(0, b), max(0, e)) for b, e in zip(begins, ends)])
    padded = padded[
        (slice(None), slice(None))
        + tuple(slice(max(0, -b), padded.shape[2 + i] - max(0, -e)) for i, (b, e) in enumerate(zip(begins, ends)))
    ]
    forward = ConvGeometry(
        geometry.kernel, (1,) * rank, geometry.dilations, (0,) * (2 * rank), "NOTSET", geometry.group
    )
    rows = im2col(padded, forward)
    flipped = rows.reshape((rows.shape[0], channels) + geometry.kernel)[
        (slice(None), slice(None)) + (slice(None, None, -1),) * rank
    ]
    return flipped.reshape(rows.shape[0], -1)


def layer_inputs(use: WeightUse, value: np.ndarray, row_groups: int = 1) -> list[np.ndarray]:
    """X rows for each row group of the weight, from the activation tensor `value`."""
    value = np.asarray(value)
    if use.recurrent is not None:
        return [recurrent_rows(use.recurrent, value)]
    if use.conv is not None:
        grouped = value.ndim == 2 + len(use.conv.kernel) and value.shape[1] % row_groups == 0
        if row_groups > 1 and grouped and not use.conv.transposed:
            return grouped_im2col(value, use.conv, row_groups)
        rows = im2col(value, use.conv)
        return np.split(rows, row_groups, axis=1)
    if use.x_axes is not None:
        moved = np.transpose(value, use.x_axes)
        return [moved.reshape(-1, int(np.prod(moved.shape[moved.ndim - use.x_columns :], dtype=np.int64)))]
    if use.transpose_x:
        value = value.reshape(1, -1) if value.ndim == 1 else np.swapaxes(value, -1, -2)
    return [value.reshape(-1, value.shape[-1])]


def layer_tensors(model: onnx.ModelProto, layouts: dict[str, WeightLayout]) -> list[str]:
    """Every layer input a calibration reads that the graph does not already take as an input."""
    graph_inputs = {v.name for v in model.graph.input}
    return sorted({u.x for layout in layouts.values() if layout.calibratable for u in layout.uses} - graph_inputs)


__all__ = [
    "ConvGeometry",
    "WeightUse",
    "expose_tensors",
    "grouped_im2col",
    "grouped_windows",
    "im2col",
    "layer_inputs",
    "layer_tensors",
    "tensor_graph",
    "tensor_infos",
    "waves",
]


IM2COL_BYTES = 32 << 20
"""A Conv's calibration rows (im2col: a row per output position, C·k² columns, float64 in the Hessian) are built
this many bytes at a time, a few samples of the batch at once: all of a step's windows at once could take
thousands of times the model's size (docs/design-notes/encoding.md, "Conv rows in chunks")."""


def sample_chunks(use, value: np.ndarray) -> list:
    """Index slices of the activation's leading (batch) axis whose im2col rows fit `IM2COL_BYTES`; the whole
    activation for a use that is not a Conv (its rows are the activation itself)."""
    value = np.asarray(value)
    if use.conv is None or value.ndim < 2 or value.shape[0] <= 1:
        return [...]
    per_sample = int(np.prod(value.shape[1:], dtype=np.int64)) * int(np.prod(use.conv.kernel, dtype=np.int64)) * 8
    if use.conv.transposed:  # its rows are the upsampled input's windows
        per_sample *= int(np.prod(use.conv.strides, dtype=np.int64))
    step = max(1, IM2COL_BYTES // max(per_sample, 1))
    return [slice(start, start + step) for start in range(0, value.shape[0], step)]
