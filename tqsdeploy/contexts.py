"""Context windows: the starting states S the rollouts begin from.

Internally every input is an array of shape (N, *window), N windows, each a
complete model input (the model's own batch axis included). When the model's
batch axis is dynamic, windows are concatenated along it and run as one
batch; otherwise they run one at a time.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from runtimes import IOSpec
from tqsdeploy.errors import InputError


@dataclass
class Contexts:
    """N context windows for every model input."""

    arrays: dict[str, np.ndarray]
    source: str
    warnings: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return next(iter(self.arrays.values())).shape[0]

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.arrays):
            array = np.ascontiguousarray(self.arrays[name])
            digest.update(name.encode())
            digest.update(str(array.dtype).encode() + str(array.shape).encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    def save(self, path: Path) -> None:
        np.savez(path, **self.arrays)

    def describe(self) -> dict:
        return {
            "source": self.source,
            "windows": self.count,
            "sha256": self.sha256,
            "shapes": {name: list(a.shape) for name, a in self.arrays.items()},
        }

    def chunks(self, inputs: Sequence[IOSpec], batch: bool, max_windows: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(window count, feeds) chunks; windows share one run when `batch`."""
        step = max(1, max_windows) if batch else 1
        for start in range(0, self.count, step):
            stop = min(self.count, start + step)
            feeds = {}
            for spec in inputs:
                part = self.arrays[spec.name][start:stop]
                feeds[spec.name] = part.reshape((-1,) + part.shape[2:]) if batch else part[0]
            yield stop - start, feeds


def _shape_fits(window: tuple[int, ...], spec: IOSpec) -> bool:
    return len(window) == spec.rank and all(not isinstance(d, int) or d == w for d, w in zip(spec.shape, window))


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


def _as_windows(name: str, array: np.ndarray, spec: IOSpec) -> np.ndarray:
    """Accept (N, *input_shape), or an input-shaped array whose axis 0 lists windows."""
    if array.ndim == spec.rank + 1 and _shape_fits(array.shape[1:], spec):
        windows = array
    elif array.ndim == spec.rank and _shape_fits((1,) + array.shape[1:], spec):
        windows = array[:, None]
    else:
        raise InputError(
            f"contexts array '{name}' has shape {list(array.shape)}, which does not fit model input '{name}' {_fmt(spec.shape)}; "
            f"expected (windows, *{_fmt(spec.shape)})"
        )
    if windows.shape[0] == 0:
        raise InputError(f"contexts array '{name}' holds no windows")
    if spec.dtype.kind == "f" and not np.all(np.isfinite(windows)):
        raise InputError(f"contexts array '{name}' contains NaN or Inf")
    return np.ascontiguousarray(windows.astype(spec.dtype, copy=False))


def load_npz(path: Path, inputs: Sequence[IOSpec]) -> Contexts:
    """One array per model input name, leading axis = context windows."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise InputError(f"contexts file {path} does not exist") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError(f"contexts file {path} is not a readable .npz archive ({exc})") from None
    arrays = {}
    for spec in inputs:
        if spec.name not in stored:
            raise InputError(f"contexts file {path} has no array for model input '{spec.name}' (it has: {', '.join(stored) or 'none'})")
        arrays[spec.name] = _as_windows(spec.name, stored[spec.name], spec)
    counts = {name: a.shape[0] for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        raise InputError(f"contexts arrays disagree on the number of windows: {counts}")
    return Contexts(arrays=arrays, source=str(path))


def load_csv(path: Path, inputs: Sequence[IOSpec], windows: int, zscore: bool) -> Contexts:
    """Cut a numeric CSV into `windows` evenly spaced windows for a single-input model.

    A rank-2 input [batch, L] is univariate: each column becomes one series (one
    batch row). A rank-3 input [batch, L, C] or [batch, C, L] takes all C columns.
    """
    import polars as pl

    if len(inputs) != 1:
        raise InputError(f"a CSV can only fill a model with one input; this model has {len(inputs)} (use an .npz)")
    spec = inputs[0]
    try:
        frame = pl.read_csv(path, infer_schema_length=1000)
    except FileNotFoundError:
        raise InputError(f"contexts file {path} does not exist") from None
    except Exception as exc:
        raise InputError(f"contexts file {path} is not a readable CSV ({str(exc).splitlines()[0]})") from None
    numeric = frame.select([c for c, t in frame.schema.items() if t.is_numeric()])
    if numeric.width == 0:
        raise InputError(f"contexts file {path} has no numeric columns")
    data = numeric.to_numpy().astype(np.float64)
    if not np.all(np.isfinite(data)):
        raise InputError(f"contexts file {path} has missing or non-finite values")
    if zscore:
        data = (data - data.mean(axis=0)) / (data.std(axis=0) + 1e-8)
    rows, columns = data.shape
    shape = spec.shape
    if spec.rank == 2 and isinstance(shape[1], int):
        length, layout = shape[1], "univariate"
    elif spec.rank == 3 and shape[2] == columns and isinstance(shape[1], int):
        length, layout = shape[1], "time-major"
    elif spec.rank == 3 and shape[1] == columns and isinstance(shape[2], int):
        length, layout = shape[2], "channel-major"
    else:
        raise InputError(
            f"cannot cut CSV columns ({columns}) into model input '{spec.name}' {_fmt(shape)}; expected [batch, L], [batch, L, {columns}] or [batch, {columns}, L]"
        )
    if rows < length:
        raise InputError(f"contexts file {path} has {rows} rows, fewer than the model's window length {length}")
    starts = np.linspace(0, rows - length, num=windows).round().astype(int)
    cut = np.stack([data[s : s + length] for s in starts])  # (N, L, C)
    if layout == "univariate":
        cut = cut.transpose(0, 2, 1)  # (N, C, L): columns are the batch rows
        if isinstance(shape[0], int) and shape[0] != columns:
            cut = cut.reshape(-1, 1, length)  # static batch: one series per window
    elif layout == "time-major":
        cut = cut[:, None]
    else:
        cut = cut.transpose(0, 2, 1)[:, None]
    return Contexts(arrays={spec.name: _as_windows(spec.name, cut, spec)}, source=str(path))


def random_contexts(inputs: Sequence[IOSpec], windows: int, seed: int) -> Contexts:
    """Standard-normal windows; dynamic dimensions become 1. Only on explicit request."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in inputs:
        if any(not isinstance(d, int) for d in spec.shape[1:]):
            raise InputError(f"cannot make random contexts for input '{spec.name}' {_fmt(spec.shape)}: only the batch axis may be dynamic")
        shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape)
        arrays[spec.name] = rng.standard_normal((windows, *shape)).astype(spec.dtype)
    warning = "contexts are random standard-normal noise, not data: the scores describe the model off its data distribution"
    return Contexts(arrays=arrays, source=f"random(seed={seed})", warnings=[warning])


def load_contexts(path: Path | None, inputs: Sequence[IOSpec], *, windows: int, zscore: bool, random: bool, seed: int) -> Contexts:
    """Dispatch on the file type; random contexts only when asked."""
    if path is None:
        if not random:
            raise InputError("no contexts given", hint="pass --contexts FILE (.npz or .csv), or --random-contexts to score on noise")
        return random_contexts(inputs, windows, seed)
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return load_csv(path, inputs, windows, zscore)
    return load_npz(path, inputs)
