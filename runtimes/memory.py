"""Resident memory of a session, measured in a fresh process: what a deployment pays for a model, apart from
everything the measuring process holds.

The child resets its peak (`/proc/self/clear_refs`), creates the session, runs it on the given feeds, and reports
its resident-set growth: the peak (creation included: ONNX Runtime folds constants there) and what stays.

    python -m runtimes.memory MODEL FEEDS.npz [--provider cpu] [--threads N]
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CALLS = 3
"""Calls made after the session is created: the first allocates the activations, the next reuse them."""


@dataclass(frozen=True)
class SessionMemory:
    peak_bytes: int
    """Resident-set growth at its highest, from just before the session is created to after its calls."""
    steady_bytes: int
    """Resident-set growth after the calls."""


def measure(
    model: str | Path, feeds: str | Path, provider: str = "cpu", threads: int | None = None, timeout_s: float = 600
) -> SessionMemory | None:
    """The session's memory on `feeds` (a .npz of one array per input), or None where it cannot be read (not
    Linux, or the child failed: its reason is not the caller's business, the measurement is simply absent)."""
    return measure_each([model], feeds, provider, threads, timeout_s)[0]


def measure_each(
    models: list[str | Path],
    feeds: str | Path,
    provider: str = "cpu",
    threads: int | None = None,
    timeout_s: float = 600,
) -> list[SessionMemory | None]:
    """`measure` of each model, their children run side by side: each reads only its own resident set, so what one
    measures does not depend on the other, and the caller waits for one child's start-up (most of its time), not
    one per model."""
    if not Path("/proc/self/clear_refs").exists():
        return [None] * len(models)
    command = [sys.executable, "-m", "runtimes.memory"]
    options = ["--provider", provider] + (["--threads", str(threads)] if threads else [])
    children = []
    for model in models:
        try:
            children.append(
                subprocess.Popen(
                    [*command, str(model), str(feeds), *options],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        except OSError:
            children.append(None)
    return [_result(child, timeout_s) for child in children]


def _result(child: subprocess.Popen | None, timeout_s: float) -> SessionMemory | None:
    if child is None:
        return None
    try:
        out, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return None
    try:
        found = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None
    return SessionMemory(int(found["peak_bytes"]), int(found["steady_bytes"]))


def _status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                values[key] = int(value.split()[0]) * 1024
    return values


def _child(argv: list[str]) -> None:
    import argparse

    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("feeds")
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    feeds = dict(np.load(args.feeds))
    from runtimes import for_provider

    runtime = for_provider(args.provider, args.threads)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = _status()["VmRSS"]
    session = runtime.open(Path(args.model))
    for _ in range(CALLS):
        session.run(feeds)
    after = _status()
    print(json.dumps({"peak_bytes": after["VmHWM"] - before, "steady_bytes": after["VmRSS"] - before}))


if __name__ == "__main__":
    _child(sys.argv[1:])
