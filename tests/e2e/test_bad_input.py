"""Every bad input ends in one line naming the problem, exit code 2, no
traceback, and an untouched input file."""

import hashlib

import models
import numpy as np
import onnx
import pytest
from conftest import cli


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fails(args, *phrases, code=2):
    result = cli(*args)
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == code, text
    assert "Traceback" not in text
    message = " ".join(text.split())
    for phrase in phrases:
        assert phrase in message, message
    return message


@pytest.fixture
def ctx(tmp_path):
    path = tmp_path / "ctx.npz"
    np.savez(path, x=np.random.default_rng(0).standard_normal((3, 1, 32)).astype(np.float32))
    return path


def test_not_onnx(tmp_path, ctx):
    bogus = tmp_path / "notes.onnx"
    bogus.write_text("this is a text file, not a model\n" * 20)
    _fails(["score", bogus, "-c", ctx, "-o", tmp_path / "run"], "is not an ONNX model")
    assert bogus.read_text().startswith("this is a text file")


def test_truncated(tmp_path, ctx):
    full = models.two_branch(tmp_path / "full.onnx")
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    before = _digest(cut)
    _fails(["score", cut, "-c", ctx, "-o", tmp_path / "run"], "truncated or corrupt")
    assert _digest(cut) == before


def _external(tmp_path, location):
    model = onnx.load(str(models.two_branch(tmp_path / "src.onnx")))
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save_model(
        model, str(folder / "model.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0
    )
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def test_external_data_missing(tmp_path, ctx):
    _fails(["score", _external(tmp_path, "gone.bin"), "-c", ctx, "-o", tmp_path / "run"], "gone.bin", "missing")


def test_external_data_outside_folder(tmp_path, ctx):
    (tmp_path / "evil.bin").write_bytes(b"\0" * 100000)
    _fails(
        ["score", _external(tmp_path, "../evil.bin"), "-c", ctx, "-o", tmp_path / "run"], "outside the model's folder"
    )


def test_external_data_loads_when_valid(tmp_path, ctx):
    path = _external(tmp_path, "weights.bin")
    result = cli("score", path, "-c", ctx, "-o", tmp_path / "run", "--steps", "2")
    assert result.exit_code == 0, result.output


def test_no_quantizable_tensors(tmp_path):
    model = models.small_weights_model(tmp_path / "small.onnx")
    np.savez(tmp_path / "c.npz", x=np.ones((2, 1, 4), np.float32))
    _fails(["score", model, "-c", tmp_path / "c.npz", "-o", tmp_path / "run"], "no quantizable tensors", "--min-params")


def test_contexts_missing_input(two_branch, tmp_path):
    model, _ = two_branch
    np.savez(tmp_path / "wrong.npz", state=np.ones((2, 1, 32), np.float32))
    _fails(["score", model, "-c", tmp_path / "wrong.npz", "-o", tmp_path / "run"], "no array for model input 'x'")


def test_contexts_wrong_shape(two_branch, tmp_path):
    model, _ = two_branch
    np.savez(tmp_path / "wrong.npz", x=np.ones((2, 1, 31), np.float32))
    _fails(
        ["score", model, "-c", tmp_path / "wrong.npz", "-o", tmp_path / "run"],
        "does not fit model input 'x' [batch, 32]",
    )


@pytest.mark.parametrize("layout", ["external data", "one file of SKELETON_BYTES or more"])
def test_a_refused_score_of_a_streamed_model_leaves_nothing_that_blocks_the_next_run(tmp_path, monkeypatch, layout):
    """A model swept from its files (external data, or an .onnx of 64 MiB or more: the threshold lowered to 0 here,
    as in test_streaming) gets a session file in its run folder before the contexts are read: a refusal must take it
    away again, or the corrected command finds 'not a tqsdeploy run folder and not empty' (issue 34, item 1)."""
    import sys

    folder = tmp_path / "ext"
    folder.mkdir()
    proto = onnx.load(str(models.mlp_forecaster(tmp_path / "inline.onnx")))
    model = folder / "big.onnx"
    if layout == "external data":
        onnx.save_model(
            proto,
            str(model),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="big.onnx.data",
            size_threshold=0,
        )
    else:
        onnx.save_model(proto, str(model))
        monkeypatch.setattr(sys.modules["graph_ops.io"], "SKELETON_BYTES", 0)
    np.savez(tmp_path / "wrong.npz", x=np.ones((2, 1, 31), np.float32))
    np.savez(tmp_path / "right.npz", x=np.random.default_rng(0).standard_normal((2, 1, 32)).astype(np.float32))
    run = tmp_path / "runs" / "big"
    _fails(["score", model, "-c", tmp_path / "wrong.npz", "-o", run, "--steps", 2], "does not fit model input 'x'")
    assert not run.exists() and not (tmp_path / "runs").exists()
    result = cli("score", model, "-c", tmp_path / "right.npz", "-o", run, "--steps", 2, "--probes", 1)
    assert result.exit_code == 0, result.output
    run.joinpath("keep.txt").write_text("the user's")  # a refusal in a finished run folder removes only what it made
    before = sorted(p.name for p in run.iterdir())
    _fails(
        ["score", model, "-c", tmp_path / "wrong.npz", "-o", run, "--steps", 3, "--fresh"],
        "does not fit model input 'x'",
    )
    assert sorted(p.name for p in run.iterdir()) == before


def test_contexts_beyond_float32_are_named_not_turned_into_inf(two_branch, tmp_path):
    """A float64 context of 1e39 is finite, but not as the model's float32 input."""
    model, _ = two_branch
    big = np.random.default_rng(0).standard_normal((2, 1, 32))
    big[1, 0, 5] = 1e39
    np.savez(tmp_path / "big.npz", x=big)
    _fails(
        ["score", model, "-c", tmp_path / "big.npz", "-o", tmp_path / "run"],
        "contexts array 'x' holds 1e+39, beyond float32's range",
    )


def test_a_folder_of_the_users_own_files_is_refused_not_overwritten(two_branch, tmp_path):
    model, ctx_path = two_branch
    own = tmp_path / "own"
    own.mkdir()
    (own / "contexts.npz").write_bytes(ctx_path.read_bytes())
    (own / "rollout.toml").write_text('# mine\nsteps = 3\ntrajectory = ["y"]\n')
    before = {p.name: p.read_bytes() for p in own.iterdir()}
    _fails(["score", model, "-c", ctx_path, "-o", own], "not a tqsdeploy run folder")
    assert {p.name: p.read_bytes() for p in own.iterdir()} == before


def test_rollout_spec_does_not_fit(tmp_path):
    model = models.shift_model(tmp_path / "shift.onnx")
    np.savez(tmp_path / "c.npz", x=np.ones((2, 1, 16), np.float32))
    spec = tmp_path / "spec.toml"
    spec.write_text('steps = 3\n[[feedback]]\noutput = "y"\ninput = "x"\nmode = "replace"\n')
    _fails(
        ["score", model, "-c", tmp_path / "c.npz", "--spec", spec, "-o", tmp_path / "run", "--min-params", "1"],
        "does not fit input 'x'",
    )
    spec.write_text('steps = 3\n[[feedback]]\noutput = "y"\ninput = "state"\n')
    _fails(
        ["score", model, "-c", tmp_path / "c.npz", "--spec", spec, "-o", tmp_path / "run", "--min-params", "1"],
        "'state' is not a model input",
    )


def test_rollout_spec_not_toml(two_branch, tmp_path):
    model, ctx_path = two_branch
    (tmp_path / "bad.toml").write_text("steps = = 3")
    _fails(["score", model, "-c", ctx_path, "--spec", tmp_path / "bad.toml", "-o", tmp_path / "run"], "not valid TOML")


def test_nonfinite_nominal_rollout(tmp_path, ctx):
    model = models.nan_model(tmp_path / "nan.onnx")
    _fails(["score", model, "-c", ctx, "-o", tmp_path / "run"], "NaN or Inf", "'y'")


def test_unknown_provider(two_branch, tmp_path):
    model, ctx_path = two_branch
    _fails(["score", model, "-c", ctx_path, "--provider", "tpu", "-o", tmp_path / "run"], "unknown provider 'tpu'")


def test_unavailable_provider(two_branch, tmp_path):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("CUDA is available here")
    model, ctx_path = two_branch
    _fails(["score", model, "-c", ctx_path, "--provider", "cuda", "-o", tmp_path / "run"], "'cuda' is not available")


def test_missing_model_and_contexts(two_branch, tmp_path):
    model, _ = two_branch
    _fails(["score", tmp_path / "nope.onnx", "-c", tmp_path / "x.npz"], "does not exist")
    _fails(["score", model, "-o", tmp_path / "run"], "no contexts given", "--random-contexts")
    _fails(["score", model, "-c", tmp_path / "absent.npz", "-o", tmp_path / "run"], "does not exist")


def test_single_step_model_refuses_more_steps(tmp_path):
    model = models.assorted_ops(tmp_path / "multi.onnx")  # nothing to feed back: detected as single-step (T = 1)
    _fails(
        ["score", model, "--random-contexts", "-o", tmp_path / "run", "--min-params", "1", "--steps", "4"],
        "single-step",
        "--steps 1",
    )


def test_model_file_untouched_by_a_full_run(two_branch, tmp_path):
    model, ctx_path = two_branch
    before = _digest(model)
    result = cli("score", model, "-c", ctx_path, "-o", tmp_path / "run")
    assert result.exit_code == 0
    assert _digest(model) == before


def _reordered(source, target, order):
    """`source` with its nodes listed in `order` (a permutation of their indices)."""
    model = onnx.load(str(source))
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)
    onnx.save(model, str(target))
    return target


def test_nodes_out_of_order_are_sorted_not_refused(two_branch, tmp_path):
    """ONNX Runtime runs a graph whose nodes are out of order (hand-edited graphs often are);
    tqsdeploy sorts its own copy (onnx-graphsurgeon) and gives the sorted model's results."""
    model, ctx_path = two_branch
    count = len(onnx.load(str(model)).graph.node)
    shuffled = _reordered(model, tmp_path / "shuffled.onnx", list(reversed(range(count))))
    with pytest.raises(Exception, match="topologically sorted"):
        onnx.checker.check_model(str(shuffled))
    before = _digest(shuffled)
    for name, path in [("sorted", model), ("shuffled", shuffled)]:
        result = cli("score", path, "-c", ctx_path, "-o", tmp_path / name, "--steps", "3", "--strategy", "feed")
        assert result.exit_code == 0, result.output
    import polars as pl

    tables = [pl.read_parquet(tmp_path / name / "scores.parquet").sort("unit") for name in ("sorted", "shuffled")]
    assert tables[0]["unit"].to_list() == tables[1]["unit"].to_list()
    assert np.allclose(tables[0]["gamma"].to_numpy(), tables[1]["gamma"].to_numpy(), rtol=1e-6)
    result = cli("export", shuffled, "--run", tmp_path / "shuffled", "--C", "4", "-o", tmp_path / "q.onnx")
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(str(tmp_path / "q.onnx"))  # what tqsdeploy writes is in order
    assert _digest(shuffled) == before


def test_nodes_in_a_cycle_are_refused(tmp_path, ctx):
    model = onnx.load(str(models.two_branch(tmp_path / "two.onnx")))
    model.graph.node[1].input[0] = "dead_out"  # dead_raw = dead_out @ Wdead, dead_out = dead_raw * 0
    onnx.save(model, str(tmp_path / "cycle.onnx"))
    message = _fails(
        ["score", tmp_path / "cycle.onnx", "-c", ctx, "-o", tmp_path / "run"], "cycle.onnx", "cannot be sorted"
    )
    assert "[C]" not in message and "[W]" not in message  # onnx-graphsurgeon's own log lines stay quiet


SCORE_SETTINGS = {
    "--probe-bits 1": (["--probe-bits", "1"], "--probe-bits must be 2 to 16"),
    "--probe-bits 64": (["--probe-bits", "64"], "--probe-bits must be 2 to 16"),
    "--probes -1": (["--probes", "-1"], "--probes must be 0 or more"),
    "--eps nan": (["--eps", "nan"], "--eps must be a positive finite"),
    "--eps -1": (["--eps", "-1"], "--eps must be a positive finite"),
    "--dead-rtol nan": (["--dead-rtol", "nan"], "--dead-rtol must be"),
    "--seed -1": (["--seed", "-1"], "--seed must be 0 or more"),
    "--early-stop-window 0": (["--early-stop", "--early-stop-window", "0"], "--early-stop-window must be 1"),
    "--horizons 0,1": (["--horizons", "0,1"], "--horizons are steps from 1"),
    "--horizons past T": (["--steps", "2", "--horizons", "5"], "beyond the rollout's 2 steps"),
    "--random-contexts with -c": (["--random-contexts"], "exclude each other"),
}


@pytest.mark.parametrize("case", SCORE_SETTINGS)
def test_score_settings_out_of_range_are_refused(tmp_path, ctx, case):
    """Each of these once gave a wrong table with exit 0 (all units dead, NaN γ, horizons dropped)."""
    model = models.two_branch(tmp_path / "m.onnx")
    args, phrase = SCORE_SETTINGS[case]
    _fails(["score", model, "-c", ctx, "-o", tmp_path / "run", *args], phrase)
    assert not (tmp_path / "run" / "scores.csv").exists()


def _int_input_model(path):
    """y = x + embedding[hour]: an int64 input beside the float state."""
    from onnx import TensorProto, helper

    table = np.random.default_rng(0).standard_normal((24, 32)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "hour"], ["offset"]), helper.make_node("Add", ["x", "offset"], ["y"])]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 32]),
        helper.make_tensor_value_info("hour", TensorProto.INT64, ["b"]),
    ]
    return models._model(
        nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 32])], {"table": table}, path
    )


@pytest.mark.parametrize(
    "hour,phrase",
    [
        (np.full((3, 1), 5.7), "holds fractions"),
        (np.full((3, 1), np.nan), "contains NaN or Inf"),
        (np.full((3, 1), True), "cannot take as it is"),
        (np.full((3, 1), 1e30), "outside int64's range"),
    ],
)
def test_context_values_the_cast_would_change_are_refused(tmp_path, hour, phrase):
    model = _int_input_model(tmp_path / "m.onnx")
    path = tmp_path / "c.npz"
    np.savez(path, x=np.zeros((3, 1, 32), np.float32), hour=hour)
    _fails(["score", model, "-c", path, "--steps", "1", "--min-params", "1", "-o", tmp_path / "run"], phrase)
    np.savez(path, x=np.zeros((3, 1, 32), np.complex64), hour=np.full((3, 1), 5))
    _fails(["score", model, "-c", path, "--steps", "1", "--min-params", "1", "-o", tmp_path / "run"], "complex64")


@pytest.fixture
def pair(tmp_path):
    """A reference, a candidate, contexts and a truth that fit them (y = x @ W, T = 2)."""
    model = models.two_branch(tmp_path / "m.onnx")
    ctx = tmp_path / "ctx.npz"
    np.savez(ctx, x=np.random.default_rng(0).standard_normal((3, 1, 32)).astype(np.float32))
    truth = np.zeros((3, 2, 1, 32))
    return model, ctx, truth


@pytest.mark.parametrize("command", ["eval", "gate"])
def test_a_nan_truth_is_bad_input_not_a_failed_gate(tmp_path, pair, command):
    model, ctx, truth = pair
    truth[0, 0, 0, 3] = np.nan
    np.savez(tmp_path / "t.npz", y=truth)
    extra = (
        ["--max-degradation", "5%", "--report-dir", tmp_path / "g"]
        if command == "gate"
        else ["--report", tmp_path / "r"]
    )
    _fails(
        [command, model, "-r", model, "-c", ctx, "--steps", 2, "--truth", tmp_path / "t.npz", *extra],
        "truth 'y'",
        "contains NaN or Inf",
    )


def test_a_reference_that_produces_nan_is_bad_input(tmp_path, pair):
    model, ctx, _ = pair
    proto = onnx.load(str(model))
    tiny = next(t for t in proto.graph.initializer if t.name == "tiny")  # below --min-params: not checked as a unit
    tiny.CopyFrom(onnx.numpy_helper.from_array(np.array([np.nan], np.float32), "tiny"))
    onnx.save(proto, str(tmp_path / "nan.onnx"))
    _fails(
        [
            "gate",
            model,
            "-r",
            tmp_path / "nan.onnx",
            "-c",
            ctx,
            "--steps",
            2,
            "--max-degradation",
            "5%",
            "--report-dir",
            tmp_path / "g",
        ],
        "the reference model",
        "produces NaN or Inf",
    )


@pytest.mark.parametrize(
    "args,phrase",
    [
        (["--min-compression", "nan"], "--min-compression must be a positive finite"),
        (["--max-degradation-output", "y=1%", "--max-degradation-output", "y=50%"], "gives output 'y' twice"),
        (["--max-degradation", "1.2.3%"], "takes a percentage"),
    ],
)
def test_gate_bounds_that_cannot_be_meant_are_refused(tmp_path, pair, args, phrase):
    model, ctx, _ = pair
    _fails(["gate", model, "-r", model, "-c", ctx, "--steps", 2, *args, "--report-dir", tmp_path / "g"], phrase)


def test_eval_refuses_a_variable_axis_the_outputs_lack(tmp_path, pair):
    model, ctx, _ = pair
    _fails(
        ["eval", model, "-r", model, "-c", ctx, "--steps", 2, "--variable-axis", "7", "--report", tmp_path / "r"],
        "--variable-axis 7 is not an axis",
    )


@pytest.mark.parametrize(
    "edge,phrase",
    [
        ({"fill": float("nan")}, "fill must be a finite number"),
        ({"fill": 1e40}, "beyond float32's range"),
        ({"fill": 0.0, "length": 100}, "appends 100 entries per step along axis -1, which holds 16"),
    ],
)
def test_mask_edges_whose_fill_or_length_cannot_be_meant_are_refused(edge, phrase):
    from runtimes import IOSpec
    from tqsdeploy.errors import RolloutError
    from tqsdeploy.rollout import RolloutSpec

    f32 = np.dtype(np.float32)
    inputs = [IOSpec("x", ("b", 16), f32), IOSpec("mask", ("b", 16), f32)]
    data = {
        "steps": 2,
        "feedback": [
            {"output": "y", "input": "x", "mode": "shift", "axis": -1},
            {"input": "mask", "mode": "shift", "axis": -1, **edge},
        ],
    }
    with pytest.raises(RolloutError, match=phrase):
        RolloutSpec.from_dict(data).check(inputs, [IOSpec("y", ("b", 4), f32)])


def test_a_trajectory_naming_an_output_twice_is_refused():
    from tqsdeploy.errors import RolloutError
    from tqsdeploy.rollout import RolloutSpec

    with pytest.raises(RolloutError, match="lists y more than once"):
        RolloutSpec.from_dict({"steps": 2, "trajectory": ["y", "y"], "feedback": [{"output": "y", "input": "x"}]})


@pytest.mark.parametrize("variable, value", [("TQS_SOLVER_DTYPE", "half"), ("TQS_ARRAYS", "cupyy")])
def test_a_mistyped_solver_variable_is_refused_before_any_work(two_branch, tmp_path, monkeypatch, variable, value):
    model, contexts = two_branch
    monkeypatch.setenv(variable, value)
    result = cli("score", model, "-c", contexts, "-o", tmp_path / "run")
    assert result.exit_code == 2
    assert variable in result.output and value in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args,phrase",
    [
        (
            ["baseline", "{conv}", "--method", "rtn", "--bits", "4", "--group-size", "4", "-o", "{tmp}/b.onnx"],
            "none of this model's",
        ),
        (
            ["baseline", "{mlp}", "--method", "rtn", "--bits", "1", "--group-size", "8", "-o", "{tmp}/b.onnx"],
            "no tier here (int1) takes blocks",
        ),
        (
            ["export", "{conv}", "--run", "{tmp}/run", "--C", "4", "--group-size", "4", "-o", "{tmp}/q.onnx"],
            "none of this model's",
        ),
        (
            [
                "frontier",
                "{conv}",
                "-c",
                "{tmp}/c.npz",
                "--steps",
                "2",
                "--C",
                "4",
                "--group-size",
                "4",
                "-o",
                "{tmp}/fr",
            ],
            "none of this model's",
        ),
    ],
)
def test_a_group_size_nothing_can_take_is_refused_not_ignored(tmp_path, args, phrase):
    """--group-size on a Conv-only model or with --bits 1 once wrote per-channel scales with exit 0, as if it had
    been applied."""
    conv, mlp = models.conv_stack(tmp_path / "conv.onnx"), models.mlp_forecaster(tmp_path / "mlp.onnx")
    if "export" in args or "frontier" in args:
        contexts = tmp_path / "c.npz"
        shape = [d.dim_value or 2 for d in onnx.load(str(conv)).graph.input[0].type.tensor_type.shape.dim]
        np.savez(
            contexts,
            **{
                onnx.load(str(conv)).graph.input[0].name: np.random.default_rng(0)
                .standard_normal([2, *shape])
                .astype(np.float32)
            },
        )
        result = cli(
            "score",
            conv,
            "-c",
            contexts,
            "--steps",
            "2",
            "--probe",
            "quant",
            "--min-params",
            "1",
            "-o",
            tmp_path / "run",
        )
        assert result.exit_code == 0, result.output
    _fails([a.format(conv=conv, mlp=mlp, tmp=tmp_path) for a in args], "--group-size", phrase)
    assert (
        not list(tmp_path.glob("*.onnx.*"))
        and not (tmp_path / "b.onnx").exists()
        and not (tmp_path / "q.onnx").exists()
    )
    assert not (tmp_path / "fr").exists()  # frontier refuses before its score


def _csv(path, header, rows=40):
    values = np.random.default_rng(0).standard_normal((rows, len(header) - 1))
    path.write_text(
        ",".join(header)
        + "\n"
        + "".join(f"2020-01-01 {i:02d}:00," + ",".join(f"{v:.4f}" for v in row) + "\n" for i, row in enumerate(values))
    )
    return path


@pytest.mark.parametrize("columns", [["--columns", "OT"], []])
def test_a_csv_with_two_columns_of_one_name_is_refused(tmp_path, columns):
    """polars renames the second 'OT' to 'OT_duplicated_0', so --columns OT once scored whichever came first, exit 0."""
    model = models.shift_model(tmp_path / "m.onnx")
    csv = _csv(tmp_path / "series.csv", ["date", "OT", "OT"])
    _fails(
        ["score", model, "-c", csv, "--windows", 2, "--steps", 2, "--min-params", 1, *columns, "-o", tmp_path / "run"],
        "more than one column named 'OT'",
    )


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the command line prints them; pytest would only collect them
def test_a_csv_without_rows_says_so_without_numpy_warnings(tmp_path):
    """--zscore of a header-only CSV once printed numpy's 'Mean of empty slice' warnings above the error."""
    model = models.shift_model(tmp_path / "m.onnx")
    csv = _csv(tmp_path / "series.csv", ["date", "OT"], rows=0)
    message = _fails(
        [
            "score",
            model,
            "-c",
            csv,
            "--columns",
            "OT",
            "--zscore",
            "--steps",
            2,
            "--min-params",
            1,
            "-o",
            tmp_path / "run",
        ],
        "has 0 rows",
    )
    assert "Warning" not in message and "empty slice" not in message, message


def test_eval_names_the_input_the_two_models_disagree_on(tmp_path, pair):
    """A candidate of another model once got 'differ in inputs or outputs: ({...}, {...}) vs ({...}, {...})'."""
    model, ctx, _ = pair
    other = onnx.load(str(models.two_branch(tmp_path / "other.onnx")))
    other.graph.input[0].name = "state"
    for node in other.graph.node:
        node.input[:] = ["state" if i == "x" else i for i in node.input]
    onnx.save(other, str(tmp_path / "renamed.onnx"))
    message = _fails(
        ["eval", tmp_path / "renamed.onnx", "-r", model, "-c", ctx, "--steps", 2, "--no-latency"],
        "the candidate has input 'state', the reference does not (its inputs: x)",
    )
    assert "{" not in message, message


def test_a_mistyped_feedback_output_is_named_as_the_user_wrote_it(tmp_path):
    """A typo in [[feedback]] output was reported as 'trajectory output ... is not a model output', a key the spec
    never had."""
    model = models.shift_model(tmp_path / "shift.onnx")
    np.savez(tmp_path / "c.npz", x=np.ones((2, 1, 16), np.float32))
    spec = tmp_path / "spec.toml"
    spec.write_text('steps = 3\n[[feedback]]\noutput = "yy"\ninput = "x"\nmode = "shift"\n')
    message = _fails(
        ["score", model, "-c", tmp_path / "c.npz", "--spec", spec, "-o", tmp_path / "run", "--min-params", "1"],
        "feedback output 'yy' is not a model output (outputs: y); did you mean 'y'?",
    )
    assert "trajectory" not in message, message


def test_a_truth_of_the_wrong_length_says_longer_ones_are_fine(tmp_path, pair):
    """'expected [3, 2, 1, 32]' for a truth of 4 windows read as if a truth of 40 steps would be refused too;
    a longer truth is cut to the rollout."""
    model, ctx, truth = pair
    np.savez(tmp_path / "t.npz", y=np.zeros((4, 2, 1, 32)))
    _fails(
        ["eval", model, "-r", model, "-c", ctx, "--steps", 2, "--truth", tmp_path / "t.npz", "--no-latency"],
        "truth 'y' has shape [4, 2, 1, 32]; expected [3, 2 or more, 1, 32]",
    )
    np.savez(tmp_path / "long.npz", y=np.zeros((3, 9, 1, 32)))
    result = cli(
        "eval",
        model,
        "-r",
        model,
        "-c",
        ctx,
        "--steps",
        2,
        "--truth",
        tmp_path / "long.npz",
        "--no-latency",
        "--report",
        tmp_path / "r",
    )
    assert result.exit_code == 0, result.output


def test_a_truth_without_the_batch_axis_of_one_reads_as_contexts_do(tmp_path, pair):
    """Contexts may leave out a window's batch axis of one; a truth shaped the same way was refused."""
    import json

    model, ctx, _ = pair
    truth = np.random.default_rng(5).standard_normal((3, 2, 32))  # (windows, steps, 32): no batch axis
    np.savez(tmp_path / "flat.npz", y=truth)
    np.savez(tmp_path / "full.npz", y=truth[:, :, None])
    maes = []
    for name in ("flat", "full"):
        result = cli(
            "eval",
            model,
            "-r",
            model,
            "-c",
            ctx,
            "--steps",
            2,
            "--truth",
            tmp_path / f"{name}.npz",
            "--no-latency",
            "--report",
            tmp_path / name,
        )
        assert result.exit_code == 0, result.output
        maes.append(json.loads((tmp_path / f"{name}.json").read_text())["outputs"]["y"]["vs_truth"]["mae"])
    assert maes[0] == maes[1] > 0


def test_feedback_edges_one_per_input_and_an_output_may_feed_two(tmp_path):
    """Two edges into one input were refused as "`trajectory` lists y more than once" (a key the spec did not
    have), and so was a legitimate spec whose one output feeds two inputs: the first is refused naming the
    edges, the second runs with y once in the trajectory."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    init = {
        "W": (0.5 * rng.standard_normal((32, 32)) / np.sqrt(32)).astype(np.float32),
        "V": (0.5 * rng.standard_normal((32, 32)) / np.sqrt(32)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"]),
        helper.make_node("MatMul", ["prev", "V"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 32]) for name in ("x", "prev")]
    model = models._model(
        nodes,
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
        init,
        tmp_path / "two_in.onnx",
    )
    np.savez(
        tmp_path / "c.npz",
        x=rng.standard_normal((2, 1, 32)).astype(np.float32),
        prev=rng.standard_normal((2, 1, 32)).astype(np.float32),
    )
    spec = tmp_path / "spec.toml"
    spec.write_text('steps = 3\n[[feedback]]\noutput = "y"\ninput = "x"\n[[feedback]]\noutput = "y"\ninput = "x"\n')
    message = _fails(
        ["score", model, "-c", tmp_path / "c.npz", "--spec", spec, "-o", tmp_path / "run"],
        "[[feedback]] #2 feeds input 'x', which #1 already feeds",
    )
    assert "trajectory" not in message, message
    spec.write_text('steps = 3\n[[feedback]]\noutput = "y"\ninput = "x"\n[[feedback]]\noutput = "y"\ninput = "prev"\n')
    result = cli("score", model, "-c", tmp_path / "c.npz", "--spec", spec, "-o", tmp_path / "run", "--probes", 1)
    assert result.exit_code == 0, result.output
    assert "trajectory ['y']" in result.output


def test_inspect_says_which_weights_hold_nan_or_inf(tmp_path):
    """score refuses a weight holding NaN or Inf; inspect, run first, said nothing of it."""
    import json

    from onnx import TensorProto, helper, numpy_helper

    weight = np.ones((16, 16), np.float32)
    weight[3, 4] = np.nan
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = tmp_path / "nan_weight.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(model))
    result = cli("inspect", model, "--min-params", "1")
    assert result.exit_code == 0, result.output
    assert "1 weight(s) hold NaN or Inf (W): score, export and baseline refuse this model" in " ".join(
        result.output.split()
    )
    result = cli("inspect", model, "--min-params", "1", "--json")
    assert json.loads(result.output)["nonfinite_weights"] == ["W"]
    clean = tmp_path / "clean.onnx"
    weight[3, 4] = 1.0
    graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "W"))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(clean))
    result = cli("inspect", clean, "--min-params", "1", "--json")
    assert json.loads(result.output)["nonfinite_weights"] == []


def test_contexts_with_an_empty_axis(tmp_path):
    """Windows of zero values (shape (3, 0, 32)) would score every unit dead and evaluate to NaN: refused at once."""
    model = models.two_branch(tmp_path / "m.onnx")
    empty = tmp_path / "empty.npz"
    np.savez(empty, x=np.zeros((3, 0, 32), np.float32))
    _fails(
        ["score", model, "-c", empty, "-o", tmp_path / "run"], "contexts array 'x' has shape [3, 0, 32]: an empty axis"
    )
    _fails(["eval", model, "-r", model, "-c", empty, "--no-latency", "--report", tmp_path / "r"], "an empty axis")
    assert not (tmp_path / "run").exists() and not (tmp_path / "r.json").exists()


def test_an_npz_member_that_is_no_array(tmp_path):
    import zipfile

    model = models.two_branch(tmp_path / "m.onnx")
    junk = tmp_path / "junk.npz"
    with zipfile.ZipFile(junk, "w") as archive:
        archive.writestr("x.npy", b"junk")
    _fails(
        ["score", model, "-c", junk, "-o", tmp_path / "run"],
        f"contexts file {junk}: its member 'x' is not a numpy array",
    )


def test_a_failed_fresh_score_keeps_the_finished_run_it_would_replace(tmp_path, ctx):
    """--fresh replaces a finished run only once the new one has a result: a nominal rollout that overflows leaves the
    old run's files as they were (byte for byte), and a score that fails in a new folder leaves no folder behind."""
    model = models.two_branch(tmp_path / "m.onnx")
    run = tmp_path / "run"
    assert cli("score", model, "-c", ctx, "-o", run).exit_code == 0
    kept = {path.name: _digest(path) for path in run.iterdir() if path.is_file() and not path.name.startswith(".")}
    huge = tmp_path / "huge.npz"
    np.savez(huge, x=np.full((3, 1, 32), 3e38, np.float32))
    _fails(["score", model, "-c", huge, "-o", run, "--fresh"], "NaN or Inf")
    assert {name: _digest(run / name) for name in kept} == kept and not (run / ".replaced").exists()
    _fails(["score", model, "-c", huge, "-o", tmp_path / "new"], "NaN or Inf")
    assert not (tmp_path / "new").exists()


def test_an_unknown_strategy_is_refused_before_a_finished_run_is_read(tmp_path, ctx):
    model = models.two_branch(tmp_path / "m.onnx")
    assert cli("score", model, "-c", ctx, "-o", tmp_path / "run").exit_code == 0
    _fails(["score", model, "-c", ctx, "-o", tmp_path / "run", "--strategy", "fast"], "unknown strategy 'fast'")
    _fails(["score", model, "-c", ctx, "-o", tmp_path / "run", "--steps", 10**20], "at most 100000 are taken")


def test_an_unreachable_ray_cluster_is_refused_at_once(tmp_path, ctx):
    model = models.two_branch(tmp_path / "m.onnx")
    _fails(
        ["score", model, "-c", ctx, "-o", tmp_path / "run", "--ray", "127.0.0.1:1"],
        "no Ray cluster answers at 127.0.0.1:1",
    )
    _fails(
        ["score", model, "-c", ctx, "-o", tmp_path / "run", "--ray", "nohost"],
        "--ray takes 'local', 'auto' or a cluster address",
    )


def test_a_damaged_score_table(tmp_path, ctx):
    model = models.two_branch(tmp_path / "m.onnx")
    run = tmp_path / "run"
    assert cli("score", model, "-c", ctx, "-o", run).exit_code == 0
    (run / "scores.parquet").write_bytes(b"")
    _fails(
        ["export", model, "--run", run, "--C", 4, "-o", tmp_path / "q.onnx"],
        "scores.parquet is not a readable score table",
    )
    assert not (tmp_path / "q.onnx").exists()


def test_a_bad_bucket_pattern_and_a_sub_byte_size(tmp_path, ctx):
    model = models.two_branch(tmp_path / "m.onnx")
    _fails(
        ["frontier", model, "-c", ctx, "--C", 4, "--buckets", "input=[", "--out", tmp_path / "f"],
        "input='[' is not a regular expression",
    )
    assert not (tmp_path / "f").exists()
    _fails(
        ["gate", model, "-r", model, "-c", ctx, "--no-latency", "--max-size", "0.1B", "--report-dir", tmp_path / "g"],
        "at least 1 byte",
    )


def test_a_csv_that_is_not_utf8_and_a_compression_below_one(tmp_path, ctx):
    """polars reads other encodings lossily (a Latin-1 header became 'temp\ufffdC'): refused, naming the byte. C < 1
    asks for a file larger than the original: refused before the export's passes run, not written as 1x."""
    model = models.two_branch(tmp_path / "m.onnx")
    latin = tmp_path / "latin.csv"
    latin.write_bytes("temp°C\n".encode("latin-1") + b"1\n" * 200)
    _fails(
        ["score", model, "-c", latin, "-o", tmp_path / "run"],
        f"contexts file {latin} is not UTF-8 text (byte 0xb0 at offset 4)",
    )
    wide = tmp_path / "wide.csv"
    wide.write_bytes("a,b\n1,2\n".encode("utf-16"))
    _fails(["score", model, "-c", wide, "-o", tmp_path / "run"], "is not UTF-8 text (a UTF-16 byte order mark)")
    assert cli("score", model, "-c", ctx, "-o", tmp_path / "run").exit_code == 0
    _fails(
        ["export", model, "--run", tmp_path / "run", "--C", 0.5, "-o", tmp_path / "q.onnx"],
        "compression target 0.5 is below 1",
    )
    _fails(["score", model, "-c", ctx, "-o", tmp_path / "run2", "--probes", 0], "--probe both needs --probes >= 1")
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "run2").exists()


def test_a_run_set_aside_by_a_killed_fresh_score_comes_back(tmp_path, ctx):
    """kill -9 while --fresh replaced a run leaves the old run in .replaced/ and the new one without a result (the
    state is written here as such a kill leaves it): the next score restores the old run and resumes it, whole."""
    import shutil

    model = models.two_branch(tmp_path / "m.onnx")
    run = tmp_path / "run"
    assert cli("score", model, "-c", ctx, "-o", run).exit_code == 0
    scores = _digest(run / "scores.parquet")
    (run / ".replaced").mkdir()
    for name in ("run.json", "sweep.jsonl", "scores.parquet", "scores.csv", "rollout.toml", "contexts.npz"):
        shutil.move(run / name, run / ".replaced" / name)
    (run / "run.json").write_text('{"format": 1, "status": "running", "fingerprint": "another"}')
    result = cli("score", model, "-c", ctx, "-o", run)
    assert result.exit_code == 0, result.output
    assert (
        "resuming" in " ".join(result.output.split())
        and _digest(run / "scores.parquet") == scores
        and not (run / ".replaced").exists()
    )


def test_a_score_killed_as_it_began_in_a_new_folder_does_not_block_the_rerun(tmp_path, ctx):
    """kill -9 between the first file and the first result leaves the provisional run.json, an empty .replaced/,
    the rollout and contexts and a half-written temporary (written here as such a kill leaves them): the rerun
    scores, and no temporary or .replaced/ survives it."""
    model = models.two_branch(tmp_path / "m.onnx")
    run = tmp_path / "run"
    (run / ".replaced").mkdir(parents=True)
    (run / "run.json").write_text('{"format": 1, "status": "starting"}')
    (run / "rollout.toml").write_text("steps = 1\n")
    (run / ".contexts.npz.0123abcd.partial").write_bytes(b"PK")
    result = cli("score", model, "-c", ctx, "-o", run)
    assert result.exit_code == 0, result.output
    assert (run / "scores.parquet").exists() and not list(run.glob(".*.partial")) and not (run / ".replaced").exists()
