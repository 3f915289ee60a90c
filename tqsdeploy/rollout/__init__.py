"""Rollouts: how a one-step ONNX model becomes a dynamical system.

Three jobs, one module each: `spec` (the RolloutSpec: feedback edges and
trajectory, read from TOML and checked against the model's signature),
`detect` (a spec guessed from shapes and names when none is given) and
`steps` (running the model autoregressively). `resolve_spec` is the one place
a command turns what the user passed into the spec it rolls out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from runtimes import IOSpec
from tqsdeploy.rollout.detect import AmbiguousRollout, Detection, detect, detect_rollout, mask_fill, mask_like
from tqsdeploy.rollout.spec import MODES, CheckedSpec, Feedback, RolloutSpec, aligned_shape
from tqsdeploy.rollout.steps import next_feeds, rollout

DEFAULT_STEPS = 8
"""Rollout steps of a detected spec when the user gives none."""


def resolve_spec(
    spec: RolloutSpec | str | Path | None, steps: int | None, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec]
) -> CheckedSpec:
    """A given spec (file or object, `steps` overriding its steps) or a detected one, checked against the signature:
    the one check a spec gets, so every stage after this one takes the `CheckedSpec` as it is."""
    if spec is None:
        resolved = detect(inputs, outputs, steps, DEFAULT_STEPS)
    else:
        resolved = spec if isinstance(spec, RolloutSpec) else RolloutSpec.from_toml(spec)
        if steps:
            resolved = resolved.with_steps(steps)
    return resolved.check(inputs, outputs)


__all__ = [
    "DEFAULT_STEPS",
    "MODES",
    "AmbiguousRollout",
    "CheckedSpec",
    "Detection",
    "Feedback",
    "RolloutSpec",
    "aligned_shape",
    "detect",
    "detect_rollout",
    "mask_fill",
    "mask_like",
    "next_feeds",
    "resolve_spec",
    "rollout",
]
