"""Every weight a pass encoded, kept in the run's cache: an interrupted export resumes, and a later one reuses it.

A calibrated pass (GPTQ, GPTAQ, QEP) encodes the weights wave by wave, each wave on statistics collected with every
earlier wave at its codes: the slow part of an export (a 22-minute pass on a user's model). Each weight it finishes
is written at once to the run's cache (`run_cache`, `export-cache/weights/<key>.npz`) under a key that hashes
everything its codes depend on: the export's identity (the score run's fingerprint of model, contexts, rollout and
settings; the target; the runtime; opset; versions and sources), the group size, how the pass encodes the weight
(its channel runs, each with its tier, grid and rounding) and the codes of every weight its statistics depend on
(those upstream of its inputs). So a rerun finds what an interrupted export finished, a later export at another C
finds every weight an earlier pass (uniform or mixed) encoded the same way on the same inputs, and a weight whose
inputs changed gets another key and is encoded again. Passes that round to nearest are kept the same way.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from pathlib import Path
from typing import Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from tiers import Encoded
from tiers.encoded import PackedCodes
from tqsdeploy.encoding import run_cache
from tqsdeploy.encoding.run_cache import FOLDER, RunCache
from tqsdeploy.files import write_npz

__all__ = [
    "FOLDER",
    "PassCheckpoints",
    "code_hash",
    "digest",
    "finished",
    "flatten",
    "interrupted_outputs",
    "record_output",
    "restore",
]


def _dtype(name: str) -> np.dtype:
    custom = getattr(
        ml_dtypes, name, None
    )  # int4, float8_e4m3fn, bfloat16 ...: numpy knows them only through ml_dtypes
    return np.dtype(custom if custom is not None else name)


def flatten(encoded: Encoded, weight: np.ndarray | None, arrays: list[np.ndarray]) -> dict:
    """The encoding as JSON-able fields, its arrays appended to `arrays` (raw bytes: ml_dtypes types
    do not survive np.load without pickle). A 'raw' encoding that is the weight itself is stored as a
    reference to it: the file writer keeps such a weight as it is, and it costs nothing to keep."""

    def array(value) -> dict | None:
        if value is None:
            return None
        if isinstance(value, PackedCodes):
            return {"packed": array(value.data), "dtype": value.dtype.name, "shape": list(value.shape)}
        value = np.ascontiguousarray(value)
        arrays.append(value.reshape(-1).view(np.uint8))
        return {"index": len(arrays) - 1, "dtype": value.dtype.name, "shape": list(value.shape)}

    fields = {
        "tier": encoded.tier,
        "form": encoded.form,
        "shape": list(encoded.shape),
        "axis": encoded.axis,
        "block_size": encoded.block_size,
        "dtype": encoded.dtype,
    }
    if encoded.form == "raw" and weight is not None and encoded.values is weight:
        fields["values"] = "weight"
    else:
        fields["values"] = array(encoded.values)
    fields["scale"], fields["zero_point"] = array(encoded.scale), array(encoded.zero_point)
    fields["parts"] = [flatten(part, None, arrays) for part in encoded.parts]
    return fields


def restore(fields: dict, arrays: Sequence[np.ndarray], weight: np.ndarray | None) -> Encoded:
    """The encoding `flatten` made `fields` of, its arrays viewed from `arrays` (raw bytes, wherever they are)."""

    def array(entry):
        if entry is None:
            return None
        if "packed" in entry:
            return PackedCodes(array(entry["packed"]), _dtype(entry["dtype"]), tuple(entry["shape"]))
        return arrays[entry["index"]].view(_dtype(entry["dtype"])).reshape(entry["shape"])

    values = weight if fields["values"] == "weight" else array(fields["values"])
    return Encoded(
        fields["tier"],
        fields["form"],
        values,
        tuple(fields["shape"]),
        array(fields["scale"]),
        array(fields["zero_point"]),
        fields["axis"],
        fields["block_size"],
        fields["dtype"],
        tuple(restore(p, arrays, None) for p in fields["parts"]),
    )


def _digest(name: str, fields: dict, arrays: Sequence[np.ndarray]) -> bytes:
    digest = hashlib.sha256(name.encode() + b"\0" + json.dumps(fields, sort_keys=True).encode())
    for value in arrays:
        digest.update(memoryview(value))
    return digest.digest()


def digest(name: str, encoded: Encoded, weight: np.ndarray | None = None) -> bytes:
    """What identifies the weight's encoding, codes and all (the checkpoints' key, and
    `tqsdeploy.encoding.calibrator`'s statistics cache's)."""
    arrays: list[np.ndarray] = []
    return _digest(name, flatten(encoded, weight, arrays), arrays)


class PassCheckpoints:
    """One pass's weights in the run's cache, each under a key of what its codes depend on (see the module)."""

    def __init__(
        self,
        cache: RunCache,
        identity: str,
        weights: Mapping[str, np.ndarray],
        signature: Callable[[str], str],
        upstream: Callable[[str], frozenset],
    ):
        """`identity`: what every weight of the pass depends on besides itself; `signature(name)`: how the pass
        encodes the weight; `upstream(name)`: the weights whose codes its statistics depend on."""
        self.cache, self.identity, self.weights = cache, identity, weights
        self.signature, self.upstream = signature, upstream
        self.digests: dict[str, bytes] = {}
        """The codes' digest of every weight of this pass encoded or read so far."""
        self.reused = 0
        """Weights this pass read from the cache that this process did not write."""

    def _path(self, name: str) -> Path | None:
        above = sorted(self.upstream(name))
        if any(u not in self.digests for u in above):
            return None  # an input's codes are not known yet
        parts = [self.identity, name, self.signature(name), *(f"{u} {self.digests[u].hex()}" for u in above)]
        return self.cache.path("weights", run_cache.key(*parts))

    def resume(self, groups: Sequence[Sequence[str]]) -> dict[str, tuple[Encoded, dict]]:
        """Every weight this pass can read from the cache, by weight: (encoding, what calibration said of it), read
        group by group (a weight's key needs the codes of those upstream)."""
        found: dict[str, tuple[Encoded, dict]] = {}
        for names in groups:
            for name in names:
                loaded = self.load(name)
                if loaded is not None:
                    found[name] = loaded
                    self.digests[name] = loaded[1]["digest"]
        return found

    def load(self, name: str) -> tuple[Encoded, dict] | None:
        """The weight's entry under its current key (the weights upstream as encoded), if any."""
        path = self._path(name)
        if path is None or not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                arrays = [data[f"a{i}"] for i in range(meta["arrays"])]
            encoded = restore(meta["encoded"], arrays, self.weights.get(name))
        except Exception:  # a damaged or foreign file (or one evicted while read): encode the weight again
            return None
        meta["digest"] = bytes.fromhex(meta["digest"])
        self.reused += not self.cache.mine(path)
        self.cache.used(path, "weights")
        return encoded, meta

    def save(self, name: str, encoded: Encoded, rows: int | None = None, thin: int | None = None) -> bytes:
        """Write one finished weight (with the calibration rows behind it and, when they were too few, its
        input width) unless the cache holds it already; its digest, for the keys of the weights downstream."""
        arrays: list[np.ndarray] = []
        fields = flatten(encoded, self.weights.get(name), arrays)
        digest = _digest(name, fields, arrays)
        path = self._path(name)
        if path is not None and path.exists():  # the same codes under the same key (another pass's): kept as written
            self.cache.used(path, "weights")
            return digest
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            meta = {"encoded": fields, "arrays": len(arrays), "rows": rows, "thin": thin, "digest": digest.hex()}
            write_npz(
                path,
                {
                    "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
                    **{f"a{i}": a for i, a in enumerate(arrays)},
                },
            )
            self.cache.wrote(path, "weights", f"{name}: {self.signature(name)}")
        return digest

    def advance(self, digests: Mapping[str, bytes]) -> None:
        """A group is finished: the keys of the weights downstream depend on its codes."""
        self.digests.update(digests)


PACKAGES = ("graph_ops", "runtimes", "tiers", "tqsdeploy")
"""The distribution's packages, whose sources `code_hash` covers."""


def sources() -> dict[str, Path]:
    """Every Python source of `PACKAGES` by its path from the packages' folder ('tiers/hessian.py'), found where
    each package is imported from (not relative to this file: a module moved between folders once left the hash
    with no file at all)."""
    found = {}
    for package in PACKAGES:
        folder = Path(importlib.import_module(package).__file__).resolve().parent
        for source in sorted(folder.rglob("*.py")):
            found[source.relative_to(folder.parent).as_posix()] = source
    return found


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """A hash of the toolkit's own sources (read once per process): a pass resumed after tqsdeploy changed (its
    version number may not have) encodes afresh instead of joining codes of two versions."""
    digest = hashlib.sha256()
    for name, source in sources().items():
        digest.update(name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


OUTPUTS = "outputs.json"
"""In the cache folder: the files an export began writing, under its identity (`record_output`)."""


def record_output(run_dir: Path, identity: str, path: Path) -> None:
    """Note, before an export writes `path`, that it is this export's: if the export is interrupted, its
    rerun (the same command) may overwrite the file instead of refusing it as someone else's."""
    from tqsdeploy.files import write_json

    record = Path(run_dir) / FOLDER / OUTPUTS
    known = _outputs(record)
    mine = set(known.get(identity, [])) | {str(Path(path).resolve())}
    record.parent.mkdir(parents=True, exist_ok=True)
    write_json(record, {**known, identity: sorted(mine)})


def finished(run_dir: Path, identity: str) -> None:
    """The export of this identity wrote every file it began: none is left for a rerun to overwrite."""
    from tqsdeploy.files import write_json

    record = Path(run_dir) / FOLDER / OUTPUTS
    known = _outputs(record)
    if known.pop(identity, None) is not None:
        write_json(record, known)


def interrupted_outputs(run_dir: Path, identity: str) -> set[Path]:
    """The files an interrupted export with this identity began writing (see `record_output`)."""
    return {Path(p) for p in _outputs(Path(run_dir) / FOLDER / OUTPUTS).get(identity, [])}


def _outputs(record: Path) -> dict:
    try:
        found = json.loads(record.read_text())
    except (OSError, ValueError):  # none yet, or damaged: no file is taken for this export's
        return {}
    return found if isinstance(found, dict) else {}
