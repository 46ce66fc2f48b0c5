"""A one-line progress report for long preprocessing runs: share done, docs/s, MB/s, tokens.

Rewrites one line in place on a terminal; in a log file (not a TTY) it prints a line every 30 seconds
instead, so logs stay short.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_bytes: int, label: str = "", stream=None, interval_s: float | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.5 if self.tty else 30.0)
        self.total_bytes, self.label = max(1, total_bytes), label
        self.start = self._last = time.monotonic()
        self.bytes = self.docs = self.tokens = self.bad = 0

    def update(self, bytes_read: int, docs: int, tokens: int, bad: int) -> None:
        self.bytes += bytes_read
        self.docs += docs
        self.tokens += tokens
        self.bad += bad
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._print(end="\r" if self.tty else "\n")

    def close(self) -> None:
        self._print(end="\n")

    def line(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.start)
        return (f"{self.label}{100 * self.bytes / self.total_bytes:5.1f}% | {self.docs:,} docs "
                f"({self.docs / elapsed:,.0f} docs/s, {self.bytes / elapsed / 2**20:.2f} MB/s) | "
                f"{self.tokens:,} tokens | {self.bad:,} bad lines")

    def _print(self, end: str) -> None:
        print(self.line(), end=end, file=self.stream, flush=True)
