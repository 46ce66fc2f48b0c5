"""Write docs/configuration.md from the config schema, so that the page cannot drift from the code.

A key's meaning is the comment beside its field in ``megatron_domino/config/schema.py`` (``model_config.py`` for
the model section): the comment lines right above the field, then the comment after it on the same line. A
field without one has no meaning to print, and ``tests/test_docs.py`` fails on it. A comment that starts with
the name of a tuple of allowed values (``DOMINO_SPLITS``) gives the key's allowed values; ``PIPELINE_SCHEDULES``
names the pipeline schedules' registry (``megatron_domino/pipeline/schedules/``).

    python tools/config_reference.py            # rewrite docs/configuration.md
    python tools/config_reference.py --check    # exit 1 if docs/configuration.md is not what the schema gives
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize

from megatron_domino.config import model_config, schema
from megatron_domino.pipeline.schedules import names as schedule_names

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "configuration.md")
_ALLOWED = re.compile(r"^([A-Z][A-Z0-9_]+)\b[:;,]?\s*")

INTRO = """\
# Configuration reference

Generated from `megatron_domino/config/schema.py` by `python tools/config_reference.py`; do not edit by hand.
Every key below is `section.key`. A run reads one YAML file and then the overrides on its command line, e.g.
`python pretrain_gpt.py --config configs/tiny/gpt.yaml train.steps=50 'data.path=[data/my_text_document]'`.

- **Files.** A config holds the sections below as top-level mappings. `include: base.yaml` (or a list) names other
  files, relative to the including file; they are merged in order, then the file's own keys go on top. Mappings
  merge key by key; lists and scalars are replaced whole.
- **Overrides.** `section.key=value` arguments come last, in order. Values are YAML: `true`/`false` are the only
  booleans, `3e-4` is a float, `null` unsets, `[a, b]` is a list (quote it for the shell).
- **Checks.** Types, names and every rule between keys are checked before any process group starts. An error
  names the key, the value, the rule and a fix, with "did you mean" for a misspelt key; all problems are
  reported together. `--dry-run` runs the same checks for a world size you do not have yet.
- **What a run used.** A run writes its resolved config, every key, to `<log.dir>/config.yaml`, which `--config`
  reads back; a checkpoint's metadata keeps it too.
- **Types.** "or null" means the key may be unset (`null`); the meaning says what unset does.
"""


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the comment text beside it (above it, then after it), '' when it has none."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {}  # line -> (text, whether the line holds nothing but the comment)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        after = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        docs[node.target.id] = " ".join(above + after).strip()
    return docs


def split_allowed(doc: str) -> tuple[tuple | None, str]:
    """(allowed values, meaning): a leading tuple name in the comment gives the values; the rest is the meaning."""
    match = _ALLOWED.match(doc)
    namespace = {**vars(model_config), **vars(schema), "PIPELINE_SCHEDULES": schedule_names()}
    if match and isinstance(namespace.get(match.group(1)), tuple):
        return namespace[match.group(1)], doc[match.end():]
    return None, doc


def sections() -> list[tuple[str, type]]:
    return [(f.name, f.default_factory) for f in dataclasses.fields(schema.Config)]


def config_keys() -> list[tuple[str, dataclasses.Field, str]]:
    """(dotted key, field, comment) for every key of the schema, in schema order."""
    rows = []
    for section, cls in sections():
        docs = field_docs(cls)
        rows += [(f"{section}.{f.name}", f, docs.get(f.name, "")) for f in dataclasses.fields(cls)]
    return rows


def _type(text: str) -> str:
    inner = re.fullmatch(r"Optional\[(.+)\]", text)
    if inner:
        return _type(inner.group(1)) + " or null"
    union = re.fullmatch(r"Union\[(.+)\]", text)
    return " or ".join(part.strip() for part in union.group(1).split(",")) if union else text


def _value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e4:
        return str(int(value)) + ".0"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    lines = [INTRO]
    for section, cls in sections():
        summary = " ".join(inspect.getdoc(cls).split("\n\n")[0].split()).replace("``", "`")
        lines += [f"## {section}: {summary}", "",
                  "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            allowed, meaning = split_allowed(docs.get(f.name, ""))
            values = ", ".join(f"`{_value(v)}`" for v in allowed) if allowed else ""
            lines.append(f"| `{section}.{f.name}` | {_type(str(f.type))} | `{_value(default)}` | {values} | "
                         f"{_cell(meaning)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the page instead of writing it")
    args = parser.parse_args(argv)
    missing = [key for key, _, doc in config_keys() if not split_allowed(doc)[1]]
    if missing:
        print("config keys without a meaning (add a comment beside the field in megatron_domino/config/): "
              + ", ".join(missing), file=sys.stderr)
        return 1
    text = render()
    if args.check:
        with open(PAGE, encoding="utf-8") as f:
            current = f.read() == text
        print("docs/configuration.md is " + ("current" if current else
                                             "stale: run python tools/config_reference.py"))
        return 0 if current else 1
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
