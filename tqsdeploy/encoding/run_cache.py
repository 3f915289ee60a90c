"""The export cache of a score run: work done once per run, reused by every later `export` and `frontier` of it.

`export-cache/` in the run folder holds each weight a uniform or calibrated pass encoded (`weights/`, written by
`checkpoints.PassCheckpoints` under a key of everything its codes depend on) and small measured values
(`values/`: a candidate's drift keyed by the digest of the codes it fed, a tier's grid or method choice). Every
key hashes the settings that change codes, the score run, the runtime, the versions and tqsdeploy's own sources,
so an entry made by other code or settings is never read: a cache may save time, never change an answer.

The folder is capped in bytes (`TQS_CACHE_BYTES`, `export --cache-bytes`; default `DEFAULT_COPIES` times the
units' parameter count, about that many copies of the model's INT8 codes), the least recently used entries
dropped first, and `cache.json` says what it holds (entries, bytes, last use). `score --fresh` and
`export --fresh` drop it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from tqsdeploy.errors import InputError
from tqsdeploy.files import write_json

FOLDER = "export-cache"
NOTE = "cache.json"
LOCK = ".cache.lock"
ENV = "TQS_CACHE_BYTES"
DEFAULT_COPIES = 8
"""Default cap: this many bytes per unit parameter (an export keeps ~6 passes of 0.25-1 byte per weight; a
frontier ~25)."""
MIN_BYTES = 64 << 20
"""The default cap is never below this: a small model's whole frontier fits."""
KINDS = ("weights", "values")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str, option: str = ENV) -> int:
    """'512M', '2G', '1000000' as bytes (binary multiples); a malformed size is an input error naming `option`."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text).lower())
    if found is None:
        raise InputError(f"{option} takes a size in bytes such as 512M or 2G, not {text!r}")
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def cap_bytes(asked: int | None, unit_params: int) -> int:
    """The cache's cap: `asked`, else `TQS_CACHE_BYTES`, else `DEFAULT_COPIES` bytes per unit parameter."""
    if asked is not None:
        return asked
    if os.environ.get(ENV, "").strip():
        return parse_bytes(os.environ[ENV])
    return max(MIN_BYTES, DEFAULT_COPIES * unit_params)


def key(*parts: str) -> str:
    """A cache key: the hash of what the entry depends on."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:40]


def drop(run_dir: Path) -> None:
    """Remove a run folder's cache (`--fresh`)."""
    folder = Path(run_dir) / FOLDER
    if folder.is_dir():
        with FileLock(str(Path(run_dir) / LOCK)):
            shutil.rmtree(folder, ignore_errors=True)


class RunCache:
    """One process's view of a run folder's cache: entries read and written, the cap applied by `settle`."""

    def __init__(self, run_dir: Path, cap: int):
        self.run_dir, self.cap = Path(run_dir), cap
        self.folder = self.run_dir / FOLDER
        self.read: Counter = Counter()
        """Entries this process read, by kind ('weights', 'drift', 'choice')."""
        self.made: Counter = Counter()
        """Entries this process wrote, by kind."""
        self._labels: dict[str, tuple[str, str]] = {}
        """Entries this process wrote: path relative to the folder -> (kind, label), for the note."""
        self.note: dict = {}
        """`cache.json` as the last `settle` wrote it."""

    def path(self, kind: str, name: str) -> Path:
        suffix = ".npz" if kind == "weights" else ".json"
        return self.folder / ("weights" if kind == "weights" else "values") / f"{name}{suffix}"

    def mine(self, path: Path) -> bool:
        """Whether this process wrote the entry at `path` (what it reads back of its own is not a reuse)."""
        return path.relative_to(self.folder).as_posix() in self._labels

    def used(self, path: Path, kind: str) -> None:
        """An entry was read: it becomes the most recently used."""
        try:
            os.utime(path)
        except OSError:
            pass
        if not self.mine(path):
            self.read[kind] += 1

    def wrote(self, path: Path, kind: str, label: str) -> None:
        self._labels[path.relative_to(self.folder).as_posix()] = (kind, label)
        self.made[kind] += 1

    def value(self, kind: str, name: str) -> dict | None:
        """A measured value kept under `name` (a `key`), or None."""
        path = self.path(kind, name)
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):  # none, or damaged: measured again
            return None
        if not isinstance(entry, dict) or entry.get("kind") != kind:
            return None
        self.used(path, kind)
        return entry["value"]

    def keep(self, kind: str, name: str, label: str, value) -> None:
        path = self.path(kind, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"kind": kind, "label": label, "value": value})
        self.wrote(path, kind, label)

    def counts(self) -> dict[str, dict[str, int]]:
        """What this process read from the cache and wrote to it so far, by kind."""
        return {"read": dict(self.read), "made": dict(self.made)}

    def since(self, earlier: dict | None) -> dict[str, dict[str, int]]:
        """What was read and made since `earlier` (a `counts`), by kind, with the cache's size now."""
        now, earlier = self.counts(), earlier or {}
        spent = {
            way: {kind: n - earlier.get(way, {}).get(kind, 0) for kind, n in counts.items()}
            for way, counts in now.items()
        }
        return spent | {"cap_bytes": self.cap}

    def settle(self) -> dict:
        """Drop the least recently used entries past the cap and write the note (`cache.json`); the note."""
        if not self.folder.is_dir():
            return {}
        with FileLock(str(self.run_dir / LOCK)):
            note_path = self.folder / NOTE
            try:
                earlier = {e["path"]: e for e in json.loads(note_path.read_text()).get("files", [])}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                earlier = {}
            entries = self._entries(earlier)
            entries.sort(key=lambda e: e["last_used"])
            total = sum(e["bytes"] for e in entries)
            while entries and total > self.cap:
                oldest = entries.pop(0)
                (self.folder / oldest["path"]).unlink(missing_ok=True)
                total -= oldest["bytes"]
            note = {
                "cap_bytes": self.cap,
                "bytes": total,
                "entries": len(entries),
                "by_kind": {
                    kind: {
                        "entries": sum(e["kind"] == kind for e in entries),
                        "bytes": sum(e["bytes"] for e in entries if e["kind"] == kind),
                    }
                    for kind in sorted({e["kind"] for e in entries})
                },
                "files": [
                    e | {"last_used": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e["last_used"]))}
                    for e in reversed(entries)
                ],
            }
            write_json(note_path, note)
        self.note = note
        return note

    def _entries(self, earlier: dict) -> list[dict]:
        """Every entry on disk: its path, kind, label (this process's, else the note's), bytes and last use."""
        entries = []
        for sub in ("weights", "values"):
            folder = self.folder / sub
            if not folder.is_dir():
                continue
            with os.scandir(folder) as listing:
                for item in listing:
                    if not item.is_file() or item.name.startswith("."):
                        continue
                    relative = f"{sub}/{item.name}"
                    status = item.stat()
                    kind, label = self._labels.get(
                        relative, (earlier.get(relative, {}).get("kind", sub), earlier.get(relative, {}).get("label"))
                    )
                    entries.append(
                        {
                            "path": relative,
                            "kind": kind,
                            "label": label,
                            "bytes": status.st_size,
                            "last_used": status.st_mtime,
                        }
                    )
        return entries


@dataclass(frozen=True)
class CacheOptions:
    """How an export uses its run's cache."""

    cap_bytes: int | None = None
    """The cap (`cap_bytes`); None: `TQS_CACHE_BYTES`, else the default."""
    fresh: bool = False
    """Drop the cache (and the run's measured prices) before the export: everything is made again."""
