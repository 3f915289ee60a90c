"""Cut a model to the part downstream of some weights.

Perturbing a weight changes nothing upstream of its consumers, so the first
step of a rollout can be scored by running only the downstream part, fed with
the nominal activations at the cut (computed once). `activation_outputs`
makes those activations graph outputs, `cut_downstream` builds the sub-model.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
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


class GraphWalk:
    """What every node of a graph reads, and which nodes read each tensor, worked out once for many
    downstream questions (a sweep asks one per unit and per cut)."""

    def __init__(self, graph: onnx.GraphProto):
        self.nodes = list(graph.node)
        self.reads = [_reads(node) for node in self.nodes]
        self.readers: dict[str, list[int]] = {}
        for i, names in enumerate(self.reads):
            for name in names:
                self.readers.setdefault(name, []).append(i)
        self.initializers = {t.name for t in graph.initializer}
        self._downstream: dict[frozenset, tuple[list[int], set[str]]] = {}

    def downstream(self, weights: set[str]) -> tuple[list[int], set[str]]:
        """Indices (graph order) of the nodes that transitively read any of `weights`, and every tensor they
        affect; kept per set of weights (planning asks again for each unit: its cut's start, its mask, its
        boundary). Callers do not modify what they get."""
        key = frozenset(weights)
        if key not in self._downstream:
            self._downstream[key] = self._walk_down(key)
        return self._downstream[key]

    def _walk_down(self, weights: frozenset) -> tuple[list[int], set[str]]:
        affected, found = set(weights), set()
        frontier = [i for name in weights for i in self.readers.get(name, ())]
        heapq.heapify(frontier)
        while frontier:  # smallest index first: ONNX graphs are topologically sorted
            i = heapq.heappop(frontier)
            if i in found:
                continue
            found.add(i)
            for name in self.nodes[i].output:
                if name and name not in affected:
                    affected.add(name)
                    for reader in self.readers.get(name, ()):
                        heapq.heappush(frontier, reader)
        return sorted(found), affected

    def boundary(self, weights, outputs) -> tuple[str, ...]:
        """The unaffected tensors the downstream part of `weights` reads (inputs and upstream activations);
        empty when none of `outputs` depends on the weights."""
        found, affected = self.downstream(set(weights))
        if not any(o in affected for o in outputs):
            return ()
        reads = set().union(*(self.reads[i] for i in found)) if found else set()
        return tuple(sorted(n for n in reads if n not in affected and n not in self.initializers))


def downstream_nodes(graph: onnx.GraphProto, weights: set[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """Nodes that (transitively) read any of `weights`, in graph order, and every tensor they affect."""
    walk = GraphWalk(graph)
    found, affected = walk.downstream(set(weights))
    return [walk.nodes[i] for i in found], affected


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor shape inference can type."""
    return {v.name: v.type.tensor_type.elem_type for v in inferred_values(model) if v.type.tensor_type.elem_type}


def inferred_values(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Every value shape inference can type or shape, without copying large weights:
    big initializers are declared as inputs for the inference, small ones (shape constants) kept."""
    light = weights_as_inputs(model, lambda t: len(t.raw_data) <= 4096 and not t.HasField("data_location"))
    inferred = onnx.shape_inference.infer_shapes(light)
    return list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)


def activation_outputs(
    model: onnx.ModelProto, names: list[str] | set[str], types: dict[str, int] | None = None
) -> bytes:
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


def node_costs(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> list[float]:
    """A rough compute cost of every node (graph order) for inputs of the given shapes: multiply-adds
    of MatMul, Gemm and Conv, the output's size for every other op. What planning cuts needs to
    tell a cut of the last layer from one of the whole model; dims shape inference cannot resolve count 1."""
    light = weights_as_inputs(model, lambda t: len(t.raw_data) <= 4096 and not t.HasField("data_location"))
    for value in light.graph.input:
        if value.name in shapes and len(shapes[value.name]) == len(value.type.tensor_type.shape.dim):
            for dim, size in zip(value.type.tensor_type.shape.dim, shapes[value.name]):
                dim.Clear()
                dim.dim_value = int(size)
    try:
        inferred = onnx.shape_inference.infer_shapes(light)
        values = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    except Exception:  # a graph shape inference cannot walk: every node counts alike
        values = []
    dims = {
        v.name: [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in v.type.tensor_type.shape.dim
        ]
        for v in values
    }
    dims.update({t.name: list(t.dims) for t in model.graph.initializer})
    size = lambda name: float(np.prod(dims.get(name, [1]), dtype=np.float64))  # noqa: E731
    costs = []
    for node in model.graph.node:
        out = size(node.output[0]) if node.output else 1.0
        first = dims.get(node.input[0], [1]) if node.input else [1]
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
            transposed = node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute)
            out *= (first[0] if transposed else first[-1]) if first else 1
        elif node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
            kernel = dims.get(node.input[1], [1])
            per_output = (
                kernel[1:] if node.op_type == "Conv" else kernel[:1] + kernel[2:]
            )  # input channels (per group) x kernel
            out *= float(np.prod(per_output, dtype=np.float64))
        costs.append(max(out, 1.0))
    return costs


def reading_share(model: onnx.ModelProto, weights: set[str], costs: list[float]) -> float:
    """Share of `costs` spent in the nodes that read any of `weights` directly."""
    reading = sum(c for node, c in zip(model.graph.node, costs) if _reads(node) & weights)
    return reading / max(sum(costs), 1e-30)


@dataclass(frozen=True)
class CutPlan:
    """Which units share a cut: each group runs on one session of the part downstream of all its weights."""

    groups: tuple[tuple[str, ...], ...]
    """Unit names per cut, in the order the sweep should run them."""
    seconds: float
    """The planned sweep's estimated seconds (builds, each cut's nominal run, every probe run)."""
    group_seconds: tuple[float, ...] = ()
    """The same, per group (what a lane taking that cut spends on it)."""

    @property
    def order(self) -> list[str]:
        return [name for group in self.groups for name in group]

    def group_of(self, unit: str) -> int:
        return next(i for i, group in enumerate(self.groups) if unit in group)


BUILD_FIXED = 0.3
"""Share of a whole model's session build a cut costs however small it is (session set-up, graph passes)."""


def cut_order(walk: GraphWalk, units: dict[str, list[str]]) -> list[str]:
    """Unit names in the order their cuts start: by the first node downstream of their weights (then by name)."""

    def start(name: str) -> tuple[int, str]:
        found, _ = walk.downstream(set(units[name]))
        return (found[0] if found else len(walk.nodes), name)

    return sorted(units, key=start)


FED_PENALTY = 0.5
"""How much slower a node runs with its weight fed than with it constant (ONNX Runtime pre-packs only
constant weights), when no measurement says: about 0.3 for MatMul, 0.8 for Conv on x86 CPUs."""


def plan_cuts(
    model: onnx.ModelProto,
    units: dict[str, list[str]],
    costs: list[float],
    call_s: float,
    build_s: float,
    runs_per_unit: int,
    fed_penalty: float = FED_PENALTY,
) -> CutPlan:
    """Group units, taken in the order their cuts start, so that the sweep costs least (`CutPlanner.plan`)."""
    return CutPlanner(model, units, costs).plan(call_s, build_s, runs_per_unit, fed_penalty)


class CutPlanner:
    """What planning cuts needs from the graph (each unit's downstream nodes, the weights each node reads),
    worked out once: a sweep plans from auto's estimate and again from the whole model's measured run."""

    def __init__(
        self, model: onnx.ModelProto, units: dict[str, list[str]], costs: list[float], walk: GraphWalk | None = None
    ):
        walk = walk or GraphWalk(model.graph)
        self.nodes = len(walk.nodes)
        sizes = {t.name: float(np.prod(t.dims, dtype=np.float64)) for t in model.graph.initializer}
        readers = {name: len(walk.readers.get(name, ())) for name in sizes}
        self.weight = np.array([sum(sizes[n] / readers[n] for n in reads & sizes.keys()) for reads in walk.reads])
        self.cost = np.asarray(costs, np.float64)
        self.masks, self.fed = {}, {}
        for name, tensors in units.items():
            mask = np.zeros(self.nodes, bool)
            mask[walk.downstream(set(tensors))[0]] = True
            self.masks[name] = mask
            self.fed[name] = np.zeros(self.nodes, bool)
            self.fed[name][[i for t in tensors for i in walk.readers.get(t, ())]] = True
        self.order = cut_order(walk, units)

    def plan(self, call_s: float, build_s: float, runs_per_unit: int, fed_penalty: float = FED_PENALTY) -> CutPlan:
        """Group units, taken in the order their cuts start, so that the sweep costs least.

        A cut shared by several units starts at the earliest of them: every probe of a later unit then
        runs more of the graph, but one build serves them all. Estimated with a run of the whole model
        costing `call_s` and its build `build_s`: a cut's run costs its share of `costs`, plus
        `fed_penalty` of the share of the nodes that read its units' weights (overridable, so not
        pre-packed), its build a fixed part plus its share of the weights it reads; `runs_per_unit` runs
        per unit plus the cut's own nominal run. Exact over contiguous groupings (dynamic programming,
        quadratic in units).
        """
        cost, weight, masks, fed, order = self.cost, self.weight, self.masks, self.fed, self.order
        total_cost, total_weight = max(cost.sum(), 1e-30), max(weight.sum(), 1e-30)

        def group_seconds(mask: np.ndarray, reading: np.ndarray, members: int) -> float:
            run = call_s * (float(cost[mask].sum()) + fed_penalty * float(cost[reading].sum())) / total_cost
            build = build_s * (BUILD_FIXED + (1 - BUILD_FIXED) * float(weight[mask].sum()) / total_weight)
            return build + run * (1 + members * runs_per_unit)

        best = [0.0] + [np.inf] * len(order)
        split = [0] * (len(order) + 1)
        for end in range(1, len(order) + 1):
            mask, reading = np.zeros(self.nodes, bool), np.zeros(self.nodes, bool)
            for start in range(end - 1, -1, -1):
                mask |= masks[order[start]]
                reading |= fed[order[start]]
                seconds = best[start] + group_seconds(mask, reading, end - start)
                if seconds < best[end]:
                    best[end], split[end] = seconds, start
        groups, end = [], len(order)
        while end > 0:
            groups.append((split[end], end))
            end = split[end]
        groups.reverse()
        return CutPlan(
            groups=tuple(tuple(order[a:b]) for a, b in groups),
            seconds=float(best[-1]),
            group_seconds=tuple(float(best[b] - best[a]) for a, b in groups),
        )
