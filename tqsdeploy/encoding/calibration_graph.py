"""The calibration graph: the model with every scored weight a plain input and every layer input an output, and
what calibration asks of it (which weights lie upstream of a tensor, which nodes read it, what type it has)."""

from __future__ import annotations

from typing import Mapping

import onnx

import graph_ops
from graph_ops.calibration import expose_tensors, layer_tensors, tensor_graph, tensor_infos
from graph_ops.fed_codes import fed_codes_model
from graph_ops.layout import WeightLayout
from graph_ops.qdq import at_opset
from graph_ops.recurrent import add_recurrent_states
from tiers import Encoded

UNKNOWN_DIM = "unk__"
"""How onnx shape inference names an axis it cannot tell (`CalibrationGraph.infos`)."""


class CalibrationGraph:
    """Built on first use from the model (no weight data), at the opset the output is written at."""

    def __init__(self, proto, layouts: Mapping[str, WeightLayout], opset: int):
        self._source, self.layouts, self.opset = proto, layouts, opset
        self._proto = None
        self._inputs: set[str] | None = None
        self._tensors = None
        self._value_infos: dict | None = None

    @property
    def proto(self):
        if self._proto is None:
            inputs_fed = add_recurrent_states(
                at_opset(graph_ops.weights_as_graph_inputs(self._source, list(self.layouts)), self.opset), self.layouts
            )
            self._proto = expose_tensors(inputs_fed, layer_tensors(self._source, self.layouts))
        return self._proto

    @property
    def inputs(self) -> set[str]:
        """What the calibration graph takes as inputs: the model's inputs and the scored weights."""
        if self._inputs is None:
            self._inputs = {v.name for v in self.proto.graph.input}
        return self._inputs

    @property
    def tensors(self):
        """(weights upstream of each tensor, indices of the nodes reading each) of the calibration graph."""
        if self._tensors is None:
            self._tensors = tensor_graph(self.proto, self.layouts)
        return self._tensors

    def upstream(self, name: str) -> frozenset:
        """The weights whose encodings weight `name`'s statistics depend on: those upstream of its inputs."""
        upstream, _ = self.tensors
        return frozenset().union(*(upstream.get(use.x, frozenset()) for use in self.layouts[name].uses))

    def infos(self, names: list[str], encoded: Mapping[str, Encoded]) -> dict:
        """Value infos of the named activations as the session that computes them from the model input knows them
        (onnx shape inference on it): a wave cut at them declares what ONNX Runtime would have known had it computed
        them itself, so it fuses the same. Those whose element type cannot be told are left out."""
        if self._value_infos is None:
            upstream, _ = self.tensors
            self._value_infos = tensor_infos(self.proto, list(upstream), required=False)
        names = [name for name in names if name in self._value_infos]
        proto, _ = fed_codes_model(self.proto, encoded, names, {name: self._value_infos[name] for name in names})
        try:
            inferred = onnx.shape_inference.infer_shapes(proto)
        except Exception:  # best effort: the type alone, as the graph declares it
            inferred = proto
        infos = {}
        for value in inferred.graph.output:
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
                infos[value.name] = onnx.ValueInfoProto()
                infos[value.name].CopyFrom(value)
                for dim in infos[value.name].type.tensor_type.shape.dim:
                    if dim.dim_param.startswith(
                        UNKNOWN_DIM
                    ):  # made up by inference: unknown to the runtime, not equal to another's
                        dim.ClearField("dim_param")
        return infos
