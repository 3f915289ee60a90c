"""Runtime sessions behind one small contract (see `runtimes.base`).

Commands hold a `Runtime` (the protocol in `runtimes.base`) made by
`for_provider`, never a concrete engine. ONNX Runtime is the default; each
engine's module is imported when a provider of it is asked for, so CPU-only
installs never import TensorRT. A new engine (OpenVINO, say) is one module
with a Runtime class and a `make` function, and its provider names in
`RUNTIMES`: the CLI's `--provider` choices and help are read off that list.
"""

import importlib
from dataclasses import dataclass
from pathlib import Path

from runtimes.base import (
    DerivedFeeds,
    IOSpec,
    ModelSource,
    Runtime,
    RuntimeUnavailable,
    Session,
    SessionFactory,
    WithDefaults,
    kept,
)
from runtimes.ort import (
    DEVICES,
    PROVIDERS,
    OrtRuntime,
    OrtSession,
    available_providers,
    release_freed_memory,
    return_large_allocations,
)


@dataclass(frozen=True)
class Provider:
    """One `--provider` name: the module that makes its runtime, and what that runtime can do."""

    name: str
    module: str
    """The module whose `make(provider, threads, **options)` makes the runtime, imported when it is asked for."""
    engine: str
    """The engine in words, as the `--provider` help groups the names ('ONNX Runtime execution providers')."""
    gpu: bool = False
    """Runs on a GPU, where one lane's calls keep it busy: a sweep on it runs one lane."""
    sweep_only: bool = False
    """Offered by `score` alone: export, eval and gate give the runtime ONNX Runtime's settings (exact
    dequantization, the optimized graph), which native TensorRT, refitting one engine's weights, has not."""
    builds_engines: bool = False
    """Its module's `build_engine(model, output, **options)` writes an engine file (`tqsdeploy engine`)."""

    def make(self, threads: int | None = None, **options) -> Runtime:
        return importlib.import_module(self.module).make(self.name, threads, **options)


RUNTIMES: dict[str, Provider] = {
    p.name: p
    for p in (
        *(
            Provider(name, "runtimes.ort", "ONNX Runtime execution providers", gpu=name in DEVICES)
            for name in PROVIDERS
        ),
        Provider(
            "trt-engine",
            "runtimes.trt",
            "native TensorRT, weights refitted",
            gpu=True,
            sweep_only=True,
            builds_engines=True,
        ),
    )
}
"""`--provider` names, in the order the CLI lists them."""

DEFAULT_RUNTIME: Runtime = OrtRuntime()
"""ONNX Runtime on the CPU, its default threads: what a command runs on when it is given no runtime."""


def for_provider(provider: str, threads: int | None = None, **options) -> Runtime:
    """The runtime for a `--provider` name: 'cpu', 'cuda', 'tensorrt' (ONNX Runtime providers) or
    'trt-engine' (native TensorRT). `threads`: CPU threads per session (None: the engine's default);
    `options`: the engine's own settings (ONNX Runtime's `exact_qdq`, `tf32`, ...), refused by an
    engine that has no such setting."""
    if provider not in RUNTIMES:
        raise RuntimeUnavailable(f"unknown provider '{provider}'; choose one of {', '.join(RUNTIMES)}")
    return RUNTIMES[provider].make(threads, **options)


def provider_names(sweep: bool = False) -> list[str]:
    """The `--provider` names a command offers: those of a sweep (`score`: every one), or the others'."""
    return [p.name for p in RUNTIMES.values() if sweep or not p.sweep_only]


def on_gpu(provider: str) -> bool:
    """Whether the runtime of a `--provider` name runs on a GPU."""
    return provider in RUNTIMES and RUNTIMES[provider].gpu


def build_engine(model: Path, output: Path, **options) -> Path:
    """An engine file of the ONNX `model`, by the runtime that builds them (native TensorRT; `options`: its own)."""
    builder = next((p for p in RUNTIMES.values() if p.builds_engines), None)
    if builder is None:
        raise RuntimeUnavailable("no runtime here builds engine files")
    return importlib.import_module(builder.module).build_engine(model, output, **options)


__all__ = [
    "DEFAULT_RUNTIME",
    "PROVIDERS",
    "RUNTIMES",
    "DerivedFeeds",
    "IOSpec",
    "ModelSource",
    "OrtRuntime",
    "OrtSession",
    "Provider",
    "Runtime",
    "RuntimeUnavailable",
    "Session",
    "SessionFactory",
    "WithDefaults",
    "available_providers",
    "build_engine",
    "kept",
    "for_provider",
    "on_gpu",
    "provider_names",
    "release_freed_memory",
    "return_large_allocations",
]
