"""Rollout specs: which output feeds which input at the next step, read from TOML and checked against a model.

A spec says which output feeds which input at the next step (`replace`: the
output is the next state; `shift`: drop the oldest entries along an axis and
append the output; an edge without an output shifts a mask along with its
context, appending `fill`) and which outputs form the trajectory Y. Inputs
that receive no feedback stay constant.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from runtimes import IOSpec
from tqsdeploy.errors import RolloutError

MODES = ("replace", "shift", "advance")
MAX_STEPS = 100_000
"""Longest rollout taken: the trajectories of every window stay in memory, and a typo'd step count would otherwise
run silently for hours (docs/design-notes/rollout.md, 'MAX_STEPS')."""
SPEC_KEYS = ("steps", "trajectory", "feedback", "origin")
EDGE_KEYS = ("output", "input", "mode", "axis", "fill", "length", "by", "modulo")


@dataclass(frozen=True)
class Feedback:
    """One output fed back into one input at every step.

    An edge without an output (`output=None`) shifts its input by the length
    the sibling shift edge appends (or `length`) and appends `fill`: a padding
    mask that moves with its context. Mode 'advance' (no output) adds `by` to its
    input each step, modulo `modulo` if given: a calendar input (hour of day) that
    would otherwise stay at its first value for the whole rollout.
    """

    output: str | None
    input: str
    mode: str = "replace"
    axis: int = -1
    fill: float | None = None
    length: int | None = None
    by: float | None = None
    modulo: float | None = None

    def to_dict(self) -> dict:
        """Plain data; keys that are unset are left out (keeps old run fingerprints)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, eq=False)
class RolloutSpec:
    """Steps, feedback edges and trajectory outputs of an autoregressive rollout."""

    steps: int
    feedback: tuple[Feedback, ...]
    trajectory: tuple[str, ...]
    origin: str = "spec"
    """Where the spec came from: 'spec' (a file) or 'detected'."""

    def _fields(self) -> tuple:
        return self.steps, self.feedback, self.trajectory, self.origin

    def __eq__(self, other: object) -> bool:
        """By value, checked or not: a `CheckedSpec` is the same rollout as the spec it was checked from."""
        return self._fields() == other._fields() if isinstance(other, RolloutSpec) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._fields())

    def __post_init__(self):
        if self.steps < 1:
            raise RolloutError(f"rollout needs at least 1 step, got {self.steps}")
        if self.steps > MAX_STEPS:
            raise RolloutError(
                f"rollout of {self.steps} steps: at most {MAX_STEPS} are taken "
                "(a rollout keeps every step's outputs in memory)"
            )
        seen = set()
        for edge in self.feedback:
            if edge.mode not in MODES:
                raise RolloutError(f"feedback mode '{edge.mode}' is not one of {', '.join(MODES)}")
            if edge.input in seen:
                raise RolloutError(f"input '{edge.input}' is the target of two feedback edges")
            seen.add(edge.input)
            if edge.mode == "advance":
                if edge.output is not None or edge.by is None or edge.fill is not None or edge.length is not None:
                    raise RolloutError(
                        f"feedback edge for input '{edge.input}' has mode \"advance\": it takes `by` (added each step) "
                        "and optionally `modulo`, and no `output`, `fill` or `length`"
                    )
                if edge.modulo is not None and not edge.modulo > 0:
                    raise RolloutError(
                        f"feedback edge for input '{edge.input}' has modulo {edge.modulo:g}; it must be positive"
                    )
                continue
            if edge.by is not None or edge.modulo is not None:
                raise RolloutError(
                    f"feedback edge for input '{edge.input}': `by` and `modulo` only apply to mode = \"advance\""
                )
            if edge.output is None:
                if edge.mode != "shift" or edge.fill is None:
                    raise RolloutError(
                        f"feedback edge for input '{edge.input}' has no output, "
                        'so it needs mode = "shift" and a `fill` value to append'
                    )
            elif edge.fill is not None or edge.length is not None:
                raise RolloutError(
                    f"feedback edge '{edge.output}' → '{edge.input}' appends its output: "
                    "`fill` and `length` only apply to edges without an output"
                )
            if edge.length is not None and edge.length < 1:
                raise RolloutError(
                    f"feedback edge for input '{edge.input}' has length {edge.length}; it must be at least 1"
                )
        if not self.trajectory:
            raise RolloutError("rollout spec names no trajectory outputs")

    @property
    def fed_inputs(self) -> set[str]:
        return {edge.input for edge in self.feedback}

    @property
    def run_outputs(self) -> list[str]:
        """Outputs a step must produce: the trajectory plus whatever is fed back."""
        names = list(self.trajectory)
        names += [e.output for e in self.feedback if e.output is not None and e.output not in names]
        return names

    def with_steps(self, steps: int) -> "RolloutSpec":
        return RolloutSpec(steps=steps, feedback=self.feedback, trajectory=self.trajectory, origin=self.origin)

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "trajectory": list(self.trajectory),
            "feedback": [e.to_dict() for e in self.feedback],
            "origin": self.origin,
        }

    @classmethod
    def from_dict(cls, data: Mapping, origin: str = "spec") -> "RolloutSpec":
        """Strict: unknown keys, missing `steps` and wrongly typed values are errors."""
        if not isinstance(data, Mapping):
            raise RolloutError("rollout spec must be a table of keys")
        _known_keys(data, SPEC_KEYS, "rollout spec")
        if "steps" not in data:
            raise RolloutError("rollout spec has no `steps` (the number of rollout steps T, e.g. steps = 8)")
        steps = _typed(data["steps"], int, "steps")
        trajectory = data.get("trajectory")
        if trajectory is not None and (
            not isinstance(trajectory, list) or not all(isinstance(t, str) for t in trajectory)
        ):
            raise RolloutError(
                f'`trajectory` must be a list of output names, e.g. trajectory = ["y"], not {trajectory!r}'
            )
        raw = data.get("feedback", [])
        if not isinstance(raw, list) or not all(isinstance(e, Mapping) for e in raw):
            raise RolloutError("`feedback` must be a list of [[feedback]] tables")
        edges = []
        for i, e in enumerate(raw, 1):
            where = f"[[feedback]] #{i}"
            _known_keys(e, EDGE_KEYS, where)
            if "input" not in e:
                raise RolloutError(f"{where} has no `input`")
            output = _typed(e["output"], str, f"{where} output") if "output" in e else None
            fill = e.get("fill")
            if fill is not None and (isinstance(fill, bool) or not isinstance(fill, (int, float))):
                raise RolloutError(f"{where} fill must be a number, not {fill!r}")
            if fill is not None and not np.isfinite(fill):
                raise RolloutError(f"{where} fill must be a finite number, not {fill!r}")
            by, modulo = (_number(e.get(key), f"{where} {key}") for key in ("by", "modulo"))
            edges.append(
                Feedback(
                    output=output,
                    input=_typed(e["input"], str, f"{where} input"),
                    mode=_typed(e.get("mode", "replace"), str, f"{where} mode"),
                    axis=_typed(e.get("axis", -1), int, f"{where} axis"),
                    fill=float(fill) if fill is not None else None,
                    length=_typed(e["length"], int, f"{where} length") if "length" in e else None,
                    by=by,
                    modulo=modulo,
                )
            )
        feedback = tuple(edges)
        fed = [e.input for e in feedback]
        again = next((i for i, name in enumerate(fed) if name in fed[:i]), None)
        if again is not None:  # before the trajectory's check, which would name a key the spec may not have
            raise RolloutError(
                f"[[feedback]] #{again + 1} feeds input '{fed[again]}', "
                f"which #{fed.index(fed[again]) + 1} already feeds; an input takes one edge"
            )
        if trajectory is None:  # each output once, even where it feeds two inputs
            trajectory = list(dict.fromkeys(e.output for e in feedback if e.output is not None))
        repeated = sorted({t for t in trajectory if trajectory.count(t) > 1})
        if repeated:
            raise RolloutError(f"`trajectory` lists {', '.join(repeated)} more than once")
        return cls(steps=steps, feedback=feedback, trajectory=tuple(trajectory), origin=str(data.get("origin", origin)))

    @classmethod
    def from_toml(cls, path: str | Path) -> "RolloutSpec":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise RolloutError(f"rollout spec {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise RolloutError(f"rollout spec {path} is not valid TOML: {exc}") from None
        try:
            return cls.from_dict(data)
        except RolloutError as exc:
            raise RolloutError(f"rollout spec {path}: {exc}") from None

    def to_toml(self, reasons: Mapping[str, str] | None = None) -> str:
        """TOML that `from_toml` reads back (written by tomli-w, which escapes any name); `reasons`
        (per input) become comments above their edge."""
        import tomli_w

        text = tomli_w.dumps({"steps": self.steps, "trajectory": list(self.trajectory)})
        for edge in self.feedback:
            fields = {"output": edge.output, "input": edge.input, "mode": edge.mode}
            if edge.mode == "shift":
                fields["axis"] = edge.axis
            fields.update(fill=edge.fill, length=edge.length, by=edge.by, modulo=edge.modulo)
            comment = (
                "".join(f"# {line}\n" for line in reasons[edge.input].splitlines())
                if reasons and edge.input in reasons
                else ""
            )
            text += "\n[[feedback]]\n" + comment + tomli_w.dumps({k: v for k, v in fields.items() if v is not None})
        return text

    def check(self, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec]) -> "CheckedSpec":
        """Fail with a clear message when the spec does not fit the model's signature; else the spec typed as
        checked, so that what runs it need not check it again."""
        ins = {s.name: s for s in inputs}
        outs = {s.name: s for s in outputs}
        self._check_names(ins, outs)
        for edge in self.feedback:
            self._check_edge(edge, ins, outs)
        if self.steps > 1 and not any(e.output is not None or e.mode == "advance" for e in self.feedback):
            raise RolloutError(
                f"the rollout feeds nothing back, so all {self.steps} steps would repeat step 1; "
                "a model without feedback is single-step: use steps = 1 (--steps 1)"
            )
        return CheckedSpec(steps=self.steps, feedback=self.feedback, trajectory=self.trajectory, origin=self.origin)

    def _check_names(self, ins: Mapping[str, IOSpec], outs: Mapping[str, IOSpec]) -> None:
        """Every name the spec gives is one of the model's inputs or outputs."""
        for edge in self.feedback:  # before the trajectory, which defaults to these outputs: name what the user wrote
            if edge.output is not None and edge.output not in outs:
                raise RolloutError(
                    f"feedback output '{edge.output}' is not a model output "
                    f"(outputs: {', '.join(outs)}){_guess(edge.output, outs)}"
                )
            if edge.input not in ins:
                raise RolloutError(
                    f"feedback input '{edge.input}' is not a model input "
                    f"(inputs: {', '.join(ins)}){_guess(edge.input, ins)}"
                )
        for name in self.trajectory:
            if name not in outs:
                raise RolloutError(
                    f"trajectory output '{name}' is not a model output (outputs: {', '.join(outs)}){_guess(name, outs)}"
                )

    def _check_edge(self, edge: Feedback, ins: Mapping[str, IOSpec], outs: Mapping[str, IOSpec]) -> None:
        """One edge's shapes: what it feeds fits the input it feeds, along the axis it shifts."""
        target = ins[edge.input].shape
        if edge.mode == "advance":
            _check_advance(edge, ins[edge.input])
            return
        if edge.mode == "shift" and not -len(target) <= edge.axis < len(target):
            raise RolloutError(
                f"feedback edge for input '{edge.input}' {shape_text(target)} shifts along axis {edge.axis}, "
                "which it does not have"
            )
        if edge.output is None:
            self._check_outputless(edge, ins)
            return
        source = outs[edge.output].shape
        if edge.mode == "shift" and len(source) != len(target):
            source = aligned_shape(source, target, edge.axis) or source
        if len(source) != len(target):
            raise RolloutError(
                f"output '{edge.output}' has rank {len(source)} but input '{edge.input}' has rank {len(target)}; "
                "they cannot feed each other"
            )
        skip = edge.axis % len(target) if edge.mode == "shift" else None
        for axis, (a, b) in enumerate(zip(source, target)):
            if axis != skip and isinstance(a, int) and isinstance(b, int) and a != b:
                raise RolloutError(
                    f"output '{edge.output}' {shape_text(source)} does not fit "
                    f"input '{edge.input}' {shape_text(target)} for mode '{edge.mode}' (axis {axis} differs)"
                )

    def _check_outputless(self, edge: Feedback, ins: Mapping[str, IOSpec]) -> None:
        """An edge without an output appends its fill: a length it fits, given or taken from a sibling shift edge."""
        target = ins[edge.input].shape
        _check_fill(edge, ins[edge.input])
        size = target[edge.axis] if edge.mode == "shift" and -len(target) <= edge.axis < len(target) else None
        if edge.length is not None and isinstance(size, int) and edge.length > size:
            raise RolloutError(
                f"feedback edge for input '{edge.input}' {shape_text(target)} appends {edge.length} entries per step "
                f"along axis {edge.axis}, which holds {size}"
            )
        if edge.length is None and not shift_siblings(
            self, edge, len(target), {e.input: ins[e.input].rank for e in self.feedback if e.input in ins}
        ):
            raise RolloutError(
                f"feedback edge for input '{edge.input}' has no output and no `length`, "
                "and no shift edge with an output moves an input of the same rank "
                f"along axis {edge.axis}; give `length` (entries appended per step)"
            )


@dataclass(frozen=True, eq=False)
class CheckedSpec(RolloutSpec):
    """A spec known to fit the signature of the model it rolls out (what `RolloutSpec.check` returns, in
    `resolve_spec`): a sweep's job takes only this, so its runners, workers and lanes trust it."""


def _check_advance(edge: "Feedback", spec: IOSpec) -> None:
    """An advanced input must hold numbers, and an integer one whole steps (0.5 h added to an int64 hour is 0)."""
    if spec.dtype.kind not in "iuf":
        raise RolloutError(
            f"feedback edge for input '{edge.input}' advances it, but it holds {spec.dtype}, not numbers"
        )
    if spec.dtype.kind in "iu" and any(v is not None and v != round(v) for v in (edge.by, edge.modulo)):
        raise RolloutError(
            f"feedback edge for input '{edge.input}' advances a {spec.dtype} input: "
            "`by` and `modulo` must be whole numbers"
        )


def _number(value, what: str) -> float | None:
    """A finite number from the spec (None when absent)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise RolloutError(f"`{what}` must be a finite number, not {value!r}")
    return float(value)


def _check_fill(edge: "Feedback", spec: IOSpec) -> None:
    """The fill must survive the cast to the input's type (1e40 is inf in float32; 0.5 is 0 in an int mask)."""
    if spec.dtype.kind == "f" and abs(edge.fill) > float(np.finfo(spec.dtype).max):
        raise RolloutError(
            f"feedback edge for input '{edge.input}' appends fill {edge.fill:g}, "
            f"beyond {spec.dtype}'s range, the input's type"
        )
    if spec.dtype.kind in "iub" and edge.fill != round(edge.fill):
        raise RolloutError(
            f"feedback edge for input '{edge.input}' appends fill {edge.fill:g} into a {spec.dtype} input; "
            "it must be a whole number"
        )


def _known_keys(data: Mapping, allowed: Sequence[str], where: str) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            guess = f"; did you mean '{close[0]}'?" if close else f" (known keys: {', '.join(allowed)})"
            raise RolloutError(f"unknown key '{key}' in {where}{guess}")


def _typed(value, kind: type, what: str):
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RolloutError(f"`{what}` must be {'an integer' if kind is int else 'a string'}, not {value!r}")
    return value


def shift_siblings(spec: RolloutSpec, edge: Feedback, rank: int, ranks: Mapping[str, int]) -> list[Feedback]:
    """The shift edges with an output that move an input of `edge`'s rank along the same axis."""
    axis = edge.axis % rank
    return [
        e
        for e in spec.feedback
        if e.output is not None and e.mode == "shift" and ranks.get(e.input) == rank and e.axis % rank == axis
    ]


def aligned_shape(output: Sequence, target: Sequence, axis: int) -> tuple | None:
    """An output's shape as a shift along `axis` of an input of shape `target` appends it: the same rank,
    one axis fewer (one entry along `axis`: a state into a history [B, 2, C, H, W]), or one singleton axis
    more, squeezed (a forecast [B, 24, 1] into a context [B, 96]). None when the ranks cannot meet."""
    output, rank = tuple(output), len(target)
    if len(output) == rank:
        return output
    if len(output) == rank - 1:
        at = axis % rank
        if same_but(output[:at] + (1,) + output[at:], tuple(target), axis):
            return output[:at] + (1,) + output[at:]
        for k in reversed(range(rank)):  # a forecast missing the input's singleton axis ([B, 24] into [B, 96, 1])
            if target[k] == 1 and k != at and same_but(output[:k] + (1,) + output[k:], tuple(target), axis):
                return output[:k] + (1,) + output[k:]
        return None
    if len(output) == rank + 1:
        for k in reversed(range(len(output))):
            squeezed = output[:k] + output[k + 1 :]
            if output[k] == 1 and same_but(squeezed, tuple(target), axis):
                return squeezed
    return None


def shape_text(shape) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


def same_but(a: tuple, b: tuple, axis: int) -> bool:
    """Two shapes of one rank that agree on every axis but `axis` (unknown dims agree with anything)."""
    if len(a) != len(b):
        return False
    skip = axis % len(a)
    return all(
        i == skip or x == y or not isinstance(x, int) or not isinstance(y, int) for i, (x, y) in enumerate(zip(a, b))
    )


def _guess(name: str, known) -> str:
    """'; did you mean 'x_next'?' for a near miss of a known name, else ''."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""
