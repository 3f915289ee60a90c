"""Readable names for weights whose ONNX names an exporter generated: from the reading node's scope metadata or name."""

import models
import onnx
from onnx import helper

import graph_ops
from graph_ops.names import weight_labels

EXPECTED = {
    "val_3": "encoder.fc.weight",  # dynamo: the module scope and the parameter the FX node read
    "val_7": "mix.weight",  # the same, read through a Transpose
    "val_20": "pair.matmul (val_20)",  # one label for two weights: each keeps its ONNX name beside it
    "val_21": "pair.matmul (val_21)",
    "onnx::MatMul_12": "head.proj.MatMul",  # TorchScript: the node's path
    "decoder.weight": "decoder.weight",  # a name a user wrote stays as it is
    "val_2": "val_2",  # an int64 shape read in encoder.fc claims nothing
}


def test_labels_from_scopes_fx_nodes_and_node_paths(tmp_path):
    proto = onnx.load(str(models.exporter_names(tmp_path / "m.onnx")))
    assert weight_labels(proto.graph) == EXPECTED
    layouts = graph_ops.weight_layouts(proto)
    assert {name: layout.label for name, layout in layouts.items()} == {
        k: v for k, v in EXPECTED.items() if k != "val_2"
    }
    # the same label whichever tensors a caller asks about (inspect asks for all, export for the units)
    assert graph_ops.weight_layouts(proto, ["val_20"])["val_20"].label == "pair.matmul (val_20)"


def test_a_recovered_name_that_another_tensor_holds_keeps_the_onnx_name_beside_it(tmp_path):
    proto = onnx.load(str(models.exporter_names(tmp_path / "m.onnx")))
    node = next(n for n in proto.graph.node if "val_20" in n.input)
    del node.metadata_props[:]
    helper.set_metadata_props(
        node,
        {
            "pkg.torch.onnx.name_scopes": "['', 'decoder', 'linear_9']",
            "pkg.torch.onnx.fx_node": "(%h2, %p_decoder_weight)",
        },
    )
    labels = weight_labels(proto.graph)
    assert labels["val_20"] == "decoder.weight (val_20)" and labels["decoder.weight"] == "decoder.weight"
    assert labels["val_21"] == "pair.matmul"  # no longer shared
    assert len(set(labels.values())) == len(labels)


def test_a_model_without_scope_metadata_keeps_its_names(tmp_path):
    proto = onnx.load(str(models.shift_model(tmp_path / "s.onnx")))
    assert all(name == label for name, label in weight_labels(proto.graph).items())
