"""Calibration waves start from the activations kept from the waves before, not from the model input:
the same statistics and codes as running every wave from the input, with the model run about once per pass."""

from __future__ import annotations

import models
import numpy as np
import pytest

import graph_ops
from tiers import TIERS, Layout, Rounding, encode
from tqsdeploy.encoding.calibrator import CalibrationRollout, Calibrator
from tqsdeploy.rollout import RolloutSpec
from tqsdeploy.rollout.contexts import Contexts

TOLERANCE = 1e-6
"""Largest difference allowed between the two paths' statistics, relative to their scale. On this machine they
agree bit for bit (ONNX Runtime is told the shapes it would have inferred itself, so it fuses the same); a
fusion that differed would round differently, at float32 resolution (~1e-7 relative)."""


def _pass(path, keep: bool, method: str, counted: list[int], monkeypatch):
    model = graph_ops.load_model(path)
    names = [w.name for w in graph_ops.find_weight_tensors(model.proto) if w.params >= 200]
    layouts = graph_ops.weight_layouts(model.proto, names)
    weights = graph_ops.read_weights(model.proto, names)
    contexts = Contexts({"x": np.random.default_rng(3).standard_normal((6, 1, 4, 16)).astype(np.float32)}, "test")
    spec = RolloutSpec.from_dict({"steps": 3, "feedback": [{"output": "y", "input": "x"}]})
    calibrator = Calibrator(model.proto, layouts, CalibrationRollout(contexts, spec), weights=weights)
    calibrator.keep_activations = keep
    made = graph_ops.io.session_source

    def counting(proto, *args):  # every session the calibrator opens: the nodes it runs
        counted.append(sum(n.op_type in ("MatMul", "Relu", "Add", "LayerNormalization") for n in proto.graph.node))
        return made(proto, *args)

    monkeypatch.setattr(graph_ops.io, "session_source", counting)
    stats, tier = {}, TIERS["int4-asym"]

    def encode_one(name, merged):
        stats[name] = [m.H.copy() for m in merged] if merged else None
        layout = layouts[name]
        return encode(
            weights[name], Layout(layout.shape, layout.perm, layout.row_groups), tier, Rounding(method), merged
        )

    encoded = calibrator.run(encode_one, Rounding(method).needs_cross)
    calibrator.close()
    return encoded, stats, calibrator


@pytest.mark.parametrize("method", ["qep", "gptaq"])
def test_waves_from_kept_activations_agree_with_waves_from_the_input(tmp_path, monkeypatch, method):
    """A deep residual stack (8 blocks, a weight shared by blocks 1 and 3, one reused by every block, Add +
    LayerNormalization that ONNX Runtime fuses): every weight's statistics agree within `TOLERANCE` and the
    codes are the same; the kept path runs each model node about once per pass, the old one once per wave."""
    path = models.deep_residual_stack(tmp_path / "stack.onnx")
    old_nodes, new_nodes = [], []
    old, old_stats, _ = _pass(path, False, method, old_nodes, monkeypatch)
    new, new_stats, calibrator = _pass(path, True, method, new_nodes, monkeypatch)
    assert len(calibrator.waves) >= 16 and {"S", "T"} <= set(new)
    for name, parts in old_stats.items():
        if parts is None:
            continue
        for a, b in zip(parts, new_stats[name]):
            assert np.max(np.abs(a - b)) <= TOLERANCE * np.max(np.abs(a)), name
    for name in old:
        np.testing.assert_array_equal(old[name].dequantize(), new[name].dequantize(), err_msg=name)
    graph_nodes = (
        8 * 7 + 2 * 2 + 1
    )  # its MatMul/Relu/Add/LayerNormalization nodes; the first session runs them all (the samples)
    assert sum(old_nodes) > 8 * graph_nodes  # each wave from the input: quadratic in depth
    # each wave from the last, but where S and T are quantized everything after their first use is computed again
    # (the kept activations held them at full precision): about 1 + 1 + 4/8 + 1 model runs
    assert sum(new_nodes) < 4 * graph_nodes < sum(old_nodes) / 2


def test_a_mixed_pass_solves_only_what_changed_and_makes_the_same_codes(tmp_path):
    """A calibrated pass takes from the cached passes every weight encoded the same way on statistics from
    weights encoded the same way (`Encoder._same`): after uniform INT4, the all-INT4 mixed pass solves nothing,
    and a refinement that moves the last layer's V7 to INT2 solves V7 alone; the codes are a fresh encoder's."""
    from tqsdeploy.encoding.encoder import Encoder
    from tqsdeploy.encoding.slots import make_slots
    from tqsdeploy.units import Unit

    path = models.deep_residual_stack(tmp_path / "stack.onnx")
    model = graph_ops.load_model(path)
    tensors = [w for w in graph_ops.find_weight_tensors(model.proto) if w.params >= 200]
    layouts = graph_ops.weight_layouts(model.proto, [w.name for w in tensors])
    weights = graph_ops.read_weights(model.proto, list(layouts))
    units = [Unit(w.name, (w,)) for w in tensors]
    contexts = Contexts({"x": np.random.default_rng(3).standard_normal((6, 1, 4, 16)).astype(np.float32)}, "test")
    spec = RolloutSpec.from_dict({"steps": 3, "feedback": [{"output": "y", "input": "x"}]})

    def encoder():
        coder = Encoder(
            units,
            layouts,
            weights,
            calibrator=lambda: Calibrator(model.proto, layouts, CalibrationRollout(contexts, spec), weights=weights),
        )
        solved: list[str] = []
        coder.on_weight = solved.append
        return coder, solved

    slots = make_slots(units, layouts, 0.0)
    everything = {s.name: "int4-asym" for s in slots}
    moved = {**everything, "V7": "int2-asym"}
    coder, solved = encoder()
    coder.uniform("int4-asym", Rounding("qep"))
    assert len(solved) == len(layouts)
    solved.clear()
    coder.calibrated(slots, everything, Rounding("qep"))
    assert solved == []
    refined = coder.calibrated(slots, moved, Rounding("qep"))
    assert solved == ["V7"]
    fresh, _ = encoder()
    again = fresh.calibrated(slots, moved, Rounding("qep"))
    for name in layouts:
        np.testing.assert_array_equal(refined[name].dequantize(), again[name].dequantize(), err_msg=name)
    coder.close()
    fresh.close()


@pytest.mark.parametrize("threshold, trims", [(0, True), (1 << 40, False)])
def test_a_wave_with_large_statistics_hands_the_heap_back_and_keeps_its_codes(tmp_path, monkeypatch, threshold, trims):
    """After a wave whose statistics took `TRIM_AFTER_BYTES` or more the freed heap goes back to the OS (one trim
    per wave); below it a pass trims nothing but its session's close, and the codes are the same either way."""
    import tqsdeploy.encoding.calibrator as calibrator_module

    path = models.deep_residual_stack(tmp_path / "stack.onnx")
    trimmed = []
    monkeypatch.setattr(calibrator_module, "TRIM_AFTER_BYTES", threshold)
    monkeypatch.setattr(calibrator_module, "release_freed_memory", lambda: trimmed.append(1))
    encoded, _, calibrator = _pass(path, True, "qep", [], monkeypatch)
    closing = 1  # the calibration session's close hands its arena back too
    assert len(trimmed) - closing == (len(calibrator.groups) if trims else 0)
    monkeypatch.setattr(calibrator_module, "TRIM_AFTER_BYTES", 1 << 40 if trims else 0)
    again, _, _ = _pass(path, True, "qep", [], monkeypatch)
    for name in encoded:
        np.testing.assert_array_equal(encoded[name].dequantize(), again[name].dequantize(), err_msg=name)
