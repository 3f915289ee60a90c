"""Runtime sessions behind one small contract (see `runtimes.base`).

ONNX Runtime is the default; TensorRT is imported lazily so CPU-only installs
work without it.
"""

from runtimes.base import DerivedFeeds, IOSpec, ModelSource, RuntimeUnavailable, Session, SessionFactory, WithDefaults, kept
from runtimes.ort import PROVIDERS, OrtRuntime, OrtSession, available_providers, release_freed_memory, return_large_allocations


def make_runtime(provider: str, threads: int | None = None):
    """'cpu', 'cuda', 'tensorrt' (ONNX Runtime providers) or 'trt-engine' (native TensorRT)."""
    if provider == "trt-engine":
        from runtimes.trt import TrtRuntime

        return TrtRuntime()
    return OrtRuntime(provider=provider, threads=threads)

__all__ = [
    "PROVIDERS",
    "DerivedFeeds",
    "IOSpec",
    "ModelSource",
    "OrtRuntime",
    "OrtSession",
    "RuntimeUnavailable",
    "Session",
    "SessionFactory",
    "WithDefaults",
    "available_providers",
    "kept",
    "make_runtime",
    "release_freed_memory",
    "return_large_allocations",
]
