"""The one error type for bad settings, shared by the loader, the validator and the rest of the package.

Every problem is written "<key> = <value>: <rule>. Fix: <fix>" so that a person can find the setting,
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


class ConfigError(ValueError):
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
