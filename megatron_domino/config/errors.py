"""The errors a user can fix: bad settings, bad data files, bad checkpoints, a launch that cannot start.

They share ``KnownError``, whose message already says what is wrong, where (key, file, rank) and the fix:
the entry points print such an error as a short block and keep its traceback in a log file, while any
other exception is a bug and keeps its traceback on the console (``training/cli.py``).

A config problem is written "<key> = <value>: <rule>. Fix: <fix>" so that a person can find the setting,
see why it is wrong and what to type instead. Several problems found together travel in one error,
one line each, so a user fixes a config in one round instead of one rerun per mistake.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Problem:
    """One offending setting: its dotted key (e.g. ``parallel.tp``), its value, the rule broken and the fix."""

    key: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}: {self.rule}. Fix: {self.fix}"


class KnownError(Exception):
    """A failure the user can fix from its message alone; the traceback would only bury it."""


class DataError(KnownError, ValueError):
    """A dataset that cannot be trained on: damaged or mismatched files, token ids beyond the vocabulary,
    an empty split. The message names the file."""


class CheckpointError(KnownError, ValueError):
    """A checkpoint that cannot be loaded or saved as asked. The message names the folder or file."""


class LaunchError(KnownError, RuntimeError):
    """A process that cannot start as configured: no CUDA device for NCCL, an unknown backend."""


class ConfigError(KnownError, ValueError):
    """Invalid configuration. ``problems`` lists every offending setting; the message has one line per problem."""

    def __init__(self, key: str, value: Any, rule: str, fix: str):
        self.problems = [Problem(key, value, rule, fix)]
        super().__init__(str(self.problems[0]))

    @classmethod
    def of(cls, problems: Iterable[Problem]) -> "ConfigError":
        """One error carrying several problems (at least one)."""
        problems = list(problems)
        if not problems:
            raise ValueError("ConfigError.of needs at least one problem")
        error = cls(problems[0].key, problems[0].value, problems[0].rule, problems[0].fix)
        error.problems = problems
        error.args = ("\n".join(str(p) for p in problems),)
        return error

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.problems]
