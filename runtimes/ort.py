"""ONNX Runtime sessions (CPU, CUDA and TensorRT execution providers)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from runtimes.base import IOSpec, ModelSource, RuntimeUnavailable

PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
"""Provider short names -> ONNX Runtime provider lists, most preferred first."""

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _spec(arg) -> IOSpec:
    shape = tuple(d if isinstance(d, int) else (d or None) for d in arg.shape)
    return IOSpec(name=arg.name, shape=shape, dtype=np.dtype(_ORT_TYPES.get(arg.type, np.float32)))


def available_providers() -> list[str]:
    """Short names of the providers this onnxruntime build can use."""
    import onnxruntime as ort

    present = set(ort.get_available_providers())
    return [name for name, chain in PROVIDERS.items() if chain[0] in present]


@dataclass(frozen=True)
class OrtRuntime:
    """How to open ONNX Runtime sessions; picklable, so it can travel to workers.

    `exact_qdq` turns off the MatMulNBits rewrite's int8 activations
    (accuracy_level 4) so integer DequantizeLinear->MatMul runs exactly; by
    default the session runs what a deployment would run.

    `tf32` lets the CUDA provider round float32 MatMul/Conv inputs to TF32 (10-bit
    mantissa, ~1e-3 relative). Off by default: a score measures output differences
    of that size (an 8-bit residual moves outputs by ~1e-3), so TF32 noise would be
    scored as sensitivity.
    """

    provider: str = "cpu"
    threads: int | None = None
    optimization: str = "all"
    exact_qdq: bool = False
    tf32: bool = False
    config: tuple[tuple[str, str], ...] = field(default=())
    optimized_model_path: str | None = None
    """Where ONNX Runtime should save the graph it really runs (for reports)."""
    disabled_optimizers: tuple[str, ...] = ()
    """Graph optimizers ONNX Runtime must skip (`for_model`)."""

    name = "onnxruntime"

    def check(self) -> None:
        if self.provider not in PROVIDERS:
            raise RuntimeUnavailable(f"unknown provider '{self.provider}'; choose one of {', '.join(PROVIDERS)}")
        if self.provider not in available_providers():
            raise RuntimeUnavailable(
                f"execution provider '{self.provider}' is not available in this onnxruntime build "
                f"(available: {', '.join(available_providers())}); install the GPU extra: pip install 'tqsdeploy[gpu]'"
            )

    def with_threads(self, threads: int) -> "OrtRuntime":
        return dataclasses.replace(self, threads=threads)

    def yielding(self) -> "OrtRuntime":
        """This runtime with its sessions' intra-op threads sleeping between calls instead of spinning. For a
        session whose calls alternate with numpy work: ONNX Runtime's idle threads otherwise spin for a while
        after each call and starve numpy's BLAS threads (docs/design-notes/runtimes.md, 'Idle threads sleep
        between calls')."""
        entry = ("session.intra_op.allow_spinning", "0")
        return self if entry in self.config else dataclasses.replace(self, config=self.config + (entry,))

    def for_model(self, proto) -> "OrtRuntime":
        """This runtime made safe for `proto`. On the CPU, ONNX Runtime 1.32's NCHWc layout pass crashes the
        process (a segmentation fault while the session is built, no message) on some float16 graphs, a torch
        float16 TransformerEncoderLayer among them. Its kernels are float32 only, so a model that computes in
        float16 (a float16 graph input or output) loses nothing without it."""
        import onnx

        half = onnx.TensorProto.FLOAT16
        computes_in_half = any(v.type.tensor_type.elem_type == half for v in (*proto.graph.input, *proto.graph.output))
        if self.provider != "cpu" or not computes_in_half or "NchwcTransformer" in self.disabled_optimizers:
            return self
        return dataclasses.replace(self, disabled_optimizers=self.disabled_optimizers + ("NchwcTransformer",))

    def providers(self) -> list:
        """The provider list for ONNX Runtime, with the CUDA provider's TF32 choice spelled out."""
        cuda = {"use_tf32": "1" if self.tf32 else "0"}
        return [(name, cuda) if name == "CUDAExecutionProvider" else name for name in PROVIDERS[self.provider]]

    def optimized(self, model: bytes) -> bytes:
        """The graph ONNX Runtime runs for `model` on this machine, serialised (its optimized model: with
        optimization 'all' on the CPU, in the layouts of this CPU's kernels)."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tqs-optimized-") as folder:
            path = Path(folder) / "optimized.onnx"
            dataclasses.replace(self, optimized_model_path=str(path), threads=1).open(model).close()
            return path.read_bytes()

    def open(self, model: ModelSource, external_data_dir: Path | None = None) -> "OrtSession":
        import onnxruntime as ort

        self.check()
        options = ort.SessionOptions()
        options.log_severity_level = 4  # fatal only: a failed run raises, and its message becomes the one error line
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[self.optimization]
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        if self.exact_qdq:
            options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        if external_data_dir is not None:
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(external_data_dir)
            )
        if self.optimized_model_path:
            options.optimized_model_filepath = self.optimized_model_path
        for key, value in self.config:
            options.add_session_config_entry(key, value)
        source = model if isinstance(model, bytes) else os.fspath(model)
        if external_data_dir is not None and not isinstance(source, bytes) and _elsewhere(source, external_data_dir):
            # a graph file whose tensors live in another folder (score's session files): ONNX Runtime 1.24 reads a
            # path's external data beside it whatever the folder option says, and honours the option for bytes
            source = Path(source).read_bytes()
        if self.exact_qdq:
            source, external_data_dir = _exact_kernels(source, external_data_dir, options)
        session = ort.InferenceSession(
            source,
            sess_options=options,
            providers=self.providers(),
            disabled_optimizers=[*self.disabled_optimizers, *_broken_optimizers(ort.__version__)] or None,
        )
        wanted, got = PROVIDERS[self.provider][0], session.get_providers()[0]
        if got != wanted:
            # ONNX Runtime logs the failure and carries on with the next provider in the list (a TensorRT
            # provider without TensorRT's libraries runs on CUDA, a CUDA one without cuDNN on the CPU):
            # scores and timings would then silently belong to another provider than the one asked for.
            raise RuntimeUnavailable(
                f"execution provider '{self.provider}' failed to load ({wanted} fell back to {got}; are its libraries "
                f"{'(TensorRT) ' if self.provider == 'tensorrt' else '(CUDA, cuDNN) '}on LD_LIBRARY_PATH?); "
                "choose another --provider"
            )
        if isinstance(source, bytes) and self.provider == "cpu":
            # ONNX Runtime keeps the serialised model only to re-create the session when a GPU
            # provider falls back to CPU; a CPU session never does, so that copy is dead weight
            # (one whole model per session). Nothing else reads it.
            session.disable_fallback()
            session._model_bytes = None
        return OrtSession(session, self.provider)


FP16_INITIALIZER_FUSION_FIXED = (1, 32)
"""ONNX Runtime 1.24 to 1.27 (measured; 1.28 to 1.31 not) crash in FuseFp16InitializerToFp32NodeTransformer, at the
"all" level, on a float16 initializer that is also a graph input: what `overridable` sessions declare to feed a
scored weight. 1.32 runs it."""


def _elsewhere(path: str, folder: Path) -> bool:
    """Whether a model file's external data folder is not its own, and the file small enough to pass as bytes."""
    return Path(path).resolve().parent != Path(folder).resolve() and os.path.getsize(path) < (1 << 30)


def _broken_optimizers(version: str) -> list[str]:
    """Graph transformers to leave out on this release: without the float16 one, the initializer's Cast to float32
    is folded at load all the same."""
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())  # '1.32.0.dev…' too
    return ["FuseFp16InitializerToFp32NodeTransformer"] if release < FP16_INITIALIZER_FUSION_FIXED else []


def _exact_kernels(source: bytes | str, external_data_dir: Path | None, options) -> tuple[bytes | str, Path | None]:
    """`source` with its MatMulNBits nodes computing in float (accuracy_level 0): what `exact_qdq` asks of the
    kernels a file names itself, as the session option asks it of the ones ONNX Runtime fuses. Unchanged when
    every MatMulNBits already computes exactly (or there is none)."""
    import onnx

    proto = (
        onnx.load_model_from_string(source)
        if isinstance(source, bytes)
        else onnx.load(source, load_external_data=False)
    )
    changed = False
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level" and attribute.i != 0:
                    attribute.i, changed = 0, True
    if not changed:
        return source, external_data_dir
    if external_data_dir is None and not isinstance(source, bytes):  # its external data beside the file it came from
        external_data_dir = Path(source).parent
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_data_dir))
    return proto.SerializeToString(), external_data_dir


def make(provider: str, threads: int | None = None, **options) -> OrtRuntime:
    """`runtimes.for_provider` for ONNX Runtime's providers; `options`: OrtRuntime's other fields."""
    return OrtRuntime(provider=provider, threads=threads, **options)


DEVICES = {"cuda": "cuda", "tensorrt": "cuda"}
"""Where each provider wants its inputs: GPU providers read device memory; CPU reads host arrays."""


class OrtSession:
    """A live ONNX Runtime session honouring the `runtimes.base.Session` contract.

    On a GPU provider (`device` set) runs go through an IOBinding: values from `keep` (the
    perturbed weights of a rollout, the model's own weights fed from its file) are copied to
    the device once and bound there on every step, the step's states come from host arrays and
    the outputs come back to the host (the divergence is summed there). Without it every run
    would copy every fed weight to the GPU again. On CPU runs are plain `run` calls."""

    def __init__(self, session, provider: str, device: str | None = None, device_id: int = 0):
        self._session = session
        self.name = f"onnxruntime[{provider}]"
        self.inputs = [_spec(a) for a in session.get_inputs()]
        self.outputs = [_spec(a) for a in session.get_outputs()]
        self.weights = frozenset(a.name for a in session.get_overridable_initializers())
        self.providers = session.get_providers()
        self.device = device if device is not None else DEVICES.get(provider)
        self.device_id = device_id

    def keep(self, values: Mapping[str, np.ndarray]) -> dict[str, object]:
        if self.device is None:
            return dict(values)
        import onnxruntime as ort

        return {
            name: value
            if isinstance(value, ort.OrtValue)
            else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), self.device, self.device_id)
            for name, value in values.items()
        }

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(output_names) if output_names else [o.name for o in self.outputs]
        if self.device is None:
            values = self._session.run(names, dict(feeds))
            return dict(zip(names, values))
        import onnxruntime as ort

        binding = self._session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in names:
            binding.bind_output(name, "cpu")
        self._session.run_with_iobinding(binding)
        return dict(zip(names, binding.copy_outputs_to_cpu()))

    def close(self) -> None:
        self._session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def release_freed_memory() -> None:
    """Hand the heap freed by a closed session (or a dropped model copy) back to the OS: glibc keeps
    it otherwise, and it counts in the process's resident size until reused. A no-op without glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


LARGE_ALLOCATION = 4 << 20
"""Bytes from which glibc serves an allocation from its own mapping (see `return_large_allocations`)."""


def return_large_allocations() -> None:
    """Have every allocation of `LARGE_ALLOCATION` bytes or more (weights, codes, activations) mapped on its
    own and handed back to the OS when freed. glibc otherwise raises that limit after the first large free
    (up to 32 MiB), and weight-sized arrays freed afterwards stay in its heap, counted in the process's
    resident memory from then on (docs/design-notes/runtimes.md, 'Large allocations go back to the OS'). A
    no-op without glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, LARGE_ALLOCATION)  # M_MMAP_THRESHOLD; setting it also fixes it
    except (OSError, AttributeError):
        pass
