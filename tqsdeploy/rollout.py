"""Rollout specs: how a one-step ONNX model becomes a dynamical system.

A spec says which output feeds which input at the next step (`replace`: the
output is the next state; `shift`: drop the oldest entries along an axis and
append the output; an edge without an output shifts a mask along with its
context, appending `fill`) and which outputs form the trajectory Y. Inputs
that receive no feedback stay constant. Without a spec, `detect_rollout`
pairs outputs with inputs from shapes and names; a model with nothing to
feed back is single-step (T = 1).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from runtimes import IOSpec, Session, kept
from tqsdeploy.errors import RolloutError

MODES = ("replace", "shift")
SPEC_KEYS = ("steps", "trajectory", "feedback", "origin")
EDGE_KEYS = ("output", "input", "mode", "axis", "fill", "length")
HINT = "write a rollout spec (TOML, see README 'Rollout specs') and pass it with --spec"


@dataclass(frozen=True)
class Feedback:
    """One output fed back into one input at every step.

    An edge without an output (`output=None`) shifts its input by the length
    the sibling shift edge appends (or `length`) and appends `fill`: a padding
    mask that moves with its context.
    """

    output: str | None
    input: str
    mode: str = "replace"
    axis: int = -1
    fill: float | None = None
    length: int | None = None

    def to_dict(self) -> dict:
        """Plain data; keys that are unset are left out (keeps old run fingerprints)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


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
        seen = set()
        for edge in self.feedback:
            if edge.mode not in MODES:
                raise RolloutError(f"feedback mode '{edge.mode}' is not one of {', '.join(MODES)}")
            if edge.input in seen:
                raise RolloutError(f"input '{edge.input}' is the target of two feedback edges")
            seen.add(edge.input)
            if edge.output is None:
                if edge.mode != "shift" or edge.fill is None:
                    raise RolloutError(f"feedback edge for input '{edge.input}' has no output, so it needs mode = \"shift\" and a `fill` value to append")
            elif edge.fill is not None or edge.length is not None:
                raise RolloutError(f"feedback edge '{edge.output}' → '{edge.input}' appends its output: `fill` and `length` only apply to edges without an output")
            if edge.length is not None and edge.length < 1:
                raise RolloutError(f"feedback edge for input '{edge.input}' has length {edge.length}; it must be at least 1")
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
        if trajectory is not None and (not isinstance(trajectory, list) or not all(isinstance(t, str) for t in trajectory)):
            raise RolloutError(f"`trajectory` must be a list of output names, e.g. trajectory = [\"y\"], not {trajectory!r}")
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
            edges.append(
                Feedback(
                    output=output,
                    input=_typed(e["input"], str, f"{where} input"),
                    mode=_typed(e.get("mode", "replace"), str, f"{where} mode"),
                    axis=_typed(e.get("axis", -1), int, f"{where} axis"),
                    fill=float(fill) if fill is not None else None,
                    length=_typed(e["length"], int, f"{where} length") if "length" in e else None,
                )
            )
        feedback = tuple(edges)
        if trajectory is None:
            trajectory = [e.output for e in feedback if e.output is not None]
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
            fields.update(fill=edge.fill, length=edge.length)
            comment = "".join(f"# {line}\n" for line in reasons[edge.input].splitlines()) if reasons and edge.input in reasons else ""
            text += "\n[[feedback]]\n" + comment + tomli_w.dumps({k: v for k, v in fields.items() if v is not None})
        return text

    def check(self, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec]) -> None:
        """Fail with a clear message when the spec does not fit the model's signature."""
        ins = {s.name: s for s in inputs}
        outs = {s.name: s for s in outputs}
        for name in self.trajectory:
            if name not in outs:
                raise RolloutError(f"trajectory output '{name}' is not a model output (outputs: {', '.join(outs)})")
        for edge in self.feedback:
            if edge.output is not None and edge.output not in outs:
                raise RolloutError(f"feedback output '{edge.output}' is not a model output (outputs: {', '.join(outs)})")
            if edge.input not in ins:
                raise RolloutError(f"feedback input '{edge.input}' is not a model input (inputs: {', '.join(ins)})")
            target = ins[edge.input].shape
            if edge.mode == "shift" and not -len(target) <= edge.axis < len(target):
                raise RolloutError(f"feedback edge for input '{edge.input}' {_fmt(target)} shifts along axis {edge.axis}, which it does not have")
            if edge.output is None:
                _check_fill(edge, ins[edge.input])
                size = target[edge.axis] if edge.mode == "shift" and -len(target) <= edge.axis < len(target) else None
                if edge.length is not None and isinstance(size, int) and edge.length > size:
                    raise RolloutError(f"feedback edge for input '{edge.input}' {_fmt(target)} appends {edge.length} entries per step along axis {edge.axis}, which holds {size}")
                if edge.length is None and not _siblings(self, edge, len(target), {e.input: ins[e.input].rank for e in self.feedback if e.input in ins}):
                    raise RolloutError(
                        f"feedback edge for input '{edge.input}' has no output and no `length`, and no shift edge with an output "
                        f"moves an input of the same rank along axis {edge.axis}; give `length` (entries appended per step)"
                    )
                continue
            source = outs[edge.output].shape
            if edge.mode == "shift" and len(source) != len(target):
                source = aligned_shape(source, target, edge.axis) or source
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
        if self.steps > 1 and not any(e.output is not None for e in self.feedback):
            raise RolloutError(
                f"the rollout feeds nothing back, so all {self.steps} steps would repeat step 1; a model without feedback is single-step: use steps = 1 (--steps 1)"
            )


def _check_fill(edge: "Feedback", spec: IOSpec) -> None:
    """The fill must survive the cast to the input's type (1e40 is inf in float32; 0.5 is 0 in an int mask)."""
    if spec.dtype.kind == "f" and abs(edge.fill) > float(np.finfo(spec.dtype).max):
        raise RolloutError(f"feedback edge for input '{edge.input}' appends fill {edge.fill:g}, beyond {spec.dtype}'s range, the input's type")
    if spec.dtype.kind in "iub" and edge.fill != round(edge.fill):
        raise RolloutError(f"feedback edge for input '{edge.input}' appends fill {edge.fill:g} into a {spec.dtype} input; it must be a whole number")


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


def _siblings(spec: RolloutSpec, edge: Feedback, rank: int, ranks: Mapping[str, int]) -> list[Feedback]:
    """The shift edges with an output that move an input of `edge`'s rank along the same axis."""
    axis = edge.axis % rank
    return [
        e for e in spec.feedback
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
        if _same_but(output[:at] + (1,) + output[at:], tuple(target), axis):
            return output[:at] + (1,) + output[at:]
        for k in reversed(range(rank)):  # a forecast missing the input's singleton axis ([B, 24] into [B, 96, 1])
            if target[k] == 1 and k != at and _same_but(output[:k] + (1,) + output[k:], tuple(target), axis):
                return output[:k] + (1,) + output[k:]
        return None
    if len(output) == rank + 1:
        for k in reversed(range(len(output))):
            squeezed = output[:k] + output[k + 1:]
            if output[k] == 1 and _same_but(squeezed, tuple(target), axis):
                return squeezed
    return None


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


# --- detection -------------------------------------------------------------

ROLE_WORDS = {"input", "inputs", "in", "output", "outputs", "out", "next", "new", "prev", "previous", "past", "current", "curr", "cur", "pred", "hat"}
FORECAST_WORDS = {"forecast", "forecasts", "point", "mean", "median", "prediction", "predictions", "pred", "y", "yhat"}
CONTEXT_WORDS = {"inputs", "input", "context", "past", "values", "x", "history", "series", "observations"}
MASK_WORDS = {"mask", "masks", "pad", "padding", "paddings", "padded"}
"""Names of padding/observation masks; 'observed' alone too, but not 'observed_data' (CSDI's series)."""
SERIES_WORDS = {"data", "values", "series", "target", "targets", "x", "input", "inputs"}
HIDDEN_WORDS = {"h", "c", "hn", "cn", "hidden", "cell", "carry", "present", "cache", "kv"}
"""Recurrent state (an RNN's h/c, a key-value cache): fed back, but not what is forecast. Only an edge whose
output and input share a stem made of these words (and 'state') counts: 'cell_temperature' is a forecast."""
STATIC_WORDS = {"land", "sea", "lsm", "orography", "topography", "soil", "lake", "static", "constant", "constants"}
"""Static fields that are masks by name (a land-sea mask), not padding that moves with the context."""
SIDE_OUTPUT_WORDS = {
    "quantile", "quantiles", "std", "stddev", "sigma", "var", "variance", "logvar", "scale", "lower", "upper", "interval",
    "prob", "probs", "probability", "logits", "uncertainty", "confidence", "attention", "attn",
}
"""Output names of heads that describe a forecast rather than continue it (quantiles, spreads, attention)."""
COVARIATE_WORDS = {
    "covariate", "covariates", "exog", "exogenous", "time", "timestamp", "timestamps", "calendar", "date", "dates", "mark",
    "static", "known", "forcing", "forcings",
}
"""Input names of what a forecaster is told about the horizon (time features, Informer's x_mark, forcings), not its state."""


def _tokens(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [t for t in re.split(r"[^a-z0-9]+", spaced.lower()) if t]


def _affinity(output: str, input: str) -> tuple[int, str]:
    """How strongly two names say they belong together (0-3), and why."""
    out_t, in_t = _tokens(output), _tokens(input)
    out_stem = [t for t in out_t if t not in ROLE_WORDS]
    in_stem = [t for t in in_t if t not in ROLE_WORDS]
    if out_stem and out_stem == in_stem:
        return 3, f"names share the stem '{'_'.join(out_stem)}'"
    if not out_stem and not in_stem:
        return 2, "names are output/input"
    if set(out_t) & FORECAST_WORDS and set(in_t) & CONTEXT_WORDS:
        return 2, "forecast-like output name, context-like input name"
    return 0, "names say nothing"


def _coincidental(output: str, input: str, affinity: int) -> bool:
    """A side head into an input, or an output into a covariate, without a stem in common: a shape that fits
    by coincidence (3 quantiles over the horizon and 3 time features) must not become the rollout."""
    return affinity < 3 and (_side_output(output) or _covariate(input))


def _side_output(name: str) -> bool:
    return bool(set(_tokens(name)) & SIDE_OUTPUT_WORDS)


def _covariate(name: str) -> bool:
    """Covariate words and no word that names a series ('time_features' and 'x_mark_enc', not 'time_series')."""
    tokens = set(_tokens(name))
    return bool(tokens & COVARIATE_WORDS) and not tokens & {"context", "history", "series", "observations"}


def mask_like(name: str) -> bool:
    """A padding/observation mask by name; such inputs move with their context instead of being fed."""
    tokens = set(_tokens(name))
    return bool(tokens & MASK_WORDS) or ("observed" in tokens and not tokens & SERIES_WORDS)


def mask_fill(name: str) -> float:
    """What a mask appends for a forecast entry: 1 where 1 means present (observed, Hugging Face's
    attention_mask: 1 = attend), else 0 (TimesFM's padding: 1 = padded)."""
    tokens = set(_tokens(name))
    return 1.0 if tokens & {"observed", "attention", "attend", "valid"} else 0.0


def _pairing(output: IOSpec, input: IOSpec) -> tuple[int, Feedback, str] | None:
    """Score and edge for feeding `output` into `input`, or None when the shapes cannot."""
    if output.rank == input.rank - 1:
        return _one_axis_fewer(output, input)
    if output.rank == input.rank + 1:  # a singleton axis more ([B, 24, 1] into [B, 96]): paired as squeezed
        for k in reversed(range(output.rank)):
            pair = _shift_as(output, output.shape[:k] + output.shape[k + 1:], input, f"once its singleton axis {k} is dropped") if output.shape[k] == 1 else None
            if pair is not None:
                return pair
        return None
    if output.rank != input.rank:
        return None
    both_ints = lambda a, b: isinstance(a, int) and isinstance(b, int)  # noqa: E731
    differing = [i for i, (a, b) in enumerate(zip(output.shape, input.shape)) if both_ints(a, b) and a != b]
    # a named length against a number or another name (seq_len vs 96, pred_len vs seq_len): lengths that may differ;
    # the batch axis aside (exporters name it per tensor), and unnamed dims agree with anything
    uncertain = [i for i, (a, b) in enumerate(zip(output.shape, input.shape)) if i > 0 and not both_ints(a, b) and None not in (a, b) and a != b]
    exact = all(a == b for i, (a, b) in enumerate(zip(output.shape, input.shape)) if i not in differing)
    affinity, why = _affinity(output.name, input.name)
    if _coincidental(output.name, input.name, affinity):
        return None
    if not differing and not uncertain:
        score, edge = 105, Feedback(output.name, input.name, "replace")
        reason = f"{_named(output)} has the shape of {_named(input)} → replace" if exact else f"{_named(output)} and {_named(input)} agree where known → replace"
    elif not differing and len(uncertain) == 1:
        if affinity < 2:  # a decoder's hidden state [B, dec_len, D] is not the next encoder memory [B, enc_len, D]
            return None
        axis = uncertain[0] - input.rank
        score, edge = 100, Feedback(output.name, input.name, "shift", axis)
        reason = f"{_named(output)} appends to {_named(input)} along axis {axis}, whose lengths may differ → shift"
    elif len(differing) == 1 and not uncertain and output.shape[differing[0]] < input.shape[differing[0]]:
        axis = differing[0] - input.rank
        score, edge = 100, Feedback(output.name, input.name, "shift", axis)
        reason = f"{_named(output)} appends to {_named(input)} along axis {axis} ({output.shape[differing[0]]} < {input.shape[differing[0]]}) → shift"
    else:
        return None
    return score + (1 if exact else 0) + affinity, edge, f"{reason}; {why}"


def _named(spec: IOSpec) -> str:
    """A tensor in a reason: its name and shape, so a line keyed by the input never shows the output's shape as the input's."""
    return f"'{spec.name}' {_fmt(spec.shape)}"


def _matches_but(a: tuple, b: tuple, axis: int) -> bool:
    """Shapes equal on every axis but `axis`: the same numbers or the same names (unnamed dims and the batch
    axis agree with anything). Stricter than `_same_but`: a name never matches a number."""
    return len(a) == len(b) and all(
        i == axis % len(a) or x == y or x is None or y is None or (i == 0 and not (isinstance(x, int) and isinstance(y, int)))
        for i, (x, y) in enumerate(zip(a, b))
    )


def _one_axis_fewer(output: IOSpec, input: IOSpec) -> tuple[int, Feedback, str] | None:
    """An output with one axis fewer than its input: one entry of a history ([B, C, H, W] into [B, 2, C, H, W];
    [B, 7] into [B, seq, 7]) along the one axis it fits, or a forecast missing the input's singleton axis
    ([B, 24] into [B, 96, 1])."""
    affinity, why = _affinity(output.name, input.name)
    if _coincidental(output.name, input.name, affinity):
        return None
    fits = [i for i in range(1, input.rank)
            if input.shape[i] != 1 and _matches_but(output.shape[:i] + (1,) + output.shape[i:], input.shape, i)]
    if len(fits) == 1:
        axis = fits[0] - input.rank
        reason = f"{_named(output)} is one entry of the history {_named(input)} along axis {axis} → shift"
        return 100 + affinity, Feedback(output.name, input.name, "shift", axis), f"{reason}; {why}"
    for k in reversed(range(1, input.rank)):
        pair = _shift_as(output, output.shape[:k] + (1,) + output.shape[k:], input, f"with the input's singleton axis {k} added") if input.shape[k] == 1 else None
        if pair is not None:
            return pair
    return None


def _shift_as(output: IOSpec, shape: tuple, input: IOSpec, how: str) -> tuple[int, Feedback, str] | None:
    """The pairing of `output` read as `shape` (one singleton axis added or dropped), when it is a shift."""
    pair = _pairing(IOSpec(output.name, shape, output.dtype), input)
    if pair is None or pair[1].mode != "shift":
        return None
    return pair[0], pair[1], pair[2].replace(" → shift", f" {how} → shift", 1)


def _best_assignments(options: list[list[tuple[int, int, Feedback, str]]], limit: int = 4) -> tuple[int, list[list]]:
    """Exact maximum-score matching of outputs to inputs (each input fed at most once).

    `options[k]` lists (score, input index, edge, reason) for output k; an
    output may also feed nothing (score 0). Returns the best total and up to
    `limit` distinct assignments reaching it (more than one = ambiguous).
    Memoised over (output, used inputs): exact and small for real signatures.
    """
    memo: dict[tuple[int, int], tuple[int, list[list]]] = {}

    def best(k: int, used: int) -> tuple[int, list[list]]:
        if k == len(options):
            return 0, [[]]
        if (k, used) in memo:
            return memo[(k, used)]
        top, ways = best(k + 1, used)
        for score, index, edge, reason in options[k]:
            if used >> index & 1:
                continue
            rest, rest_ways = best(k + 1, used | 1 << index)
            if score + rest > top:
                top, ways = score + rest, []
            if score + rest == top:
                ways = ways + [[(edge, reason)] + w for w in rest_ways]
        memo[(k, used)] = top, ways[: limit + 1]
        return memo[(k, used)]

    total, ways = best(0, 0)
    return total, ways[:limit]


@dataclass(frozen=True)
class Detection:
    """A detected rollout and why: the reason for each fed input, what stays out."""

    spec: RolloutSpec
    reasons: dict[str, str]
    """Per fed input, why it is paired the way it is."""
    unused_outputs: tuple[str, ...]
    """Float outputs that feed nothing and stay out of the trajectory (quantile heads, hidden states)."""
    constant_inputs: tuple[str, ...]
    """Inputs that receive nothing and stay constant (forcings, static features, int ids)."""

    @property
    def single_step(self) -> bool:
        return not self.spec.feedback


class AmbiguousRollout(RolloutError):
    """Two or more pairings are equally good; carries them so `inspect --emit-spec` can write them."""

    def __init__(self, message: str, candidates: Sequence[Detection]):
        super().__init__(message)
        self.candidates = list(candidates)


def detect_rollout(inputs: Sequence[IOSpec], outputs: Sequence[IOSpec], steps: int | None = None, default_steps: int = 8) -> Detection:
    """Pair float outputs with the inputs they feed, from shapes and names.

    Same shape → replace; same dims but a shorter length on one axis → shift.
    The pairing maximises the total score (shape fit, then name affinity);
    masks move with the context they pad (input-only shift edge; fill 0 =
    observed under TimesFM's 1 = padded convention, fill 1 for names with
    'observed'). No feedable pair: a single-step model, T = 1, trajectory =
    every float output. Raises AmbiguousRollout when two pairings tie.
    """
    floats_out = [s for s in outputs if s.dtype.kind == "f"]
    if not floats_out:
        raise RolloutError(f"cannot detect the rollout: the model has no float outputs (outputs: {', '.join(s.name for s in outputs)})", hint=HINT)
    targets = [s for s in inputs if s.dtype.kind == "f" and not mask_like(s.name)]
    if len(targets) > 16:  # the exact matcher walks subsets of inputs
        raise RolloutError(f"cannot detect the rollout: {len(targets)} float inputs are too many to pair by shape", hint=HINT)
    options = []
    for output in floats_out:
        found = []
        for index, target in enumerate(targets):
            pair = _pairing(output, target)
            if pair is not None:
                found.append((pair[0], index, pair[1], pair[2]))
        options.append(found)
    _, ways = _best_assignments(options)
    candidates = [_complete(chosen, inputs, floats_out, steps, default_steps) for chosen in ways]
    doubt = _doubtful_shift(candidates[0], inputs, outputs) if len(candidates) == 1 else None
    if doubt:
        raise AmbiguousRollout(
            f"cannot detect the rollout: {doubt}; if that is the rollout, copy it into rollout.toml and pass --spec rollout.toml, "
            f"else write the spec that is (run 'tqsdeploy inspect MODEL --emit-spec rollout.toml'):\n# --- candidate 1 ---\n{candidates[0].spec.to_toml(candidates[0].reasons)}",
            candidates,
        )
    if len(candidates) > 1:
        blocks = "\n".join(f"# --- candidate {i} ---\n{c.spec.to_toml(c.reasons)}" for i, c in enumerate(candidates, 1))
        raise AmbiguousRollout(
            f"cannot detect the rollout: {len(candidates)} pairings of outputs to inputs fit equally well; "
            f"copy one of these into rollout.toml and pass --spec rollout.toml (or run 'tqsdeploy inspect MODEL --emit-spec rollout.toml'):\n{blocks}",
            candidates,
        )
    return candidates[0]


def _complete(chosen: list[tuple[Feedback, str]], inputs: Sequence[IOSpec], floats_out: Sequence[IOSpec], steps: int | None, default_steps: int) -> Detection:
    """A Detection from the chosen output edges: add mask edges, trajectory, steps."""
    edges = [edge for edge, _ in chosen]
    reasons = {edge.input: reason for edge, reason in chosen}
    shapes = {s.name: s.shape for s in inputs}
    shifted = [e for e in edges if e.mode == "shift"]
    for spec in inputs:
        tokens = set(_tokens(spec.name))
        masked = mask_like(spec.name) or (spec.dtype.kind == "b" and "observed" in tokens)  # Moirai's bool past_observed_target
        if spec.name in reasons or spec.dtype.kind not in "fiub" or not masked or tokens & STATIC_WORDS:
            continue
        fitting = [e for e in shifted if _same_but(shapes[e.input], spec.shape, e.axis) and _covers(spec.shape, shapes[e.input], e.axis)]
        if len({e.axis for e in fitting}) == 1:
            fill, partner = mask_fill(spec.name), fitting[0]
            edges.append(Feedback(None, spec.name, "shift", partner.axis, fill=fill))
            meaning = "1 = observed or attended: observed masks, Hugging Face's attention_mask" if fill else "1 = padded (TimesFM), so 0 = observed"
            size = "same shape as" if shapes[partner.input] == spec.shape else f"shaped like (but for axis {partner.axis})"
            reasons[spec.name] = f"mask-like name, {size} '{partner.input}': shifts with it, appending {fill!r} ({meaning}); edit fill if your mask means the opposite"
    if edges:
        fed = tuple(e.output for e, _ in chosen)
        recurrent = {e.output for e, _ in chosen if _recurrent(e)}
        forecast = tuple(name for name in fed if name not in recurrent)
        trajectory = forecast or fed  # recurrent state is fed back but is not the forecast
        spec = RolloutSpec(steps=steps or default_steps, feedback=tuple(edges), trajectory=trajectory, origin="detected")
    else:
        if steps not in (None, 1):
            raise RolloutError(
                f"the model is single-step (no float output can feed an input), so --steps {steps} would repeat the same step; use --steps 1 or a spec",
                hint=HINT,
            )
        spec = RolloutSpec(steps=1, feedback=(), trajectory=tuple(s.name for s in floats_out), origin="detected")
    fed_outputs = {e.output for e in edges}
    return Detection(
        spec=spec,
        reasons=reasons,
        unused_outputs=tuple(s.name for s in floats_out if s.name not in fed_outputs) if edges else (),
        constant_inputs=tuple(s.name for s in inputs if s.name not in reasons),
    )


def _recurrent(edge: Feedback) -> bool:
    """An edge carrying recurrent state: output and input share a stem of state words (h_out → h_in,
    hidden_state_out → hidden_state_in), as opposed to a forecast variable fed back."""
    out_stem = [t for t in _tokens(edge.output or "") if t not in ROLE_WORDS]
    in_stem = [t for t in _tokens(edge.input) if t not in ROLE_WORDS]
    return bool(out_stem) and out_stem == in_stem and bool(set(out_stem) & HIDDEN_WORDS) and set(out_stem) <= HIDDEN_WORDS | {"state", "states"}


def _covers(mask: tuple, context: tuple, axis: int) -> bool:
    """A mask at least as long as its context along the shift axis (TimesFM's padding spans context and horizon);
    a one-entry 'mask' beside a multi-frame history is a static field."""
    have, need = mask[axis], context[axis]
    return not (isinstance(have, int) and isinstance(need, int)) or have >= need


def _same_but(a: tuple, b: tuple, axis: int) -> bool:
    """Two shapes of one rank that agree on every axis but `axis` (unknown dims agree with anything)."""
    if len(a) != len(b):
        return False
    skip = axis % len(a)
    return all(i == skip or x == y or not isinstance(x, int) or not isinstance(y, int) for i, (x, y) in enumerate(zip(a, b)))


def _doubtful_shift(detection: Detection, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec]) -> str | None:
    """Why a detected shift looks like a coincidence: an output that would replace more than half of its input
    along the axis each step. A state stacked with forcings or static fields ([B, 6, H, W] in, [B, 4, H, W]
    out) has that shape; a history or a context window takes at most half of itself per step."""
    ins, outs = {s.name: s.shape for s in inputs}, {s.name: s.shape for s in outputs}
    for edge in detection.spec.feedback:
        if edge.output is None or edge.mode != "shift":
            continue
        aligned = aligned_shape(outs[edge.output], ins[edge.input], edge.axis)
        if aligned is None:
            continue
        have, put = ins[edge.input][edge.axis], aligned[edge.axis]
        if isinstance(have, int) and isinstance(put, int) and 2 * put > have:
            return (
                f"output '{edge.output}' {_fmt(outs[edge.output])} would shift into input '{edge.input}' {_fmt(ins[edge.input])} along axis {edge.axis}, "
                f"replacing {put} of its {have} entries every step: more like a state with extra channels (forcings, static fields) than a history"
            )
    return None


def detect(inputs: Sequence[IOSpec], outputs: Sequence[IOSpec], steps: int | None = None, default_steps: int = 8) -> RolloutSpec:
    """The detected spec alone (see `detect_rollout`)."""
    return detect_rollout(inputs, outputs, steps, default_steps).spec


def next_feeds(feeds: Mapping[str, np.ndarray], produced: Mapping[str, np.ndarray], spec: RolloutSpec) -> dict[str, np.ndarray]:
    """The inputs of the next step, given this step's inputs and outputs."""
    new = dict(feeds)
    appended: dict[str, int] = {}
    for edge in spec.feedback:
        if edge.output is None:
            continue
        current, output = feeds[edge.input], produced[edge.output]
        if edge.mode == "replace":
            if output.shape != current.shape:
                raise RolloutError(
                    f"output '{edge.output}' has shape {list(output.shape)} but input '{edge.input}' has shape {list(current.shape)}; mode 'replace' needs equal shapes"
                )
            new[edge.input] = output.astype(current.dtype, copy=False)
            continue
        axis = edge.axis % current.ndim
        aligned = aligned_shape(output.shape, current.shape, edge.axis) if output.ndim != current.ndim else None
        if aligned is not None:
            output = output.reshape(aligned)
        if output.ndim != current.ndim or any(o != c for i, (o, c) in enumerate(zip(output.shape, current.shape)) if i != axis):
            raise RolloutError(
                f"output '{edge.output}' of shape {list(output.shape)} cannot be appended to input '{edge.input}' of shape {list(current.shape)} along axis {edge.axis}"
            )
        appended[edge.input] = output.shape[axis]
        new[edge.input] = _shifted(current, output.astype(current.dtype, copy=False), axis)
    for edge in spec.feedback:
        if edge.output is not None:
            continue
        current = feeds[edge.input]
        axis = edge.axis % current.ndim
        length = edge.length
        if length is None:
            lengths = {appended[e.input] for e in _siblings(spec, edge, current.ndim, {k: np.ndim(v) for k, v in feeds.items()})}
            if len(lengths) != 1:
                raise RolloutError(
                    f"feedback edge for input '{edge.input}' takes its shift length from its sibling shift edges, which append {sorted(lengths) or 'nothing'}; give `length`"
                )
            length = lengths.pop()
        shape = list(current.shape)
        shape[axis] = length
        new[edge.input] = _shifted(current, np.full(shape, edge.fill, current.dtype), axis)
    return new


def _shifted(current: np.ndarray, appended: np.ndarray, axis: int) -> np.ndarray:
    """`current` with `appended` added at the end of `axis` and as many oldest entries dropped."""
    length = current.shape[axis]
    joined = np.concatenate([current, appended], axis=axis)
    return np.take(joined, np.arange(joined.shape[axis] - length, joined.shape[axis]), axis=axis)


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
    extra = dict(kept(session, weights)) if weights else {}  # on a GPU: copied to the device once, not every step
    names = spec.run_outputs
    total = steps or spec.steps
    for step in range(total):
        produced = session.run({**state, **extra}, names)
        yield {name: produced[name] for name in spec.trajectory}
        if step + 1 < total:  # no feedback after the last step: it would only fail or cost
            state = next_feeds(state, produced, spec)
