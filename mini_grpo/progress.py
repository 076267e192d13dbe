"""Progress for long stages that have no step of their own to report: a line at least every
`every` seconds while the stage runs, so that a slow machine is not taken for a hung one.

    with Heartbeat(print, lambda: f"[eval] greedy: {done}/{total} completions"):
        ...                                   # the line, with the seconds so far, every 10 s

    phases = Phases(print, "[mini-grpo] set-up")
    phases.begin("the task")                  # "[mini-grpo] set-up: the task ... (10 s)"
    phases.begin("the model")                 # the task's phase ends, the model's begins
    phases.report()                           # one line: each phase's seconds

The line is written from a daemon thread (what it reads must be safe to read while the stage
changes it: counters, not structures being rebuilt), and never after the stage has ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

EVERY = 10.0  # seconds between two lines of a stage that says nothing else


class Heartbeat:
    """While the `with` block runs: `say(what() + " (N s)")` every `every` seconds."""

    def __init__(self, say: Callable[[str], None], what: Callable[[], str],
                 every: float = EVERY):
        self.say, self.what, self.every = say, what, every
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a line is never written after __exit__ returns
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        self.start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                if self._stop.is_set():
                    return
                self.say(f"{self.what()} ({time.monotonic() - self.start:.0f} s)")

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._stop.set()
        self._thread.join()


class Phases:
    """A stage made of named phases, one after the other: each announced by a Heartbeat
    while it runs (`begin` ends the one before), timed, and all reported in one line."""

    def __init__(self, say: Callable[[str], None], name: str, every: float = EVERY):
        self.say, self.name, self.every = say, name, every
        self.seconds: dict[str, float] = {}
        self._beat: Heartbeat | None = None

    def begin(self, phase: str) -> None:
        self.end()
        self._phase, self._t0 = phase, time.monotonic()
        self._beat = Heartbeat(self.say, lambda: f"{self.name}: {phase} ...", self.every)
        self._beat.__enter__()

    def end(self) -> None:
        """The running phase ends (nothing if none runs): its heartbeat stops, its seconds
        count. Call it on every way out of the stage, errors included."""
        if self._beat is not None:
            self._beat.__exit__(None, None, None)
            self._beat = None
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) \
                + time.monotonic() - self._t0

    def report(self) -> str:
        """One line: the stage's seconds in all and each phase's (those of 0.5 s or more)."""
        self.end()
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items() if v >= 0.5)
        line = f"{self.name}: {sum(self.seconds.values()):.0f} s" + (f" ({parts})" if parts
                                                                    else "")
        self.say(line)
        return line


class Laps:
    """A step's phases timed one after the other: `lap(name)` records the seconds since the
    last lap (or `start`) under `name` in `times`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.times = clock, {}
        self._t = clock()

    def start(self) -> None:
        self._t = self.clock()

    def __call__(self, name: str) -> None:
        now = self.clock()
        self.times[name], self._t = now - self._t, now
