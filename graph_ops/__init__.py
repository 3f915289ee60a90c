"""ONNX graph surgery: loading models safely, finding weight tensors and their
layouts, and rewriting graphs so one runtime session can score many weight
variants or a file can store quantized weights.

Nothing here runs a model or knows about TQS; it takes and returns ONNX
protos, paths and plain dataclasses.
"""

from graph_ops import batch, derived, prefix, wire
from graph_ops.io import GraphError, LoadedModel, load_model, model_bytes, weight_bits
from graph_ops.layout import WeightLayout, weight_layouts
from graph_ops.output import save_model
from graph_ops.overridable import input_declarations, lift_constants, make_weights_overridable, weights_as_graph_inputs
from graph_ops.weight_use import WeightUse
from graph_ops.weights import (
    FileWeights,
    WeightTensor,
    find_weight_tensors,
    model_weights,
    read_weights,
    release_pages,
    replace_weights,
)

__all__ = [
    "FileWeights",
    "GraphError",
    "LoadedModel",
    "WeightLayout",
    "WeightTensor",
    "WeightUse",
    "batch",
    "derived",
    "find_weight_tensors",
    "load_model",
    "input_declarations",
    "lift_constants",
    "weights_as_graph_inputs",
    "make_weights_overridable",
    "prefix",
    "model_bytes",
    "model_weights",
    "read_weights",
    "release_pages",
    "replace_weights",
    "wire",
    "save_model",
    "weight_bits",
    "weight_layouts",
]
