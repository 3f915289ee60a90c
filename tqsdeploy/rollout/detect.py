"""Rollout detection: pair a model's outputs with the inputs they feed, from shapes and names.

Used when no spec is given; a model with nothing to feed back is single-step (T = 1).
Ambiguous pairings are refused with every candidate written as a spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from runtimes import IOSpec
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout.spec import Feedback, RolloutSpec, aligned_shape, same_but, shape_text

HINT = "write a rollout spec (TOML, see README 'Rollout specs') and pass it with --spec"

ROLE_WORDS = {
    "input",
    "inputs",
    "in",
    "output",
    "outputs",
    "out",
    "next",
    "new",
    "prev",
    "previous",
    "past",
    "current",
    "curr",
    "cur",
    "pred",
    "hat",
}
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
    "quantile",
    "quantiles",
    "std",
    "stddev",
    "sigma",
    "var",
    "variance",
    "logvar",
    "scale",
    "lower",
    "upper",
    "interval",
    "prob",
    "probs",
    "probability",
    "logits",
    "uncertainty",
    "confidence",
    "attention",
    "attn",
}
"""Output names of heads that describe a forecast rather than continue it (quantiles, spreads, attention)."""
COVARIATE_WORDS = {
    "covariate",
    "covariates",
    "exog",
    "exogenous",
    "time",
    "timestamp",
    "timestamps",
    "calendar",
    "date",
    "dates",
    "mark",
    "static",
    "known",
    "forcing",
    "forcings",
}
"""Input names of what a forecaster is told about the horizon (time features, Informer's x_mark, forcings), not its
state."""


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
            pair = (
                _shift_as(
                    output, output.shape[:k] + output.shape[k + 1 :], input, f"once its singleton axis {k} is dropped"
                )
                if output.shape[k] == 1
                else None
            )
            if pair is not None:
                return pair
        return None
    if output.rank != input.rank:
        return None

    def both_ints(a, b) -> bool:
        return isinstance(a, int) and isinstance(b, int)

    differing = [i for i, (a, b) in enumerate(zip(output.shape, input.shape)) if both_ints(a, b) and a != b]
    # a named length against a number or another name (seq_len vs 96, pred_len vs seq_len): lengths that may differ;
    # the batch axis aside (exporters name it per tensor), and unnamed dims agree with anything
    uncertain = [
        i
        for i, (a, b) in enumerate(zip(output.shape, input.shape))
        if i > 0 and not both_ints(a, b) and None not in (a, b) and a != b
    ]
    exact = all(a == b for i, (a, b) in enumerate(zip(output.shape, input.shape)) if i not in differing)
    affinity, why = _affinity(output.name, input.name)
    if _coincidental(output.name, input.name, affinity):
        return None
    if not differing and not uncertain:
        score, edge = 105, Feedback(output.name, input.name, "replace")
        reason = (
            f"{_named(output)} has the shape of {_named(input)} → replace"
            if exact
            else f"{_named(output)} and {_named(input)} agree where known → replace"
        )
    elif not differing and len(uncertain) == 1:
        if affinity < 2:  # a decoder's hidden state [B, dec_len, D] is not the next encoder memory [B, enc_len, D]
            return None
        axis = uncertain[0] - input.rank
        score, edge = 100, Feedback(output.name, input.name, "shift", axis)
        reason = f"{_named(output)} appends to {_named(input)} along axis {axis}, whose lengths may differ → shift"
    elif len(differing) == 1 and not uncertain and output.shape[differing[0]] < input.shape[differing[0]]:
        axis = differing[0] - input.rank
        score, edge = 100, Feedback(output.name, input.name, "shift", axis)
        reason = (
            f"{_named(output)} appends to {_named(input)} along axis {axis} "
            f"({output.shape[differing[0]]} < {input.shape[differing[0]]}) → shift"
        )
    else:
        return None
    return score + (1 if exact else 0) + affinity, edge, f"{reason}; {why}"


def _named(spec: IOSpec) -> str:
    """A tensor in a reason: its name and shape, so a line keyed by the input never shows the output's shape as the
    input's."""
    return f"'{spec.name}' {shape_text(spec.shape)}"


def _matches_but(a: tuple, b: tuple, axis: int) -> bool:
    """Shapes equal on every axis but `axis`: the same numbers or the same names (unnamed dims and the batch
    axis agree with anything). Stricter than `same_but`: a name never matches a number."""
    return len(a) == len(b) and all(
        i == axis % len(a)
        or x == y
        or x is None
        or y is None
        or (i == 0 and not (isinstance(x, int) and isinstance(y, int)))
        for i, (x, y) in enumerate(zip(a, b))
    )


def _one_axis_fewer(output: IOSpec, input: IOSpec) -> tuple[int, Feedback, str] | None:
    """An output with one axis fewer than its input: one entry of a history ([B, C, H, W] into [B, 2, C, H, W];
    [B, 7] into [B, seq, 7]) along the one axis it fits, or a forecast missing the input's singleton axis
    ([B, 24] into [B, 96, 1])."""
    affinity, why = _affinity(output.name, input.name)
    if _coincidental(output.name, input.name, affinity):
        return None
    fits = [
        i
        for i in range(1, input.rank)
        if input.shape[i] != 1 and _matches_but(output.shape[:i] + (1,) + output.shape[i:], input.shape, i)
    ]
    if len(fits) == 1:
        axis = fits[0] - input.rank
        reason = f"{_named(output)} is one entry of the history {_named(input)} along axis {axis} → shift"
        return 100 + affinity, Feedback(output.name, input.name, "shift", axis), f"{reason}; {why}"
    for k in reversed(range(1, input.rank)):
        pair = (
            _shift_as(
                output, output.shape[:k] + (1,) + output.shape[k:], input, f"with the input's singleton axis {k} added"
            )
            if input.shape[k] == 1
            else None
        )
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


def detect_rollout(
    inputs: Sequence[IOSpec], outputs: Sequence[IOSpec], steps: int | None = None, default_steps: int = 8
) -> Detection:
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
        raise RolloutError(
            "cannot detect the rollout: the model has no float outputs "
            f"(outputs: {', '.join(s.name for s in outputs)})",
            hint=HINT,
        )
    targets = [s for s in inputs if s.dtype.kind == "f" and not mask_like(s.name)]
    if len(targets) > 16:  # the exact matcher walks subsets of inputs
        raise RolloutError(
            f"cannot detect the rollout: {len(targets)} float inputs are too many to pair by shape", hint=HINT
        )
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
            f"cannot detect the rollout: {doubt}; "
            "if that is the rollout, copy it into rollout.toml and pass --spec rollout.toml, "
            "else write the spec that is (run 'tqsdeploy inspect MODEL --emit-spec rollout.toml'):\n"
            f"# --- candidate 1 ---\n{candidates[0].spec.to_toml(candidates[0].reasons)}",
            candidates,
        )
    if len(candidates) > 1:
        blocks = "\n".join(f"# --- candidate {i} ---\n{c.spec.to_toml(c.reasons)}" for i, c in enumerate(candidates, 1))
        raise AmbiguousRollout(
            f"cannot detect the rollout: {len(candidates)} pairings of outputs to inputs fit equally well; "
            "copy one of these into rollout.toml and pass --spec rollout.toml "
            f"(or run 'tqsdeploy inspect MODEL --emit-spec rollout.toml'):\n{blocks}",
            candidates,
        )
    return candidates[0]


def _complete(
    chosen: list[tuple[Feedback, str]],
    inputs: Sequence[IOSpec],
    floats_out: Sequence[IOSpec],
    steps: int | None,
    default_steps: int,
) -> Detection:
    """A Detection from the chosen output edges: add mask edges, trajectory, steps."""
    edges = [edge for edge, _ in chosen]
    reasons = {edge.input: reason for edge, reason in chosen}
    for edge, reason in _mask_edges(inputs, edges, reasons):
        edges.append(edge)
        reasons[edge.input] = reason
    if edges:
        fed = tuple(e.output for e, _ in chosen)
        recurrent = {e.output for e, _ in chosen if _recurrent(e)}
        forecast = tuple(name for name in fed if name not in recurrent)
        trajectory = forecast or fed  # recurrent state is fed back but is not the forecast
        spec = RolloutSpec(
            steps=steps or default_steps, feedback=tuple(edges), trajectory=trajectory, origin="detected"
        )
    else:
        if steps not in (None, 1):
            raise RolloutError(
                "the model is single-step (no float output can feed an input), "
                f"so --steps {steps} would repeat the same step; use --steps 1 or a spec",
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


def _mask_edges(
    inputs: Sequence[IOSpec], edges: Sequence[Feedback], reasons: dict[str, str]
) -> list[tuple[Feedback, str]]:
    """An edge and its reason for each mask-like input no edge feeds that moves with one shift edge's input."""
    shapes = {s.name: s.shape for s in inputs}
    shifted = [e for e in edges if e.mode == "shift"]
    found = []
    for spec in inputs:
        tokens = set(_tokens(spec.name))
        masked = mask_like(spec.name) or (
            spec.dtype.kind == "b" and "observed" in tokens
        )  # Moirai's bool past_observed_target
        if spec.name in reasons or spec.dtype.kind not in "fiub" or not masked or tokens & STATIC_WORDS:
            continue
        fitting = [
            e
            for e in shifted
            if same_but(shapes[e.input], spec.shape, e.axis) and _covers(spec.shape, shapes[e.input], e.axis)
        ]
        if len({e.axis for e in fitting}) == 1:
            fill, partner = mask_fill(spec.name), fitting[0]
            meaning = (
                "1 = observed or attended: observed masks, Hugging Face's attention_mask"
                if fill
                else "1 = padded (TimesFM), so 0 = observed"
            )
            size = (
                "same shape as" if shapes[partner.input] == spec.shape else f"shaped like (but for axis {partner.axis})"
            )
            reason = (
                f"mask-like name, {size} '{partner.input}': shifts with it, appending {fill!r} ({meaning}); "
                "edit fill if your mask means the opposite"
            )
            found.append((Feedback(None, spec.name, "shift", partner.axis, fill=fill), reason))
    return found


def _recurrent(edge: Feedback) -> bool:
    """An edge carrying recurrent state: output and input share a stem of state words (h_out → h_in,
    hidden_state_out → hidden_state_in), as opposed to a forecast variable fed back."""
    out_stem = [t for t in _tokens(edge.output or "") if t not in ROLE_WORDS]
    in_stem = [t for t in _tokens(edge.input) if t not in ROLE_WORDS]
    return (
        bool(out_stem)
        and out_stem == in_stem
        and bool(set(out_stem) & HIDDEN_WORDS)
        and set(out_stem) <= HIDDEN_WORDS | {"state", "states"}
    )


def _covers(mask: tuple, context: tuple, axis: int) -> bool:
    """A mask at least as long as its context along the shift axis (TimesFM's padding spans context and horizon);
    a one-entry 'mask' beside a multi-frame history is a static field."""
    have, need = mask[axis], context[axis]
    return not (isinstance(have, int) and isinstance(need, int)) or have >= need


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
                f"output '{edge.output}' {shape_text(outs[edge.output])} would shift into "
                f"input '{edge.input}' {shape_text(ins[edge.input])} along axis {edge.axis}, "
                f"replacing {put} of its {have} entries every step: "
                "more like a state with extra channels (forcings, static fields) than a history"
            )
    return None


def detect(
    inputs: Sequence[IOSpec], outputs: Sequence[IOSpec], steps: int | None = None, default_steps: int = 8
) -> RolloutSpec:
    """The detected spec alone (see `detect_rollout`)."""
    return detect_rollout(inputs, outputs, steps, default_steps).spec
