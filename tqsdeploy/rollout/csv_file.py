"""A CSV of series read strictly: UTF-8, named columns each once, every used cell a finite float32 number,
and the layout its columns take in a model input."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from runtimes import IOSpec
from tqsdeploy.errors import InputError
from tqsdeploy.rollout.spec import shape_text

FLOAT32_MAX = float(np.finfo(np.float32).max)


def read_csv_columns(path: Path, columns: Sequence[str] | None = None) -> tuple[np.ndarray, list[str]]:
    """The numeric columns of a CSV as float64 (rows, columns), strictly.

    `columns` picks series by name; otherwise every column where most cells are
    numbers is used (dates and labels, where none are, are skipped). A used
    column's cell that is empty, not a number, not finite or beyond float32's
    range is an error naming its line and column, never a dropped column or an
    Inf in the model's input.
    """
    frame = _read_frame(path)
    header = _header(path)
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:  # polars renames the second 'OT' to 'OT_duplicated_0': --columns OT would read whichever came first
        raise InputError(
            f"contexts file {path} has more than one column named '{repeated[0]}' (its header: {', '.join(header)})",
            hint="give each column its own name",
        )
    if columns:
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise InputError(f"contexts file {path} has no column '{missing[0]}' (it has: {', '.join(frame.columns)})")
        used = list(columns)
    else:
        used = _numeric_columns(frame)
        if not used:
            raise InputError(f"contexts file {path} has no numeric columns", hint="name the series with --columns")
    data = np.empty((frame.height, len(used)), np.float64)
    for j, name in enumerate(used):
        data[:, j] = _column_values(frame, name, path)
    return data, used


def _read_frame(path: Path):
    """The CSV as a polars frame of strings (every cell is checked here, not guessed by polars)."""
    import polars as pl

    try:
        _check_utf8(path)
        return pl.read_csv(path, infer_schema=False)
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"contexts file {path} does not exist") from None
    except Exception as exc:
        raise InputError(f"contexts file {path} is not a readable CSV ({str(exc).splitlines()[0]})") from None


def _numeric_columns(frame) -> list[str]:
    """The columns where most filled cells are numbers."""
    import polars as pl

    used = []
    for name in frame.columns:
        cells = frame[name].str.strip_chars()
        filled = cells.drop_nulls().filter(cells.drop_nulls() != "")
        if filled.len() and filled.cast(pl.Float64, strict=False).drop_nulls().len() > filled.len() / 2:
            used.append(name)
    return used


def _column_values(frame, name: str, path: Path) -> np.ndarray:
    """One used column as float64; its first bad cell is an error naming its line and what is wrong with it."""
    import polars as pl

    cells = frame[name].str.strip_chars()
    values = cells.cast(pl.Float64, strict=False).to_numpy()
    bad = np.flatnonzero(~np.isfinite(values) | (np.abs(np.nan_to_num(values)) > FLOAT32_MAX))
    if bad.size:
        row = int(bad[0])
        cell = cells[row]
        line = row + 2  # the header is line 1
        if cell is None or cell == "":
            why = "is empty (a missing value)"
        elif np.isnan(values[row]) and cell.lower() not in ("nan", "+nan", "-nan"):
            why = f"'{cell}' is not a number"
        elif np.isfinite(values[row]):
            why = f"{cell} is beyond float32's range (±{FLOAT32_MAX:.3g}), the models' input type"
        else:
            why = f"'{cell}' is not finite"
        more = f" ({bad.size} such cells in this column)" if bad.size > 1 else ""
        raise InputError(f"contexts file {path}, line {line}, column '{name}': {why}{more}")
    return values


def _check_utf8(path: Path) -> None:
    """A CSV must be UTF-8: polars reads other encodings lossily (a Latin-1 '°C' header became 'temp\ufffdC', a
    UTF-16 file 'no numeric columns'), so a column name or a cell would be silently something else."""
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        found = "a UTF-16 byte order mark" if utf16 else f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        raise InputError(
            f"contexts file {path} is not UTF-8 text ({found})",
            hint="save it as UTF-8 (iconv -f ITS-ENCODING -t utf-8)",
        ) from None


def _header(path: Path) -> list[str]:
    """The CSV's column names as written (polars renames repeated ones)."""
    import csv

    with open(path, newline="", encoding="utf-8-sig", errors="replace") as handle:
        return [name.strip() for name in next(csv.reader(handle), [])]


def csv_layout(spec: IOSpec, names: Sequence[str], path: Path | str = "the CSV") -> tuple[int, str]:
    """Window length and layout ('univariate', 'time-major', 'channel-major') of a CSV's columns `names` for a
    model input."""
    shape, columns = spec.shape, len(names)
    if spec.rank == 2 and isinstance(shape[1], int):
        return shape[1], "univariate"
    if spec.rank == 3 and shape[2] == columns and isinstance(shape[1], int):
        return shape[1], "time-major"
    if spec.rank == 3 and shape[1] == columns and isinstance(shape[2], int):
        return shape[2], "channel-major"
    fewer = [d for d in shape[1:] if isinstance(d, int) and d < columns] if spec.rank == 3 else []
    if fewer:  # a fixed series axis: the model cannot take every column, so which ones is the user's choice
        k = min(fewer)
        raise InputError(
            f"model input '{spec.name}' {shape_text(shape)} takes {k} series per window, "
            f"and {path} has {columns} numeric columns ({', '.join(names)})",
            hint=f"pick {k} with --columns, e.g. --columns {','.join(names[-k:])}",
        )
    raise InputError(
        f"cannot cut CSV columns ({columns}) into model input '{spec.name}' {shape_text(shape)}; "
        f"expected [batch, L], [batch, L, {columns}] or [batch, {columns}, L]"
    )
