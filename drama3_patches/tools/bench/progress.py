"""Progress of a bench phase on stderr: a tqdm bar on a terminal, plain lines in logs and pipes.

Each line or bar says how many requests are done, completed and failed, and
the elapsed time. Plain lines come at every eighth of the work, at the end, and
at least every ``EVERY_S`` seconds, so a log of an hour-long level shows it moving.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time

EVERY_S = 10.0


def use_tqdm(stream) -> bool:
    """A bar only where a person watches (a terminal) and tqdm is installed."""
    isatty = getattr(stream, "isatty", None)
    try:
        tty = bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        tty = False
    if not tty or importlib.util.find_spec("tqdm") is None:
        return False
    try:
        # tqdm draws nothing on a terminal that reports no size (a bare pty): lines instead.
        size = os.get_terminal_size(stream.fileno())
        return size.columns > 0 and size.lines > 0
    except (AttributeError, OSError, ValueError):  # no descriptor to ask: trust isatty
        return True


class Progress:
    def __init__(self, stream, total: int, label: str, clock=time.monotonic):
        self.stream, self.total, self.label, self.clock = stream, total, label, clock
        self.done = self.failed = 0
        self.lock = threading.Lock()
        self.t0 = self.last = clock()
        self.step = max(1, total // 8)
        self.bar = None
        if use_tqdm(stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, file=stream, unit="req", leave=True, dynamic_ncols=True)
            self.bar.set_postfix(completed=0, failed=0, refresh=False)

    def start(self) -> None:
        """Elapsed time counts from here (after a level's warm-up requests)."""
        with self.lock:
            self.t0 = self.last = self.clock()
            if self.bar is not None:
                self.bar.reset(total=self.total)

    @property
    def completed(self) -> int:
        return self.done - self.failed

    def line(self, now: float) -> str:
        return (f"{self.label}: {self.done}/{self.total} done, {self.completed} completed, {self.failed} failed, "
                f"{now - self.t0:.1f} s elapsed")

    def tick(self, ok: bool = True) -> None:
        with self.lock:
            self.done += 1
            self.failed += 0 if ok else 1
            if self.bar is not None:
                self.bar.set_postfix(completed=self.completed, failed=self.failed, refresh=False)
                self.bar.update(1)
                if self.done == self.total:
                    self.bar.close()
                return
            now = self.clock()
            if self.done == self.total or self.done % self.step == 0 or now - self.last >= EVERY_S:
                self.last = now
                self.stream.write(self.line(now) + "\n")
                self.stream.flush()


class Silent:
    """--quiet: the same calls, no output."""

    def start(self) -> None:
        pass

    def tick(self, ok: bool = True) -> None:
        pass


def make(stream, total: int, label: str, quiet: bool = False):
    return Silent() if quiet or stream is None else Progress(stream, total, label)
