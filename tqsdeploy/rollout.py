"""Rollout specs: how a one-step ONNX model becomes a dynamical system.

A spec says which output feeds which input at the next step (`replace`: the
output is the next state; `shift`: drop the oldest entries along an axis and
append the output) and which outputs form the trajectory Y. Inputs that
receive no feedback stay constant. Without a spec, the common single-input,
single-output cases are detected from the model's shapes.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from runtimes import IOSpec, Session
from tqsdeploy.errors import RolloutError

MODES = ("replace", "shift")


@dataclass(frozen=True)
class Feedback:
    """One output fed back into one input at every step."""

    output: str
    input: str
    mode: str = "replace"
    axis: int = -1


@dataclass(frozen=True)
class RolloutSpec:
    """Steps, feedback edges and trajectory outputs of an autoregressive rollout."""

    steps: int
    feedback: tuple[Feedback, ...]
    trajectory: tuple[str, ...]
    origin: str = "spec"
    """Where the spec came from: 'spec' (a file) or 'detected'."""

    def __post_init__(self):
        if self.steps < 1:
            raise RolloutError(f"rollout needs at least 1 step, got {self.steps}")
        for edge in self.feedback:
            if edge.mode not in MODES:
                raise RolloutError(f"feedback mode '{edge.mode}' is not one of {', '.join(MODES)}")
        if not self.trajectory:
            raise RolloutError("rollout spec names no trajectory outputs")

    @property
    def fed_inputs(self) -> set[str]:
        return {edge.input for edge in self.feedback}

    @property
    def run_outputs(self) -> list[str]:
        """Outputs a step must produce: the trajectory plus whatever is fed back."""
        names = list(self.trajectory)
        names += [e.output for e in self.feedback if e.output not in names]
        return names

    def with_steps(self, steps: int) -> "RolloutSpec":
        return RolloutSpec(steps=steps, feedback=self.feedback, trajectory=self.trajectory, origin=self.origin)

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "trajectory": list(self.trajectory),
            "feedback": [asdict(e) for e in self.feedback],
            "origin": self.origin,
        }

    @classmethod
    def from_dict(cls, data: Mapping, origin: str = "spec") -> "RolloutSpec":
        try:
            feedback = tuple(
                Feedback(output=str(e["output"]), input=str(e["input"]), mode=str(e.get("mode", "replace")), axis=int(e.get("axis", -1)))
                for e in data.get("feedback", [])
            )
            trajectory = tuple(data.get("trajectory") or [e.output for e in feedback])
            return cls(steps=int(data.get("steps", 1)), feedback=feedback, trajectory=trajectory, origin=data.get("origin", origin))
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutError(f"rollout spec is malformed: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> "RolloutSpec":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise RolloutError(f"rollout spec {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise RolloutError(f"rollout spec {path} is not valid TOML: {exc}") from None
        return cls.from_dict(data)

    def to_toml(self) -> str:
        lines = [f"steps = {self.steps}", "trajectory = [" + ", ".join(f'"{t}"' for t in self.trajectory) + "]"]
        for edge in self.feedback:
            lines += ["", "[[feedback]]", f'output = "{edge.output}"', f'input = "{edge.input}"', f'mode = "{edge.mode}"']
            if edge.mode == "shift":
                lines.append(f"axis = {edge.axis}")
        return "\n".join(lines) + "\n"

    def check(self, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec]) -> None:
        """Fail with a clear message when the spec does not fit the model's signature."""
        ins = {s.name: s for s in inputs}
        outs = {s.name: s for s in outputs}
        for name in self.trajectory:
            if name not in outs:
                raise RolloutError(f"trajectory output '{name}' is not a model output (outputs: {', '.join(outs)})")
        for edge in self.feedback:
            if edge.output not in outs:
                raise RolloutError(f"feedback output '{edge.output}' is not a model output (outputs: {', '.join(outs)})")
            if edge.input not in ins:
                raise RolloutError(f"feedback input '{edge.input}' is not a model input (inputs: {', '.join(ins)})")
            source, target = outs[edge.output].shape, ins[edge.input].shape
            if len(source) != len(target):
                raise RolloutError(
                    f"output '{edge.output}' has rank {len(source)} but input '{edge.input}' has rank {len(target)}; they cannot feed each other"
                )
            skip = edge.axis % len(target) if edge.mode == "shift" else None
            for axis, (a, b) in enumerate(zip(source, target)):
                if axis != skip and isinstance(a, int) and isinstance(b, int) and a != b:
                    raise RolloutError(
                        f"output '{edge.output}' {_fmt(source)} does not fit input '{edge.input}' {_fmt(target)} "
                        f"for mode '{edge.mode}' (axis {axis} differs)"
                    )


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


def _compatible(a, b) -> bool:
    return not (isinstance(a, int) and isinstance(b, int)) or a == b


def detect(inputs: Sequence[IOSpec], outputs: Sequence[IOSpec], steps: int) -> RolloutSpec:
    """Guess the feedback of a one-input, one-output float model from shapes."""
    floats_in = [s for s in inputs if s.dtype.kind == "f"]
    floats_out = [s for s in outputs if s.dtype.kind == "f"]
    hint = "write a rollout spec (TOML, see README 'Rollout specs') and pass it with --spec"
    if len(floats_in) != 1 or len(floats_out) != 1:
        raise RolloutError(
            f"cannot detect the rollout: model has {len(floats_in)} float inputs and {len(floats_out)} float outputs", hint=hint
        )
    x, y = floats_in[0], floats_out[0]
    if x.rank != y.rank:
        raise RolloutError(f"cannot detect the rollout: input '{x.name}' {_fmt(x.shape)} and output '{y.name}' {_fmt(y.shape)} differ in rank", hint=hint)
    differing = [i for i, (a, b) in enumerate(zip(x.shape, y.shape)) if not _compatible(a, b)]
    if not differing:
        edge = Feedback(output=y.name, input=x.name, mode="replace")
    elif len(differing) == 1 and y.shape[differing[0]] < x.shape[differing[0]]:
        edge = Feedback(output=y.name, input=x.name, mode="shift", axis=differing[0] - x.rank)
    else:
        raise RolloutError(
            f"cannot detect the rollout: output '{y.name}' {_fmt(y.shape)} neither matches nor shifts into input '{x.name}' {_fmt(x.shape)}",
            hint=hint,
        )
    return RolloutSpec(steps=steps, feedback=(edge,), trajectory=(y.name,), origin="detected")


def next_feeds(feeds: Mapping[str, np.ndarray], produced: Mapping[str, np.ndarray], spec: RolloutSpec) -> dict[str, np.ndarray]:
    """The inputs of the next step, given this step's inputs and outputs."""
    new = dict(feeds)
    for edge in spec.feedback:
        current, output = feeds[edge.input], produced[edge.output]
        if edge.mode == "replace":
            if output.shape != current.shape:
                raise RolloutError(
                    f"output '{edge.output}' has shape {list(output.shape)} but input '{edge.input}' has shape {list(current.shape)}; mode 'replace' needs equal shapes"
                )
            new[edge.input] = output.astype(current.dtype, copy=False)
            continue
        axis = edge.axis % current.ndim
        if output.ndim != current.ndim or any(o != c for i, (o, c) in enumerate(zip(output.shape, current.shape)) if i != axis):
            raise RolloutError(
                f"output '{edge.output}' of shape {list(output.shape)} cannot be appended to input '{edge.input}' of shape {list(current.shape)} along axis {edge.axis}"
            )
        length = current.shape[axis]
        joined = np.concatenate([current, output.astype(current.dtype, copy=False)], axis=axis)
        new[edge.input] = np.take(joined, np.arange(joined.shape[axis] - length, joined.shape[axis]), axis=axis)
    return new


def rollout(
    session: Session,
    feeds: Mapping[str, np.ndarray],
    spec: RolloutSpec,
    weights: Mapping[str, np.ndarray] | None = None,
    steps: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Run the model autoregressively, yielding the trajectory outputs of each step.

    `weights` override the named weights for every step of this rollout.
    """
    state = dict(feeds)
    extra = dict(weights or {})
    names = spec.run_outputs
    for _ in range(steps or spec.steps):
        produced = session.run({**state, **extra}, names)
        yield {name: produced[name] for name in spec.trajectory}
        state = next_feeds(state, produced, spec)
