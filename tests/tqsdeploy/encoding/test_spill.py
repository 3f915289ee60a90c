"""A large model's kept passes read from files (`tqsdeploy.encoding.spill`): the same values, read-only, nothing left
on disk, and pages handed back without changing what is read."""

import gc

import numpy as np

from tiers import TIERS, Layout, encode, split
from tqsdeploy.encoding import spill as spill_module
from tqsdeploy.encoding.spill import Spill


def _encodings(rng) -> dict:
    layout = Layout((96, 80), (0, 1))
    weights = {name: rng.standard_normal(layout.shape).astype(np.float32) for name in ("a", "b", "c")}
    made = {
        "a": encode(weights["a"], layout, TIERS["int8-asym"]),
        "b": encode(weights["b"], layout, TIERS["int4-asym"]).compact(),  # packed 4-bit codes
        "c": split(  # channel groups at two tiers, int2 codes packed
            [
                encode(weights["c"][:48], Layout((48, 80), (0, 1)), TIERS["int2-asym"]).compact(),
                encode(weights["c"][48:], Layout((48, 80), (0, 1)), TIERS["int8-asym"]),
            ],
            layout,
        ),
    }
    return made


def _arrays(encoded) -> list[np.ndarray]:
    values = encoded.values if isinstance(encoded.values, np.ndarray) or encoded.values is None else encoded.values.data
    found = [v for v in (values, encoded.scale, encoded.zero_point) if v is not None]
    return found + [a for part in encoded.parts for a in _arrays(part)]


def test_kept_passes_read_the_same_values_from_files_that_are_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(spill_module, "MIN_BYTES", 0)
    made = _encodings(np.random.default_rng(0))
    expected = {name: encoded.dequantize() for name, encoded in made.items()}
    spill = Spill(tmp_path / "run")
    kept = spill.keep(made)
    assert spill.bytes >= sum(a.nbytes for e in made.values() for a in _arrays(e))
    assert list((tmp_path / "run").iterdir()) == []  # unlinked once mapped
    for name, encoded in kept.items():
        arrays = _arrays(encoded)
        assert arrays and all(not a.flags.writeable and not a.flags.owndata for a in arrays)  # views of the map
        assert [a.dtype for a in arrays] == [a.dtype for a in _arrays(made[name])]
        assert np.array_equal(encoded.dequantize(), expected[name])
    spill.release()  # pages handed back: read again from the file, the same bytes
    for name, encoded in kept.items():
        assert np.array_equal(encoded.expand().dequantize(), expected[name])
    del kept, encoded, arrays
    gc.collect()
    spill.release()
    assert spill._maps == []  # a pass no longer viewed is unmapped: its unlinked file's blocks are freed
    spill.close()


def test_small_arrays_and_the_weight_itself_stay_in_memory(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    made = _encodings(rng)
    weight = rng.standard_normal((4, 4)).astype(np.float32)
    raw = encode(weight, Layout((4, 4), (0, 1)), TIERS["fp32"])
    spill = Spill(tmp_path)
    kept = spill.keep(made)  # every array under MIN_BYTES (64 KiB): nothing written
    assert spill.bytes == 0 and all(kept[n] is made[n] for n in made)
    assert raw.form == "raw" and raw.values is weight
    monkeypatch.setattr(spill_module, "MIN_BYTES", 0)
    assert spill.keep({"w": raw}, {"w": weight})["w"] is raw and spill.bytes == 0  # the model's own: not copied
    spill.close()
