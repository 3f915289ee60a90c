"""The `tqsdeploy` command: a thin layer over the library.

Exit codes: 0 success, 1 a gate failed, 2 bad usage or input (one-line
message, no traceback), 3 an internal error (a bug: please report it).

`app` holds the frame (errors, consoles, shared options); each module registers its commands on it, in the
order `--help` lists them.
"""

from tqsdeploy.cli.app import _OneLineErrors, app
from tqsdeploy.cli import inspect_score, export_baseline, frontier, eval_gate  # noqa: E402,F401  (registers the commands)

__all__ = ["_OneLineErrors", "app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
