"""A JSONL corpus cut into line-aligned byte ranges (preprocessing's resumable partitions) and read in
batches of whole lines (one worker task each)."""
from __future__ import annotations

import os

_BATCH_LINES, _BATCH_BYTES = 256, 1 << 20  # one worker task


def partition_ranges(path: str, partitions: int) -> list[tuple[int, int, int]]:
    """(first byte, end byte, first line number) of up to ``partitions`` line-aligned byte ranges."""
    size = os.path.getsize(path)
    starts = [0]
    with open(path, "rb") as f:
        for k in range(1, partitions):
            f.seek(max(starts[-1], k * size // partitions))
            if f.tell() > 0:
                f.seek(f.tell() - 1)
                f.readline()  # move to the start of the next line
            if starts[-1] < f.tell() < size:
                starts.append(f.tell())
        bounds = starts + [size]
        first_lines, line = [], 1
        for a, b in zip(bounds, bounds[1:]):
            first_lines.append(line)
            f.seek(a)
            remaining = b - a
            while remaining > 0:
                chunk = f.read(min(remaining, 1 << 24))
                line += chunk.count(b"\n")
                remaining -= len(chunk)
    return [(a, b, n) for a, b, n in zip(bounds, bounds[1:], first_lines)]


def read_batches(path: str, byte_range: tuple[int, int, int]):
    """Batches (first line number, raw lines) from a byte range, for the workers."""
    start, end, line_no = byte_range
    with open(path, "rb") as f:
        f.seek(start)
        batch, batch_bytes, pos = [], 0, start
        while pos < end:
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            batch.append(raw)
            batch_bytes += len(raw)
            if len(batch) >= _BATCH_LINES or batch_bytes >= _BATCH_BYTES:
                yield line_no, batch
                line_no += len(batch)
                batch, batch_bytes = [], 0
        if batch:
            yield line_no, batch
