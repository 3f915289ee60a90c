"""Where the rounding solvers' arrays and threads come from.

`array_module` picks the array library of the heavy products (CuPy on a CUDA device when the `gpu` extra
is installed, numpy otherwise): the same calls run in CI under numpy. On CuPy the statistics' products, the
inverse Cholesky and GPTQ's column loop on integer grids (`tiers.column_loop`) run on the device.
`shared_cores` splits the cores' BLAS threads between solves that run side by side
(`tqsdeploy.encoding.calibrator`), so parallel solves never ask for more threads than threadpoolctl says
numpy may use.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np

_ARRAY_MODULE = None


def array_module():
    """The array library the heavy products run in: CuPy when the optional `gpu` extra installed it and a
    CUDA device is visible, else numpy (TQS_ARRAYS=numpy forces numpy). Same calls either way (CuPy
    mirrors numpy's API), so CI runs this code under numpy; tests/runtimes/test_gpu.py holds the device's codes to
    numpy's (docs/design-notes/tiers.md, 'On the device')."""
    global _ARRAY_MODULE
    if _ARRAY_MODULE is None:
        _ARRAY_MODULE = np
        if _setting("TQS_ARRAYS", ARRAY_CHOICES)[0] != "numpy":
            try:
                import cupy

                if cupy.cuda.runtime.getDeviceCount() > 0:
                    _ARRAY_MODULE = cupy
            except Exception:  # noqa: BLE001 - not installed, no driver, no device: numpy
                pass
    return _ARRAY_MODULE


DEVICE_FROM_ORDER = 1024
"""K from which the statistics' products and the inverse Cholesky go to the device: below it the copies and
launches cost more than the host's BLAS call (docs/design-notes/tiers.md, 'On the device')."""
DEVICE_LOOP_FROM = 2048 * 2048
"""Weight elements (N·K) from which GPTQ's column loop runs on the device (`tiers.column_loop`). Its K
columns are each a dozen small kernel launches, so smaller weights loop faster on the host
(docs/design-notes/tiers.md, 'On the device')."""


def on_device(order: int) -> bool:
    """Whether a K x K statistic of this order goes to the device."""
    return order >= DEVICE_FROM_ORDER and array_module() is not np


def loop_on_device(rows: int, columns: int) -> bool:
    """Whether GPTQ's column loop over an N x K weight runs on the device."""
    return rows * columns >= DEVICE_LOOP_FROM and array_module() is not np


def _on_host(value) -> np.ndarray:
    """A result of `array_module()` as a numpy array (a copy off the device for CuPy)."""
    return value if isinstance(value, np.ndarray) else array_module().asnumpy(value)


ONE_THREAD_BELOW = 256
"""Statistics' products of fewer columns run on one BLAS thread (`gram`): they take milliseconds, and on a busy
machine a second BLAS thread waiting for a core made each take a third of a second (a 7168 x 48 cross term on 2
cores shared with other jobs: 4.6 ms on one thread, 313 ms on two; docs/design-notes/tiers.md, 'Small products on
one thread')."""
_NUMPY_BLAS: list | None = None


@contextmanager
def one_thread() -> Iterator[None]:
    """numpy's BLAS on one thread for the block; in the main thread only (the setting is the process's, and solves
    running side by side set their own, `shared_cores`)."""
    global _NUMPY_BLAS
    if threading.current_thread() is not threading.main_thread() or THREAD_CAP is not None:
        yield
        return
    if _NUMPY_BLAS is None:
        from threadpoolctl import ThreadpoolController

        _NUMPY_BLAS = [
            lib
            for lib in ThreadpoolController().lib_controllers
            if lib.user_api == "blas" and lib.filepath not in MANAGED_BLAS
        ]
    before = [(lib, lib.num_threads) for lib in _NUMPY_BLAS]
    for lib, threads in before:
        if threads != 1:
            lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, threads in before:
            if threads != 1:
                lib.set_num_threads(threads)


def gram(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """aᵀ·b (float64), on the device when there is one: the statistics' K x K products (small ones on one thread)."""
    if not on_device(a.shape[1]):
        if a.shape[1] >= ONE_THREAD_BELOW:
            return a.T @ b
        with one_thread():
            return a.T @ b
    xp = array_module()
    a_dev = xp.asarray(a)
    return _on_host(a_dev.T @ (a_dev if b is a else xp.asarray(b)))


def device_inverse_cholesky(damped_reversed: np.ndarray) -> np.ndarray | None:
    """`inverse_cholesky`'s J·L⁻¹·J on the device (None: numpy's LAPACK path applies, or the factor failed)."""
    if not on_device(damped_reversed.shape[0]):
        return None
    xp = array_module()
    from cupyx.scipy.linalg import solve_triangular

    lower = xp.linalg.cholesky(xp.asarray(damped_reversed))
    inverse = solve_triangular(lower, xp.eye(lower.shape[0]), lower=True)
    upper = _on_host(xp.ascontiguousarray(inverse[::-1, ::-1]))
    return upper if np.all(np.isfinite(upper)) else None


COPY_TILE = 256
"""Side of the tiles `c_order` copies a strided matrix by (256 x 256 float64: 512 KiB, inside this machine's L2)."""


def c_order(view: np.ndarray, dtype=None) -> np.ndarray:
    """A C-ordered copy of `view` (cast to `dtype`), the same values as np.array(view, dtype, order="C").

    numpy copies a transposed or reversed matrix a destination row at a time, so every element it reads from a
    column-major source is another cache line; tile by tile both stay in cache. Such copies are made per weight
    (or statistic) and pass (docs/design-notes/tiers.md, 'Tiled copies')."""
    dtype = np.dtype(view.dtype if dtype is None else dtype)
    if view.ndim != 2 or view.flags.c_contiguous or min(view.shape) <= COPY_TILE:
        return np.array(view, dtype, order="C")
    rows, columns = view.shape
    out = np.empty((rows, columns), dtype)
    for r0 in range(0, rows, COPY_TILE):
        for c0 in range(0, columns, COPY_TILE):
            out[r0 : r0 + COPY_TILE, c0 : c0 + COPY_TILE] = view[r0 : r0 + COPY_TILE, c0 : c0 + COPY_TILE]
    return out


SOLVER_DTYPES = ("auto", "float32", "float64")
ARRAY_CHOICES = ("auto", "numpy")


def _setting(variable: str, choices: tuple[str, ...]) -> tuple[str, str | None]:
    """An environment variable's value (the first choice when unset) and what is wrong with it, if anything."""
    value = os.environ.get(variable, choices[0])
    return value, None if value in choices else f"{variable} must be one of {', '.join(choices)}, not '{value}'"


def environment_problem() -> str | None:
    """What is wrong with the solver's environment variables (TQS_ARRAYS, TQS_SOLVER_DTYPE), in one line, or
    None: commands check it before any work, so a typo is an input error, not a failure half-way through."""
    return _setting("TQS_ARRAYS", ARRAY_CHOICES)[1] or _setting("TQS_SOLVER_DTYPE", SOLVER_DTYPES)[1]


FLOAT32_FROM = 1024
"""Input width K from which `solve_dtype` is float32 under 'auto'. Below it a solve is numpy's per-call
cost more than flops, so float32 gains nothing there and narrower layers keep float64's codes
(docs/design-notes/tiers.md, 'Solves in float32 from K = 1024')."""


def solver_dtype() -> str:
    """The solvers' precision setting (TQS_SOLVER_DTYPE): 'auto' (the default; `solve_dtype` picks per weight),
    'float32' or 'float64'."""
    chosen, problem = _setting("TQS_SOLVER_DTYPE", SOLVER_DTYPES)
    if problem:
        raise ValueError(problem)
    return chosen


def solve_dtype(order: int) -> str:
    """What a solve on K = `order` inputs computes in: float32 (the precision of the official PyTorch GPTQ,
    GPTAQ and QEP code) with 'float32', and with 'auto' from `FLOAT32_FROM` on; float64 otherwise. It covers
    GPTQ/GPTAQ's column loop (`tiers.column_loop`), QEP's correction (its Cholesky solve at QEP's 100% damping
    and its product with G) and the per-channel grid choice's products (`tiers.hessian.second_lower`). The
    statistics H and G, GPTQ's inverse Cholesky (`tiers.factors.inverse_cholesky`: in float32 it moved a chaotic
    model's codes too far) and GPTAQ's P stay float64, and so do the grids and the sums. What float32 saves and
    what it keeps: docs/design-notes/tiers.md, 'Solves in float32 from K = 1024'."""
    chosen = solver_dtype()
    return "float32" if chosen == "float32" or (chosen == "auto" and order >= FLOAT32_FROM) else "float64"


THREAD_CAP: int | None = None
"""BLAS threads each solve may use while solves run side by side (`shared_cores`); None: no cap."""


MANAGED_BLAS: set[str] = set()
"""BLAS libraries whose threads `tiers.gptq` sets itself call by call (scipy's own OpenBLAS, one thread for
small LAPACK calls): what they hold at a moment is no limit the user set."""


def solver_threads() -> int:
    """Cores the solvers may use: numpy's BLAS threads as threadpoolctl sees them now (the core count, or
    what OMP_NUM_THREADS / threadpool_limits set), so parallel solves never exceed a limit the user set.
    The libraries in `MANAGED_BLAS` are left out: counted, the first small LAPACK call (which sets scipy's
    copy to one thread) would make this 1 for the rest of the process, and every calibration wave would
    solve its weights one at a time."""
    from threadpoolctl import threadpool_info

    counts = [
        lib["num_threads"]
        for lib in threadpool_info()
        if lib.get("user_api") == "blas" and lib.get("filepath") not in MANAGED_BLAS
    ]
    return max(1, min(counts) if counts else 1)


@contextmanager
def shared_cores(workers: int) -> Iterator[None]:
    """`workers` solves at once, each on cores // workers BLAS threads (no more threads than cores)."""
    global THREAD_CAP
    from threadpoolctl import threadpool_limits

    each = max(1, solver_threads() // max(1, workers))
    previous, THREAD_CAP = THREAD_CAP, each
    try:
        with threadpool_limits(limits=each, user_api="blas"):
            yield
    finally:
        THREAD_CAP = previous
