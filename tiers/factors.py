"""Factorizations of a damped Hessian the solvers read (`tiers.gptq`): GPTQ's inverse Cholesky U and QEP's Cholesky
factor, through scipy's LAPACK, with the copies they need made in place where LAPACK allows.

A K x K float64 matrix is 134 MB at K = 4096: each factorization works in the one buffer it damps H into.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiers import solver_backend as backend
from tiers.solver_backend import COPY_TILE, c_order, device_inverse_cholesky

CHOLESKY_RETRIES = 8
"""Times the damping is multiplied by 10 before a failed Cholesky is reported."""

LAPACK_THREADS_FROM = 2048
"""Matrix order from which scipy's own OpenBLAS (when it has one) runs LAPACK on all its threads."""
_LAPACK: tuple | None = None


def lapack_for(order: int):
    """scipy's LAPACK (in-place potrf/trtri/potrs, which numpy lacks), imported on first use.

    Where scipy brings its own OpenBLAS beside numpy's, its threads spin after each call and fight
    numpy's for the cores (docs/design-notes/tiers.md, 'scipy's own OpenBLAS'). So that copy runs
    one thread below `LAPACK_THREADS_FROM` (calls of milliseconds) and all of them above (calls of
    seconds, where the spinning is noise)."""
    global _LAPACK
    if _LAPACK is None:
        from threadpoolctl import ThreadpoolController

        before = {lib.filepath for lib in ThreadpoolController().lib_controllers}
        from scipy.linalg import lapack

        # loaded with scipy, or scipy's wheel's own (scipy imported earlier)
        own = [
            lib
            for lib in ThreadpoolController().lib_controllers
            if lib.user_api == "blas" and (lib.filepath not in before or Path(lib.filepath).parent.name == "scipy.libs")
        ]
        _LAPACK = (lapack, [(lib, lib.num_threads) for lib in own])
        backend.MANAGED_BLAS.update(lib.filepath for lib in own)
    lapack, own = _LAPACK
    for lib, threads in own:
        wanted = threads if order >= LAPACK_THREADS_FROM else 1
        if backend.THREAD_CAP is not None:
            wanted = min(wanted, backend.THREAD_CAP)
        if lib.num_threads != wanted:
            lib.set_num_threads(wanted)
    return lapack


def inverse_cholesky(H: np.ndarray, percdamp: float) -> np.ndarray:
    """Upper U with UᵀU = (H + λI)⁻¹, λ = percdamp·mean(diag H), in float64 whatever `solver_dtype` says: at
    GPTQ's 1% damping H + λI can be as ill-conditioned as 100·K, and a float32 U moves enough codes to change a
    chaotic model's drift (docs/design-notes/tiers.md, 'GPTQ's inverse Cholesky stays float64'); it is one
    factorization per statistic, shared by every weight, tier and grid solved on it.

    The official sequence (Cholesky, its inverse as torch's cholesky_inverse, Cholesky of that:
    potrf/potri/potrf, 4/3·K³ flops) gives the same U as one Cholesky of H with its rows and columns
    reversed and the inverse of that triangle (potrf/trtri, 2/3·K³): with J the reversal, JHJ = LLᵀ
    makes H = (JLJ)(JLJ)ᵀ with JLJ upper, so U = (JLJ)⁻¹ = J·L⁻¹·J, equal to the official U up to
    rounding, in half the time. Guard (not in the official code): when a Cholesky fails, the
    damping is multiplied by 10 and tried again, so a rank-deficient H from too little calibration
    data degrades gracefully instead of stopping an export.
    """
    lapack = lapack_for(H.shape[0])
    mean = float(np.mean(np.diag(H))) if H.size else 1.0
    damp = percdamp * mean
    for _ in range(CHOLESKY_RETRIES + 1):
        work = _damped(H[::-1, ::-1], damp)
        if (upper := device_inverse_cholesky(work)) is not None:
            return upper
        # work is symmetric and C-ordered, so work.T is the same matrix in Fortran order and LAPACK works on it in place
        factor, info = lapack.dpotrf(work.T, lower=1, clean=1, overwrite_a=1)
        if info == 0:
            factor, info = lapack.dtrtri(factor, lower=1, overwrite_c=1)
        if info == 0:
            upper = _reversed_in_place(work) if np.shares_memory(factor, work) else c_order(factor[::-1, ::-1])
            del work, factor
            if np.all(np.isfinite(upper)):
                return upper
        damp = max(damp, 1e-6 * abs(mean) or 1e-12) * 10
    raise np.linalg.LinAlgError(f"Hessian is not positive definite even with damping {damp / 10:.3g}")


def _reversed_in_place(work: np.ndarray) -> np.ndarray:
    """J·L⁻¹·J in C order in `work`'s own buffer, where LAPACK left L⁻¹ column-major (so `work`, read in C order,
    holds its transpose): a transpose by tiles, then the buffer reversed end to end. The values `c_order` of the
    reversed factor would copy, without a second K x K array (128 MB at K = 4096, beside the first)."""
    order, tile = work.shape[0], COPY_TILE
    for i0 in range(0, order, tile):
        i1 = min(i0 + tile, order)
        work[i0:i1, i0:i1] = work[i0:i1, i0:i1].T.copy()
        for j0 in range(i1, order, tile):
            j1 = min(j0 + tile, order)
            above = work[i0:i1, j0:j1].copy()
            work[i0:i1, j0:j1] = work[j0:j1, i0:i1].T
            work[j0:j1, i0:i1] = above.T
    flat = work.reshape(-1)
    size, step = flat.size, tile * tile
    for start in range(0, size // 2, step):
        stop = min(start + step, size // 2)
        head = flat[start:stop].copy()
        flat[start:stop] = flat[size - stop : size - start][::-1]
        flat[size - stop : size - start] = head[::-1]
    return work


def _damped(H: np.ndarray, damp: float) -> np.ndarray:
    """H + damp·I (the same values) without an identity matrix beside it."""
    damped = np.array(H, np.float64, copy=True, order="C")
    damped[np.diag_indices_from(damped)] += damp
    return damped


def damped_cholesky(H: np.ndarray, percdampqep: float, dtype=np.float64) -> np.ndarray:
    """Lower Cholesky factor (Fortran order, `dtype`) of H + λI, λ = percdampqep·mean(diag H), damping raised 10x
    on failure."""
    lapack = lapack_for(H.shape[0])
    potrf = lapack.spotrf if dtype == np.float32 else lapack.dpotrf
    mean = float(np.mean(np.diag(H)))
    damp = percdampqep * mean
    for _ in range(CHOLESKY_RETRIES + 1):
        damped = _damped(H, damp)
        if dtype != np.float64:
            damped = damped.astype(dtype)
        factor, info = potrf(damped.T, lower=1, overwrite_a=1)  # symmetric: its transpose is itself, in Fortran order
        if info == 0:
            return factor
        damp = max(damp, 1e-6 * abs(mean) or 1e-12) * 10
    raise np.linalg.LinAlgError(f"damped Hessian is not positive definite even with damping {damp / 10:.3g}")
