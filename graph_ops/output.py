"""Output files put in place safely: a write lands under its final name whole or not at all.

Every file a command writes goes through `atomic_output`; output folders are checked before the work
(`check_writable`) and the ones a failed command created are removed again. A model and its external data
change together (`publish_model`), and a replaced model's data file goes only when nothing else names it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import uuid
from pathlib import Path
from typing import Callable, Iterator

import onnx
from onnx import external_data_helper

from graph_ops.io import PROTOBUF_LIMIT, SKELETON_BYTES, OutputError, iter_tensors, stored_bytes


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` that replaces `path` only when the block succeeds.

    An interrupted or failed write leaves the previous file (or none) under
    the final name, never a truncated one; write failures become one-line
    `OutputError`s naming the file.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # 'File exists' / 'Not a directory' alone do not say which path is the file in the way
        blocker = next((p for p in (path.parent, *path.parent.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker is not None else exc.strerror or exc
        raise OutputError(f"cannot create folder {path.parent}: {why}") from None
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        yield temporary
        os.replace(temporary, path)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        if temporary.exists():
            temporary.unlink()


def missing_folders(folder: str | os.PathLike) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first (what creating it would make)."""
    folder = Path(folder).absolute()
    return [parent for parent in (folder, *folder.parents) if not parent.exists()]


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove the folders (deepest first) that are still empty; a folder that gained files stays."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def check_writable(folder: str | os.PathLike) -> None:
    """Fail now, before any work, when `folder` cannot take new files.

    Folders the check had to create are removed again, so a command that then
    fails on its input leaves no empty output folder behind."""
    created = missing_folders(folder)
    try:
        with atomic_output(Path(folder) / ".tqs-write-check") as probe:
            try:
                probe.write_bytes(b"")
            except OSError as exc:  # the folder, not the probe's own name, is what the user can act on
                raise OutputError(f"cannot write into folder {folder}: {exc.strerror or exc}") from None
        (Path(folder) / ".tqs-write-check").unlink(missing_ok=True)
    finally:
        remove_empty_folders(created)


def data_location(path: Path) -> str:
    """A fresh external-data file name for model `path`: a new write never overwrites the data an
    older copy of the model still points to, so model and data change together, at the model's rename."""
    return f"{path.name}.{uuid.uuid4().hex[:8]}.data"


def publish_model(path: Path, location: str | None, write: Callable[[Path], None]) -> None:
    """Put a model in place: `write` fills a temporary model file (and may write the external-data file
    `location` beside `path`, None: the model holds its weights), which then replaces `path` atomically.

    A failed or interrupted write removes `location` (no model points to it: a full disk keeps no orphan
    of the model's size). After the rename, the data file the replaced model pointed to goes, and nothing
    else: a name this writer did not make, or one another model in the folder still points to (a copy,
    the input itself), is never removed."""
    try:
        replaced = _data_files_of(path)
        with atomic_output(path) as temporary:
            write(temporary)
    except BaseException:
        if location is not None:
            path.with_name(location).unlink(missing_ok=True)
        raise
    ours = re.compile(re.escape(path.name) + r"\.[0-9a-f]{8}\.data")
    for name in replaced - {location}:
        stale = path.with_name(name)
        if ours.fullmatch(name) and stale.is_file() and not _named_by_other_model(stale, path):
            stale.unlink(missing_ok=True)


def _data_files_of(path: Path) -> set[str]:
    """External-data file names the model now at `path` points to (none: no model there, not one we can
    read, or one holding its weights inside, which is too large to parse for nothing)."""
    try:
        if not path.is_file() or path.stat().st_size > SKELETON_BYTES:
            return set()
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - whatever is there, nothing of it is removed
        return set()
    return {
        external_data_helper.ExternalDataInfo(t).location
        for t in iter_tensors(proto.graph)
        if external_data_helper.uses_external_data(t)
    }


def _named_by_other_model(data: Path, model: Path) -> bool:
    """Whether another .onnx file in the folder holds the data file's name (a reference stores it as plain
    bytes): a search, not a parse, so a model of any size is cheap to rule out; unreadable counts as named."""
    needle = data.name.encode()
    for other in data.parent.glob("*.onnx"):
        if other == model or not other.is_file():
            continue
        try:
            with open(other, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
                if view.find(needle) != -1:
                    return True
        except ValueError:  # an empty file cannot be mapped, and names nothing
            continue
        except OSError:
            return True
    return False


def save_model(proto: onnx.ModelProto, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Write a model atomically, with a side-car external-data file above 2 GiB (or when asked).

    With external data the proto's tensors are moved out of it (onnx does so in place).
    """
    path = Path(path)
    if external_data is None:
        external_data = stored_bytes(proto) >= PROTOBUF_LIMIT
    if not external_data:
        publish_model(path, None, lambda temporary: onnx.save_model(proto, str(temporary)))
        return path
    location = data_location(path)
    publish_model(
        path,
        location,
        lambda temporary: onnx.save_model(
            proto,
            str(temporary),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=location,
            size_threshold=1024,
        ),
    )
    return path
