"""A large model's kept passes on disk: each pass's codes written once to a file and mapped back read-only.

An export of a model past `ONE_SESSION_BYTES` keeps the uniform passes it may still read (the price list's tiers,
the fallback's): up to a byte per weight each, in anonymous memory for the whole export beside the model's own
pages. Mapped from a file, the same bytes are the operating system's file cache: resident while a rollout or the
writer reads them and handed back after (`release`), as the model's weights are (`graph_ops.FileWeights`). The file
is unlinked as soon as it is mapped, so nothing is left behind, whatever ends the process.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np

from tiers import Encoded
from tqsdeploy.encoding.checkpoints import flatten, restore

ALIGN = 64
"""Each array starts on this many bytes (the kernels' vector width; a page would waste more than it gains)."""
MIN_BYTES = 1 << 16
"""Arrays smaller than this stay in memory (scales, zero points): a page of file cache would hold more."""


class Spill:
    """Passes kept in files under `folder`, one file (mapped, then unlinked) per pass."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._maps: list[weakref.ref] = []
        """Each pass's map, held by its views alone: a pass dropped (`Encoder.forget`) frees its file's disk blocks."""
        self.bytes = 0
        """Bytes moved to files so far (what anonymous memory no longer holds)."""

    def keep(self, encodings: dict[str, Encoded], weights=None) -> dict[str, Encoded]:
        """`encodings` with their large arrays read from a file instead of memory (the same values, read-only),
        each taken apart and put together as the run's cache does (`checkpoints.flatten`, `restore`). An encoding
        with no large array, such as a 'raw' one that is the weight itself (`weights[name]`), is left as it is."""
        weights = weights or {}
        flat = {}
        for name, encoded in encodings.items():
            arrays: list[np.ndarray] = []
            fields = flatten(encoded, weights.get(name), arrays)
            if any(_large(a) for a in arrays):
                flat[name] = (fields, arrays)
        if not flat:
            return encodings
        self.folder.mkdir(parents=True, exist_ok=True)
        offsets, position = {}, 0
        handle, path = tempfile.mkstemp(dir=self.folder, prefix=".spill-")
        try:
            with os.fdopen(handle, "wb") as sink:
                for name, (_, arrays) in flat.items():
                    for index, raw in enumerate(arrays):
                        if not _large(raw):
                            continue
                        padding = -position % ALIGN
                        sink.write(b"\0" * padding)
                        offsets[(name, index)] = position = position + padding
                        sink.write(raw.data)
                        position += raw.nbytes
            with open(path, "rb") as source:
                mapped = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_READ)
        finally:
            os.unlink(path)
        self._maps.append(weakref.ref(mapped))
        self.bytes += position
        kept = dict(encodings)
        for name, (fields, arrays) in flat.items():
            views = [
                np.frombuffer(mapped, np.uint8, raw.nbytes, offsets[(name, i)]) if (name, i) in offsets else raw
                for i, raw in enumerate(arrays)
            ]  # read-only: the map is
            kept[name] = restore(fields, views, weights.get(name))
        return kept

    def release(self) -> None:
        """Hand the pages read so far back to the operating system (the next read faults them in from the file)."""
        self._maps = [ref for ref in self._maps if ref() is not None]
        for ref in self._maps:
            mapped = ref()
            if mapped is not None and not mapped.closed:
                mapped.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Unmap every file no encoding still views (a map still viewed goes with its last view)."""
        for ref in self._maps:
            mapped = ref()
            try:
                if mapped is not None:
                    mapped.close()
            except BufferError:
                pass
        self._maps.clear()


def _large(raw: np.ndarray) -> bool:
    """Whether an array goes to the file (an empty one has nothing to map)."""
    return 0 < raw.nbytes and raw.nbytes >= MIN_BYTES
