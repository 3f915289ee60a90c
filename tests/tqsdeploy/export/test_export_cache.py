"""The run folder's export cache: every pass's weights, every candidate's drift and every grid choice kept once per
score run and reused by later exports, without changing a byte of what they write."""

import json
import shutil

import models
from conftest import invoke, scored_run

from tqsdeploy.encoding import checkpoints
from tqsdeploy.encoding.run_cache import FOLDER, NOTE
from tqsdeploy.export import CacheOptions, ExportSettings, Planner

scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", n=32, hidden=64),
    (4, 2, 32),
    seed=11,
    steps=3,
    name="cache",
)
UNTIMED = ("timings_s", "profile_s", "cache", "output", "files")
"""Fields of the allocation record that say how long the export took, what it reused and where it wrote, not what
it chose."""


def _run(scored, tmp_path, name="run"):
    """A copy of the score run with no cache and no prices."""
    _, _, folder = scored
    shutil.copytree(
        folder / "run", tmp_path / name, ignore=shutil.ignore_patterns("measured.jsonl", ".measured.lock", FOLDER)
    )
    return tmp_path / name


def _export(run, target, path, settings=ExportSettings(), cache=CacheOptions()):
    """(outcome, [(pass label, weights, done before it began)], [(pass label, weight encoded)]) of one export."""
    planner = Planner(run, settings=settings, cache=cache)
    passes, encoded = [], []
    planner.encoder.on_pass = lambda label, count, done, cached: passes.append((label, count, done))
    planner.encoder.on_weight = lambda name: encoded.append((passes[-1][0], name))
    try:
        outcome = planner.export(target, path, final=True)
        planner.finished()
    finally:
        planner.close()
    return outcome, passes, encoded


def _record(path):
    record = json.loads(path.with_suffix(".allocation.json").read_text())
    return {k: v for k, v in record.items() if k not in UNTIMED}


def test_a_warm_export_writes_the_bytes_a_cold_one_writes_and_encodes_nothing(scored, tmp_path):
    """The same export three times: without a cache, into an empty cache and from the full one. One file and one
    record (less its timings), whatever the cache held; the warm one encodes no weight and measures no drift."""
    run = _run(scored, tmp_path)
    plain, _, _ = _export(_run(scored, tmp_path, "plain"), 4, tmp_path / "plain.onnx", cache=None)
    cold, _, made = _export(run, 4, tmp_path / "cold.onnx")
    warm, passes, encoded = _export(run, 4, tmp_path / "warm.onnx")
    assert (tmp_path / "cold.onnx").read_bytes() == (tmp_path / "warm.onnx").read_bytes()
    assert (tmp_path / "plain.onnx").read_bytes() == (tmp_path / "cold.onnx").read_bytes()
    cold_record, warm_record = _record(tmp_path / "cold.onnx"), _record(tmp_path / "warm.onnx")
    assert cold_record == warm_record
    assert made and not encoded and all(done == count for _, count, done in passes)
    assert cold.cache["made"]["weights"] > 0 and cold.cache["made"]["drift"] > 0
    assert warm.cache["read"]["drift"] > 0 and warm.cache["read"]["prices"] > 0 and not warm.cache["made"]
    assert cold.cache["made"]["share"] > 0 and warm.cache["read"]["share"] == cold.cache["made"]["share"]
    assert warm.drift == cold.drift == plain.drift


def test_a_second_export_at_another_target_runs_no_pass_the_first_ran(scored, tmp_path):
    """C 4, then C 8: every pass of the first is read from the cache; what C 8 encodes is new work (its mixed
    allocation, the uniform models at the tier it can compare with); the prices of the slots already priced are
    not rolled out again, and the file is what a fresh run folder writes (also near the INT2 size after both)."""
    run = _run(scored, tmp_path)
    first, first_passes, _ = _export(run, 4, tmp_path / "c4.onnx")
    second, passes, encoded = _export(run, 8, tmp_path / "c8.onnx")
    ran_before = {label for label, count, done in first_passes if done < count}
    assert ran_before and first.allocation.tiers != second.allocation.tiers
    for label, count, done in passes:
        if label in ran_before and not label.startswith("mixed"):
            assert done == count, (label, done, count)
    assert ("mixed qep", "W3") in encoded  # the new allocation's last wave, at least, is new work
    assert not {label for label, _ in encoded} & (ran_before - {"mixed qep"})  # the uniform fallbacks at int2 are new
    assert second.cache["read"]["prices"] > 0 and second.cache["read"]["choice"] > 0
    fresh, _, _ = _export(_run(scored, tmp_path, "fresh"), 8, tmp_path / "fresh.onnx")
    assert (tmp_path / "fresh.onnx").read_bytes() == (tmp_path / "c8.onnx").read_bytes()
    planner = Planner(run)
    near = 0.99 * planner.comparison.uniform("int2-asym").compression  # int1 joins the tiers, slots are cut finer
    planner.close()
    _export(run, near, tmp_path / "near.onnx")
    _export(_run(scored, tmp_path, "near"), near, tmp_path / "near-fresh.onnx")
    assert (tmp_path / "near.onnx").read_bytes() == (tmp_path / "near-fresh.onnx").read_bytes()


def test_a_large_models_warm_export_writes_what_its_cold_one_writes(scored, tmp_path, monkeypatch):
    """Past ONE_SESSION_BYTES candidates run from their codes (and past FED_FLOATS_BYTES the allocation as priced
    too) and losing codes are dropped from memory: the cache serves them the same, byte for byte."""
    import sys

    job_module = sys.modules["tqsdeploy.export.job"]
    plain = tmp_path / "plain.onnx"
    _export(_run(scored, tmp_path, "plain"), 4, plain, cache=None)
    for floats in (1 << 40, 0):
        monkeypatch.setattr(job_module, "ONE_SESSION_BYTES", 0)
        monkeypatch.setattr(job_module, "FED_FLOATS_BYTES", floats)
        run = _run(scored, tmp_path, f"run{floats}")
        _export(run, 4, tmp_path / f"cold{floats}.onnx")
        warm, _, encoded = _export(run, 4, tmp_path / f"warm{floats}.onnx")
        assert not encoded and warm.cache["read"]["drift"] > 0
        cold_bytes = (tmp_path / f"cold{floats}.onnx").read_bytes()
        assert cold_bytes == (tmp_path / f"warm{floats}.onnx").read_bytes() == plain.read_bytes()


def test_entries_of_other_settings_or_other_code_are_never_read(scored, tmp_path, monkeypatch):
    """Blockwise codes (--group-size) change every weight's codes: nothing of the per-channel export's cache is
    read. Nor is anything after tqsdeploy's sources changed (another code hash), even for the same settings."""
    run = _run(scored, tmp_path)
    _export(run, 4, tmp_path / "a.onnx")
    blockwise, _, encoded = _export(run, 4, tmp_path / "b.onnx", ExportSettings(group_size=16))
    assert encoded and not {k: n for k, n in blockwise.cache["read"].items() if k != "prices"}
    monkeypatch.setattr(checkpoints, "code_hash", lambda: "another version")
    upgraded, _, encoded = _export(run, 4, tmp_path / "c.onnx")
    assert encoded and not {k: n for k, n in upgraded.cache["read"].items() if k != "prices"}
    assert (tmp_path / "c.onnx").read_bytes() == (tmp_path / "a.onnx").read_bytes()


def test_the_cap_drops_the_least_recently_used_entries(scored, tmp_path):
    """Three uniform passes into a cache capped at about two of them: the oldest pass goes, the last two stay whole
    (read back without encoding), and cache.json lists what is held within the cap."""
    from tiers import TIERS, Rounding

    run = _run(scored, tmp_path)
    planner = Planner(run, cache=CacheOptions())
    planner.encoder.uniform(TIERS["int8-asym"], Rounding("gptq"))
    planner.close()
    one_pass = sum(p.stat().st_size for p in (run / FOLDER / "weights").iterdir())
    shutil.rmtree(run / FOLDER)
    cap = int(2.5 * one_pass)
    for method in ("gptq", "gptaq", "qep"):
        planner = Planner(run, cache=CacheOptions(cap_bytes=cap))
        planner.encoder.uniform(TIERS["int8-asym"], Rounding(method))
        planner.close()
    note = json.loads((run / FOLDER / NOTE).read_text())
    held = sum(p.stat().st_size for p in (run / FOLDER).rglob("*") if p.is_file() and p.parent.name != FOLDER)
    assert note["bytes"] == held <= cap and note["cap_bytes"] == cap
    assert (
        note["entries"]
        == len(note["files"])
        == sum(1 for p in (run / FOLDER).rglob("*") if p.parent.name in ("weights", "values"))
    )
    assert all(entry["label"] for entry in note["files"])
    counts = {}
    for method in ("qep", "gptaq", "gptq"):  # newest first: reading one makes it the most recent
        planner = Planner(run, cache=CacheOptions(cap_bytes=cap))
        planner.encoder.uniform(TIERS["int8-asym"], Rounding(method))
        counts[method] = planner.encoder.log.reused
        planner.close()
    weights = len(planner.layouts)
    assert counts == {"qep": weights, "gptaq": weights, "gptq": 0}


def test_fresh_drops_the_cache(scored, tmp_path):
    """`export --fresh` makes everything again (its prices too); `score --fresh` takes the cache away with the run
    it replaces."""
    model, contexts, _ = scored
    run = _run(scored, tmp_path)
    code, text = invoke("export", model, "--run", run, "--C", 4, "-o", tmp_path / "a.onnx", "--verbose")
    assert code == 0, text
    before = {p.name for p in (run / FOLDER / "weights").iterdir()}
    code, text = invoke("export", model, "--run", run, "--C", 4, "-o", tmp_path / "b.onnx", "--verbose")
    assert code == 0 and "cache: reused " in text and "weights read from the run's cache" in text, text
    assert "reused 0 encoded weights" not in text
    code, text = invoke("export", model, "--run", run, "--C", 4, "-o", tmp_path / "c.onnx", "--verbose", "--fresh")
    assert (
        code == 0
        and "reused 0 encoded weights, 0 drifts, 0 grid choices, 0 channel-group shares, 0 tier prices" in text
    ), text
    assert {p.name for p in (run / FOLDER / "weights").iterdir()} == before  # made again, the same entries
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "c.onnx").read_bytes()
    code, text = invoke("score", model, "-c", contexts, "--steps", 3, "--probes", 1, "-o", run, "--fresh")
    assert code == 0, text
    assert not (run / FOLDER).exists() and not (run / ".replaced").exists()
