"""Runtime sessions behind one small contract (see `runtimes.base`).

ONNX Runtime is the default; TensorRT is imported lazily so CPU-only installs
work without it.
"""

from runtimes.base import IOSpec, ModelSource, RuntimeUnavailable, Session, SessionFactory
from runtimes.ort import PROVIDERS, OrtRuntime, OrtSession, available_providers

__all__ = [
    "PROVIDERS",
    "IOSpec",
    "ModelSource",
    "OrtRuntime",
    "OrtSession",
    "RuntimeUnavailable",
    "Session",
    "SessionFactory",
    "available_providers",
]
