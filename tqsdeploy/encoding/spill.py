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
from dataclasses import replace
from pathlib import Path

import numpy as np

from tiers import Encoded
from tiers.encoded import PackedCodes

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
        """`encodings` with their large arrays read from a file instead of memory (the same values, read-only). A
        'raw' encoding that is the weight itself (`weights[name]`) is left as it is: it is the model's."""
        arrays: list[np.ndarray] = []

        def collect(encoded: Encoded) -> None:
            for value in (_data(encoded.values), encoded.scale, encoded.zero_point):
                if isinstance(value, np.ndarray) and value.nbytes >= MIN_BYTES:
                    arrays.append(value)
            for part in encoded.parts:
                collect(part)

        own = {n: e for n, e in encodings.items() if weights is None or e.values is not weights.get(n)}
        for encoded in own.values():
            collect(encoded)
        if not arrays:
            return encodings
        self.folder.mkdir(parents=True, exist_ok=True)
        offsets, position = {}, 0
        handle, path = tempfile.mkstemp(dir=self.folder, prefix=".spill-")
        try:
            with os.fdopen(handle, "wb") as sink:
                for value in arrays:
                    if id(value) in offsets:
                        continue
                    padding = -position % ALIGN
                    sink.write(b"\0" * padding)
                    position += padding
                    offsets[id(value)] = position
                    sink.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)  # int4 &c.: no buffer
                    position += value.nbytes
            with open(path, "rb") as source:
                mapped = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_READ)
        finally:
            os.unlink(path)
        self._maps.append(weakref.ref(mapped))
        self.bytes += position

        def mapped_view(value):
            if not isinstance(value, np.ndarray) or id(value) not in offsets:
                return value
            raw = np.frombuffer(mapped, np.uint8, value.nbytes, offsets[id(value)])  # read-only: the map is
            return raw.view(value.dtype).reshape(value.shape)

        def moved(encoded: Encoded) -> Encoded:
            values = encoded.values
            if isinstance(values, PackedCodes):
                values = PackedCodes(mapped_view(values.data), values.dtype, values.shape)
            else:
                values = mapped_view(values)
            return replace(
                encoded,
                values=values,
                scale=mapped_view(encoded.scale),
                zero_point=mapped_view(encoded.zero_point),
                parts=tuple(moved(p) for p in encoded.parts),
            )

        return {n: moved(e) if n in own else e for n, e in encodings.items()}

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


def _data(values):
    return values.data if isinstance(values, PackedCodes) else values
