"""Two kinds of failure: the user's input is wrong (exit 2, one line, no
traceback) or the tool has a bug (reported as an internal error)."""

from __future__ import annotations

from graph_ops import GraphError
from runtimes import RuntimeUnavailable
from tiers import TierError


class TqsError(Exception):
    """Something about the user's input or request is wrong; the message says what."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} (hint: {self.hint})" if self.hint else text


class InputError(TqsError):
    """A file or argument cannot be used as given."""


class RolloutError(TqsError):
    """The rollout spec does not fit the model, or the rollout itself failed."""


class InfeasibleError(TqsError):
    """A requested target cannot be met."""


class BoundUnmet(TqsError):
    """A deployment bound (`export --max-memory`, `--max-slowdown`) cannot be met or was not met as measured: exit
    1, as a failed gate."""


class InternalError(RuntimeError):
    """A bug in tqsdeploy, never the user's fault."""


USER_ERRORS = (TqsError, GraphError, RuntimeUnavailable, TierError)
"""Exceptions the CLI reports as a one-line error with exit code 2."""
