"""Rollout detection on seed-shaped signatures, input-only mask edges, strict specs, --emit-spec."""

from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, cli
from models import _model
from onnx import TensorProto, helper

from runtimes import IOSpec, OrtRuntime
from tqsdeploy.errors import RolloutError
from tqsdeploy.rollout import AmbiguousRollout, Feedback, RolloutSpec, detect, detect_rollout, next_feeds
from tqsdeploy.rollout.contexts import Contexts
from tqsdeploy.rollout.engine import RolloutEngine

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _w(rng, *shape):
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def timesfm_shaped(path: Path, length: int = 32, horizon: int = 8, q: int = 3) -> Path:
    """inputs, masks [batch, L] (1 = padded) -> forecast [batch, H], quantiles [batch, H, q]."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Sub", ["one", "masks"], ["keep"]),
        helper.make_node("Mul", ["inputs", "keep"], ["x"]),
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["forecast"]),
        helper.make_node("MatMul", ["h", "W3"], ["q"]),
        helper.make_node("Reshape", ["q", "qshape"], ["quantiles"]),
    ]
    init = {
        "one": np.ones(1, np.float32),
        "W1": _w(rng, length, 48),
        "W2": _w(rng, 48, horizon),
        "W3": _w(rng, 48, horizon * q),
        "qshape": np.array([-1, horizon, q]),
    }
    ins = [_vi("inputs", F, ["batch", length]), _vi("masks", F, ["batch", length])]
    outs = [_vi("forecast", F, ["batch", horizon]), _vi("quantiles", F, ["batch", horizon, q])]
    return _model(nodes, ins, outs, init, path)


def pangu_shaped(path: Path, k: int = 4, j: int = 6) -> Path:
    """Static shapes, no batch axis: input [k, j], input_surface [k] -> output, output_surface."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("MatMul", ["input", "Wy"], ["dy"]),
        helper.make_node("Add", ["input", "dy"], ["output"]),
        helper.make_node("ReduceMean", ["input"], ["ymean"], axes=[1], keepdims=0),
        helper.make_node("Add", ["input_surface", "ymean"], ["output_surface"]),
    ]
    init = {"Wy": _w(rng, j, j)}
    ins = [_vi("input", F, [k, j]), _vi("input_surface", F, [k])]
    outs = [_vi("output", F, [k, j]), _vi("output_surface", F, [k])]
    return _model(nodes, ins, outs, init, path), init["Wy"]


def bert_shaped(path: Path, vocab: int = 50, width: int = 16) -> Path:
    """int64 input_ids, attention_mask -> last_hidden_state [b, s, w], embedding [b, w]: nothing to feed back."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["tok"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=F),
        helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]),
        helper.make_node("Mul", ["tok", "m3"], ["masked"]),
        helper.make_node("MatMul", ["masked", "W"], ["last_hidden_state"]),
        helper.make_node("ReduceMean", ["last_hidden_state"], ["embedding"], axes=[1], keepdims=0),
    ]
    init = {"E": _w(rng, vocab, width), "W": _w(rng, width, width), "axis2": np.array([2])}
    ins = [_vi("input_ids", I64, ["batch", "seq"]), _vi("attention_mask", I64, ["batch", "seq"])]
    outs = [_vi("last_hidden_state", F, ["batch", "seq", width]), _vi("embedding", F, ["batch", width])]
    return _model(nodes, ins, outs, init, path)


def _signature(path):
    session = OrtRuntime().open(path)
    return session.inputs, session.outputs


def test_timesfm_shaped_shifts_context_and_mask(tmp_path):
    found = detect_rollout(*_signature(timesfm_shaped(tmp_path / "m.onnx")))
    assert found.spec.feedback == (
        Feedback("forecast", "inputs", "shift", -1),
        Feedback(None, "masks", "shift", -1, fill=0.0),
    )
    assert found.spec.trajectory == ("forecast",) and found.unused_outputs == ("quantiles",)
    # the mask moves by the forecast length (the sibling edge's output), appending fill = observed
    masks = np.ones((2, 32), np.float32)
    new = next_feeds(
        {"inputs": np.zeros((2, 32), np.float32), "masks": masks}, {"forecast": np.ones((2, 8), np.float32)}, found.spec
    )
    np.testing.assert_array_equal(new["masks"][:, :24], 1)
    np.testing.assert_array_equal(new["masks"][:, 24:], 0)
    np.testing.assert_array_equal(new["inputs"][:, 24:], 1)


def test_input_only_edge_with_explicit_length_and_missing_sibling():
    spec = RolloutSpec.from_dict(
        {
            "steps": 2,
            "trajectory": ["y"],
            "feedback": [{"output": "y", "input": "x"}, {"input": "pad", "mode": "shift", "fill": 1, "length": 3}],
        }
    )
    new = next_feeds(
        {"x": np.zeros((1, 4), np.float32), "pad": np.zeros((1, 10), np.float32)},
        {"y": np.ones((1, 4), np.float32)},
        spec,
    )
    np.testing.assert_array_equal(new["pad"], [[0] * 7 + [1] * 3])
    no_length = RolloutSpec.from_dict(
        {
            "steps": 2,
            "trajectory": ["y"],
            "feedback": [{"output": "y", "input": "x"}, {"input": "pad", "mode": "shift", "fill": 1}],
        }
    )
    from runtimes import IOSpec

    f32 = np.dtype(np.float32)
    with pytest.raises(RolloutError, match="give `length`"):
        no_length.check([IOSpec("x", ("b", 4), f32), IOSpec("pad", ("b", 10), f32)], [IOSpec("y", ("b", 4), f32)])


def test_pangu_shaped_static_model_rolls_out_window_by_window(tmp_path):
    path, wy = pangu_shaped(tmp_path / "m.onnx")
    session = OrtRuntime().open(path)
    spec = detect(session.inputs, session.outputs, steps=3)
    assert spec.feedback == (
        Feedback("output", "input", "replace"),
        Feedback("output_surface", "input_surface", "replace"),
    )
    rng = np.random.default_rng(3)
    ctx = Contexts(
        {
            "input": rng.standard_normal((5, 4, 6)).astype(np.float32),
            "input_surface": rng.standard_normal((5, 4)).astype(np.float32),
        },
        "test",
    )
    engine = RolloutEngine(session, ctx, spec)
    got = engine.trajectories()
    assert not engine.batched and got["output"].shape == (5, 3, 4, 6) and got["output_surface"].shape == (5, 3, 4)
    y, x = ctx.arrays["input"][4].astype(np.float64), ctx.arrays["input_surface"][4].astype(np.float64)
    for t in range(3):  # window 4 by numpy
        y, x = y + y @ wy, x + y.mean(axis=1)
        np.testing.assert_allclose(got["output"][4, t], y, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["output_surface"][4, t], x, rtol=1e-4, atol=1e-5)


def test_single_step_int_inputs(tmp_path):
    found = detect_rollout(*_signature(bert_shaped(tmp_path / "m.onnx")))
    assert found.single_step and found.spec.steps == 1 and found.spec.feedback == ()
    assert found.spec.trajectory == ("last_hidden_state", "embedding")
    assert found.constant_inputs == ("input_ids", "attention_mask")
    with pytest.raises(RolloutError, match="single-step"):
        detect_rollout(*_signature(tmp_path / "m.onnx"), steps=4)


def test_point_and_quantile_heads(tmp_path):
    rng = np.random.default_rng(4)
    names = ["quantile_10", "mean", "quantile_90"]
    nodes = [helper.make_node("MatMul", ["context", f"W{i}"], [n]) for i, n in enumerate(names)]
    path = _model(
        nodes,
        [_vi("context", F, ["b", 24])],
        [_vi(n, F, ["b", 6]) for n in names],
        {f"W{i}": _w(rng, 24, 6) for i in range(3)},
        tmp_path / "m.onnx",
    )
    found = detect_rollout(*_signature(path))
    assert found.spec.feedback == (Feedback("mean", "context", "shift", -1),)
    assert found.spec.trajectory == ("mean",) and found.unused_outputs == ("quantile_10", "quantile_90")


def _ambiguous(path):
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("MatMul", ["a", "W"], ["c"]), helper.make_node("MatMul", ["b", "W"], ["d"])]

    def io(names):
        return [_vi(n, F, ["n", 4]) for n in names]

    return _model(nodes, io("ab"), io("cd"), {"W": _w(rng, 4, 4)}, path)


def test_ambiguous_pairing_lists_toml_candidates(tmp_path):
    path = _ambiguous(tmp_path / "m.onnx")
    with pytest.raises(AmbiguousRollout) as info:
        detect_rollout(*_signature(path))
    assert len(info.value.candidates) == 2
    edges = {c.spec.feedback for c in info.value.candidates}
    assert edges == {(Feedback("c", "a"), Feedback("d", "b")), (Feedback("c", "b"), Feedback("d", "a"))}
    text = str(info.value)
    blocks = text.split("# --- candidate ")[1:]
    for block, candidate in zip(blocks, info.value.candidates):
        toml = block.split("\n", 1)[1]
        (tmp_path / "c.toml").write_text(toml)
        assert RolloutSpec.from_toml(tmp_path / "c.toml").feedback == candidate.spec.feedback
    result = cli("score", path, "--random-contexts", "--min-params", "1", "--out", tmp_path / "run")
    assert result.exit_code == 2 and "candidate 2" in result.output + (result.stderr or "")
    result = cli("inspect", path, "--min-params", "1", "--emit-spec", tmp_path / "spec.toml")
    assert result.exit_code == 0
    written = (tmp_path / "spec.toml").read_text()
    assert "AMBIGUOUS" in written and "# [[feedback]]" in written
    with pytest.raises(RolloutError, match="no `steps`"):  # all candidates commented out: the user must pick one
        RolloutSpec.from_toml(tmp_path / "spec.toml")


@pytest.mark.parametrize(
    "text,message",
    [
        ('step = 8\ntrajectory = ["y"]', "did you mean 'steps'"),
        ('trajectory = ["y"]', "no `steps`"),
        ('steps = 2\ntrajectory = "yy"', "must be a list of output names"),
        ('steps = "8"\ntrajectory = ["y"]', "`steps` must be an integer"),
        ('steps = 2\n[[feedback]]\noutput = "y"\ninput = "x"\nmod = "shift"', "did you mean 'mode'"),
        ('steps = 2\n[[feedback]]\ninput = "x"\nmode = "shift"', 'needs mode = "shift" and a `fill`'),
        ('steps = 2\n[[feedback]]\noutput = "y"\ninput = "x"\nfill = 0', "only apply to edges without an output"),
    ],
)
def test_strict_spec_parsing(tmp_path, text, message):
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(RolloutError, match=message.replace("(", r"\(")):
        RolloutSpec.from_toml(tmp_path / "s.toml")


def test_unknown_names_list_the_models_names(tmp_path):
    path = timesfm_shaped(tmp_path / "m.onnx")
    (tmp_path / "s.toml").write_text('steps = 2\ntrajectory = ["yy"]\n')
    result = cli("score", path, "--spec", tmp_path / "s.toml", "--random-contexts", "--out", tmp_path / "run")
    text = " ".join((result.output + (result.stderr or "")).split())
    assert result.exit_code == 2 and "'yy' is not a model output (outputs: forecast, quantiles)" in text
    (tmp_path / "s.toml").write_text(
        'steps = 2\n[[feedback]]\noutput = "forecast"\ninput = "context"\nmode = "shift"\n'
    )
    with pytest.raises(RolloutError, match="inputs: inputs, masks"):
        RolloutSpec.from_toml(tmp_path / "s.toml").check(*_signature(path))


def test_emit_spec_round_trip_and_no_overwrite(tmp_path):
    path = timesfm_shaped(tmp_path / "m.onnx")
    target = tmp_path / "rollout.toml"
    result = cli("inspect", path, "--steps", "3", "--emit-spec", target)
    assert result.exit_code == 0, result.output
    emitted = RolloutSpec.from_toml(target)
    detected = detect(*_signature(path), steps=3)
    assert (emitted.steps, emitted.feedback, emitted.trajectory) == (
        detected.steps,
        detected.feedback,
        detected.trajectory,
    )
    assert "quantiles" in target.read_text()  # listed as an unused output
    before = target.read_text()
    result = cli("inspect", path, "--emit-spec", target)
    assert result.exit_code == 2 and "--force" in result.output + (result.stderr or "") and target.read_text() == before
    assert cli("inspect", path, "--emit-spec", target, "--force").exit_code == 0


def test_spec_free_score_of_a_timesfm_shaped_model(tmp_path):
    """The whole score path with a detected mask edge: padded windows, quantiles out of the trajectory."""
    path = timesfm_shaped(tmp_path / "m.onnx")
    rng = np.random.default_rng(6)
    masks = np.zeros((3, 1, 32), np.float32)
    masks[0, :, :10] = 1
    np.savez(tmp_path / "ctx.npz", inputs=rng.standard_normal((3, 1, 32)).astype(np.float32), masks=masks)
    result = cli(
        "score", path, "--contexts", tmp_path / "ctx.npz", "--steps", "3", "--probes", "1", "--out", tmp_path / "run"
    )
    text = " ".join((result.output + (result.stderr or "")).split())
    assert result.exit_code == 0, text
    assert "fill 0.0 = not padded/missing → masks (shift, axis -1)" in text
    stored = RolloutSpec.from_toml(tmp_path / "run" / "rollout.toml")
    assert stored.feedback[1] == Feedback(None, "masks", "shift", -1, fill=0.0)


@pytest.mark.parametrize(
    "example",
    [
        "etth1_patchtst",
        "era5_emulator",
        "lorenz96",
        "timesfm_etth1",
        "pangu_lorenz96",
        "era5_downscale",
        "token_embedder",
        "tied_mixer_etth1",
        "dwconv_mixer_etth1",
    ],
)
def test_examples_detect_their_committed_spec(example):
    folder = REPO / "examples" / example
    found = detect(*_signature(folder / "model.onnx"))
    committed = RolloutSpec.from_toml(folder / "rollout.toml")
    assert (found.feedback, found.trajectory) == (committed.feedback, committed.trajectory)


def test_calibration_states_move_the_mask(tmp_path):
    """Teacher-forced states (what calibration sees) apply the input-only edge like every rollout."""
    session = OrtRuntime().open(timesfm_shaped(tmp_path / "m.onnx"))
    spec = detect(session.inputs, session.outputs, steps=3)
    masks = np.ones((2, 1, 32), np.float32)
    ctx = Contexts({"inputs": np.ones((2, 1, 32), np.float32), "masks": masks}, "test")
    states = RolloutEngine(session, ctx, spec).states()
    assert len(states) == 3  # one batched chunk of 2 windows x 3 steps
    np.testing.assert_array_equal(states[2]["masks"][:, :16], 1)
    np.testing.assert_array_equal(states[2]["masks"][:, 16:], 0)


@pytest.mark.parametrize(
    "covariate,side", [("time_features", "quantiles"), ("x_mark_enc", "forecast_std"), ("calendar", "q")]
)
def test_shapes_that_fit_by_coincidence_feed_no_covariate_and_no_side_head(tmp_path, covariate, side):
    """3 quantiles over the horizon fit 3 time features over context + horizon: a shift by shape alone. Side heads
    (quantiles, spreads) feed nothing and covariates receive nothing unless their names share a stem."""
    rng = np.random.default_rng(6)
    nodes = [
        helper.make_node("MatMul", ["context", "Wf"], ["forecast"]),
        helper.make_node("Reshape", [covariate, "flat"], ["cov_flat"]),
        helper.make_node("MatMul", ["cov_flat", "Wc"], ["cov_h"]),
        helper.make_node("MatMul", ["context", "Wq"], ["q_flat"]),
        helper.make_node("Add", ["q_flat", "cov_h"], ["q_sum"]),
        helper.make_node("Reshape", ["q_sum", "shape"], [side]),
    ]
    inits = {
        "Wf": _w(rng, 64, 8),
        "Wc": _w(rng, 216, 24),
        "Wq": _w(rng, 64, 24),
        "flat": np.array([0, -1], np.int64),
        "shape": np.array([0, 3, 8], np.int64),
    }
    path = _model(
        nodes,
        [_vi("context", F, ["b", 64]), _vi(covariate, F, ["b", 3, 72])],
        [_vi("forecast", F, ["b", 8]), _vi(side, F, ["b", 3, 8])],
        inits,
        tmp_path / "m.onnx",
    )
    found = detect_rollout(*_signature(path))
    assert found.spec.feedback == (Feedback("forecast", "context", "shift", -1),)
    assert found.unused_outputs == (side,) and found.constant_inputs == (covariate,)
    same_stem = detect_rollout(
        [IOSpec("quantiles_in", (None, 3, 8), np.dtype(np.float32))],
        [IOSpec("quantiles_out", (None, 3, 8), np.dtype(np.float32))],
    )
    assert same_stem.spec.feedback == (Feedback("quantiles_out", "quantiles_in"),)  # a stem in common still pairs


def _sig(inputs, outputs):
    """IOSpecs from (name, shape[, dtype]) tuples."""

    def make(items):
        return [IOSpec(i[0], tuple(i[1]), np.dtype(i[2] if len(i) > 2 else np.float32)) for i in items]

    return make(inputs), make(outputs)


def test_a_fixed_length_output_into_a_dynamic_length_input_shifts():
    found = detect_rollout(*_sig([("past_values", ("batch", "seq_len", 7))], [("prediction", ("batch", 96, 7))]))
    assert found.spec.feedback == (Feedback("prediction", "past_values", "shift", -2),)


def test_a_state_stacked_with_forcings_is_not_shifted_along_its_channels():
    """[B, 6, H, W] in (4 variables + 2 forcings), [B, 4, H, W] out: a shift along the channels would move the
    forcings into the variables' places every step. Refused with the candidate written out, not adopted."""
    with pytest.raises(AmbiguousRollout, match="replacing 4 of its 6 entries") as info:
        detect_rollout(*_sig([("surface", ("batch", 6, 32, 64))], [("surface_next", ("batch", 4, 32, 64))]))
    assert len(info.value.candidates) == 1
    history = detect_rollout(*_sig([("state", ("batch", 2, 4, 8, 8))], [("next_state", ("batch", 1, 4, 8, 8))]))
    assert history.spec.feedback == (Feedback("next_state", "state", "shift", -4),)  # a history takes half of itself


@pytest.mark.parametrize(
    "mask,dtype,shape,fill",
    [
        ("attention_mask", np.float32, ("batch", 64), 1.0),  # Hugging Face: 1 = attend
        ("past_observed_mask", np.bool_, ("batch", 64), 1.0),
        ("attention_mask", np.int64, ("batch", 64), 1.0),
        ("input_padding", np.float32, ("batch", 80), 0.0),  # TimesFM: context + horizon long, 1 = padded
        ("masks", np.float32, ("batch", 64), 0.0),
    ],
)
def test_masks_of_any_type_and_length_move_with_their_context(mask, dtype, shape, fill):
    found = detect_rollout(*_sig([("context", ("batch", 64)), (mask, shape, dtype)], [("forecast", ("batch", 16))]))
    assert Feedback(None, mask, "shift", -1, fill=fill) in found.spec.feedback
    assert found.spec.trajectory == ("forecast",)


def test_observed_data_is_a_series_not_a_mask_and_hidden_state_is_fed_but_not_forecast():
    csdi = detect_rollout(
        *_sig([("observed_data", ("b", 7, 96)), ("observed_mask", ("b", 7, 96))], [("forecast", ("b", 7, 24))])
    )
    assert Feedback("forecast", "observed_data", "shift", -1) in csdi.spec.feedback
    assert Feedback(None, "observed_mask", "shift", -1, fill=1.0) in csdi.spec.feedback
    rnn = detect_rollout(
        *_sig(
            [("obs", ("b", 8)), ("h_in", (1, "b", 32)), ("c_in", (1, "b", 32))],
            [("y", ("b", 8)), ("h_out", (1, "b", 32)), ("c_out", (1, "b", 32))],
        )
    )
    assert {e.input for e in rnn.spec.feedback} == {"obs", "h_in", "c_in"} and rnn.spec.trajectory == ("y",)


def test_time_features_are_covariates_even_when_named_past():
    found = detect_rollout(
        *_sig([("past_values", ("b", 96, 4)), ("past_time_features", ("b", 96, 4))], [("prediction", ("b", 24, 4))])
    )
    assert found.spec.feedback == (Feedback("prediction", "past_values", "shift", -2),)
    assert "past_time_features" in found.constant_inputs


def test_no_feedback_runs_after_the_last_step(tmp_path):
    """A replace edge whose shapes never agree fails at the second step, not after the only one."""
    from tqsdeploy.rollout import rollout

    rng = np.random.default_rng(7)
    path = _model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [_vi("x", F, [2, 5])],
        [_vi("y", F, [2, 3])],
        {"W": _w(rng, 5, 3)},
        tmp_path / "m.onnx",
    )
    session = OrtRuntime().open(path)
    spec = RolloutSpec.from_dict({"steps": 1, "feedback": [{"output": "y", "input": "x"}]})
    assert len(list(rollout(session, {"x": np.zeros((2, 5), np.float32)}, spec))) == 1
    with pytest.raises(RolloutError, match="needs equal shapes"):
        list(rollout(session, {"x": np.zeros((2, 5), np.float32)}, spec, steps=2))


@pytest.mark.parametrize(
    "inputs,outputs,feedback,trajectory",
    [
        # lengths that may differ: a fixed horizon into a named context, named into named; shifts only with names
        # that say so
        (
            [("past_values", ("B", 96, 7)), ("future_time_features", ("B", "horizon", 4))],
            [("prediction", ("B", "horizon", 7))],
            [Feedback("prediction", "past_values", "shift", -2)],
            ("prediction",),
        ),
        (
            [("context", ("B", "seq_len"))],
            [("forecast", ("B", "pred_len"))],
            [Feedback("forecast", "context", "shift", -1)],
            ("forecast",),
        ),
        (
            [
                ("decoder_input_ids", ("batch", "dec_len"), np.int64),
                ("encoder_hidden_states", ("batch", "enc_len", 32)),
            ],
            [("logits", ("batch", "dec_len", 64)), ("last_hidden_state", ("batch", "dec_len", 32))],
            [],
            ("logits", "last_hidden_state"),
        ),
        # one axis fewer: one entry along the dynamic time axis, or the input's singleton axis added
        ([("x", ("batch", "seq", 7))], [("y", ("batch", 7))], [Feedback("y", "x", "shift", -2)], ("y",)),
        ([("x", ("B", 96, 1))], [("y", ("B", 24))], [Feedback("y", "x", "shift", -2)], ("y",)),
        # forecast variables named like recurrent state stay in the trajectory; a land-sea mask is a static field
        (
            [("cell_temperature", ("B", 1, 16, 16)), ("memory", ("B", 1, 16, 16))],
            [("cell_temperature_next", ("B", 1, 16, 16)), ("memory_next", ("B", 1, 16, 16))],
            [Feedback("cell_temperature_next", "cell_temperature"), Feedback("memory_next", "memory")],
            ("cell_temperature_next", "memory_next"),
        ),
        (
            [("radar", ("B", 4, 16, 16)), ("land_sea_mask", ("B", 1, 16, 16))],
            [("radar_next", ("B", 1, 16, 16))],
            [Feedback("radar_next", "radar", "shift", -3)],
            ("radar_next",),
        ),
    ],
)
def test_detection_on_signatures_the_second_audit_found(inputs, outputs, feedback, trajectory):
    found = detect_rollout(*_sig(inputs, outputs))
    assert list(found.spec.feedback) == feedback and found.spec.trajectory == trajectory


def test_reason_lines_name_the_output_and_the_input_and_one_step_is_singular(tmp_path):
    """inspect's reason line, keyed by the input, names whose shape is whose; a single-step rollout reads '1 step'
    in score's and eval's summaries (issue 34, item 10)."""
    import models

    shift = models.shift_model(tmp_path / "s.onnx", length=16, horizon=4)
    result = cli("inspect", shift)
    text = " ".join(result.output.split())
    assert (
        result.exit_code == 0 and "x: 'y' [batch, 4] appends to 'x' [batch, 16] along axis -1 (4 < 16) → shift" in text
    ), text
    single = models.assorted_ops(tmp_path / "a.onnx")
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "c.npz",
        ids=rng.integers(0, 100, (2, 3)),
        img=rng.standard_normal((2, 3, 4, 8, 8)).astype(np.float32),
    )
    result = cli("score", single, "-c", tmp_path / "c.npz", "--probes", "1", "--out", tmp_path / "run")
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and "rollout 1 step (detected)" in text and "1 steps" not in text, text
    result = cli("eval", single, "--reference", single, "-c", tmp_path / "c.npz", "--report", tmp_path / "e")
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and "2 context windows × 1 step;" in text, text
