"""The CLI end to end on the committed example models (slow: real rollouts)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, invoke

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(  # dwconv_mixer_etth1 takes 4 minutes here: benchmarks/bench_export.py runs it instead
    "example", ["etth1_patchtst", "era5_emulator", "lorenz96", "tied_mixer_etth1"]
)
def test_score_export_eval_gate(example, tmp_path):
    folder = REPO / "examples" / example
    model = tmp_path / f"{example}.onnx"
    shutil.copy(folder / "model.onnx", model)
    before = model.read_bytes()
    common = ["--contexts", folder / "contexts.npz", "--spec", folder / "rollout.toml"]
    code, text = invoke("score", model, *common, "--out", tmp_path / "run", "--probes", "1", layout=True)
    assert code == 0, text
    scores = json.loads((tmp_path / "run" / "run.json").read_text())
    assert scores["status"] == "complete" and scores["units"] >= 3
    code, text = invoke("export", model, "--run", tmp_path / "run", "--C", "4", "--out-dir", tmp_path, layout=True)
    assert code == 0, text
    allocation = json.loads((tmp_path / f"{example}.C4.allocation.json").read_text())
    assert 4 <= allocation["compression"] <= 4 * 1.02
    code, text = invoke(
        "eval",
        tmp_path / f"{example}.C4.onnx",
        "--reference",
        model,
        *common,
        "--truth",
        folder / "truth.npz",
        "--report",
        tmp_path / "eval",
        layout=True,
    )
    assert code == 0, text
    report = json.loads((tmp_path / "eval.json").read_text())
    output = next(iter(report["outputs"].values()))
    assert output["vs_truth"]["reference_mae"] > 0 and report["compression"] == allocation["compression"]
    code, text = invoke(
        "gate",
        tmp_path / f"{example}.C4.onnx",
        "--reference",
        model,
        *common,
        "--min-compression",
        "4",
        "--max-degradation",
        "1000%",
        "--report-dir",
        tmp_path / "gate",
        layout=True,
    )
    assert code == 0, text
    assert model.read_bytes() == before


def test_ci_workflow_runs_literally_on_the_bundled_model(tmp_path):
    """The example workflow's tqsdeploy commands, exactly as written, pass on the ETTh1 example."""
    workflow = yaml.safe_load((REPO / "examples" / "ci" / "compress-and-gate.yml").read_text())
    job = workflow["jobs"]["compress"]
    env = dict(os.environ, **job["env"])
    example = REPO / "examples" / "etth1_patchtst"
    gate_step = next(step["run"] for step in job["steps"] if "tqsdeploy gate" in step.get("run", ""))
    assert '"$HELDOUT"' in gate_step and '"$HELDOUT_TRUTH"' in gate_step, (
        gate_step
    )  # the gate judges on windows the score never saw
    for variable, source in (
        ("MODEL", "model.onnx"),
        ("CONTEXTS", "contexts.npz"),
        ("TRUTH", "truth.npz"),
        ("HELDOUT", "heldout.npz"),
        ("HELDOUT_TRUTH", "heldout_truth.npz"),
        ("SPEC", "rollout.toml"),
    ):
        target = tmp_path / env[variable]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(example / source, target)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    commands = [
        step["run"] for step in job["steps"] if "tqsdeploy " in step.get("run", "") and "pip install" not in step["run"]
    ]
    assert [c.split()[1] for c in commands] == ["score", "export", "gate"]
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, command + "\n" + done.stdout + done.stderr
    gate = json.loads((tmp_path / "gate-report" / "gate.json").read_text())
    assert gate["passed"] and {c["name"] for c in gate["checks"]} >= {"compression"}


def test_qep_w2_on_the_weight_tied_example_stays_within_the_min_max_grids_drift(tmp_path):
    """Issue 35: on the tied mixer (4 weights read by 6 MatMul nodes each, heads with thin Hessians) QEP W2 on
    the clip-searched grid alone drifted 0.281 ± 0.015 on the held-out windows (6 calibration sets), on the min-max
    grid of 95188a9 0.177 ± 0.020, with each channel on the grid its solve does best on 0.164 ± 0.016. These
    contexts: 0.295 searched alone, 0.165 min-max, 0.146 now; the bound is min-max's mean + 1 sd."""
    from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate

    folder = REPO / "examples" / "tied_mixer_etth1"
    code, text = invoke(
        "baseline",
        folder / "model.onnx",
        "--method",
        "qep",
        "--bits",
        "2",
        "--calib",
        folder / "contexts.npz",
        "-o",
        tmp_path / "qep.onnx",
        layout=True,
    )
    assert code == 0, text
    report = evaluate(
        tmp_path / "qep.onnx",
        folder / "model.onnx",
        folder / "heldout.npz",
        spec=folder / "rollout.toml",
        settings=EvalSettings(exact=True),
    )
    assert report["outputs"]["forecast"]["vs_reference"]["mae"] <= 0.197


def test_qep_w2_on_lorenz96_keeps_the_grid_that_does_no_worse_than_95188a9s(tmp_path):
    """Issue 35: each channel on the grid its solve does best on cost lorenz96's uniform QEP W2 1.9 points of
    held-out drift against 95188a9's min-max grids over 20 calibration sets (21.67 vs 19.79, t = 5.5). With
    --grids auto the baseline measures both grids on its calibration windows and keeps min-max there (on all 20
    sets): no worse than 95188a9 held-out, while the per-channel choice is worse on these windows too."""
    from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate

    folder = REPO / "examples" / "lorenz96"
    drift = {}
    for grids in ("auto", "per-channel", "min-max"):
        out = tmp_path / f"qep.{grids}.onnx"
        code, text = invoke(
            "baseline",
            folder / "model.onnx",
            "--method",
            "qep",
            "--bits",
            "2",
            "--calib",
            folder / "contexts.npz",
            "--min-params",
            "256",
            "--grids",
            grids,
            "-o",
            out,
            layout=True,
        )
        assert code == 0, text
        report = evaluate(
            out,
            folder / "model.onnx",
            folder / "heldout.npz",
            spec=folder / "rollout.toml",
            settings=EvalSettings(exact=True),
        )
        drift[grids] = report["outputs"]["x_next"]["vs_reference"]["drift_pct"]
    record = json.loads((tmp_path / "qep.auto.baseline.json").read_text())
    assert record["grid_drifts_pct"][record["grids"]] == min(record["grid_drifts_pct"].values())
    assert drift["auto"] <= drift["min-max"] * (1 + 1e-9) < drift["per-channel"], drift


def test_the_demo_evaluates_and_gates_on_windows_the_score_never_saw():
    """make demo gated the C = 4 model on contexts.npz, the windows it was scored, calibrated and measured on."""
    demo = (REPO / "Makefile").read_text().split("\ndemo:")[1].split("\n\n")[0]
    lines = {line.split()[1]: line for line in demo.splitlines() if "tqsdeploy " in line}
    assert "$(EXAMPLE)/contexts.npz" in lines["score"]
    for command in ("eval", "gate"):
        assert (
            "--contexts $(EXAMPLE)/heldout.npz" in lines[command]
            and "--truth $(EXAMPLE)/heldout_truth.npz" in lines[command]
        ), lines[command]
    assert (REPO / "examples" / "etth1_patchtst" / "heldout_truth.npz").exists()


def test_a_model_from_torchs_default_exporter_reads_as_its_modules_and_says_what_its_numbers_are(tmp_path):
    """Issue 55's walk-through: a PatchTST-like forecaster exported with torch.onnx.export(dynamo=True,
    external_data=True) goes through inspect -> score from a CSV -> export -> eval -> gate. Its units read as module
    paths, the export summary names both sizes, the slots, the drift's windows and every candidate, and the gate says
    what it judged."""
    import re
    import time

    from runtimes.ort_versions import OLDEST_SUPPORTED, parse_version

    folder = REPO / "examples" / "patchtst_dynamo"
    model, data = folder / "model.onnx", folder / "model.onnx.data"
    before = (model.read_bytes(), data.read_bytes())

    code, text = invoke("inspect", model, "--json")
    assert code == 0, text
    units = {u["unit"]: u["label"] for u in json.loads(text)["units"]}
    assert len(units) == 14 and units["head.weight"] == "head.weight"
    generated = {name: label for name, label in units.items() if name.startswith("val_")}
    assert len(generated) == 13 and all(
        re.fullmatch(r"embed\.weight|layers\.[01]\.(attn\.[qkvo]|ff\.(up|down))\.weight", label)
        for label in generated.values()
    ), generated
    assert len(set(units.values())) == 14

    run = tmp_path / "run"
    code, text = invoke("score", model, "--contexts", folder / "score.csv", "--windows", 8, "--out", run)
    assert code == 0 and "8 context windows" in text, text
    started = time.monotonic()
    code, printed = invoke("export", model, "--run", run, "--C", 4, "--out-dir", tmp_path, layout=True)
    seconds, text = time.monotonic() - started, " ".join(printed.split())
    assert code == 0, text
    record = json.loads((tmp_path / "patchtst_dynamo_model.C4.allocation.json").read_text())
    disk = f"{record['reference_file_bytes']:,} → {record['file_bytes']:,} ({record['disk_compression']:.2f}x"
    assert record["reference_file_bytes"] == len(before[0]) + len(before[1]) and f"bytes on disk {disk}" in text
    assert f"stored tensor bits {record['compression']:.3f}x smaller than the original's (what --C counts" in text
    assert f"here 14 units as {record['slots']} slots ('head.weight' in " in text
    assert f"{record['drift_pct']:.4g}% on the 8 scoring windows, in-sample" in text
    assert f"shipped {record['shipped']!r}" in text and "(mixed: each slot at the tier the allocation chose" in text
    assert all(f"{c['label']} {c['drift_pct']:.4g}%" in text for c in record["compared"]), record["compared"]
    loads_on = record["oldest_onnxruntime"]["release"]  # the file says which runtime it needs
    assert parse_version(loads_on) <= OLDEST_SUPPORTED and f"loads on ONNX Runtime {loads_on} or later" in text
    assert not re.search(r"'val_\d+'", text)  # no unit named by its generated name alone
    labels = {row["label"] for row in record["tiers"] if row["unit"].startswith("val_")}
    assert labels and not any(label.startswith("val_") for label in labels)
    progress = re.findall(r"^(?:encoding|measuring tiers).*$", printed, re.M)
    timed = [line for line in progress if "done in" not in line]
    assert progress and len(timed) <= seconds / 10 + 1, progress  # a line per stage, a few more on time

    heldout = ["--reference", model, "--contexts", folder / "heldout.csv", "--windows", 16, "--no-latency"]
    candidate = tmp_path / "patchtst_dynamo_model.C4.onnx"
    code, text = invoke("eval", candidate, *heldout, "--report", tmp_path / "eval")
    assert code == 0, text
    output = json.loads((tmp_path / "eval.json").read_text())["outputs"]["forecast"]
    point, (low, high) = output["degradation_pct"], output["degradation_ci95"]
    assert output["degradation_basis"] == "truth" and low < point < high and output["vs_reference"]["drift_std_pct"] > 0
    bound = f"{(point + high) / 2:.6g}%"
    for on, exit_code in (("upper", 1), ("point", 0)):
        code, text = invoke(
            "gate", candidate, *heldout, "--max-degradation", bound, "--on", on, "--report-dir", tmp_path / on
        )
        gate = json.loads((tmp_path / on / "gate.json").read_text())
        assert code == exit_code and gate["on"] == on and gate["checks"][0]["on"] == on, text
        assert f"(--on {on}" in text
    assert (model.read_bytes(), data.read_bytes()) == before
