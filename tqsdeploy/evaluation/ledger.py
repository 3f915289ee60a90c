"""The frontier's ledger of finished work: each export and evaluation, so a rerun after an interruption redoes none.

One JSON line per finished step under an identity of everything the work depends on (model, score run, settings,
contexts, runtime, code): entries of another identity are ignored, an export whose files changed since is made
again, and a half-written last line (a kill) is dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tqsdeploy.files import write_text

PROGRESS = "frontier-progress.jsonl"
"""The ledger's name in the frontier's folder; its presence marks the folder as a frontier's."""


def stamp(path: Path) -> list[int] | None:
    """What tells a file from one written since: its size and modification time."""
    try:
        status = path.stat()
    except OSError:
        return None
    return [status.st_size, status.st_mtime_ns]


def digest(path: str | Path | None) -> str | None:
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []


class Ledger:
    """Finished work read back from, and appended to, the ledger file at `path`."""

    def __init__(self, path: Path, identity: dict):
        self.path = path
        self.identity = _hash(identity)
        self.parts = {k: _hash(v)[:16] for k, v in identity.items()}
        self.entries: dict[str, dict] = {}
        lines = _read_lines(path)
        earlier, kept = self._take(lines)
        self.changed = sorted(k for k in self.parts if earlier.get(k) != self.parts[k]) if earlier is not None else []
        """What differs from the earlier work found in the ledger (score, model, settings, runtime, splits, code)."""
        self._headed = bool(lines) and kept == len(lines) and kept > len(self.entries)
        if lines and not self._headed:  # another identity's entries (or a torn line): this one's stay, under its header
            entries = ({"identity": self.identity, "key": k, "value": v} for k, v in self.entries.items())
            write_text(path, "".join(json.dumps(e, default=str) + "\n" for e in [self._header(), *entries]))
            self._headed = True

    def _take(self, lines: list[str]) -> tuple[dict | None, int]:
        """Keep this identity's entries (up to a torn line); return the parts of the last other identity's header
        and how many lines are this identity's."""
        earlier, kept = None, 0
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                break
            if not isinstance(entry, dict):
                continue
            if "parts" in entry:  # a header: what the work after it was done for
                earlier = entry["parts"] if entry.get("identity") != self.identity else earlier
                kept += entry.get("identity") == self.identity
            elif entry.get("identity") == self.identity:
                self.entries[entry["key"]] = entry["value"]
                kept += 1
        return earlier, kept

    def _header(self) -> dict:
        return {"identity": self.identity, "parts": self.parts}

    def put(self, key: str, value: dict) -> None:
        self.entries[key] = value
        with open(self.path, "a", encoding="utf-8") as handle:
            if not self._headed:
                handle.write(json.dumps(self._header()) + "\n")
                self._headed = True
            handle.write(json.dumps({"identity": self.identity, "key": key, "value": value}, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def export(self, key: str) -> dict | None:
        """A finished export's recorded fields, if its files are still the ones it wrote."""
        value = self.entries.get(key)
        if value is None or any(stamp(Path(f)) != stamped for f, stamped in value["files"].items()):
            return None
        return dict(value["candidate"])

    def put_export(self, key: str, fields: dict, files) -> None:
        self.put(key, {"candidate": fields, "files": {str(f): stamp(Path(f)) for f in files}})

    def evaluation(self, key: str, path: Path) -> dict | None:
        """A finished evaluation of the file at `path`, if it is still the file evaluated (not one made since)."""
        kept = self.entries.get(key)
        return kept if kept is not None and kept.get("stamp") == stamp(path) else None
