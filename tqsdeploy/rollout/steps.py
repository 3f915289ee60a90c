"""Rollout stepping: run a one-step model autoregressively, feeding outputs back as the spec says."""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from runtimes import Session, kept
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout.spec import RolloutSpec, aligned_shape, shift_siblings


def next_feeds(
    feeds: Mapping[str, np.ndarray], produced: Mapping[str, np.ndarray], spec: RolloutSpec
) -> dict[str, np.ndarray]:
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
                    f"output '{edge.output}' has shape {list(output.shape)} "
                    f"but input '{edge.input}' has shape {list(current.shape)}; mode 'replace' needs equal shapes"
                )
            new[edge.input] = output.astype(current.dtype, copy=False)
            continue
        axis = edge.axis % current.ndim
        aligned = aligned_shape(output.shape, current.shape, edge.axis) if output.ndim != current.ndim else None
        if aligned is not None:
            output = output.reshape(aligned)
        if output.ndim != current.ndim or any(
            o != c for i, (o, c) in enumerate(zip(output.shape, current.shape)) if i != axis
        ):
            raise RolloutError(
                f"output '{edge.output}' of shape {list(output.shape)} cannot be appended to "
                f"input '{edge.input}' of shape {list(current.shape)} along axis {edge.axis}"
            )
        appended[edge.input] = output.shape[axis]
        new[edge.input] = _shifted(current, output.astype(current.dtype, copy=False), axis)
    for edge in spec.feedback:
        if edge.output is not None:
            continue
        current = feeds[edge.input]
        if edge.mode == "advance":
            moved = current + (int(edge.by) if current.dtype.kind in "iu" else edge.by)
            new[edge.input] = (
                np.mod(moved, int(edge.modulo) if current.dtype.kind in "iu" else edge.modulo) if edge.modulo else moved
            ).astype(current.dtype, copy=False)
            continue
        axis = edge.axis % current.ndim
        length = edge.length
        if length is None:
            lengths = {
                appended[e.input]
                for e in shift_siblings(spec, edge, current.ndim, {k: np.ndim(v) for k, v in feeds.items()})
            }
            if len(lengths) != 1:
                raise RolloutError(
                    f"feedback edge for input '{edge.input}' takes its shift length from its sibling shift edges, "
                    f"which append {sorted(lengths) or 'nothing'}; give `length`"
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
