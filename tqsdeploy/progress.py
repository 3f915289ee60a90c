"""Progress of long work, one helper for every command.

On a terminal: a rich bar with counts, elapsed time and ETA. Anywhere else
(CI logs, files, pipes) a bar prints nothing useful, so plain lines are
printed: one when a display's work is done ("encoding (mixed qep): 14/14
weights (100%), done in 3 s"), and between those at most one every `interval`
seconds for the whole command (every display on one console shares the pace),
with the time elapsed and the ETA (from an estimate until the first item ends,
if the caller has one): an 18-minute score in CI shows it is alive and when it
will end, and a 9-second export prints a line per finished stage and nothing
else. A step that runs longer than the interval still gets its line (a
background timer), so a log never goes quiet for long.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import (
    Progress as RichProgress,
)
from rich.text import Text

INTERVAL_S = float(os.environ.get("TQS_PROGRESS_INTERVAL", 10.0))
"""Seconds between plain progress lines when the output is not a terminal."""
HEARTBEAT_THREAD = "tqs-progress"
"""The name of a display's timer thread: one still alive after a command is a display nobody stopped."""


class _Pace:
    """When a console last got a plain line, shared by every display on it: one command's displays together print
    at most one timed line per interval, however many stages they show."""

    _last: dict[int, float] = {}
    _lock = threading.Lock()

    @classmethod
    def due(cls, console: Console, since: float, interval: float, now: float) -> bool:
        """Whether a timed line is due: `interval` seconds after the later of `since` (the display's start) and the
        console's last line."""
        with cls._lock:
            return now - max(since, cls._last.get(id(console), since)) >= interval

    @classmethod
    def printed(cls, console: Console, now: float) -> None:
        with cls._lock:
            cls._last[id(console)] = now


def counted(count: int, noun: str) -> str:
    """'1 step', '8 steps': a count with its noun in the right number."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class _Remaining(ProgressColumn):
    """The bar's ETA from the caller's estimate (`Progress.remaining`), counting down between updates."""

    def __init__(self, remaining: Callable[[], float]):
        super().__init__()
        self._left = remaining

    def render(self, task) -> Text:
        seconds = int(max(0.0, self._left()))
        return Text(f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}", style="progress.remaining")


class Progress:
    """`with Progress(console, "scoring", total, "rollouts") as bar: bar.advance()`.

    `total` may be unknown (None) at first and set later with `start`."""

    def __init__(
        self,
        console: Console,
        description: str,
        total: int | None = None,
        unit: str = "steps",
        done: int = 0,
        interval: float = INTERVAL_S,
    ):
        self.console, self.description, self.unit, self.interval = console, description, unit, interval
        self.total, self.done, self.detail = total, done, ""
        self.tty = console.is_terminal
        self._bar: RichProgress | None = None
        self._task = None
        self._started = None
        self._said_done = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._timer: threading.Thread | None = None
        self._estimate: tuple[float, float] | None = None
        self.remaining: Callable[[], float] | None = None
        """Seconds left, by the caller's estimate of each item's cost (items that differ in cost by orders of
        magnitude: the frontier's steps): the ETA shown, from the start, instead of the items' pace."""

    def __enter__(self) -> "Progress":
        if self.total is not None:
            self.start(self.total, self.done)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, total: int, done: int = 0) -> None:
        """Begin (or resize) the display; `done` counts work finished before (a resumed run)."""
        self.total, self.done = total, done
        if done < total:
            self._said_done = False
        if self._started is None:
            self._started = time.monotonic()
            self._resumed = done
        if not self.tty and self._timer is None and self.interval > 0:
            self._stopped.clear()  # a display stopped before it began (or between uses) beats again
            self._timer = threading.Thread(target=self._heartbeat, daemon=True, name=HEARTBEAT_THREAD)
            self._timer.start()
        if self.tty:
            if self._bar is None:
                self._bar = RichProgress(
                    TextColumn("[progress.description]{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn(self.unit),
                    TimeElapsedColumn(),
                    TextColumn("ETA"),
                    TimeRemainingColumn() if self.remaining is None else _Remaining(self.remaining),
                    console=self.console,
                )
                self._bar.start()
                self._task = self._bar.add_task(escape(self.description), total=total, completed=done)
            else:
                self._bar.update(self._task, total=total, completed=done)

    def estimate(self, seconds: float) -> None:
        """What the remaining work should take, measured before any of it finished (auto's timing of the sweep):
        the ETA shown until the first item ends, after which the items' own pace takes over."""
        self._estimate = (seconds, time.monotonic())

    def advance(self, count: int = 1, detail: str | None = None) -> None:
        if self._started is None:
            self.start(self.total or 0)
        self.done += count
        if detail is not None:
            self.detail = detail
        if self._bar is not None:
            self._bar.update(self._task, advance=count, description=escape(f"{self.description} {self.detail}".strip()))
            return
        with self._lock:
            now = time.monotonic()
            if self._finished():
                if not self._said_done:  # the stage's line, once
                    self._said_done = True
                    self._line(now)
            elif _Pace.due(self.console, self._started, self.interval, now):
                self._line(now)

    def _finished(self) -> bool:
        return bool(self.total and self.done >= self.total)

    def _heartbeat(self) -> None:
        """Print the line when a step outlasts the interval without an advance."""
        while not self._stopped.wait(self.interval / 4):
            with self._lock:
                now = time.monotonic()
                if not self._finished() and _Pace.due(self.console, self._started, self.interval, now):
                    self._line(now)

    def _line(self, now: float) -> None:
        _Pace.printed(self.console, now)
        elapsed = now - self._started
        text = f"{self.description}: {self.done}"
        if self.total:
            text += f"/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%)"
            fresh = self.done - self._resumed
            if self.done >= self.total:
                text += f", done in {_duration(elapsed)}"
            elif self.remaining is not None:
                text += f", {_duration(elapsed)} elapsed, ETA {_duration(self.remaining())}"
            elif fresh > 0:
                text += f", {_duration(elapsed)} elapsed, ETA {_duration(elapsed / fresh * (self.total - self.done))}"
            elif self._estimate is not None:  # nothing finished yet: the estimate, less the time since it was made
                seconds, made = self._estimate
                left = _duration(max(0.0, seconds - (now - made)))
                text += f", {_duration(elapsed)} elapsed, ETA about {left} (estimated)"
            else:
                text += f", {_duration(elapsed)} elapsed"
        else:
            text += f" {self.unit}, {_duration(elapsed)} elapsed"
        if self.detail and not self._finished():  # what it is working on; nothing once it is done
            text += f" [{self.detail}]"
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        self._stopped.set()
        if self._timer is not None:
            self._timer.join()
            self._timer = None
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
