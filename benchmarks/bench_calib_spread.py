"""Held-out drift of the uniform baselines over several calibration sets (run on demand; minutes).

W4 and W2 drift of a weight-reusing or chaotic model can swing between nearly equal codes, so one calibration
set says little: this draws 5 seeded random sets of as many windows as the example's contexts.npz holds, adds
contexts.npz itself, runs `baseline` on each with every checkout's CLI given (so two versions compare on the
same sets) and prints the held-out drift as bench_versions.py measures it (mean drift % over the trajectory
outputs of heldout.npz's rollout, exact dequantization), mean ± sd over the 6 sets.

Where the windows come from: the tied mixer's from the ETTh1 rows its contexts span (shift rollout); a model
whose rollout feeds its outputs back by replacement (lorenz96, pangu_lorenz96) from the states of truth.npz,
the scoring trajectories' later states (never the held-out ones); the single-step downscaler's (era5_downscale) from
the ERA5 month's test-week hours, never one of heldout.npz's.

    python benchmarks/bench_calib_spread.py [--example lorenz96] [--cli new=PATH,old=PATH]
        [--methods qep] [--bits 4,2] [--sets 5]

A PATH ending in .py runs with this Python (benchmarks/cli_min_max_grids.py: today's code on 95188a9's min-max grids).

With `--tqs C[,C...] --uniform TIER[,TIER...]` it measures TQS-PTQ instead: per set, `score` on the set (the frontier's
settings), `export --C C` and `export --uniform TIER` (the rollout-calibrated uniform model the export compares),
both from that run, each set's held-out drift of both and their paired ratio, mean ± sd (a C of W: the uniform
model's own size, read from its record). `--select kfold:4[,...]`
adds, per selection, `export --C C --select SEL` from the same run beside today's default selection (its held-out drift
and ratio to the same uniform model), and `--keep DIR` keeps the runs (the folds' sub-runs among them) and prints each
shipped model's kind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np

from tqsdeploy.evaluation.evaluate import EvalSettings, evaluate

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ETTH1_CSV", REPO.parent / "shared" / "data" / "ETTh1.csv"))
"""ETTh1 rows (a worktree elsewhere: ETTH1_CSV names the file)."""
SETS = 5
SPANS = {"tied_mixer_etth1": (9472, 12160), "timesfm_etth1": (11520, 13376), "etth1_patchtst": (11520, 13120)}
"""The ETTh1 rows each example's contexts.npz windows start in (its targets in the test rows)."""
MIN_PARAMS = {"lorenz96": 256, "era5_emulator": 256}  # as bench_versions.py and run_frontiers.py


def etth1_sets(folder: Path, example: Path, count: int = SETS) -> list[Path]:
    """An ETTh1 forecaster: `count` seeded random sets of as many windows as contexts.npz holds (seeds 100, 101, ...),
    starting where its windows start (`SPANS`), standardized with its norm.json; its first input takes the windows, any
    other (timesfm's masks) zeros: every row observed."""
    if example.name not in SPANS:
        raise SystemExit(f"{example.name}: no ETTh1 span known to draw calibration windows from (SPANS)")
    first, last = SPANS[example.name]
    contexts = np.load(example / "contexts.npz")
    name = contexts.files[0]
    n, length = contexts[name].shape[0], contexts[name].shape[-1]
    norm = json.loads((example / "norm.json").read_text())
    raw = np.loadtxt(DATA, delimiter=",", skiprows=1, usecols=range(1, 8), dtype=np.float64)
    data = ((raw - np.array(norm["mean"])) / np.array(norm["std"])).astype(np.float32)
    paths = []
    for k in range(count):
        starts = np.random.default_rng(100 + k).integers(first, last, n)
        windows = np.stack([data[s : s + length].T for s in starts])
        paths.append(folder / f"calib{k}.npz")
        np.savez(paths[-1], **{name: windows}, **{other: np.zeros_like(windows) for other in contexts.files[1:]})
    return paths


def trajectory_sets(folder: Path, example: Path, count: int = SETS) -> list[Path]:
    """A replace-feedback rollout: `count` seeded sets of truth.npz states (seeds 100, 101, ...), fed back as its
    spec says."""
    spec = tomllib.loads((example / "rollout.toml").read_text())
    pairs = {f["output"]: f["input"] for f in spec["feedback"] if f["mode"] == "replace"}
    contexts, truth = np.load(example / "contexts.npz"), np.load(example / "truth.npz")
    if set(pairs.values()) != set(contexts.files):
        raise SystemExit(f"{example.name}: not every input is fed back by replacement; no calibration states to draw")
    n = len(contexts[contexts.files[0]])
    trajectories, steps = truth[next(iter(pairs))].shape[:2]
    paths = []
    for k in range(count):
        pick = np.random.default_rng(100 + k).choice(trajectories * steps, n, replace=False)
        paths.append(folder / f"calib{k}.npz")
        np.savez(paths[-1], **{pairs[o]: truth[o][pick // steps, pick % steps] for o in pairs})
    return paths


ERA5 = Path(os.environ.get("ERA5_NPZ", REPO.parent / "shared" / "data" / "era5_t2m_uk_2019_03.npz"))
"""The ERA5 2 m temperature month era5_downscale was trained on (a worktree elsewhere: ERA5_NPZ names the file)."""
DOWNSCALE_TEST_HOURS, DOWNSCALE_FACTOR = (504, 744), 3
"""era5_downscale's test week (hours 504..743; weeks 1-3 trained it) and its coarsening factor (its train.py)."""


def downscale_sets(folder: Path, example: Path, count: int = SETS) -> list[Path]:
    """The single-step downscaler: `count` seeded sets (seeds 100, 101, ...) of as many windows of test-week hours as
    contexts.npz holds, never an hour of heldout.npz, each coarsened as its train.py coarsens (3 x 3 block means,
    the last block column edge-padded), with its hour of day (the file starts at 00 UTC)."""
    contexts, heldout = np.load(example / "contexts.npz"), np.load(example / "heldout.npz")
    windows, per_window = contexts["hour"].shape
    t2m = np.load(ERA5)["t2m"].astype(np.float32)
    padded = np.pad(t2m, ((0, 0), (0, -t2m.shape[1] % 3), (0, -t2m.shape[2] % 3)), mode="edge")
    coarse = padded.reshape(len(t2m), -1, 3, padded.shape[2] // 3, 3).mean((2, 4))[:, None]
    if coarse.shape[1:] != contexts["coarse"].shape[2:]:
        raise SystemExit(
            f"{example.name}: coarsened ERA5 is {coarse.shape[1:]}, contexts.npz {contexts['coarse'].shape[2:]}"
        )
    first, last = DOWNSCALE_TEST_HOURS
    held = _hours_of(heldout["coarse"], coarse)
    free = np.array([h for h in range(first, last) if h not in held])
    paths = []
    for k in range(count):
        times = np.random.default_rng(100 + k).choice(free, windows * per_window, replace=False).reshape(windows, -1)
        paths.append(folder / f"calib{k}.npz")
        np.savez(paths[-1], coarse=coarse[times], hour=(times % 24).astype(np.int64))
    return paths


def _hours_of(fields: np.ndarray, coarse: np.ndarray) -> set[int]:
    """The hours of `coarse` (T, 1, h, w) whose field equals one of `fields` (any leading shape): where heldout.npz's
    windows were taken from."""
    flat = coarse.reshape(len(coarse), -1)
    wanted = fields.reshape(-1, flat.shape[1])
    hours = {int(np.flatnonzero(np.all(np.isclose(flat, row, atol=1e-4), axis=1))[0]) for row in wanted}
    if len(hours) != len(wanted):
        raise SystemExit("heldout.npz's fields do not each match one hour of the ERA5 file")
    return hours


def held_out_drift(candidate: Path, example: Path) -> float:
    """Mean drift % over the trajectory outputs on heldout.npz, exact dequantization (as bench_versions.py)."""
    report = evaluate(
        candidate,
        example / "model.onnx",
        example / "heldout.npz",
        spec=example / "rollout.toml",
        settings=EvalSettings(exact=True),
    )
    drifts = [o["vs_reference"]["drift_pct"] for o in report["outputs"].values()]
    return sum(drifts) / len(drifts)


def command_of(cli: str) -> list[str]:
    """How a --cli PATH runs: a .py file with this Python."""
    return [*([sys.executable] if cli.endswith(".py") else []), cli]


def uniform_size(record: Path) -> str:
    """`--tqs W`: the uniform model's own compression (from its allocation record), cut to 6 decimals so that
    the uniform model fits it: TQS-PTQ at that grid's size as today's code writes it."""
    return f"{math.floor(json.loads(record.read_text())['compression'] * 1e6) / 1e6:.6f}"


def tqs_spread(args, example: Path, folder: Path, sets: list[Path], clis: dict[str, str]) -> None:
    """`--tqs`: per set a score run (the first CLI's), then with every CLI TQS-PTQ at each C and the uniform model of
    its grid (`--uniform`, one tier per C) exported from that run, held-out drift of each."""
    extra = ["--min-params", str(MIN_PARAMS[args.example])] if args.example in MIN_PARAMS else []
    targets, tiers = args.tqs.split(","), args.uniform.split(",")
    tiers = tiers * len(targets) if len(tiers) == 1 else tiers
    targets = [f"W@{t}" if c == "W" else c for c, t in zip(targets, tiers)]  # `--tqs W,W`: one key per uniform size
    uniform = {label: {t: [] for t in tiers} for label in clis}
    tqs = {label: {c: [] for c in targets} for label in clis}
    selections = [s for s in args.select.split(",") if s]
    variants = {label: {c: [] for c in targets} for label in (f"{cli} {s}" for cli in clis for s in selections)}
    for k, calib in enumerate(sets):
        run = folder / f"run{k}"
        subprocess.run(
            [
                *command_of(next(iter(clis.values()))),
                "score",
                str(example / "model.onnx"),
                "--contexts",
                str(calib),
                "--spec",
                str(example / "rollout.toml"),
                "--out",
                str(run),
                *extra,
            ],
            check=True,
            capture_output=True,
            cwd=folder,
        )
        for label, cli in clis.items():
            for tier in uniform[label]:
                out = folder / f"uniform{k}.{label}.{tier}.onnx"
                subprocess.run(
                    [
                        *command_of(cli),
                        "export",
                        str(example / "model.onnx"),
                        "--run",
                        str(run),
                        "--uniform",
                        tier,
                        "-o",
                        str(out),
                    ],
                    check=True,
                    capture_output=True,
                    cwd=folder,
                )
                uniform[label][tier].append(held_out_drift(out, example))
            for c, tier in zip(tqs[label], tiers):
                out = folder / f"tqs{k}.{label}.C{c}.onnx"
                record = folder / f"uniform{k}.{label}.{tier}.allocation.json"
                value = uniform_size(record) if c.startswith("W@") else c
                subprocess.run(
                    [
                        *command_of(cli),
                        "export",
                        str(example / "model.onnx"),
                        "--run",
                        str(run),
                        "--C",
                        value,
                        "-o",
                        str(out),
                    ],
                    check=True,
                    capture_output=True,
                    cwd=folder,
                )
                tqs[label][c].append(held_out_drift(out, example))
                for selection in selections:
                    out = folder / f"tqs{k}.{label}.{selection.replace(':', '')}.C{c}.onnx"
                    export = [*command_of(cli), "export", str(example / "model.onnx"), "--run", str(run), "--C", value]
                    subprocess.run(
                        [*export, "--select", selection, "-o", str(out)], check=True, capture_output=True, cwd=folder
                    )
                    variants[f"{label} {selection}"][c].append(held_out_drift(out, example))
                    shipped = json.loads(out.with_suffix(".allocation.json").read_text())["chosen_on"]["shipped"]
                    print(
                        f"set {k} {label} --select {selection} C{c}: {variants[f'{label} {selection}'][c][-1]:.4g} "
                        f"({shipped})",
                        flush=True,
                    )
            print(
                f"set {k} {label}: "
                + ", ".join(f"uniform {t} {d[-1]:.4g}" for t, d in uniform[label].items())
                + ", "
                + ", ".join(f"TQS-PTQ C{c} {d[-1]:.4g}" for c, d in tqs[label].items()),
                flush=True,
            )
    for label in clis:
        for tier, drifts in uniform[label].items():
            print(
                f"{args.example} {label} uniform {tier}: held-out drift % {np.mean(drifts):.4g} ± {np.std(drifts):.2g} "
                f"(sets: {' '.join(f'{d:.4g}' for d in drifts)}; last = contexts.npz)"
            )
        for (c, drifts), tier in zip(tqs[label].items(), tiers):
            ratios = np.array(drifts) / np.array(uniform[label][tier])
            print(
                f"{args.example} {label} TQS-PTQ C{c}: held-out drift % {np.mean(drifts):.4g} ± {np.std(drifts):.2g} "
                f"(sets: {' '.join(f'{d:.4g}' for d in drifts)}); "
                f"/ uniform {tier} per set {ratios.mean():.3f} ± {ratios.std():.2g}, below it on "
                f"{int((ratios < 1).sum())} of {len(ratios)}"
            )
    report_variants(args, variants, uniform, tiers)


def report_variants(args, variants: dict, uniform: dict, tiers: list[str]) -> None:
    """`--select`: each selection's held-out drift at each C, and per set against the same uniform model."""
    for label, by_c in variants.items():
        for (c, drifts), tier in zip(by_c.items(), tiers):
            ratios = np.array(drifts) / np.array(uniform[label.split()[0]][tier][: len(drifts)])
            print(
                f"{args.example} {label} C{c}: held-out drift % {np.mean(drifts):.4g} ± {np.std(drifts):.2g} "
                f"(sets: {' '.join(f'{d:.4g}' for d in drifts)}); / uniform {tier} per set {ratios.mean():.3f} ± "
                f"{ratios.std():.2g}, below it on {int((ratios < 1).sum())}, above on {int((ratios > 1).sum())} "
                f"of {len(ratios)}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="tied_mixer_etth1")
    parser.add_argument(
        "--cli",
        default=f"new={shutil.which('tqsdeploy') or 'tqsdeploy'}",
        help="LABEL=PATH of each checkout's tqsdeploy, comma-separated",
    )
    parser.add_argument("--methods", default="qep,gptq,gptaq")
    parser.add_argument("--bits", default="4,2")
    parser.add_argument(
        "--sets", type=int, default=SETS, help="seeded draws (seeds 100, 101, ...) besides contexts.npz"
    )
    parser.add_argument(
        "--tqs", default="", help="compressions: measure TQS-PTQ export at each against --uniform over the sets"
    )
    parser.add_argument(
        "--uniform", default="int4-asym", help="the uniform tier --tqs compares with: one, or one per C"
    )
    parser.add_argument("--select", default="", help="with --tqs: export --select values measured beside the default")
    parser.add_argument("--keep", default=None, help="a folder to work in and keep (default: a temporary one)")
    args = parser.parse_args()
    example = REPO / "examples" / args.example
    clis = dict(item.split("=", 1) for item in args.cli.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        draw = etth1_sets if (example / "norm.json").exists() else trajectory_sets
        draw = downscale_sets if args.example == "era5_downscale" else draw
        drawn = draw(folder, example, args.sets)
        sets = drawn + [example / "contexts.npz"]
        if args.tqs:
            tqs_spread(args, example, folder, sets, clis)
            return
        for method in args.methods.split(","):
            for bits in args.bits.split(","):
                for label, cli in clis.items():
                    drifts = []
                    for k, calib in enumerate(sets):
                        out = folder / f"{method}{bits}.{label}.{k}.onnx"
                        command = [
                            *command_of(cli),
                            "baseline",
                            str(example / "model.onnx"),
                            "--method",
                            method,
                            "--bits",
                            bits,
                            "--calib",
                            str(calib),
                            "-o",
                            str(out),
                        ]
                        command += ["--min-params", str(MIN_PARAMS[args.example])] if args.example in MIN_PARAMS else []
                        subprocess.run(command, check=True, capture_output=True, cwd=folder)
                        drifts.append(held_out_drift(out, example))
                    values = " ".join(f"{d:.4g}" for d in drifts)
                    print(
                        f"{args.example} {method} W{bits} {label}: held-out drift % {np.mean(drifts):.4g} ± "
                        f"{np.std(drifts):.2g} (sets: {values}; last = contexts.npz)",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
