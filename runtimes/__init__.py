"""Runtime sessions behind one small contract (see `runtimes.base`).

Commands hold a `Runtime` (the protocol in `runtimes.base`) made by
`for_provider`, never a concrete engine. ONNX Runtime is the default; each
engine's module is imported when a provider of it is asked for, so CPU-only
installs never import TensorRT. A new engine (OpenVINO, say) is one module
with a Runtime class and a `make` function, and its provider names in
`RUNTIMES`.
"""

import importlib

from runtimes.base import DerivedFeeds, IOSpec, ModelSource, Runtime, RuntimeUnavailable, Session, SessionFactory, WithDefaults, kept
from runtimes.ort import PROVIDERS, OrtRuntime, OrtSession, available_providers, release_freed_memory, return_large_allocations

RUNTIMES: dict[str, str] = {**dict.fromkeys(PROVIDERS, "runtimes.ort"), "trt-engine": "runtimes.trt"}
"""`--provider` names -> the module whose `make(provider, threads, **options)` makes a runtime for them."""

DEFAULT_RUNTIME: Runtime = OrtRuntime()
"""ONNX Runtime on the CPU, its default threads: what a command runs on when it is given no runtime."""


def for_provider(provider: str, threads: int | None = None, **options) -> Runtime:
    """The runtime for a `--provider` name: 'cpu', 'cuda', 'tensorrt' (ONNX Runtime providers) or
    'trt-engine' (native TensorRT). `threads`: CPU threads per session (None: the engine's default);
    `options`: the engine's own settings (ONNX Runtime's `exact_qdq`, `tf32`, ...), refused by an
    engine that has no such setting."""
    if provider not in RUNTIMES:
        raise RuntimeUnavailable(f"unknown provider '{provider}'; choose one of {', '.join(RUNTIMES)}")
    return importlib.import_module(RUNTIMES[provider]).make(provider, threads, **options)


__all__ = [
    "DEFAULT_RUNTIME",
    "PROVIDERS",
    "RUNTIMES",
    "DerivedFeeds",
    "IOSpec",
    "ModelSource",
    "OrtRuntime",
    "OrtSession",
    "Runtime",
    "RuntimeUnavailable",
    "Session",
    "SessionFactory",
    "WithDefaults",
    "available_providers",
    "kept",
    "for_provider",
    "release_freed_memory",
    "return_large_allocations",
]
