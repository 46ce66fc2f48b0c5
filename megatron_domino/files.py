"""Files that are whole or absent: the one durability rule of the package.

A file is written beside its destination under a temporary name, flushed and fsynced, renamed over the
destination, and the folder is fsynced so the rename itself survives a crash. A reader therefore sees the
old file or the new one, never a torn one, and a power cut after the rename keeps the new one. Everything
the package writes for later (configs, checkpoints' metadata, indices, converted weights, caches, the
quick-start corpus) goes through here.
"""
from __future__ import annotations

import contextlib
import os
import tempfile


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, path: str) -> None:
    """Rename the written and closed file (or folder) ``tmp`` to ``path`` durably: ``tmp`` fsynced first, the
    folder after. For writers that produce their temporary file themselves (streams, several files at once)."""
    if os.path.isfile(tmp):
        fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def temporary_beside(path: str) -> str:
    """A fresh, unique temporary name in ``path``'s folder (same file system: the rename is atomic)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    return tmp


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", encoding: str | None = None):
    """``with atomic_open(path) as f: f.write(...)``: ``path`` holds the new content once the block ends, or
    keeps the old one if it raises."""
    tmp = temporary_beside(path)
    try:
        with open(tmp, mode, encoding=encoding if "b" not in mode else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
