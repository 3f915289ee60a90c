"""The numbers `eval` reports for one output: errors against the reference and the truth, their 95% intervals over
context windows, error growth per step, and for outputs read as vectors their cosine and nearest neighbours.

Arrays are shaped (windows, steps, ...): windows are the unit the intervals resample, since one window's steps are
not independent of each other.
"""

from __future__ import annotations

import re

import numpy as np

EMBEDDING_NAME = re.compile(r"embed|pool|sentence|hidden_state", re.IGNORECASE)
"""Output names that say their values are vectors: embedding(s), pooled/pooler_output, sentence_embedding,
last_hidden_state."""
NEIGHBOUR_VECTORS = 4096
"""Nearest neighbours are compared among at most this many vectors (the first ones): N² similarities."""


def looks_like_embedding(name: str, dims: list | None) -> bool:
    """An output read as vectors by default: named like an embedding (`EMBEDDING_NAME`) and shaped
    [batch, dim] or [batch, tokens, dim] with a fixed dim above 1."""
    return (
        bool(EMBEDDING_NAME.search(name))
        and dims is not None
        and len(dims) in (2, 3)
        and isinstance(dims[-1], int)
        and dims[-1] > 1
    )


def vector_metrics(candidate: np.ndarray, reference: np.ndarray) -> dict:
    """Cosine similarity of every candidate vector (the last axis) to its reference vector, and for the
    first `NEIGHBOUR_VECTORS` vectors whether each one's nearest neighbour (by cosine, itself excluded)
    is the same vector in both models."""
    dim = reference.shape[-1]
    c, r = (np.asarray(a, np.float64).reshape(-1, dim) for a in (candidate, reference))
    unit_c, unit_r = (a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-300) for a in (c, r))
    cosine = np.sum(unit_c * unit_r, axis=1)
    result = {"vectors": int(cosine.size), "dim": int(dim), "mean": float(cosine.mean()), "min": float(cosine.min())}
    count = min(len(c), NEIGHBOUR_VECTORS)
    if count >= 3:  # with two vectors each is the other's neighbour whatever the models do
        same = sum(
            int(np.sum(_nearest(unit_c[:count], start) == _nearest(unit_r[:count], start)))
            for start in range(0, count, 512)
        )
        result.update({"same_neighbour": same, "neighbour_vectors": count})
    return result


def _nearest(unit: np.ndarray, start: int, rows: int = 512) -> np.ndarray:
    """Index of each of rows start..start+rows' nearest other vector among `unit` (unit-norm rows)."""
    similarity = unit[start : start + rows] @ unit.T
    similarity[np.arange(similarity.shape[0]), np.arange(start, start + similarity.shape[0])] = -np.inf
    return np.argmax(similarity, axis=1)


def bootstrap(samples: tuple[np.ndarray, ...], statistic, rounds: int, seed: int) -> list[float]:
    """95% BCa interval of `statistic(*samples, axis)` over context windows resampled together
    (scipy.stats.bootstrap: BCa corrects the bias and skew a percentile interval shows over few
    windows); the percentile interval where BCa is undefined (say, identical windows)."""
    import warnings

    from scipy import stats

    value = float(statistic(*samples, axis=-1))
    if samples[0].shape[0] < 2 or rounds <= 0:
        return [value, value]
    for method in ("BCa", "percentile"):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = stats.bootstrap(
                samples,
                statistic,
                n_resamples=rounds,
                paired=True,
                vectorized=True,
                method=method,
                rng=np.random.default_rng(seed),
            )
        low, high = result.confidence_interval
        if np.isfinite(low) and np.isfinite(high):
            return [float(low), float(high)]
    return [value, value]


def window_mean(sample: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(sample, axis=axis)


def degradation(candidate: np.ndarray, reference: np.ndarray, axis: int = -1) -> np.ndarray:
    """(MAE_candidate - MAE_reference) / MAE_reference in percent, from per-window MAEs."""
    mae_c, mae_r = np.mean(candidate, axis=axis), np.mean(reference, axis=axis)
    return (mae_c - mae_r) / np.maximum(mae_r, 1e-30) * 100


def _growth_rate(per_step: np.ndarray) -> float | None:
    """Slope of ln(error) over steps: the error-growth rate per step."""
    keep = per_step > 0
    if keep.sum() < 2:
        return None
    steps = np.arange(1, per_step.size + 1)[keep]
    return float(np.polyfit(steps, np.log(per_step[keep]), 1)[0])


def metrics(candidate: np.ndarray, reference: np.ndarray, truth: np.ndarray | None, rounds: int, seed: int) -> dict:
    """All metrics for one output (or one variable); `rounds` and `seed` are the bootstrap's."""
    result = {"vs_reference": _vs_reference(candidate, reference, rounds, seed)}
    if truth is not None:
        result["vs_truth"] = _vs_truth(candidate, reference, truth, rounds, seed)
    basis = result["vs_truth"] if truth is not None else result["vs_reference"]
    result["degradation_pct"] = basis["degradation_pct" if truth is not None else "drift_pct"]
    result["degradation_ci95"] = basis["degradation_ci95" if truth is not None else "drift_pct_ci95"]
    result["degradation_basis"] = "truth" if truth is not None else "reference drift"
    return result


def _vs_reference(candidate: np.ndarray, reference: np.ndarray, rounds: int, seed: int) -> dict:
    """The drift from the reference: MAE and its interval over windows, as % of mean |reference| (`drift_pct`,
    which a constant offset of the series shrinks or grows) and as % of the reference's standard deviation over
    every window, step and value (`drift_std_pct`: offset-free, what the series' own variability makes of it)."""
    n, t = candidate.shape[:2]
    diff = np.abs(candidate - reference).reshape(n, t, -1)
    mae_window = diff.mean(axis=(1, 2))
    ref_scale = float(np.abs(reference).mean()) or 1e-30
    ref_std = float(np.std(reference, dtype=np.float64)) or 1e-30
    interval = bootstrap((mae_window,), window_mean, rounds, seed)
    return {
        "mae": float(diff.mean()),
        "rmse": float(np.sqrt(np.square(diff).mean())),
        "mae_ci95": interval,
        "drift_pct": float(diff.mean() / ref_scale * 100),
        "drift_pct_ci95": [v / ref_scale * 100 for v in interval],
        "reference_std": ref_std,
        "drift_std_pct": float(diff.mean() / ref_std * 100),
        "drift_std_pct_ci95": [v / ref_std * 100 for v in interval],
        "mae_by_step": diff.mean(axis=(0, 2)).tolist(),
        "mae_by_window": mae_window.tolist(),
        "growth_rate": _growth_rate(diff.mean(axis=(0, 2))),
    }


def _vs_truth(candidate: np.ndarray, reference: np.ndarray, truth: np.ndarray, rounds: int, seed: int) -> dict:
    n, t = candidate.shape[:2]
    cand_err = np.abs(candidate - truth).reshape(n, t, -1)
    ref_err = np.abs(reference - truth).reshape(n, t, -1)
    mae_c, mae_r = float(cand_err.mean()), float(ref_err.mean())
    windows = (cand_err.mean(axis=(1, 2)), ref_err.mean(axis=(1, 2)))
    return {
        "mae": mae_c,
        "rmse": float(np.sqrt(np.square(candidate - truth).mean())),
        "reference_mae": mae_r,
        "reference_rmse": float(np.sqrt(np.square(reference - truth).mean())),
        "degradation_pct": (mae_c - mae_r) / max(mae_r, 1e-30) * 100,
        "degradation_ci95": bootstrap(windows, degradation, rounds, seed),
        "mae_by_step": cand_err.mean(axis=(0, 2)).tolist(),
        "reference_mae_by_step": ref_err.mean(axis=(0, 2)).tolist(),
        "mae_by_window": windows[0].tolist(),
        "reference_mae_by_window": windows[1].tolist(),
        "growth_rate": _growth_rate(cand_err.mean(axis=(0, 2))),
    }


def side_metrics(candidate: np.ndarray, reference: np.ndarray, rounds: int, seed: int) -> dict:
    """How far an output outside the trajectory moved (reported, never gated): the score follows only the
    trajectory, so units feeding nothing else score dead and drop to the lowest tier, and an output such as
    a quantile head can drift far while the forecast does not."""
    if not (np.all(np.isfinite(candidate)) and np.all(np.isfinite(reference))):
        return {"nonfinite": True}
    return metrics(candidate, reference, None, rounds, seed)
