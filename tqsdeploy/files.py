"""Every output file is written to a temporary name beside it and renamed into place.

An interrupted command (Ctrl-C, kill -9, a full disk) therefore leaves the
previous file or none under each final name, never a truncated one; write
failures are one-line input errors naming the file. Models go through
`graph_ops.output.save_model` / `graph_ops.qdq.write_storage`, which do the same
for a model and its external data together.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import io
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from graph_ops.io import OutputError
from graph_ops.output import atomic_output, check_writable, missing_folders, remove_empty_folders

__all__ = [
    "RunFolderShare",
    "atomic_output",
    "check_writable",
    "claim_run_folder",
    "file_identity",
    "json_text",
    "write_json",
    "write_npz",
    "write_table",
    "write_text",
    "write_texts",
]


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_output(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)


def json_text(data) -> str:
    return json.dumps(data, indent=2, default=str)


def write_json(path: str | os.PathLike, data) -> Path:
    return write_text(path, json_text(data))


def write_texts(files: dict[Path, str]) -> list[Path]:
    """Files read as one set (gate.json, gate.md and junit.xml): each goes to its temporary name, and they are
    renamed into place only once every one was written and none is blocked by a folder, so a failure leaves the
    previous set (or none), never a new verdict beside an old one."""
    paths = [Path(path) for path in files]
    with contextlib.ExitStack() as stack:
        for path, text in zip(paths, files.values()):
            stack.enter_context(atomic_output(path)).write_text(text, encoding="utf-8")
        for path in paths:  # the one rename that fails where writing beside it worked
            if path.is_dir():
                raise OutputError(f"cannot write {path}: it is a folder")
    return paths


def write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> Path:
    with atomic_output(path) as temporary:
        with open(temporary, "wb") as handle:  # a handle: np.savez would append .npz to the temporary name
            np.savez(handle, **arrays)
    return Path(path)


def write_table(frame, path: str | os.PathLike) -> Path:
    """A polars frame as Parquet or CSV, by the file's suffix.

    Serialised in memory and written with Python's own I/O: polars reports a failed write (a full disk)
    as a ComputeError, which would surface as an internal error instead of one line naming the file."""
    buffer = io.BytesIO()
    if Path(path).suffix == ".csv":
        frame.write_csv(buffer)
    else:
        frame.write_parquet(buffer)
    data = (
        buffer.getvalue()
    )  # bytes, not getbuffer()'s view: a failed write's traceback kept the view and its BytesIO in a
    del buffer  # cycle, and Python 3.12 segfaulted collecting it (exit 139 after the one-line error)
    with atomic_output(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


RUN_MARKER = "run.json"
LOCK_NAME = ".tqsdeploy.lock"
REPLACED = ".replaced"
"""Where a run being replaced (score --fresh) waits until the new run has a result (`tqsdeploy.scoring.score`)."""


def file_identity(path: Path) -> tuple[int, int, int] | None:
    """What tells a rewritten file from the one that was there (atomic writes replace the inode)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


@contextlib.contextmanager
def claim_run_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold a run folder for this process alone while the block writes into it.

    The folder must be new, empty, or a tqsdeploy run folder (it holds
    run.json): a folder of the user's own files is refused rather than
    overwritten. A second process that wants the same folder is refused at
    once instead of mixing its results into this run, and so is one while an
    export reads the run (`RunFolderShare`). A command that fails
    before it records its run (run.json) removes the files it made there (a
    large model's session file, say), which would otherwise make the folder
    "not a run folder and not empty" and block the next, correct command.
    """
    folder = Path(folder)
    _check_run_folder(folder)
    check_writable(folder)
    made = missing_folders(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = _lock_run_folder(folder)
    for stale in folder.glob(".*.partial"):  # a write a killed command left (`atomic_output`): no writer now
        stale.unlink(missing_ok=True)
    before, recorded = {p.name for p in folder.iterdir()}, file_identity(folder / RUN_MARKER)
    try:
        yield folder
    except BaseException:
        # refused (or stopped) before recording a run: what it made goes
        if file_identity(folder / RUN_MARKER) in (None, recorded):
            for path in folder.iterdir():
                if path.name not in before and path.name != LOCK_NAME and path.is_file():
                    path.unlink(missing_ok=True)
        raise
    finally:
        lock.release()
        if made and [p.name for p in folder.iterdir()] == [LOCK_NAME]:  # refused before writing: leave no trace
            (folder / LOCK_NAME).unlink(missing_ok=True)
            remove_empty_folders(made)


def _check_run_folder(folder: Path) -> None:
    """Refuse a file, or a folder of the user's own files, as a run folder."""
    from tqsdeploy.errors import InputError

    if folder.exists() and not folder.is_dir():
        raise InputError(f"run folder {folder} is a file")
    # .replaced: a run killed as it began
    if folder.is_dir() and not (folder / RUN_MARKER).exists() and not (folder / REPLACED).is_dir():
        foreign = sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            raise InputError(
                f"{folder} is not a tqsdeploy run folder and not empty (it holds {shown})",
                hint="choose a new or empty folder with --out",
            )


def _lock_run_folder(folder: Path):
    """The run folder's lock, held; refused at once while another command writes it or an export reads it."""
    from filelock import FileLock, Timeout

    from tqsdeploy.errors import InputError

    lock = FileLock(str(folder / LOCK_NAME))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        exporting = _only_shared(folder)
        if not exporting or not _acquired_after_collecting(lock):
            raise InputError(
                f"an export is reading the score run in {folder}"
                if exporting
                else f"another tqsdeploy command is writing to {folder}",
                hint="wait for it to finish (in Python: close its Planner, or use it in a with block), "
                "or use another folder",
            ) from None
    return lock


def _only_shared(folder: Path) -> bool:
    """Whether the folder's holders are exports (`RunFolderShare`), not a command writing it."""
    with open(folder / LOCK_NAME, "a") as probe:  # closing it drops the probe's own share
        try:
            fcntl.flock(probe.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


def _acquired_after_collecting(lock) -> bool:
    """The claim tried again once unreachable objects are gone: a `Planner` of this process dropped without
    `close()` holds its share until it is collected, and must not refuse a later score in its folder."""
    from filelock import Timeout

    gc.collect()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    return True


class RunFolderShare:
    """An export's hold on the score run folder it reads, from its start until `release` (or until it is
    garbage collected).

    Exports share the folder (two exports of one run coordinate their prices through `.measured.lock`); a
    command that writes the run (`claim_run_folder`: score, whose --fresh replaces it) needs the folder alone. So
    a score is refused while an export reads the run, and an export while a score writes it: a score --fresh
    that replaced the run under a running export would get that export's prices, measured on the old rollout, in
    its new run, where later exports would reuse them. A folder that cannot be locked (read-only, a file system without
    flock) is read without the hold; the export still checks the run before each price it writes
    (`ScoreRun.check_unchanged`)."""

    def __init__(self, folder: str | os.PathLike):
        from tqsdeploy.errors import InputError

        self.folder, self._handle = Path(folder), None
        if not (self.folder / RUN_MARKER).exists():
            return  # no run here: loading it says so
        try:
            handle = open(self.folder / LOCK_NAME, "a")
        except OSError:
            return
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise InputError(
                f"a score command is writing to {self.folder}", hint="wait for it to finish, then export"
            ) from None
        except OSError:
            handle.close()
            return
        self._handle = handle

    @property
    def held(self) -> bool:
        return self._handle is not None

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()  # the share goes with the descriptor
