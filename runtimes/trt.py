"""Native TensorRT engines behind the same session contract.

Engines are built with Polygraphy (NVIDIA's own loaders and runner) with the
REFIT flag, so a sweep changes weights with `tensorrt.Refitter` instead of
rebuilding: the ONNX parser names each refittable weight after its ONNX
initializer, so the weights the sweep feeds by name map one to one.

tensorrt and polygraphy are imported only when a TensorRT runtime is used, so
CPU-only installs never need them (`pip install 'tqsdeploy[gpu]'`). This path
is written against the TensorRT 10 / Polygraphy 0.49+ documentation and is
not exercised by CI, which has no GPU (see tests/runtimes/test_gpu.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx

from runtimes.base import IOSpec, ModelSource, RuntimeUnavailable


def _import():
    try:
        import tensorrt as trt
        from polygraphy.backend import trt as poly
    except ImportError as exc:
        raise RuntimeUnavailable(
            f"TensorRT runtime needs tensorrt and polygraphy ({exc}); "
            "install the GPU extra: pip install 'tqsdeploy[gpu]'"
        ) from None
    return trt, poly


def _constant_weights(model: ModelSource) -> tuple[bytes, list[str]]:
    """The model with overridable initializers made plain constants again (TensorRT
    would otherwise expect them as network inputs), and their names."""
    proto = onnx.load_model_from_string(model) if isinstance(model, bytes) else onnx.load(os.fspath(model))
    initializers = {t.name for t in proto.graph.initializer}
    lifted = [i.name for i in proto.graph.input if i.name in initializers]
    kept = [i for i in proto.graph.input if i.name not in initializers]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    return proto.SerializeToString(), lifted


@dataclass(frozen=True)
class TrtRuntime:
    """Builds refittable TensorRT engines; picklable.

    Dynamic batch axes get an optimisation profile from 1 to `max_batch`
    (optimum `opt_batch`); other dimensions must be static.
    """

    max_batch: int = 64
    opt_batch: int = 8
    fp16: bool = False
    provider: str = "trt-engine"

    name = "tensorrt"
    threads = None
    """CPU threads do not apply: TensorRT runs on the GPU."""

    def check(self) -> None:
        _import()

    def for_model(self, proto) -> "TrtRuntime":
        return self

    def with_threads(self, threads: int) -> "TrtRuntime":
        return self

    def yielding(self) -> "TrtRuntime":
        return self

    def open(self, model: ModelSource, external_data_dir: Path | None = None) -> "TrtSession":
        trt, poly = _import()
        onnx_bytes, lifted = _constant_weights(model)
        network = poly.NetworkFromOnnxBytes(onnx_bytes)
        builder, net, parser = network()
        profile = poly.Profile()
        for index in range(net.num_inputs):
            tensor = net.get_input(index)
            shape = list(tensor.shape)
            if any(d < 0 for d in shape[1:]):
                raise RuntimeUnavailable(
                    f"TensorRT runtime: input '{tensor.name}' has dynamic dimensions beyond the batch axis: {shape}"
                )
            if shape and shape[0] < 0:
                profile.add(tensor.name, [1, *shape[1:]], [self.opt_batch, *shape[1:]], [self.max_batch, *shape[1:]])
        config = poly.CreateConfig(refittable=True, fp16=self.fp16, profiles=[profile])
        engine = poly.engine_from_network((builder, net, parser), config=config)
        return TrtSession(engine, lifted, trt)


def make(provider: str, threads: int | None = None, **options) -> TrtRuntime:
    """`runtimes.for_provider` for 'trt-engine'; `threads` does not apply (TensorRT runs on the GPU), `options`
    are TrtRuntime's fields, and another engine's settings (ONNX Runtime's `exact_qdq`) are refused."""
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(TrtRuntime)})
    if unknown:
        raise RuntimeUnavailable(
            f"native TensorRT ('{provider}') has no setting {', '.join(unknown)}; "
            "choose an ONNX Runtime provider (cpu, cuda or tensorrt)"
        )
    return TrtRuntime(provider=provider, **options)


class TrtSession:
    """A TensorRT engine with a Polygraphy runner; fed weights are refitted in."""

    def __init__(self, engine, lifted: Sequence[str], trt):
        from polygraphy.backend.trt import TrtRunner

        self._trt = trt
        self._engine = engine
        self._runner = TrtRunner(engine)
        self._runner.activate()
        self._refitter = trt.Refitter(engine, trt.Logger(trt.Logger.ERROR))
        refittable = set(self._refitter.get_all_weights())
        self.weights = frozenset(n for n in lifted if n in refittable)
        self._nominal = {}
        self._current: dict[str, int] = {}
        self.name = "tensorrt"
        self.inputs, self.outputs = [], []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            spec = IOSpec(
                name,
                tuple(d if d >= 0 else None for d in engine.get_tensor_shape(name)),
                np.dtype(trt.nptype(engine.get_tensor_dtype(name))),
            )
            (self.inputs if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else self.outputs).append(spec)

    def _refit(self, weights: Mapping[str, np.ndarray]) -> None:
        """Swap in the fed weights (and restore any left over from the last run)."""
        wanted = {n: id(w) for n, w in weights.items()}
        if wanted == self._current:
            return
        for name in set(self._current) | set(weights):
            if name in weights:
                self._nominal.setdefault(name, self._get(name))
                value = np.ascontiguousarray(weights[name], dtype=np.float32)
            else:
                value = self._nominal[name]
            if not self._refitter.set_named_weights(name, self._trt.Weights(value)):
                raise RuntimeError(f"TensorRT refused new weights for '{name}'")
        if not self._refitter.refit_cuda_engine():
            raise RuntimeError("TensorRT refit failed")
        self._current = wanted

    def _get(self, name: str) -> np.ndarray:
        return np.array(self._refitter.get_named_weights(name).numpy(), copy=True)

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        weights = {n: v for n, v in feeds.items() if n in self.weights}
        self._refit(weights)
        inputs = {n: np.ascontiguousarray(v) for n, v in feeds.items() if n not in self.weights}
        results = self._runner.infer(inputs, copy_outputs_to_host=True)
        names = list(output_names) if output_names else [o.name for o in self.outputs]
        return {n: np.asarray(results[n]) for n in names}

    def close(self) -> None:
        if self._runner is not None:
            self._runner.deactivate()
            self._runner = None


def build_engine(model: Path, output: Path, max_batch: int = 64, opt_batch: int = 8, fp16: bool = False) -> Path:
    """Serialise a TensorRT engine for a (mixed-precision) ONNX file."""
    _, poly = _import()
    network = poly.NetworkFromOnnxPath(os.fspath(model))
    builder, net, parser = network()
    profile = poly.Profile()
    for index in range(net.num_inputs):
        tensor = net.get_input(index)
        shape = list(tensor.shape)
        if shape and shape[0] < 0:
            profile.add(tensor.name, [1, *shape[1:]], [opt_batch, *shape[1:]], [max_batch, *shape[1:]])
    config = poly.CreateConfig(fp16=fp16, profiles=[profile])
    engine = poly.engine_from_network((builder, net, parser), config=config)
    poly.save_engine(engine, os.fspath(output))
    return output
