"""Checkpoints of calibration passes, so that an interrupted export resumes where it stopped.

A calibrated pass (GPTQ, GPTAQ, QEP) encodes the weights wave by wave, each wave on statistics
collected with every earlier wave at its codes: the slow part of an export (a 22-minute pass on a
user's model). Each weight it finishes is written at once to the run folder
(`export-checkpoints/<pass>/<key>.npz`) under a key that hashes everything its codes depend on: the
pass's identity (the score run's fingerprint of model, contexts, rollout and settings; the tier or
the allocation; the rounding settings; group size; runtime; versions and sources) and the codes of every weight
of the earlier waves. A rerun finds them, skips those weights and the statistics only they needed,
and writes the same bytes; a weight whose inputs changed gets another key and is encoded again.

A successful export removes the folder (`discard`); an interrupted one leaves the passes it reached,
at most `MAX_PASSES` of them (the least recently written go first), each about a byte per weight.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np

from tiers import Encoded
from tiers.encoded import PackedCodes
from tqsdeploy.files import write_npz

FOLDER = "export-checkpoints"
MAX_PASSES = 16
"""Passes kept in a run folder's checkpoints (an export makes up to ~10: one per calibrated tier, the
mixed allocation, the uniform fallbacks); older ones are removed as new ones begin."""


def _dtype(name: str) -> np.dtype:
    custom = getattr(
        ml_dtypes, name, None
    )  # int4, float8_e4m3fn, bfloat16 ...: numpy knows them only through ml_dtypes
    return np.dtype(custom if custom is not None else name)


def _flatten(encoded: Encoded, weight: np.ndarray | None, arrays: list[np.ndarray]) -> dict:
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
    fields["parts"] = [_flatten(part, None, arrays) for part in encoded.parts]
    return fields


def _restore(fields: dict, arrays: Sequence[np.ndarray], weight: np.ndarray | None) -> Encoded:
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
        tuple(_restore(p, arrays, None) for p in fields["parts"]),
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
    return _digest(name, _flatten(encoded, weight, arrays), arrays)


class PassCheckpoints:
    """The finished weights of one calibration pass, on disk under keys chained through its waves."""

    def __init__(self, root: Path, identity: str, weights: Mapping[str, np.ndarray]):
        self.folder = Path(root) / hashlib.sha256(identity.encode()).hexdigest()[:24]
        self.weights = weights
        self._chain = hashlib.sha256(identity.encode())
        self.reused = 0
        """Weights this pass read from checkpoints instead of encoding them."""

    def _path(self, chain, name: str) -> Path:
        key = chain.copy()
        key.update(b"\0" + name.encode())
        return self.folder / f"{key.hexdigest()[:32]}.npz"

    def resume(self, groups: Sequence[Sequence[str]]) -> dict[str, tuple[Encoded, dict]]:
        """Every checkpoint this pass can use, by weight: (encoding, what calibration said of it), read
        group by group while each earlier group was found whole (a later group's keys need its codes)."""
        found: dict[str, tuple[Encoded, dict]] = {}
        chain = self._chain.copy()
        for names in groups:
            for name in names:
                loaded = self._load(chain, name)
                if loaded is not None:
                    found[name] = loaded
            if any(name not in found for name in names):
                break
            for name in names:
                chain.update(found[name][1]["digest"])
        self.reused = len(found)
        if self.folder.is_dir():
            self.folder.touch()  # in use: the last to be dropped by the cap
        return found

    def load(self, name: str) -> tuple[Encoded, dict] | None:
        """The weight's checkpoint under the current key (the groups before it as encoded), if any."""
        return self._load(self._chain, name)

    def _load(self, chain, name: str) -> tuple[Encoded, dict] | None:
        path = self._path(chain, name)
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                arrays = [data[f"a{i}"] for i in range(meta["arrays"])]
            encoded = _restore(meta["encoded"], arrays, self.weights.get(name))
        except Exception:  # a damaged or foreign file: encode the weight again
            return None
        meta["digest"] = bytes.fromhex(meta["digest"])
        return encoded, meta

    def save(self, name: str, encoded: Encoded, rows: int | None = None, thin: int | None = None) -> bytes:
        """Write one finished weight (with the calibration rows behind it and, when they were too few, its
        input width); its digest for the chain."""
        arrays: list[np.ndarray] = []
        fields = _flatten(encoded, self.weights.get(name), arrays)
        digest = _digest(name, fields, arrays)
        if not self.folder.exists():
            self._make_room()
        meta = {"encoded": fields, "arrays": len(arrays), "rows": rows, "thin": thin, "digest": digest.hex()}
        write_npz(
            self._path(self._chain, name),
            {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8), **{f"a{i}": a for i, a in enumerate(arrays)}},
        )
        return digest

    def advance(self, digests: Sequence[bytes]) -> None:
        """A group is finished: later groups' keys depend on its codes."""
        for digest in digests:
            self._chain.update(digest)

    def _make_room(self) -> None:
        """Drop the least recently used passes beyond `MAX_PASSES - 1` before this one begins."""
        passes = (
            sorted((p for p in self.folder.parent.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
            if self.folder.parent.is_dir()
            else []
        )
        for old in passes[: max(0, len(passes) - (MAX_PASSES - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def code_hash() -> str:
    """A hash of the toolkit's own sources: a pass resumed after tqsdeploy changed (its version number
    may not have) encodes afresh instead of joining codes of two versions."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in ("graph_ops", "runtimes", "tiers", "tqsdeploy"):
        for source in sorted((root / package).rglob("*.py")):
            digest.update(source.relative_to(root).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def discard(run_dir: Path) -> None:
    """Remove a run folder's checkpoints (the export they served has finished)."""
    shutil.rmtree(Path(run_dir) / FOLDER, ignore_errors=True)


OUTPUTS = "outputs.json"
"""In the checkpoints folder: the files an export began writing, under its identity (`record_output`)."""


def record_output(run_dir: Path, identity: str, path: Path) -> None:
    """Note, before an export writes `path`, that it is this export's: if the export is interrupted, its
    rerun (the same command) may overwrite the file instead of refusing it as someone else's."""
    from tqsdeploy.files import write_json

    record = Path(run_dir) / FOLDER / OUTPUTS
    known = _outputs(record)
    mine = set(known.get(identity, [])) | {str(Path(path).resolve())}
    record.parent.mkdir(parents=True, exist_ok=True)
    write_json(record, {**known, identity: sorted(mine)})


def interrupted_outputs(run_dir: Path, identity: str) -> set[Path]:
    """The files an interrupted export with this identity began writing (see `record_output`)."""
    return {Path(p) for p in _outputs(Path(run_dir) / FOLDER / OUTPUTS).get(identity, [])}


def _outputs(record: Path) -> dict:
    try:
        found = json.loads(record.read_text())
    except (OSError, ValueError):  # none yet, or damaged: no file is taken for this export's
        return {}
    return found if isinstance(found, dict) else {}
