"""The rules of ``model.compile`` and its inductor cache directory (``models/compiled.py``)."""
from __future__ import annotations

import os

from .checks import Checks


def check_compile(c: Checks, m) -> None:
    if not isinstance(m.compile, bool):
        c.fail("model.compile", m.compile, "must be true or false",
               "set model.compile=true to compile the compute between communication points, or false")
    path = m.compile_cache_dir
    if path is None:
        return
    if not isinstance(path, str) or not path.strip():
        c.fail("model.compile_cache_dir", path, "must be a directory path (a string) or null",
               "set model.compile_cache_dir to a directory, or null for torch's default")
        return
    path = existing = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(existing):  # the nearest that exists: the rest is created below it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        c.fail("model.compile_cache_dir", path, f"cannot be a directory: {existing} is a file",
               "choose a path that is, or can be created as, a directory; or null for torch's default")
    elif not os.access(existing, os.W_OK | os.X_OK):
        c.fail("model.compile_cache_dir", path, f"cannot be written: {existing} is not writable",
               "choose a directory you can write to, or null for torch's default")
