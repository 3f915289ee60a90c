"""ONNX Runtime's own 4-bit weight quantizer on one model, for bench_deploy.py (run in a subprocess that has
`onnx_ir` on its path: `python deploy_ortquant.py SRC OUT rtn|hqq BLOCK`).

`rtn` is the quantizer's DEFAULT algorithm (round to nearest on a blockwise asymmetric min-max grid): MatMul weights
to MatMulNBits and Gather tables to GatherBlockQuantized in one pass. Its `RTNWeightOnlyQuantConfig` (Intel Neural
Compressor's RTN) is not used: it takes no block size and fails on the token embedder's 48-wide weights. HQQ
quantizes MatMul only ("Gather quantization is not supported yet in HQQ"), so `hqq` runs HQQ on MatMul and then
DEFAULT on Gather at the same block size: MatMul + Gather, as issue 56 compares (Gather only where a model gathers
from a table). HQQ imports torch: the work folder's pydeps get the local CPU build.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    HQQWeightOnlyQuantConfig,
    MatMulNBitsQuantizer,
)

logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)


def quantize(model: onnx.ModelProto, ops: tuple[str, ...], algorithm: str, block: int) -> onnx.ModelProto:
    if algorithm == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=block, bits=4, op_types_to_quantize=ops)
    else:
        config = DefaultWeightOnlyQuantConfig(block_size=block, bits=4, op_types_to_quantize=ops)
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block, op_types_to_quantize=ops, algo_config=config)
    quantizer.process()
    return quantizer.model.model


def gathers_a_table(model: onnx.ModelProto) -> bool:
    """Whether a Gather reads an initializer (an embedding table). Only then is Gather asked for: asking makes the
    quantizer lift the opset to 21 for int4, which breaks graphs written for an older opset (ReduceMin's axes)."""
    tables = {t.name for t in model.graph.initializer}
    return any(n.op_type == "Gather" and n.input[0] in tables for n in model.graph.node)


def main(source: str, out: str, algorithm: str, block: int) -> None:
    model = onnx.load(source)
    gather = gathers_a_table(model)
    external = any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.load(source, load_external_data=False).graph.initializer
    )
    if algorithm == "hqq":
        model = quantize(model, ("MatMul",), "hqq", block)
        if gather:
            model = quantize(model, ("Gather",), "rtn", block)
    else:
        model = quantize(model, ("MatMul", "Gather") if gather else ("MatMul",), "rtn", block)
    large = external or sum(t.ByteSize() for t in model.graph.initializer) > (1 << 30)
    onnx.save_model(model, out, save_as_external_data=large, location=Path(out).name + ".data")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
