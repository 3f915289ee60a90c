"""Quantizable units: the weight tensors (or blocks of them) that are scored,
perturbed and assigned a precision tier together."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graph_ops import WeightTensor
from tqsdeploy.errors import InputError

if TYPE_CHECKING:
    import numpy as np

    from graph_ops import LoadedModel


@dataclass(frozen=True)
class UnitSelection:
    """Which stored tensors become units, and how they are grouped."""

    min_params: int = 1024
    include: str | None = None
    """Regex: matching float tensors are units even if small or not a weight operand."""
    exclude: str | None = None
    """Regex: matching tensors are never units."""
    granularity: str = "tensor"
    """'tensor' (one unit per tensor) or 'block' (tensors grouped by `block_pattern`)."""
    block_pattern: str | None = None
    """Regex whose first group (or whole match) names a tensor's block."""


@dataclass(frozen=True)
class Unit:
    """One or more weight tensors that are perturbed and quantized together."""

    name: str
    tensors: tuple[WeightTensor, ...]

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def label(self) -> str:
        """What reports call it: a one-tensor unit's module path where the exporter generated its name
        (`graph_ops.names`), else its name; `name` stays its identity (runs, prices, allocations)."""
        return self.tensors[0].display if len(self.tensors) == 1 and self.name == self.tensors[0].name else self.name

    @property
    def params(self) -> int:
        return sum(t.params for t in self.tensors)

    @property
    def op_types(self) -> tuple[str, ...]:
        return tuple(sorted({op for t in self.tensors for op in t.op_types}))

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for t in self.tensors for n in t.nodes)

    @property
    def shape(self) -> str:
        if len(self.tensors) == 1:
            return "x".join(str(d) for d in self.tensors[0].shape) or "scalar"
        return f"{len(self.tensors)} tensors"


def _compile(pattern: str | None, option: str) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InputError(f"{option} '{pattern}' is not a valid regular expression: {exc}") from None


def select_units(
    tensors: list[WeightTensor], selection: UnitSelection, unfed: dict[str, tuple[str, int]] | None = None
) -> list[Unit]:
    """Apply the size threshold, include/exclude patterns and grouping. `unfed`: weights of a type that cannot
    be fed (`graph_ops.layout.unfed_float_tensors`), named when they leave nothing to score."""
    include = _compile(selection.include, "--include")
    exclude = _compile(selection.exclude, "--exclude")
    chosen = []
    for tensor in tensors:
        wanted = tensor.is_operand_weight and tensor.params >= selection.min_params
        if include is not None and _matches(include, tensor):
            wanted = True
        if exclude is not None and _matches(exclude, tensor):
            wanted = False
        if wanted:
            chosen.append(tensor)
    large_unfed = _large(unfed, selection)
    if not chosen and large_unfed:
        kinds = "/".join(sorted(set(large_unfed.values())))
        raise InputError(
            f"no quantizable tensors: the model's {len(large_unfed)} large weights are {kinds} "
            f"({_names(large_unfed)}), which ONNX Runtime cannot be fed from numpy, so they cannot be perturbed",
            hint="save the model with float32 or float16 weights",
        )
    if not chosen:
        raise InputError(
            f"no quantizable tensors: none of the model's {len(tensors)} float tensors "
            f"feeds a MatMul/Gemm/Conv/Gather/Einsum/RNN weight with at least {selection.min_params} parameters",
            hint="lower --min-params or name tensors with --include REGEX",
        )
    if selection.granularity == "tensor":
        return [Unit(name=t.name, tensors=(t,)) for t in chosen]
    if selection.granularity != "block":
        raise InputError(f"granularity must be 'tensor' or 'block', not '{selection.granularity}'")
    pattern = _compile(selection.block_pattern, "--block-pattern")
    if pattern is None:
        raise InputError("--granularity block needs --block-pattern REGEX (its first group names the block)")
    blocks: dict[str, list[WeightTensor]] = {}
    for tensor in chosen:
        match = pattern.search(tensor.name) or pattern.search(tensor.display)
        key = (match.group(1) if match.groups() else match.group(0)) if match else tensor.name
        blocks.setdefault(key, []).append(tensor)
    return [Unit(name=key, tensors=tuple(group)) for key, group in blocks.items()]


def called(name: str, label: str) -> str:
    """How messages name a weight or unit: `'layers.0.attn.q.weight' (val_17)` where its label is not its stored
    name, else `'head.weight'`."""
    return f"'{label}'" if label == name else f"'{label}' ({name})"


def _matches(pattern: re.Pattern, tensor: WeightTensor) -> bool:
    """--include/--exclude match a tensor's stored name or the module path reports show for it."""
    return bool(pattern.search(tensor.name) or pattern.search(tensor.display))


def _large(unfed: dict[str, tuple[str, int]] | None, selection: UnitSelection) -> dict[str, str]:
    """The unfed weights (`graph_ops.layout.unfed_float_tensors`) that would be units by size: name -> type."""
    return {name: kind for name, (kind, size) in (unfed or {}).items() if size >= selection.min_params}


def _names(names) -> str:
    names = list(names)
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def selection_notes(
    loaded: "LoadedModel",
    tensors: list[WeightTensor],
    units: list[Unit],
    selection: UnitSelection,
    unfed: dict[str, tuple[str, int]] | None = None,
) -> list[str]:
    """What a user should know about which tensors became units, beyond the unit list itself (`unfed` as
    `select_units` took it)."""
    from graph_ops.layout import read_in_subgraphs

    notes = []
    unfed = _large(unfed, selection)
    if unfed:
        notes.append(
            f"{len(unfed)} {'/'.join(sorted(set(unfed.values())))} weight(s) are not units ({_names(unfed)}): "
            "ONNX Runtime cannot be fed them from numpy, so they are neither scored nor quantized"
        )
    declared = loaded.weights_declared_as_inputs
    if declared:
        notes.append(
            f"{len(declared)} weight(s) are also listed as graph inputs "
            "(as keep_initializers_as_inputs exports write them): "
            "they are treated as the model's weights, and compressed models no longer list them as inputs"
        )
    chosen = {name for unit in units for name in unit.tensor_names}
    inner = read_in_subgraphs(loaded.proto.graph)
    hidden = [
        t
        for t in tensors
        if t.name in inner and t.name not in chosen and not t.is_operand_weight and t.params >= selection.min_params
    ]
    if hidden:
        notes.append(
            f"{len(hidden)} weight(s) read only inside Scan/Loop/If bodies are not units "
            f"({_names(t.name for t in hidden)}; "
            f"{sum(t.params for t in hidden):,} params): name them with --include to score and quantize them"
        )
    skipped = large_outside(loaded.proto, tensors, chosen | {t.name for t in hidden}, selection)
    for tensor, why in skipped[:NAMED]:
        act = "drop it from --exclude" if why == EXCLUDED else "name it with --include"
        notes.append(
            f"{called(tensor.name, tensor.display)} ({tensor.params:,} params) is not a unit: {why}; {act} to score "
            "and quantize it"
        )
    if len(skipped) > NAMED:
        rest = [t for t, _ in skipped[NAMED:]]
        notes.append(
            f"{len(rest)} more float tensor(s) of at least --min-params {selection.min_params} are not units "
            f"({sum(t.params for t in rest):,} params)"
        )
    return notes


EXCLUDED = "matches --exclude"
NAMED = 4
"""Non-unit float tensors named one by one in notes and hints (the largest); the rest are counted."""


def large_outside(
    proto, tensors: list[WeightTensor], chosen: set[str], selection: UnitSelection
) -> list[tuple[WeightTensor, str]]:
    """The float tensors of at least --min-params elements that are not units (`chosen`: the units' and
    those noted otherwise), largest first, each with why: what a user may want to --include."""
    from graph_ops.layout import unreached_reasons

    large = sorted(
        (t for t in tensors if t.name not in chosen and t.params >= selection.min_params), key=lambda t: -t.params
    )
    reasons = unreached_reasons(proto.graph, [t.name for t in large if not t.is_operand_weight])
    return [(t, reasons.get(t.name, EXCLUDED)) for t in large]


def outside_hint(proto, unit_names, selection: UnitSelection) -> str | None:
    """What to quantize when the tensors outside the units hold the bits, for export's hints: the largest
    non-unit tensors of at least --min-params when they hold most of those bits (lowering --min-params would
    not reach them), else None (the small tensors do: lower --min-params)."""
    import graph_ops

    names = set(unit_names)
    sizes = {n: b for n, b in graph_ops.io.tensor_sizes(proto).items() if n not in names}
    large = large_outside(proto, graph_ops.find_weight_tensors(proto), names, selection)
    held = sum(sizes.get(t.name, 0) for t, _ in large)
    if not large or held * 2 < sum(sizes.values()):
        return None
    named = "; ".join(f"{called(t.name, t.display)} ({t.params:,} params: {why})" for t, why in large[:NAMED])
    more = f"; {len(large) - NAMED} more" if len(large) > NAMED else ""
    act = "name them with --include" + (
        " (or drop them from --exclude)" if any(why == EXCLUDED for _, why in large) else ""
    )
    return (
        f"{len(large)} float tensor(s) of at least --min-params {selection.min_params} are not units: "
        f"{named}{more}; {act} to quantize them"
    )


def nonfinite_weights(weights: dict, stop_at_first: bool = False) -> list[str]:
    """Names of the float weights holding NaN or Inf. Memory-mapped weights are read once and their pages
    handed back (the check reads the whole model)."""
    import numpy as np

    from graph_ops import release_pages

    found = []
    for name, value in weights.items():
        if np.asarray(value).dtype.kind == "f" and not np.all(np.isfinite(value)):
            found.append(name)
            if stop_at_first:
                break
        release_pages(weights, [name])
    return found


def check_finite(weights: dict) -> None:
    """Refuse weights holding NaN or Inf: every score and quantizer of them would be meaningless."""
    if found := nonfinite_weights(weights, stop_at_first=True):
        raise InputError(f"weight '{found[0]}' contains NaN or Inf; the model cannot be scored or quantized as it is")


INDEX_PRESERVING = ("Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose")
"""Ops that pass index values through unchanged (only their layout or integer type changes)."""


def _index_source(proto):
    """name -> the tensor whose values it carries unchanged (through casts and reshapes): for an index, the model
    input."""
    producer = {name: node for node in proto.graph.node for name in node.output}

    def source(name: str) -> str:
        while name in producer and producer[name].op_type in INDEX_PRESERVING:
            name = producer[name].input[0]
        return name

    return source


def index_rows(proto) -> dict[str, int]:
    """Model inputs that index a Gather table (axis 0; token, station or series ids), each with the rows of the
    smallest table it indexes: the ids random contexts may draw without reading past a table."""
    shapes = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    shapes.update(
        {
            node.output[0]: tuple(a.t.dims)
            for node in proto.graph.node
            if node.op_type == "Constant"
            for a in node.attribute
            if a.name == "value"
        }
    )
    inputs, source, rows = {i.name for i in proto.graph.input}, _index_source(proto), {}
    for node in proto.graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type == "Gather" and axis == 0 and shapes.get(node.input[0]) and source(node.input[1]) in inputs:
            index = source(node.input[1])
            rows[index] = min(rows.get(index, shapes[node.input[0]][0]), shapes[node.input[0]][0])
    return rows


def gather_rows(proto, units: list[Unit], contexts: dict, fed_inputs: set[str]) -> dict[str, "np.ndarray"]:
    """Rows of each Gather table (embedding) the contexts read, by tensor name.

    A table read only by Gather (axis 0) whose indices are a model input that
    the rollout never feeds back (possibly cast or reshaped on the way) is read
    at the rows the context windows hold
    and nowhere else. Scoring the whole table would divide the output effect
    of those rows by the norm of every row (γ diluted by rows never read), so
    the probes perturb the touched rows only. Tables read any other way are
    left out (every row counts).
    """
    import numpy as np

    consumers: dict[str, list] = {}
    for node in proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    source = _index_source(proto)
    rows = {}
    for unit in units:
        for tensor in unit.tensors:
            nodes = consumers.get(tensor.name, [])
            if not nodes or len(tensor.shape) < 1:
                continue
            indices = set()
            for node in nodes:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if (
                    node.op_type != "Gather"
                    or node.input[0] != tensor.name
                    or node.input[1] == tensor.name
                    or axis != 0
                ):
                    break
                index = source(node.input[1])
                if index not in contexts or index in fed_inputs:
                    break
                indices.add(index)
            else:
                count = int(tensor.shape[0])
                touched = np.unique(
                    np.concatenate([np.asarray(contexts[i]).reshape(-1).astype(np.int64) % count for i in indices])
                )
                if touched.size < count:
                    rows[tensor.name] = touched
    return rows
