"""Whether a model's probes can share one batched rollout ('batch'), checked once for auto and the sweep."""

from __future__ import annotations

import numpy as np

from runtimes import IOSpec, Session
from tqsdeploy.rollout import rollout
from tqsdeploy.sweep.job import SweepJob
from tqsdeploy.units import Unit

BATCH_RTOL = 1e-4
"""How far (relative to the output's scale) a probe-batched run may stray from the unbatched one (float32)."""


def tiled(feeds: dict[str, np.ndarray], probes: int) -> dict[str, np.ndarray]:
    """Every input repeated `probes` times along its batch axis, probe-major (what `graph_ops.batch` expects)."""
    return {name: np.concatenate([value] * probes) for name, value in feeds.items()}


class BatchCheck:
    """Whether batching a model's probes keeps its results (the unbatched reference rollout is made once)."""

    def __init__(self, job: SweepJob, inputs: list[IOSpec]):
        self.job, self.inputs = job, inputs
        self.reference: tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]] | None = None
        """One window's feeds and the constant session's unbatched rollout of them (a few steps)."""

    @property
    def width(self) -> int:
        """Slots of a probe-batched call: the nominal weights, then each of a unit's probes."""
        return max(1, self.job.tasks_per_unit) + 1

    def refusal(self) -> str | None:
        """Why this model's probes cannot be batched at all, or None."""
        if not hasattr(self.job.rebuild_factory, "batched"):
            return "the model is swept from a file, not rebuilt in memory"
        static = next((s for s in self.inputs if s.rank == 0 or not s.is_dynamic(0)), None)
        if static is not None:
            return f"input '{static.name}' {list(static.shape)} has no dynamic batch axis to tile the probes along"
        return None

    def mismatch(self, unit: Unit, session: Session, constant: Session) -> str | None:
        """Why batching this unit's probes would change its results, or None.

        One window, tiled once per probe, rolled out a few steps with probe 0 nominal and the others
        perturbed as strongly as the weights are large: probe 0's rows must match the constant
        session's unbatched run. An op that mixes rows across the batch (a reduction over it, a
        reshape folding it into another axis) leaks the other probes into probe 0 and fails this.
        """
        job, probes = self.job, self.width
        if self.reference is None:
            feeds = next(iter(job.contexts.chunks(self.inputs, True, 1)))[1]
            self.reference = (feeds, list(rollout(constant, feeds, job.spec, steps=min(job.spec.steps, 3))))
        feeds, reference = self.reference
        rng = np.random.default_rng(0)
        weights = {}
        for name in unit.tensor_names:
            w = job.weights[name]
            rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64)))) or 1.0
            noise = rng.standard_normal((probes - 1, *w.shape), dtype=np.float32) * np.float32(rms)
            weights[name] = np.concatenate([w[None], (w[None] + noise).astype(w.dtype)])
        try:
            produced = list(rollout(session, tiled(feeds, probes), job.spec, weights, steps=len(reference)))
        except Exception as exc:
            return f"unit '{unit.name}': the batched model fails to run: {str(exc).splitlines()[0]}"
        for t, (outs, expected) in enumerate(zip(produced, reference), start=1):
            for name in job.spec.trajectory:
                got, want = np.asarray(outs[name]), np.asarray(expected[name], np.float64)
                if got.ndim == 0 or got.shape[0] % probes or got.size != probes * want.size:
                    return (
                        f"unit '{unit.name}': batched output '{name}' {list(got.shape)} does not keep the probes' batch"
                    )
                got = got.reshape(probes, -1)[0].astype(np.float64)
                scale = float(np.abs(want).max(initial=0.0))
                rtol = (
                    max(BATCH_RTOL, 10 * float(np.finfo(outs[name].dtype).eps))
                    if np.issubdtype(outs[name].dtype, np.floating)
                    else 0.0
                )
                error = float(np.abs(got - want.reshape(-1)).max(initial=0.0))
                if not error <= rtol * max(scale, 1e-30):
                    return (
                        f"unit '{unit.name}': batched output '{name}' at step {t} "
                        f"differs from the unbatched run by {error:.3g} "
                        f"(output scale {scale:.3g}): an op mixes rows across the batch"
                    )
        return None
