"""What a plan is doing, said on stderr once it has taken a while: a plan of a large model (many
traces under --micro-batch auto, a compile, the checks of what would fit) takes tens of seconds on a
small CPU, and a silent one looks hung. A plan that ends within AFTER_S prints nothing."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

AFTER_S = 3.0  # a plan quicker than this says nothing; a slower one says each step from then on


class Progress:
    """The plan's current step (say), printed once the plan has run AFTER_S, and every later one as it
    starts. Outside `running` (a plan made by a library call or a test) it prints nothing."""

    def __init__(self):
        self._start: float | None = None
        self._task = self._doing = ""
        self._shown = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One command's plans: the clock starts, and a timer shows the step under way at AFTER_S."""
        if self._start is not None:  # nested (auto's plans inside the command's): one clock
            yield
            return
        self._start, self._task, self._doing, self._shown = time.perf_counter(), "the plan", "", False
        timer = threading.Timer(AFTER_S, self._show)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            self._start = None

    def task(self, what: str) -> None:
        """What the plan's next steps are for: 'the plan', 'micro-batch auto', 'what would fit'."""
        self._task = what

    def say(self, doing: str) -> None:
        """The step the plan starts now."""
        with self._lock:
            self._doing = doing
            shown = self._shown
        if shown:
            self._print()

    def _show(self) -> None:
        with self._lock:
            self._shown = self._start is not None
        if self._shown and self._doing:
            self._print()

    def _print(self) -> None:
        start = self._start
        if start is not None:
            elapsed = time.perf_counter() - start
            print(f"fastpt: {self._task}: {self._doing} ({elapsed:.0f} s)", file=sys.stderr, flush=True)


progress = Progress()
