"""export --max-memory and --max-slowdown: the resident-memory bound as a second knapsack constraint (priced from the
forms the file is written in), the slowdown measured against the original, and what is said when either fails."""

import json

import models
import pytest
from conftest import cli, invoke, scored_run

from tiers import get_tiers
from tqsdeploy.errors import BoundUnmet
from tqsdeploy.export.allocate import Choice, MemoryCap, allocate
from tqsdeploy.size import SizeBudget

# Wshared (256 x 256) runs in MatMulNBits, so its resident bytes follow its tier; W1 and W3 are too small for the
# kernels and fold to float at load whatever their tier
scored = scored_run(
    lambda folder: models.mlp_forecaster(folder / "mlp.onnx", hidden=256), (4, 2, 32), seed=0, steps=4, name="bounds"
)


def _export(scored, out, *extra):
    model, _, folder = scored
    code, text = invoke("export", model, "--run", folder / "run", "--C", "2", "-o", out, *extra)
    record = json.loads(out.with_suffix(".allocation.json").read_text()) if code == 0 else None
    return code, text, record


def test_a_memory_bound_tighter_than_c_changes_the_allocation_and_is_met_as_priced(scored, tmp_path):
    code, text, free = _export(scored, tmp_path / "free.onnx")
    assert code == 0, text
    bound = free["weights_in_memory_bytes"] * 2 // 3  # C alone keeps Wshared in 16-bit floats folded to float32
    code, text, bounded = _export(scored, tmp_path / "bounded.onnx", "--max-memory", f"{bound}B")
    assert code == 0, text
    memory = bounded["bounds"]["memory"]
    assert memory["bound_bytes"] == bound and memory["met"] and memory["measured_peak_bytes"] is None
    assert memory["priced_bytes"] == bounded["weights_in_memory_bytes"] <= bound
    assert "weights only" in memory["covers"]  # TQS_MEMORY=0: no session measured, the bound covers the weights
    assert [r["tier"] for r in bounded["tiers"]] != [r["tier"] for r in free["tiers"]]
    assert f"--max-memory {bound}B" in text and ": met" in text


def test_a_loose_memory_bound_writes_the_same_model_byte_for_byte(scored, tmp_path):
    code, _, free = _export(scored, tmp_path / "free.onnx")
    code_loose, text, loose = _export(scored, tmp_path / "loose.onnx", "--max-memory", "10x")
    assert code == code_loose == 0, text
    assert (tmp_path / "free.onnx").read_bytes() == (tmp_path / "loose.onnx").read_bytes()
    assert loose["tiers"] == free["tiers"] and loose["bounds"]["memory"]["met"]
    assert loose["bounds"]["memory"]["bound_bytes"] == 10 * loose["reference_bits"] // 8  # 10x the float weights


def _stderr_lines(scored, out, *extra) -> tuple[int, list[str]]:
    model, _, folder = scored
    result = cli("export", model, "--run", folder / "run", "--C", "2", "-o", out, *extra)
    return result.exit_code, result.stderr.strip().splitlines()


def test_a_memory_bound_out_of_reach_exits_1_naming_the_smallest_reachable(scored, tmp_path):
    code, lines = _stderr_lines(scored, tmp_path / "tiny.onnx", "--max-memory", "1KB")
    assert code == 1 and not (tmp_path / "tiny.onnx").exists() and len(lines) == 1, lines
    text = lines[0]
    assert text.startswith("error: --max-memory 1KB cannot be met: the smallest reachable resident size is ")
    # W1 and W3 hold 2 x 32 x 256 float32 after load at any tier: nothing is smaller
    assert int(text.split("MB (")[1].split(" bytes")[0].replace(",", "")) > 2 * 32 * 256 * 4


@pytest.mark.parametrize(
    "option, value, said",
    [
        ("--max-memory", "12parsecs", "--max-memory takes a size such as 12MB"),
        ("--max-memory", "0x", "--max-memory as a ratio must be positive"),
        ("--max-slowdown", "-1", "--max-slowdown takes a positive finite ratio"),
    ],
)
def test_a_junk_bound_exits_2_with_one_line(scored, tmp_path, option, value, said):
    code, lines = _stderr_lines(scored, tmp_path / "junk.onnx", option, value)
    assert code == 2 and len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "junk.onnx").exists()


def test_the_slowdown_is_measured_against_the_original_and_an_unmet_one_exits_1(scored, tmp_path):
    code, text, record = _export(scored, tmp_path / "slow.onnx", "--max-slowdown", "1000")
    assert code == 0, text
    slowdown = record["bounds"]["slowdown"]
    assert slowdown["asked"] == 1000 and slowdown["priced"] is None and slowdown["met"]
    assert 0 < slowdown["measured"] < 1000 and "paired rounds" in slowdown["how"]
    code, text, _ = _export(scored, tmp_path / "fast.onnx", "--max-slowdown", "1e-6")
    assert code == 1 and (tmp_path / "fast.onnx").exists()  # written and kept, as a failed gate keeps its model
    assert "bound not met:" in text and "does not meet --max-slowdown 1e-06: measured" in text
    record = json.loads((tmp_path / "fast.allocation.json").read_text())
    assert record["bounds"]["slowdown"]["met"] is False


def test_with_memory_measured_the_bound_covers_the_session_and_reports_its_peak(scored, tmp_path):
    code, text, record = _export(scored, tmp_path / "m.onnx", "--memory", "--max-memory", "1x")
    assert code in (0, 1), text  # the measured peak may exceed the priced one: then it says so and exits 1
    memory = record["bounds"]["memory"] if record else None
    if memory is None:
        record = json.loads((tmp_path / "m.allocation.json").read_text())
        memory = record["bounds"]["memory"]
    assert memory["session_overhead_bytes"] is not None and "session peak" in memory["covers"]
    assert memory["bound_bytes"] == record["session_memory"]["original_peak_bytes"]  # 1x the original's peak
    assert memory["measured_peak_bytes"] == record["session_memory"]["peak_bytes"]
    assert memory["met"] == (code == 0) == (memory["measured_peak_bytes"] <= memory["bound_bytes"])


def _choices():
    """Two slots: `a` is sensitive and fp32 holds 4 bytes a weight; `b` is not."""
    costs = {"fp32": 32_000, "int8-asym": 8_000, "int4-asym": 4_000}
    held = {"fp32": 4_000, "int8-asym": 1_000, "int4-asym": 500}
    return [
        Choice("a", 1000, 1.0, False, dict(costs), {"fp32": 0.0, "int8-asym": 1.0, "int4-asym": 4.0}, dict(held)),
        Choice("b", 1000, 0.1, False, dict(costs), {"fp32": 0.0, "int8-asym": 0.1, "int4-asym": 0.4}, dict(held)),
    ]


def test_the_knapsack_meets_the_memory_bound_and_a_loose_one_changes_nothing():
    tiers = get_tiers(["fp32", "int8-asym", "int4-asym"], "ort")
    budget = SizeBudget(64_000)  # C 1.6: 40,000 bits for the slots; fp32 + int8 fits
    free = allocate(_choices(), tiers, 1.6, budget, fp32_fraction=0)
    assert free.tiers == {"a": "fp32", "b": "int8-asym"}
    loose = allocate(_choices(), tiers, 1.6, budget, fp32_fraction=0, memory=MemoryCap(5_000, 0, "--max-memory"))
    assert loose.tiers == free.tiers
    tight = allocate(_choices(), tiers, 1.6, budget, fp32_fraction=0, memory=MemoryCap(4_500, 0, "--max-memory"))
    assert tight.tiers == {"a": "fp32", "b": "int4-asym"}  # 4,500 bytes: b gives up its int8 for a's fp32
    greedy = allocate(
        _choices(), tiers, 1.6, budget, fp32_fraction=0, solver="greedy", memory=MemoryCap(4_500, 0, "--max-memory")
    )
    assert sum(c.resident[greedy.tiers[c.unit]] for c in _choices()) <= 4_500


def test_a_memory_cap_below_every_choice_at_its_smallest_names_what_c_reaches():
    tiers = get_tiers(["fp32", "int8-asym", "int4-asym"], "ort")
    cap = MemoryCap(900, 100, "--max-memory 1000B")
    with pytest.raises(BoundUnmet, match=r"--max-memory 1000B cannot be met at C 1.6: .* \(1,100 bytes\)"):
        allocate(_choices(), tiers, 1.6, SizeBudget(64_000), fp32_fraction=0, memory=cap)  # 2 x 500 + 100 outside
