"""A one-line progress report for long offline jobs (preprocessing, checkpoint conversion).

Rewrites one line in place on a terminal; in a log file (not a TTY) it prints a line every 30 seconds
instead, so logs stay short. The line shows the share of bytes done, the items done and their rate,
and any further counts the job keeps (tokens, bad lines), with their rate when the job asks for it.
"""
from __future__ import annotations

import sys
import time


class Progress:
    """``update`` after each piece of work; ``close`` prints the final line.

    ``unit`` names the items counted ("docs", "tensors"); ``total_items``, when known, is shown beside them.
    ``rated`` names the keyword counts shown with a per-second rate ("tokens").
    """

    def __init__(self, total_bytes: int, label: str = "", *, unit: str = "docs", total_items: int | None = None,
                 stream=None, interval_s: float | None = None, quiet: bool = False, rated: tuple = ()):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.5 if self.tty else 30.0)
        self.total_bytes, self.label, self.quiet = max(1, total_bytes), label, quiet
        self.unit, self.total_items, self.rated = unit, total_items, rated
        self.start = self._last = time.monotonic()
        self.bytes = self.items = 0
        self.counts: dict[str, int] = {}

    def update(self, bytes_done: int, items: int = 1, **counts: int) -> None:
        """Add ``bytes_done`` bytes and ``items`` items; keyword counts (``tokens=...``) add to their totals."""
        self.bytes += bytes_done
        self.items += items
        for name, value in counts.items():
            self.counts[name] = self.counts.get(name, 0) + value
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._print(end="\r" if self.tty else "\n")

    def close(self) -> None:
        self._print(end="\n")

    def line(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.start)
        of = f"/{self.total_items:,}" if self.total_items is not None else ""
        extra = "".join(f" | {value:,} {name.replace('_', ' ')}"
                        + (f" ({value / elapsed:,.0f} {name}/s)" if name in self.rated else "")
                        for name, value in self.counts.items())
        return (f"{self.label}{100 * self.bytes / self.total_bytes:5.1f}% | {self.items:,}{of} {self.unit} "
                f"({self.items / elapsed:,.0f} {self.unit}/s, {self.bytes / elapsed / 2**20:.2f} MB/s){extra}")

    def _print(self, end: str) -> None:
        if not self.quiet:
            print(self.line(), end=end, file=self.stream, flush=True)
