"""``eval.path``: more validation sets than the training data's own split, each scored on its own (one loss per set,
as Megatron's per-dataset validation losses). One parser, used by validation and by the data builder.

Each entry is a prefix (the set is named after its file name) or a one-key mapping ``{NAME: path}`` whose path is
anything ``data.path`` takes (a prefix, or a list with or without weights: a named blend)::

    eval:
      path:
        - data/wiki_text_document
        - code: [0.5, data/python_text_document, 0.5, data/js_text_document]

Every document of a set is evaluated (the set is held out as a whole: ``data.split`` does not apply to it).
"""
from __future__ import annotations

import os

from .data_path import parse_data_path
from .errors import ConfigError, Problem

EXAMPLE = "eval.path=[PREFIX_A, {code: [0.5, PREFIX_B, 0.5, PREFIX_C]}]"


def parse_eval_sets(path) -> list[tuple[str, list]]:
    """[(name, data path)] of ``eval.path`` (None: none); raises one ``ConfigError`` naming every malformed entry."""
    entries = [] if path is None else ([path] if isinstance(path, (str, dict)) else list(path))
    sets, problems = [], []
    for i, entry in enumerate(entries):
        key = f"eval.path[{i}]"
        if isinstance(entry, dict) and len(entry) == 1:
            (name, value), = entry.items()
            data_path = [value] if isinstance(value, str) else value
        elif isinstance(entry, str):
            name, data_path = os.path.basename(entry), [entry]
        else:
            problems.append(Problem(key, entry, "must be a prefix or a one-key mapping {NAME: prefix or blend}",
                                    f"write e.g. {EXAMPLE}"))
            continue
        try:
            parse_data_path(data_path)
        except ConfigError as err:
            problems.extend(Problem(f"{key}: {p.key}", p.value, p.rule, p.fix) for p in err.problems)
            continue
        sets.append((str(name), list(data_path)))
    names = [name for name, _ in sets]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(Problem("eval.path", name, "names two sets (each set's loss is logged under its name)",
                                "name them apart with the mapping form {NAME: PREFIX}"))
    if problems:
        raise ConfigError.of(problems)
    return sets
