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
from typing import Iterator, Mapping, Sequence

import numpy as np

from runtimes import IOSpec
from tqsdeploy.errors import InputError
from tqsdeploy.rollout.csv_file import csv_layout, read_csv_columns


@dataclass(frozen=True)
class ContextOptions:
    """How to read contexts that are not an .npz of ready windows, and how many windows run as one batch."""

    windows: int = 8
    zscore: bool = False
    random: bool = False
    seed: int = 0
    max_batch_windows: int = 64
    columns: tuple[str, ...] | None = None
    """CSV columns (series) to use; default every numeric column."""
    dims: tuple[tuple[str, int], ...] = ()
    """Sizes of named dynamic axes for random contexts, e.g. (("seq", 128),)."""


@dataclass
class Contexts:
    """N context windows for every model input."""

    arrays: dict[str, np.ndarray]
    source: str
    warnings: list[str] = field(default_factory=list)
    csv: dict | None = None
    """For windows cut from a CSV: layout, columns, start rows and window length."""
    following: np.ndarray | None = None
    """For windows cut from a CSV with rows kept after them: those rows, (windows, rows, columns)."""

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

    def describe(self) -> dict:
        return {
            "source": self.source,
            "windows": self.count,
            "sha256": self.sha256,
            "shapes": {name: list(a.shape) for name, a in self.arrays.items()},
            **({"csv": self.csv} if self.csv else {}),
        }

    def chunks(
        self, inputs: Sequence[IOSpec], batch: bool, max_windows: int
    ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
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


def _check_kind(name: str, windows: np.ndarray, spec: IOSpec) -> None:
    """Values the cast to the input's type would change without a word: complex parts dropped, booleans
    read as numbers, fractions (or NaN) truncated into an integer input."""
    kind, want = windows.dtype.kind, spec.dtype.kind
    if kind == "c" or (kind == "b") != (want == "b") or kind not in "biufc":
        raise InputError(
            f"contexts array '{name}' is {windows.dtype}, "
            f"which model input '{name}' ({spec.dtype}) cannot take as it is"
        )
    if want in "iu" and kind == "f":
        if not np.all(np.isfinite(windows)):
            raise InputError(f"contexts array '{name}' contains NaN or Inf, and model input '{name}' is {spec.dtype}")
        if not np.array_equal(windows, np.round(windows)):
            raise InputError(
                f"contexts array '{name}' holds fractions, and model input '{name}' is {spec.dtype} "
                "(they would be truncated)"
            )
    if want in "iu" and kind in "iuf" and windows.size:
        low, high = np.iinfo(spec.dtype).min, np.iinfo(spec.dtype).max
        if float(windows.min()) < low or float(windows.max()) > high:
            raise InputError(
                f"contexts array '{name}' holds values outside {spec.dtype}'s range, the type of model input '{name}'"
            )


def _as_windows(name: str, array: np.ndarray, spec: IOSpec) -> np.ndarray:
    """Accept (N, *input_shape), or an input-shaped array whose axis 0 lists windows."""
    if array.ndim == spec.rank + 1 and _shape_fits(array.shape[1:], spec):
        windows = array
    elif array.ndim == spec.rank and _shape_fits((1,) + array.shape[1:], spec):
        windows = array[:, None]
    else:
        raise InputError(
            f"contexts array '{name}' has shape {list(array.shape)}, "
            f"which does not fit model input '{name}' {_fmt(spec.shape)}; expected (windows, *{_fmt(spec.shape)})"
        )
    if windows.shape[0] == 0:
        raise InputError(f"contexts array '{name}' holds no windows")
    # a window with an empty axis: every rollout of it is empty, every score and drift NaN or nothing
    if windows.size == 0:
        raise InputError(
            f"contexts array '{name}' has shape {list(array.shape)}: an empty axis leaves its windows without values"
        )
    _check_kind(name, windows, spec)
    if spec.dtype.kind == "f" and not np.all(np.isfinite(windows)):
        raise InputError(f"contexts array '{name}' contains NaN or Inf")
    with np.errstate(over="ignore", invalid="ignore"):
        cast = np.ascontiguousarray(windows.astype(spec.dtype, copy=False))
    if spec.dtype.kind == "f" and cast.dtype != windows.dtype and not np.all(np.isfinite(cast)):
        limit = float(np.finfo(spec.dtype).max)
        largest = float(np.max(np.abs(windows[~np.isfinite(cast)])))
        raise InputError(
            f"contexts array '{name}' holds {largest:.3g}, beyond {spec.dtype}'s range (±{limit:.3g}), "
            "the model input's type"
        )
    return cast


def npz_arrays(path: Path, what: str, hint: str) -> dict[str, np.ndarray]:
    """Every array of an .npz (contexts, truth), or a one-line InputError naming the file as `what`: missing, not
    an .npz (`hint` says what was expected), or a member that is no .npy (numpy hands those back as bytes)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except (OSError, ValueError, TypeError, zipfile.BadZipFile, EOFError, AttributeError):
        raise InputError(f"{what} {path} is not an .npz archive of arrays", hint=hint) from None
    for name, value in stored.items():
        if not isinstance(value, np.ndarray):
            raise InputError(
                f"{what} {path}: its member '{name}' is not a numpy array (.npy)",
                hint="save the arrays with numpy.savez",
            )
    return stored


def load_npz(path: Path, inputs: Sequence[IOSpec]) -> Contexts:
    """One array per model input name, leading axis = context windows."""
    stored = npz_arrays(
        path,
        "contexts file",
        "expected one array per model input, leading axis = windows (numpy.savez), or a .csv of numeric columns",
    )
    arrays = {}
    for spec in inputs:
        if spec.name not in stored:
            raise InputError(
                f"contexts file {path} has no array for model input '{spec.name}' "
                f"(it has: {', '.join(stored) or 'none'})"
            )
        arrays[spec.name] = _as_windows(spec.name, stored[spec.name], spec)
    counts = {name: a.shape[0] for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        raise InputError(f"contexts arrays disagree on the number of windows: {counts}")
    return Contexts(arrays=arrays, source=str(path))


def describe_windows(described: dict) -> str:
    """'8 context windows', or for a univariate model fed several CSV columns what that multiplies:
    '8 context windows × 7 series each (CSV columns a, …, g): 7x the work of one series' (`Contexts.describe()`)."""
    windows, csv = described["windows"], described.get("csv") or {}
    series = len(csv.get("columns", ())) if csv.get("layout") == "univariate" else 1
    if series <= 1:
        return f"{windows} context window{'s' if windows != 1 else ''}"
    names = ", ".join(csv["columns"]) if series <= 4 else f"{', '.join(csv['columns'][:2])}, …, {csv['columns'][-1]}"
    cuts = len(csv["starts"])
    shape = (
        f"{windows} context windows × {series} series each"
        if windows == cuts
        else f"{windows} context windows ({cuts} cuts × {series} series)"
    )
    return f"{shape} (CSV columns {names}): {series}x the work of one series"


def _arrange(cut: np.ndarray, layout: str, spec: IOSpec, columns: int) -> np.ndarray:
    """(N, length, C) slices of the file as model-input windows (N, *input)."""
    length = cut.shape[1]
    if layout == "univariate":
        cut = cut.transpose(0, 2, 1)  # (N, C, L): columns are the batch rows
        if isinstance(spec.shape[0], int) and spec.shape[0] != columns:
            cut = cut.reshape(-1, 1, length)  # static batch: one series per window
        return cut
    if layout == "time-major":
        return cut[:, None]
    return cut.transpose(0, 2, 1)[:, None]


def load_csv(
    path: Path,
    inputs: Sequence[IOSpec],
    windows: int,
    zscore: bool,
    columns: Sequence[str] | None = None,
    following: int = 0,
) -> Contexts:
    """Cut a numeric CSV into `windows` evenly spaced windows for a single-input model.

    A rank-2 input [batch, L] is univariate: each column becomes one series (one
    batch row). A rank-3 input [batch, L, C] or [batch, C, L] takes all C columns.
    `following` rows after each window are kept free and returned in
    `Contexts.following` (N, following, C), in the windows' own layout via
    `Contexts.arrange`: the truth a rollout of the windows forecasts.
    """
    if len(inputs) != 1:
        raise InputError(f"a CSV can only fill a model with one input; this model has {len(inputs)} (use an .npz)")
    spec = inputs[0]
    data, names = read_csv_columns(path, columns)
    rows, count = data.shape
    length, layout = csv_layout(spec, names, path)
    if rows < length + following:
        need = f"the model's window length {length}" + (
            f" plus the {following} rows of truth a rollout forecasts" if following else ""
        )
        raise InputError(f"contexts file {path} has {rows} rows, fewer than {need}")
    distinct = rows - length - following + 1
    if windows > distinct:
        raise InputError(
            f"contexts file {path} holds {distinct} distinct windows of {length} rows"
            + (f" (plus {following} rows of truth)" if following else "")
            + f"; --windows {windows} would repeat them",
            hint=f"use --windows {distinct} or fewer",
        )
    if zscore:  # after the row checks: an empty column's mean is numpy's warnings, not an answer
        data = (data - data.mean(axis=0)) / (data.std(axis=0) + 1e-8)
    starts = np.linspace(0, rows - length - following, num=windows).round().astype(int)
    cut = np.stack([data[s : s + length] for s in starts])  # (N, L, C)
    result = Contexts(
        arrays={spec.name: _as_windows(spec.name, _arrange(cut, layout, spec, count), spec)}, source=str(path)
    )
    result.csv = {"layout": layout, "columns": names, "starts": starts.tolist(), "length": length}
    if layout == "univariate" and count > 1 and not columns:
        result.warnings.append(
            f"model input '{spec.name}' {_fmt(spec.shape)} takes one series per batch row, "
            f"and each of the {count} numeric columns of {path} "
            f"({', '.join(names)}) was taken as a series: {count} series per window, {count}x the work of one; "
            f"pass --columns to use fewer (e.g. --columns {names[-1]}, the series you forecast)"
        )
    if following:
        result.following = np.stack([data[s + length : s + length + following] for s in starts])
    return result


def continuation_rows(spec, outputs: Sequence[IOSpec], inputs: Sequence[IOSpec]) -> int:
    """Rows of a CSV a rollout forecasts after its window (steps × horizon), or 0 when the
    rollout is not a forecast of the file's own series (one output shifted into the input)."""
    from tqsdeploy.rollout import aligned_shape

    edges = [e for e in spec.feedback if e.mode == "shift"]
    if (
        len(edges) != 1
        or len([e for e in spec.feedback if e.mode != "advance"]) != 1
        or list(spec.trajectory) != [edges[0].output]
    ):
        return 0
    out = next((o for o in outputs if o.name == edges[0].output), None)
    into = next((i for i in inputs if i.name == edges[0].input), None)
    shape = aligned_shape(out.shape, into.shape, edges[0].axis) if out is not None and into is not None else None
    horizon = shape[edges[0].axis] if shape is not None and -len(shape) <= edges[0].axis < len(shape) else None
    return spec.steps * horizon if isinstance(horizon, int) else 0


def truth_from_csv(
    contexts: Contexts, spec, inputs: Sequence[IOSpec], shapes: dict[str, tuple]
) -> dict[str, np.ndarray]:
    """The ground truth of a rollout from CSV windows: the rows after each window,
    cut step by step into the forecast output's shape."""
    name = spec.trajectory[0]
    following, layout = contexts.following, contexts.csv["layout"]
    want = shapes[name]
    horizon = following.shape[1] // spec.steps
    columns = following.shape[2]
    steps = [
        _arrange(following[:, t * horizon : (t + 1) * horizon], layout, inputs[0], columns) for t in range(spec.steps)
    ]
    truth = np.stack(steps, axis=1)
    if (
        truth.shape != tuple(want)
        and truth.size == int(np.prod(want))
        and [d for d in truth.shape if d != 1] == [d for d in want if d != 1]
    ):
        truth = truth.reshape(want)  # a forecast with a singleton axis more ([B, 24, 1] into [B, 96])
    if truth.shape != tuple(want):
        raise InputError(
            f"the rows after the CSV windows make a truth of shape {list(truth.shape)}, "
            f"not the forecasts' {list(want)}",
            hint="pass --truth",
        )
    return {name: truth.astype(np.float64)}


def random_contexts(
    inputs: Sequence[IOSpec],
    windows: int,
    seed: int,
    dims: Mapping[str, int] | None = None,
    rows: Mapping[str, int] | None = None,
) -> Contexts:
    """Random windows, only on explicit request: float inputs standard-normal; integer inputs that index a Gather
    table (`rows`: input -> table rows, `units.index_rows`) uniform over its rows, integer or boolean masks at the
    value that means present (all ones for an attention mask, zeros for a padding mask). `dims` sizes named dynamic
    axes (`--dim seq=128`); an unnamed dynamic batch axis is 1."""
    from tqsdeploy.rollout import mask_fill, mask_like

    dims, rows = dict(dims or {}), dict(rows or {})
    named = {d for spec in inputs for d in spec.shape if isinstance(d, str)}
    unknown = sorted(set(dims) - named)
    if unknown:
        raise InputError(
            f"--dim {unknown[0]}: no input of the model has an axis named '{unknown[0]}'",
            hint=f"its dynamic axes are named: {', '.join(sorted(named)) or 'none'}",
        )
    rng = np.random.default_rng(seed)
    arrays, drawn = {}, []
    for spec in inputs:
        shape = []
        for axis, d in enumerate(spec.shape):
            size = d if isinstance(d, int) else dims.get(d, 1 if axis == 0 else None)
            if size is None:
                raise InputError(
                    f"cannot make random contexts for input '{spec.name}' {_fmt(spec.shape)}: "
                    f"its axis {axis} is dynamic" + (f" ('{d}') and no --dim gives its size" if d else " and unnamed"),
                    hint=(f"pass --dim {d}=N, e.g. --dim {d}=128, or " if d else "")
                    + "write the windows to an .npz with arrays "
                    + npz_layout(inputs),
                )
            shape.append(size)
        shape = (windows, *shape)
        if spec.dtype.kind in "iu" and spec.name in rows:
            arrays[spec.name] = rng.integers(0, rows[spec.name], shape).astype(spec.dtype)
            drawn.append(f"'{spec.name}' uniform over the {rows[spec.name]} rows of the table it indexes")
        elif spec.dtype.kind in "iub" and mask_like(spec.name):
            arrays[spec.name] = np.full(shape, mask_fill(spec.name)).astype(spec.dtype)
            drawn.append(f"'{spec.name}' all {mask_fill(spec.name):g} (every position present)")
        else:
            arrays[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
            drawn.append(
                f"'{spec.name}' standard-normal noise" + (" truncated to integers" if spec.dtype.kind in "iu" else "")
            )
    warning = (
        f"contexts are random, not data ({'; '.join(drawn)}): the scores describe the model off its data distribution"
    )
    return Contexts(arrays=arrays, source=f"random(seed={seed})", warnings=[warning])


def npz_layout(inputs: Sequence[IOSpec]) -> str:
    """What an .npz of windows for these inputs holds, e.g. "input_ids (windows, batch, seq) int64"."""
    return ", ".join(
        f"'{s.name}' ({', '.join(['windows', *(str(d) if d is not None else '?' for d in s.shape)])}) {s.dtype}"
        for s in inputs
    )


def load_contexts(
    path: Path | None,
    inputs: Sequence[IOSpec],
    options: ContextOptions = ContextOptions(),
    *,
    following: int = 0,
    rows: Mapping[str, int] | None = None,
) -> Contexts:
    """Dispatch on the file type; random contexts (sized by `options.dims`, ids within `rows`) only when asked;
    `following`: rows a CSV window keeps after it (evaluation's truth)."""
    dims = dict(options.dims)
    if path is not None and options.random:
        raise InputError("--random-contexts and --contexts exclude each other", hint="drop one")
    if dims and not options.random:
        raise InputError(
            "--dim sizes the axes of random contexts; a contexts file gives its own shapes",
            hint="drop --dim, or use --random-contexts",
        )
    if path is None:
        if not options.random:
            raise InputError(
                "no contexts given", hint="pass --contexts FILE (.npz or .csv), or --random-contexts to score on noise"
            )
        return random_contexts(inputs, options.windows, options.seed, dims, rows)
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return load_csv(path, inputs, options.windows, options.zscore, options.columns, following)
    if options.columns:
        raise InputError("--columns picks series of a CSV; an .npz holds one array per model input")
    if options.zscore:  # an .npz would otherwise run unstandardised windows without a word
        raise InputError(
            "--zscore standardises the columns of a CSV; an .npz is used as it is",
            hint="standardise the arrays before saving them, or drop --zscore",
        )
    if suffix != ".npz":
        raise InputError(
            f"contexts file {path} is not an .npz or a .csv",
            hint="expected an .npz with one array per model input (leading axis = windows) or a CSV of numeric columns",
        )
    return load_npz(path, inputs)
