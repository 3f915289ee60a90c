"""The results record (benchmarks/results/README.md): one current file per benchmark and one history table of its runs.

A benchmark that writes its current file into benchmarks/results/ also appends its run to results/history/STEM.md, so
an earlier run stays one row (date, commit, headline numbers, what changed) instead of a dated file of its own.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LIBRARY = ("tqsdeploy", "graph_ops", "tiers", "runtimes")
HEADER = "| date | commit | headline | what changed |\n|---|---|---|---|\n"


def commit() -> str:
    """This checkout's short HEAD, with '+' when its library code has uncommitted changes (the run measured those)."""
    head, dirty = _git("rev-parse", "--short=7", "HEAD"), _git("status", "--porcelain", "--", *LIBRARY)
    return (head or "unknown") + ("+" if dirty else "")


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def append_history(stem: str, headline: str, changed: str, results: Path = RESULTS) -> Path | None:
    """Add this run's row to results/history/STEM.md, made with its header the first time; None (nothing written)
    when the run wrote elsewhere (`--results-dir`): only benchmarks/results/ is the record."""
    if results.resolve() != RESULTS.resolve():
        return None
    path = results / "history" / f"{stem}.md"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        intro = f"The last row is the current file, `benchmarks/results/{stem}.*`."
        path.write_text(f"# {stem}: every run, oldest first\n\n{intro}\n\n{HEADER}")
    cells = (time.strftime("%Y-%m-%d %H:%M"), commit(), headline, changed or "-")
    with path.open("a") as handle:
        handle.write("| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in cells) + " |\n")
    return path
