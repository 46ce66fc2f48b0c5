"""The collector every config rule writes to: problems ("<key> = <value>: <rule>. Fix: <fix>") and warnings."""
from __future__ import annotations

import difflib
from typing import Any

from .errors import ConfigError, Problem


class Checks:
    """Collects problems and warnings; small helpers keep each rule to one line. The rules live next to
    what they govern (``parallel/topology.py``, ``pipeline/partition.py``, ...) and all take one of these."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.warnings: list[str] = []

    def fail(self, key: str, value: Any, rule: str, fix: str) -> None:
        self.problems.append(Problem(key, value, rule, fix))

    def raise_problems(self) -> None:
        """For a rule's owner checking its own input: one ``ConfigError`` with every problem found."""
        if self.problems:
            raise ConfigError.of(self.problems)

    def positive(self, key: str, value: Any, optional: bool = False) -> bool:
        """value >= 1 (or > 0 for floats). Returns whether it holds, so dependent rules can be skipped."""
        if value is None and optional:
            return True
        if value is None or not value > 0:
            self.fail(key, value, "must be positive", f"set {key} to a value above 0")
            return False
        return True

    def at_least(self, key: str, value: Any, low: float) -> None:
        if not value >= low:
            self.fail(key, value, f"must be >= {low}", f"set {key} to {low} or more")

    def in_range(self, key: str, value: Any, low: float, high: float, high_open: bool = True) -> None:
        ok = low <= value < high if high_open else low <= value <= high
        if not ok:
            interval = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
            self.fail(key, value, f"must lie in {interval}", f"choose a value in {interval}")

    def one_of(self, key: str, value: Any, choices: tuple) -> None:
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            fix = f"did you mean '{close[0]}'?" if close else "pick one of the listed values"
            self.fail(key, value, f"must be one of {', '.join(map(str, choices))}", fix)

    def divides(self, key: str, value: int, divisor: int, divisor_name: str, fix: str) -> None:
        if value % divisor:
            self.fail(key, value, f"must be divisible by {divisor_name} = {divisor}", fix)

    def split_by_tp(self, key: str, value: int | None, tp: int) -> None:
        """A size that TP cuts into equal parts (unset or non-positive: another rule names it)."""
        if value is not None and value >= 1:
            fits = [str(t) for t in (1, 2, 4, 8, 16, 32, 64) if value % t == 0]
            self.divides(key, value, tp, "parallel.tp",
                         f"use a parallel.tp that divides {value} (e.g. {', '.join(fits)})")
