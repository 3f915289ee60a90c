"""Study (issue 32): could `--grids auto` choose a tier's grid without the min-max calibration pass?

The per-channel pass already solves every row on its min-max grid too (`tiers.quantizer._both_grids`, one column
loop over both grids), so a min-max model comes out of it for free: each row's min-max solve, on the statistics of
the per-channel pass (its upstream layers per-channel quantized). If that proxy ranked the two grids as the real
min-max pass does, the export could skip the min-max pass (a fifth of a 1 GB stack's export) and run it only where
the proxy says min-max wins. For every example: `score` with its defaults, then `export --C 4` with the proxy
recorded beside each per-channel pass and rolled out on the scoring contexts next to the real min-max model.

    python benchmarks/bench_grid_proxy.py [--models era5_downscale,...] [--out grid-proxy]

Writes benchmarks/results/STEM.json and the table of STEM.md (the text below the table is kept). It patches three
private functions of the quantization path at run time (the proxy is not a feature): read it as a study, not as a
test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EXAMPLES = tuple(sorted(p.parent.name for p in (REPO / "examples").glob("*/model.onnx")))

PATCHED_EXPORT = r"""
import json, sys, threading
import tiers.quantizer as tq
import tqsdeploy.export.candidates as ec
import tqsdeploy.encoding.encoder as qz
from tiers.gptq import Quantized

local, proxies, found = threading.local(), {}, []
both_grids, encode, least_drifting = tq._both_grids, qz.Encoder._encode, ec.CandidateBuilding._least_drifting

def _both_grids(rounding, wt, stats, spec, plain_spec):
    searched, rows, plain, losses = both_grids(rounding, wt, stats, spec, plain_spec)
    proxy = Quantized(
        searched.codes.copy(), searched.scale.copy(), searched.zero.copy(), searched.spec, searched.group_size
    )
    if rows.size:  # every row on its min-max grid: the rows whose grids differ from the stacked loop's copy
        proxy.codes[rows], proxy.scale[rows], proxy.zero[rows] = plain.codes, plain.scale, plain.zero
    local.parts.append(proxy)
    return searched, rows, plain, losses

def _encode(self, name, tier, rounding, stats):
    local.parts = []
    encoded = encode(self, name, tier, rounding, stats)
    if rounding.grids != "min-max" and rounding.needs_stats:
        proxy = (
            tq.to_encoded(Quantized.stack(local.parts), self.layouts[name], tier, encoded.dtype).compact()
            if local.parts
            else encoded
        )
        proxies[(tier.name, rounding.method, name)] = proxy
    return encoded

def _least_drifting(self, tier, options):
    chosen = least_drifting(self, tier, options)
    for method in dict.fromkeys(o.method for o in options):
        encodings = {name: proxies.get((tier.name, method, name)) for name in self.encoder.layouts}
        if all(e is not None for e in encodings.values()):
            measured = self.rounding_choice.get(tier.name, {})
            found.append(
                {
                    "tier": tier.name,
                    "method": method,
                    "per_channel": measured.get(method),
                    "min_max": measured.get(method + "/min-max"),
                    "proxy": self.measure(encodings).worst_pct,
                }
            )
    return chosen

tq._both_grids, qz.Encoder._encode, ec.CandidateBuilding._least_drifting = _both_grids, _encode, _least_drifting
from tqsdeploy.cli import main
out = sys.argv.pop(1)
try:
    main()
finally:
    open(out, "w").write(json.dumps(found))
"""


def study(name: str, tmp: Path) -> list[dict]:
    """The grid choices of one example's export, each with the proxy's drift beside the two real models'."""
    folder = REPO / "examples" / name
    run, script, found = tmp / f"{name}_run", tmp / "patched_export.py", tmp / f"{name}.json"
    script.write_text(PATCHED_EXPORT)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tqsdeploy",
            "score",
            str(folder / "model.onnx"),
            "--contexts",
            str(folder / "contexts.npz"),
            "--spec",
            str(folder / "rollout.toml"),
            "--out",
            str(run),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            sys.executable,
            str(script),
            str(found),
            "export",
            "--run",
            str(run),
            "--C",
            "4",
            "--output",
            str(tmp / f"{name}.onnx"),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    rows, seen = [], set()
    for row in json.loads(found.read_text()):
        if (row["tier"], row["method"]) not in seen and row["per_channel"] is not None and row["min_max"] is not None:
            seen.add((row["tier"], row["method"]))
            real = "min-max" if row["min_max"] < row["per_channel"] else "per-channel"
            proxied = "min-max" if row["proxy"] < row["per_channel"] else "per-channel"
            rows.append(
                {
                    "model": name,
                    **row,
                    "chosen": real,
                    "proxy_chooses": proxied,
                    "proxy_over_per_channel": row["proxy"] / row["per_channel"],
                }
            )
    return rows


def write(rows: list[dict], stem: str) -> None:
    (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "Grid choice of `export --C 4` (`--grids auto`, scoring contexts): the real min-max pass against the min-max "
        "model taken from the",
        "per-channel pass (proxy); drift % is the worst output's on the scoring contexts "
        "(`benchmarks/bench_grid_proxy.py`).",
        "",
        "| model | tier | method | per-channel % | min-max % | proxy % | chosen | proxy chooses | proxy / per-channel "
        "|",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = "" if r["chosen"] == r["proxy_chooses"] else " (differs)"
        lines.append(
            f"| {r['model']} | {r['tier']} | {r['method']} | {r['per_channel']:.4g} | {r['min_max']:.4g} | "
            f"{r['proxy']:.4g} | {r['chosen']} | "
            f"{r['proxy_chooses']}{flag} | {r['proxy_over_per_channel']:.3f} |"
        )
    path = RESULTS / f"{stem}.md"
    old = path.read_text() if path.exists() else ""
    notes = (
        old[old.index("\n\n", old.index("| model |")) :] if "| model |" in old else "\n"
    )  # what was written below the table stays
    path.write_text("\n".join(lines) + notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(EXAMPLES))
    parser.add_argument("--out", default="grid-proxy")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows += study(name, Path(tmp))
            print(json.dumps(rows[-1] if rows else {}), flush=True)
    write(rows, args.out)


if __name__ == "__main__":
    main()
