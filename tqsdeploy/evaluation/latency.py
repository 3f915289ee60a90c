"""Latency and memory of a candidate next to its reference, as `eval` and `gate` report them.

Both models are open at once and called in turns (candidate then reference, the order swapped each round)
on the same feeds: the first step of the context windows, `batch` windows per call. A shared or throttling
machine then slows both alike, and the ratio of the medians stays meaningful where each median alone would
drift. Memory is the growth of the process's resident size while each session is created and first called,
after the heap freed meanwhile is handed back (the weights as the runtime holds them after load, its pre-packed
copies and first buffers): approximate, but it tells a layout that keeps codes compressed from one that folds
them into float weights.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from runtimes import Session, release_freed_memory
from tqsdeploy.rollout.contexts import Contexts


@dataclass(frozen=True)
class LatencySettings:
    batches: tuple[int, ...] | None = None
    """Windows per call; None: the batch eval's own rollout calls carry (every window, up to its chunk)."""
    warmup: int = 3
    """Calls of each model before timing (first-call allocations, lazy kernel choices)."""
    min_rounds: int = 10
    min_seconds: float = 1.0
    """Paired rounds go on until both minimums are met ..."""
    max_seconds: float = 30.0
    """... unless they pass this, where 3 rounds do (a model of seconds per call)."""


def _resident_bytes() -> int:
    """The process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def batch_feeds(contexts: Contexts, inputs, batched: bool, windows: int) -> dict[str, np.ndarray]:
    """Feeds of one call over `windows` context windows (cycled when there are fewer), as the rollout engine
    batches them; a model that runs one window per call gets the first window."""
    if not batched:
        return {spec.name: contexts.arrays[spec.name][0] for spec in inputs}
    index = np.arange(windows) % contexts.count
    return {spec.name: (part := contexts.arrays[spec.name][index]).reshape((-1,) + part.shape[2:]) for spec in inputs}


def _spread(times: list[float]) -> dict:
    values = np.asarray(times) * 1e3
    return {
        "median_ms": float(np.median(values)),
        "p10_ms": float(np.percentile(values, 10)),
        "p90_ms": float(np.percentile(values, 90)),
        "min_ms": float(values.min()),
    }


def measure(
    open_candidate,
    open_reference,
    contexts: Contexts,
    inputs,
    batched: bool,
    default_batch: int,
    settings: LatencySettings,
) -> dict:
    """Open both sessions (`open_*`: no-argument callables returning a `Session`), then time them in paired
    rounds at each batch size. Returns plain data: per batch size each model's median and spread in ms and
    candidate/reference (the ratio of the medians, and the median of the rounds' ratios)."""
    release_freed_memory()
    sessions, memory = {}, {}
    first = batch_feeds(contexts, inputs, batched, default_batch)
    for label, opener in (("candidate", open_candidate), ("reference", open_reference)):
        before = _resident_bytes()
        session: Session = opener()
        session.run(first)
        release_freed_memory()  # what folding or loading freed is not the session's
        sessions[label], memory[label] = session, max(0, _resident_bytes() - before)
    sizes = tuple(settings.batches) if settings.batches and batched else (default_batch if batched else 1,)
    try:
        results = [_timed(sessions, batch_feeds(contexts, inputs, batched, size), size, settings) for size in sizes]
    finally:
        for session in sessions.values():
            session.close()
        release_freed_memory()
    note = None
    if not batched and settings.batches:
        note = "the model runs one window per call (no batch axis it keeps): --latency-batches cannot change its batch"
    return {
        "batches": results,
        "memory_bytes": {"candidate": memory["candidate"], "reference": memory["reference"]},
        "memory_basis": "growth of resident memory while each session was created and first called, "
        "freed heap returned (approximate)",
        "method": f"{settings.warmup} warm-up calls each, then paired rounds (candidate and reference alternated, "
        f"order swapped each round) until at least {settings.min_rounds} rounds and "
        f"{settings.min_seconds:g} s (3 rounds past {settings.max_seconds:g} s)",
        "note": note,
    }


def _timed(sessions: dict[str, Session], feeds: dict[str, np.ndarray], size: int, settings: LatencySettings) -> dict:
    """One batch size: warm-up calls, then paired rounds in alternating order until the settings' minimums are met
    (or their time limit passed)."""
    for session in sessions.values():
        for _ in range(settings.warmup):
            session.run(feeds)
    times = {"candidate": [], "reference": []}
    started = time.perf_counter()
    rounds = 0
    while True:
        order = ("candidate", "reference") if rounds % 2 == 0 else ("reference", "candidate")
        for label in order:
            tick = time.perf_counter()
            sessions[label].run(feeds)
            times[label].append(time.perf_counter() - tick)
        rounds += 1
        elapsed = time.perf_counter() - started
        enough = rounds >= settings.min_rounds and elapsed >= settings.min_seconds
        if enough or (rounds >= 3 and elapsed >= settings.max_seconds):
            break
    cand, ref = _spread(times["candidate"]), _spread(times["reference"])
    paired = np.asarray(times["candidate"]) / np.maximum(np.asarray(times["reference"]), 1e-12)
    sample = next(iter(feeds.values())) if feeds else None
    return {
        "windows": size,
        "rows": int(sample.shape[0]) if feeds and np.ndim(sample) else None,
        "rounds": rounds,
        "candidate": cand,
        "reference": ref,
        "slowdown": cand["median_ms"] / max(ref["median_ms"], 1e-12),
        "paired_slowdown": float(np.median(paired)),
    }


def markdown(latency: dict, mode: str, fresh_memory: bool = False) -> list[str]:
    """The report's latency lines: one table row per batch size; the in-process memory line unless the report
    has the fresh-process measurement (`fresh_memory`), which it then stands for."""
    memory = latency["memory_bytes"]
    lines = [
        "",
        f"Latency ({mode}; {latency['method']}):",
        "",
        "| windows per call | candidate ms (median [p10, p90]) | reference ms (median [p10, p90]) "
        "| slowdown (ratio of medians) | paired slowdown (median of rounds) | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for row in latency["batches"]:
        c, r = row["candidate"], row["reference"]
        lines.append(
            f"| {row['windows']} | {c['median_ms']:.4g} [{c['p10_ms']:.4g}, {c['p90_ms']:.4g}] "
            f"| {r['median_ms']:.4g} [{r['p10_ms']:.4g}, {r['p90_ms']:.4g}] | "
            f"{row['slowdown']:.3f}x | {row['paired_slowdown']:.3f}x | {row['rounds']} |"
        )
    lines.append("")
    if not fresh_memory:
        lines.append(
            f"Memory ({latency['memory_basis']}): candidate {memory['candidate'] / 1e6:.2f} MB, "
            f"reference {memory['reference'] / 1e6:.2f} MB."
        )
    if latency.get("note"):
        lines.append(f"Note: {latency['note']}.")
    return lines
