"""The `tqsdeploy` command: a thin layer over the library.

Exit codes: 0 success, 1 a gate failed, 2 bad usage or input (one-line
message, no traceback), 3 an internal error (a bug: please report it).

`app` holds the frame (errors, consoles, shared options); each module registers its commands on it, in the
order `--help` lists them.
"""

from tqsdeploy.cli import eval_gate, export_baseline, frontier, inspect_score  # noqa: F401  (registers the commands)
from tqsdeploy.cli.app import _OneLineErrors, app

__all__ = ["_OneLineErrors", "app", "keep_freed_memory", "main"]


HEAP_TRIM_BYTES = 256 << 20
"""Freed memory glibc keeps at the top of the heap before giving it back (its default follows the largest freed
block up to 64 MiB). Solvers and rollouts free and remake temporaries of a few MiB all the time; given back, each
would come back as fresh pages, paid for in kernel time (docs/design-notes/cli.md, 'Heap trimming')."""
HEAP_MMAP_BYTES = 64 << 20
"""Blocks this large or larger are mapped on their own and returned when freed (setting the trim threshold fixes
glibc's otherwise adaptive mapping threshold: without this it would stay at 128 KiB)."""


def keep_freed_memory() -> None:
    """Tune glibc's heap for a process that churns through large temporaries (`HEAP_TRIM_BYTES`); elsewhere nothing."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
        mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_BYTES)
        mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_BYTES)


def main() -> None:
    keep_freed_memory()
    app()


if __name__ == "__main__":
    main()
