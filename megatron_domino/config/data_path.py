"""``data.path``, Megatron's list of dataset prefixes: one parser, used by validation and by the data builder.

The forms are Megatron's (``get_blend_from_list``): ``[PREFIX, ...]`` names prefixes without weights, and the
blend then weighs each prefix by its size (see ``data/builder.py``); ``[w1, PREFIX1, w2, PREFIX2, ...]`` puts
a weight before every prefix. A list is weighted when its first entry is a number. Parsing both here, before
any process starts, means a list the builder would refuse is refused at config time instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError, Problem

EXAMPLES = "data.path=[PREFIX_A,PREFIX_B] (weighted by size) or data.path=[0.3,PREFIX_A,0.7,PREFIX_B]"


@dataclass(frozen=True)
class DataBlend:
    """The prefixes of ``data.path`` and their weights as written; ``weights`` is None for an unweighted list."""

    prefixes: tuple[str, ...]
    weights: Optional[tuple[float, ...]]


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(path) -> DataBlend:
    """``data.path`` as a ``DataBlend``; raises one ``ConfigError`` naming every malformed entry.

    A single prefix may be given as a plain string, as the loader allows.
    """
    items = [str(x).strip() for x in ([path] if isinstance(path, str) else (path or []))]
    if not items:
        raise ConfigError("data.path", path, "is empty", f"give at least one prefix, e.g. {EXAMPLES}")
    if _number(items[0]) is None:
        numbers = [Problem(f"data.path[{i}]", item, "is a number in a list of prefixes without weights",
                           f"start the list with a weight to weigh every prefix: {EXAMPLES}")
                   for i, item in enumerate(items) if _number(item) is not None]
        if numbers:
            raise ConfigError.of(numbers)
        return DataBlend(tuple(items), None)
    if len(items) % 2:
        raise ConfigError("data.path", items, f"a weighted list alternates weight, prefix, but has {len(items)} "
                          "entries (an odd count)", f"put a weight before every prefix: {EXAMPLES}")
    problems = []
    for i in range(0, len(items), 2):
        weight = _number(items[i])
        if weight is None or not 0 < weight < math.inf:
            problems.append(Problem(f"data.path[{i}]", items[i], "must be a positive number (the weight of "
                                    f"the prefix {items[i + 1]!r} after it)", "write a weight > 0 before each prefix"))
        if _number(items[i + 1]) is not None:
            problems.append(Problem(f"data.path[{i + 1}]", items[i + 1], "is a number where a prefix belongs",
                                    f"alternate weight and prefix: {EXAMPLES}"))
    if problems:
        raise ConfigError.of(problems)
    return DataBlend(tuple(items[1::2]), tuple(float(w) for w in items[0::2]))
