"""Compressed where it runs (issue 56): file size, resident memory, latency and held-out accuracy of each runtime form
of a model against FP32, on ONNX Runtime CPU, every (model, variant) in a fresh process (run on demand, not in tests).

Models: every bundled example, all-MiniLM-L6-v2 (`minilm`, 22.7M pretrained parameters, token inputs; `bert` is the
random-weight stand-in) and a 1.21 GB MatMul stack (`stack`, 9 layers of 5800², external data). Variants side by
side: FP32, FP16 (onnxconverter-common, keep_io_types), `tqsdeploy export --C 8` / `--C 4` at default settings and
with each `--runtime-layout` that `export --help` lists (tqs-c8-fused, ...), and ONNX Runtime's own
`MatMulNBitsQuantizer` (RTN and HQQ, block 32 and 128, MatMul + Gather), and the default export at the size of
ONNX Runtime's RTN block-128 model (`tqs-at-ort-rtn-b128`: C = FP32's bytes over its bytes). Each measurement process
(`deploy_measure.py`) opens the variant with 2 intra-op threads and default session options, measures peak and
steady resident growth of its creation and first calls, then times it against an FP32 session in paired rounds at
batch 1 and batch N (the contexts' windows; 16 for the token and stack models); then the node types of the graph ONNX
Runtime optimised and the held-out drift / cosine (`tqsdeploy.evaluation.evaluate.evaluate`) are read. Issue 56's
targets are checked (PASS/FAIL) in the result.

    python benchmarks/bench_deploy.py [--models etth1_patchtst,...,minilm,stack] [--variants fp32,tqs-c8,...]
        [--rounds 15] [--out deploy] [--work /tmp/tqs-bench-deploy] [--changed "WHAT CHANGED"]

Smoke run (a few minutes): `python benchmarks/bench_deploy.py --models etth1_patchtst --variants fp32,tqs-c8
--rounds 3 --out /tmp/deploy-smoke`. The work folder keeps the score runs, exports, quantized copies, feeds and each
file's node types and accuracy, so a rerun only measures memory and latency again (delete a model's folder to rebuild
it). `onnx_ir` (which ONNX Runtime's quantizer imports without declaring) and the MiniLM weights are pip-installed
with --no-deps into WORK/pydeps, never into the project's environment. Results: benchmarks/results/STEM.md/.json
(models measured in this run replace theirs, the others are kept; `--replace` drops them) and a row in
results/history/STEM.md. No GPU is lent here: ort-cuda is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_models  # noqa: E402
import deploy_report  # noqa: E402
from deploy_models import EXAMPLES, prepare  # noqa: E402
from record import append_history  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
RESULTS = REPO / "benchmarks" / "results"
ORT_VARIANTS = ("ort-rtn-b32", "ort-rtn-b128", "ort-hqq-b32", "ort-hqq-b128")
PYDEPS = {
    "onnx_ir": ("onnx-ir==1.1.0", "sympy", "mpmath"),
    "torch": ("torch==2.13.0", "networkx", "filelock", "jinja2", "markupsafe", "fsspec"),  # HQQ's solver
}


def export_layouts() -> list[str]:
    """The runtime layouts `tqsdeploy export --help` offers, from the CLI itself (the default, auto, aside)."""
    done = subprocess.run(
        [sys.executable, "-m", "tqsdeploy", "export", "--help"],
        capture_output=True,
        text=True,
        env={**_env(), "COLUMNS": "250", "TERMINAL_WIDTH": "250"},
    )
    found = re.search(r"^\W*--runtime-layout\s+([a-z0-9_-]+(?:\|[a-z0-9_-]+)+)", done.stdout, re.MULTILINE)
    if not found:
        raise SystemExit("could not read --runtime-layout's choices from `tqsdeploy export --help`")
    return [layout for layout in found.group(1).split("|") if layout != "auto"]


def every_variant(layouts: list[str]) -> list[str]:
    tqs = [f"tqs-c{c}" for c in (8, 4)] + [f"tqs-c{c}-{layout}" for layout in layouts for c in (8, 4)]
    return ["fp32", "fp16", *tqs, *ORT_VARIANTS, "tqs-at-ort-rtn-b128"]


def _env(pydeps: Path | None = None) -> dict:
    path = [str(REPO)] + ([str(pydeps)] if pydeps else []) + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def timed(command: list[str], log: Path, env: dict | None = None) -> dict:
    """Run a build step under /usr/bin/time -v (its peak RSS and wall time kept); an error names the log."""
    started = time.perf_counter()
    with open(log, "w") as handle:
        done = subprocess.run(["/usr/bin/time", "-v", *command], stdout=handle, stderr=subprocess.STDOUT,
                              env=env or _env())  # fmt: skip
    text = log.read_text()
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if done.returncode != 0:
        tail = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")][-3:]
        raise RuntimeError(f"{Path(command[2] if len(command) > 2 else command[0]).name} failed ({log}): {tail}")
    return {
        "wall_s": round(time.perf_counter() - started, 1),
        "peak_rss_mb": int(peak.group(1)) / 1024 if peak else None,
    }


def file_bytes(path: Path) -> int:
    """The .onnx and every external-data file it names."""
    proto = onnx.load(str(path), load_external_data=False)
    locations = {
        entry.value
        for tensor in proto.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return path.stat().st_size + sum((path.parent / name).stat().st_size for name in locations)


class Builder:
    """Makes each variant's file once in WORK/<model>/ and says how it was made (builds.json beside)."""

    def __init__(self, case: dict, work: Path, wanted: list[str]):
        self.case, self.folder, self.work = case, work / case["name"], work
        self.wanted = wanted
        """Every variant of this run: one export call writes each C its layout's variants ask for."""
        self.log = self.folder / "builds.json"
        self.builds = json.loads(self.log.read_text()) if self.log.exists() else {}

    def _record(self, key: str, entry: dict) -> None:
        self.builds[key] = entry
        self.log.write_text(json.dumps(self.builds, indent=1))

    def file(self, variant: str) -> tuple[Path, str]:
        """The variant's model and a note on how it was made."""
        if variant == "fp32":
            return Path(self.case["model"]), "the original"
        if variant == "fp16":
            return self._fp16(), (
                "onnxconverter_common.float16.convert_float_to_float16(keep_io_types=True), Casts it retyped fixed"
            )
        if variant.startswith("ort-"):
            return self._ort(variant)
        if (peer := re.fullmatch(r"tqs-at-(ort-[a-z]+-b\d+)", variant)) is not None:
            return self._tqs_at(peer.group(1))
        match = re.fullmatch(r"tqs-c(\d+)(?:-([a-z0-9_]+))?", variant)
        if not match:
            raise SystemExit(f"unknown variant '{variant}'")
        return self._tqs(int(match.group(1)), match.group(2))

    def _fp16(self) -> Path:
        out = self.folder / "fp16" / "model.onnx"
        if not out.exists():
            out.parent.mkdir(exist_ok=True)
            script = (
                "import sys, onnx; from onnxconverter_common import float16; m = onnx.load(sys.argv[1]); "
                "c = float16.convert_float_to_float16(m, keep_io_types=True); "
                # a Cast to float whose output the converter retyped float16 (MiniLM's attention mask) casts to float16
                "vi = {v.name: v.type.tensor_type.elem_type for v in c.graph.value_info}; "
                "[setattr(a, 'i', 10) for n in c.graph.node if n.op_type == 'Cast' for a in n.attribute "
                "if a.name == 'to' and a.i == 1 and vi.get(n.output[0]) == 10]; "
                "onnx.save_model(c, sys.argv[2], save_as_external_data=c.ByteSize() > (1 << 30), "
                "location='model.onnx.data')"
            )
            command = [sys.executable, "-c", script, self.case["model"], str(out)]
            self._record("fp16", timed(command, self.folder / "fp16" / "convert.log"))
        return out

    def _ort(self, variant: str) -> tuple[Path, str]:
        _, algorithm, block = variant.split("-")
        out = self.folder / variant / "model.onnx"
        if not out.exists():
            out.parent.mkdir(exist_ok=True)
            pydeps = ensure_pydeps(self.work)
            command = [sys.executable, str(HERE / "deploy_ortquant.py"), self.case["model"], str(out), algorithm,
                       block[1:]]  # fmt: skip
            self._record(variant, timed(command, out.parent / "quantize.log", _env(pydeps)))
        how = "DEFAULT (round to nearest)" if algorithm == "rtn" else "HQQ on MatMul, DEFAULT on Gather"
        return out, f"MatMulNBitsQuantizer 4-bit {how}, block {block[1:]}, MatMul + Gather"

    def _tqs(self, c: int, layout: str | None) -> tuple[Path, str]:
        self._score()
        folder = self.folder / f"tqs-{layout or 'default'}"
        found = sorted(folder.glob(f"*.C{c}.onnx"))
        if layout and not found:  # the default export already in this layout: the same file, not exported twice
            default = sorted((self.folder / "tqs-default").glob(f"*.C{c}.allocation.json"))
            if default and json.loads(default[0].read_text()).get("runtime_layout") == layout:
                return Path(
                    str(default[0]).replace(".allocation.json", ".onnx")
                ), f"the default export's file ({layout})"
        if not found:
            self._export(folder, layout)
            found = sorted(folder.glob(f"*.C{c}.onnx"))
        if not found:
            log = self.folder / f"export-{layout or 'default'}.C{c}.log"
            errors = [ln for ln in log.read_text().splitlines() if ln.startswith("error")] if log.exists() else []
            raise RuntimeError(f"export --C {c} wrote nothing: {errors[:1] or log}")
        allocation = json.loads(Path(str(found[0]).replace(".onnx", ".allocation.json")).read_text())
        flags = " ".join(
            [f"--C {c}", *self.case.get("export_flags", [])] + ([f"--runtime-layout {layout}"] if layout else [])
        )
        return found[0], f"export {flags}: {allocation['runtime_layout']}, shipped {allocation['shipped']}"

    def _tqs_at(self, peer: str) -> tuple[Path, str]:
        """The default export at the size of ONNX Runtime's own model `peer`: C the FP32 file's bytes over the peer
        file's (the "nearest size" the issue compares at; a fixed C 8 is up to 9% smaller than block 128)."""
        peer_path, _ = self._ort(peer)
        c = round(file_bytes(Path(self.case["model"])) / file_bytes(peer_path), 4)
        self._score()
        out = self.folder / f"tqs-at-{peer}" / "model.onnx"
        if not out.exists():
            out.parent.mkdir(exist_ok=True)
            run = str(self.folder / "run")
            command = [sys.executable, "-m", "tqsdeploy", "export", self.case["model"], "--run", run, "--C", str(c),
                       "-o", str(out), *self.case.get("export_flags", [])]  # fmt: skip
            self._record(f"tqs-at-{peer}", timed(command, out.parent / "export.log"))
        allocation = json.loads(out.with_suffix(".allocation.json").read_text())
        return out, f"export --C {c} (FP32 bytes / {peer}'s): {allocation['runtime_layout']}, shipped " + str(
            allocation["shipped"]
        )

    def _score(self) -> None:
        run = self.folder / "run"
        if not (run / "run.json").exists():
            command = [sys.executable, "-m", "tqsdeploy", "score", self.case["model"], "-c", self.case["contexts"],
                       "--spec", self.case["spec"], "-o", str(run)]  # fmt: skip
            self._record("score", timed(command, self.folder / "score.log"))

    def _export(self, folder: Path, layout: str | None) -> None:
        """One export of every C this layout's variants ask for, the run's allocation shared."""
        wanted = sorted({int(m.group(1)) for v in self.wanted if (m := re.fullmatch(r"tqs-c(\d+)-?(.*)", v))
                         and (m.group(2) or None) == layout}, reverse=True)  # fmt: skip
        wanted = [c for c in wanted if not list(folder.glob(f"*.C{c}.onnx"))]
        command = [sys.executable, "-m", "tqsdeploy", "export", self.case["model"], "--run", str(self.folder / "run"),
                   "--C", ",".join(map(str, wanted)), "--out-dir", str(folder)]  # fmt: skip
        command += self.case.get("export_flags", []) + (["--runtime-layout", layout] if layout else [])
        folder.mkdir(exist_ok=True)
        log = folder.parent / f"export-{layout or 'default'}.log"
        try:
            self._record(f"export {layout or 'default'} C{','.join(map(str, wanted))}", timed(command, log))
        except RuntimeError:
            if len(wanted) == 1:
                raise
            for c in wanted:  # one C out of reach fails the whole call: each alone, so the others are still written
                alone = command[: command.index("--C") + 1] + [str(c)] + command[command.index("--C") + 2 :]
                try:
                    self._record(f"export {layout or 'default'} C{c}", timed(alone, log.with_suffix(f".C{c}.log")))
                except RuntimeError:
                    pass


def ensure_pydeps(work: Path) -> Path:
    """onnx_ir (and torch, for HQQ) with what they import, installed without dependencies into the work folder (the
    project's onnx and numpy stay the ones imported)."""
    target = work / "pydeps"
    for module, packages in PYDEPS.items():
        if not (target / module).exists():
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *packages]
            subprocess.run(command, check=True)
    return target


def feeds(case: dict, work: Path) -> tuple[Path, list[int]]:
    """The calls timed: batch 1 and batch N of the held-out windows, as the rollout engine batches them (kept)."""
    path, meta = work / case["name"] / "feeds.npz", work / case["name"] / "feeds.json"
    if path.exists() and meta.exists():
        return path, json.loads(meta.read_text())["batches"]
    from runtimes import for_provider
    from tqsdeploy.evaluation.latency import batch_feeds
    from tqsdeploy.rollout import RolloutSpec
    from tqsdeploy.rollout.contexts import ContextOptions, load_contexts
    from tqsdeploy.rollout.engine import RolloutEngine

    session = for_provider("cpu").open(Path(case["model"]), external_data_dir=Path(case["model"]).parent)
    inputs = [s for s in session.inputs if s.name not in session.weights]
    contexts = load_contexts(Path(case["heldout"]), inputs, ContextOptions())
    engine = RolloutEngine(session, contexts, RolloutSpec.from_toml(Path(case["spec"])), 64)
    engine.chunks  # the batching decision, as eval makes it
    batched = engine.batched
    session.close()
    batches = [1, case["batch"]] if batched else [1]
    arrays = {f"b{n}:{k}": v for n in batches for k, v in batch_feeds(contexts, inputs, batched, n).items()}
    np.savez(path, **arrays)
    meta.write_text(json.dumps({"batches": batches, "batched": batched}))
    return path, batches


def signature(path: Path) -> str:
    stats = [p.stat() for p in sorted(path.parent.glob(path.name + "*"))]
    return ";".join(f"{s.st_size}:{s.st_mtime_ns}" for s in stats)


def measure(case: dict, variant: str, path: Path, work: Path, args) -> dict:
    """One fresh measurement process; node types and accuracy from the work folder's cache when the file is the same."""
    folder = work / case["name"]
    cache_path = folder / "measured.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    known = cache.get(variant, {}) if cache.get(variant, {}).get("signature") == signature(path) else {}
    feed_path, batches = feeds(case, work)
    job = {**case, "model": str(path), "reference": case["model"], "feeds": str(feed_path), "batches": batches,
           "threads": args.threads, "rounds": args.rounds, "min_seconds": args.seconds, "scratch": str(folder),
           "nodes": "nodes" not in known, "accuracy": variant != "fp32" and "accuracy" not in known,
           "out": str(folder / "result.json")}  # fmt: skip
    (folder / "job.json").write_text(json.dumps(job))
    command = [sys.executable, str(HERE / "deploy_measure.py"), str(folder / "job.json")]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measurement failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads((folder / "result.json").read_text())
    keep = {k: result.get(k, known.get(k)) for k in ("nodes", "accuracy")}
    cache[variant] = {"signature": signature(path), **{k: v for k, v in keep.items() if v is not None}}
    cache_path.write_text(json.dumps(cache, indent=1))
    if variant == "fp32":
        keep["accuracy"] = {"drift_pct": 0.0, "degradation_pct": None, "cosine_mean": 1.0, "cosine_min": 1.0}
    return {**result, **keep}


def bench_model(name: str, variants: list[str], work: Path, args) -> dict:
    case = prepare(name, work)
    builder = Builder(case, work, variants)
    rows = {}
    for variant in variants:
        try:
            path, how = builder.file(variant)
            row = {"file": str(path), "how": how, "file_bytes": file_bytes(path)}
            row.update(measure(case, variant, path, work, args))
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            row = {"skipped": str(exc)[:400]}
        rows[variant] = row
        print(f"{name} {variant}: {deploy_report.one_line(row)}", flush=True)
    params = deploy_report.parameters(Path(case["model"]))
    return {**{k: case[k] for k in ("kind", "note", "batch")}, "name": name, "parameters": params,
            "builds": builder.builds, "variants": rows, **deploy_report.stamp()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(EXAMPLES + ("minilm", "stack")))
    parser.add_argument("--variants", default="all", help="Comma-separated, or 'all' (which `--variants list` lists).")
    parser.add_argument("--rounds", type=int, default=15, help="Paired rounds at least per batch (after 3 warm-ups).")
    parser.add_argument("--seconds", type=float, default=1.0, help="Seconds of paired rounds at least per batch.")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads of every session.")
    parser.add_argument("--work", default="/tmp/tqs-bench-deploy", help="Work folder kept between runs.")
    parser.add_argument("--out", default="deploy", help="Stem in benchmarks/results/, or a path prefix elsewhere.")
    parser.add_argument("--replace", action="store_true", help="Drop the models this run did not measure.")
    parser.add_argument("--note", default="", help="A line on the machine's state (quiet, shared).")
    parser.add_argument("--changed", default="", help="What changed since the last run: the history row's last cell.")
    parser.add_argument(
        "--stack-rounding",
        choices=("rtn", "default"),
        default="rtn",
        help="The stack's exports: RTN without the uniform fallback (minutes), or export's defaults (QEP; tens of "
        "minutes on 2 cores). Use a --work folder of its own for each: the files are kept by name.",
    )
    args = parser.parse_args()
    if args.stack_rounding == "default":
        deploy_models.STACK_EXPORT_FLAGS = ()
    layouts = export_layouts()
    offered = every_variant(layouts)
    if args.variants == "list":
        print("\n".join(offered))
        return
    variants = offered if args.variants == "all" else [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in offered]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(offered)}")
    out = Path(args.out) if "/" in args.out else RESULTS / args.out
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = deploy_report.load(out.with_suffix(".json"), args.replace)
    results["run"] = deploy_report.machine(args, layouts)
    for name in [m for m in args.models.split(",") if m]:
        results["models"][name] = bench_model(name, variants, work, args)
        deploy_report.write(results, out)  # after every model: a long run keeps what it measured
    append_history(out.name, deploy_report.headline(results), args.changed, results=out.parent)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
