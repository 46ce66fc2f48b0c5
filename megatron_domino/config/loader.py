"""YAML config files -> typed ``Config``: includes, dotted overrides, type checks, atomic save.

A file holds the top-level sections of ``Config`` (model, parallel, ...) and may name other files under
``include:`` (paths relative to the including file). Includes are deep-merged in order, then the file's
own keys on top; ``section.key=value`` overrides come last. Values are parsed as YAML scalars and then
checked against the schema's field types, so a typo or a wrong type fails here, before any process
group exists, with the dotted key and a suggestion.

The YAML dialect follows YAML 1.2 on two points, for loading and saving alike: only ``true``/``false``
are booleans (``yes``/``no``/``on``/``off`` stay strings), and ``3e-4`` is a float (YAML 1.1 needs a dot
and would read it as a string, a classic trap for learning rates).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Iterable

import yaml

from ..files import atomic_open
from .errors import ConfigError, Problem
from .schema import Config

_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


for _cls in (_Loader, _Dumper):
    _cls.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in entries if tag not in (_BOOL_TAG, _FLOAT_TAG)]
        for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    _cls.add_implicit_resolver(_BOOL_TAG, _BOOL_RE, list("tTfF"))
    _cls.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))

# The schema types these lists as a bare ``list``; their items are checked here.
_LIST_ITEM_TYPES = {"parallel.pipeline_layout": int, "data.path": str, "model.moe_layer_freq": int,
                    "eval.sample_prompts": str}


def parse_yaml_value(text: str) -> Any:
    """Parse one value (an override's right-hand side) with the same rules as the files."""
    return yaml.load(text, Loader=_Loader)


def _yaml_reason(err: yaml.YAMLError) -> str:
    """PyYAML's complaint on one line (its own message spans several, with a caret drawing)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if problem is None:
        return str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _suggestion(name: str, choices: Iterable[str], elsewhere: dict[str, str] | None = None) -> str:
    choices = list(choices)
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if elsewhere and name in elsewhere:
        return f"did you mean '{elsewhere[name]}.{name}'?"
    return "valid names are " + ", ".join(sorted(choices))


def _section_types() -> dict[str, tuple[type, dict[str, Any]]]:
    """Section name -> (dataclass, field name -> resolved type hint)."""
    hints = typing.get_type_hints(Config)
    return {name: (cls, typing.get_type_hints(cls)) for name, cls in hints.items()}


def _convert(key: str, value: Any, hint: Any, problems: list[Problem]) -> Any:
    """Check ``value`` against the field type ``hint``; return it converted, or record a problem."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is typing.Union:  # int | list: the value's own kind picks
        hint = list if isinstance(value, (list, tuple)) else next(a for a in typing.get_args(hint) if a is not list)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is bool:
        if isinstance(value, bool):
            return value
        return problems.append(Problem(key, value, "must be true or false", f"write {key}=true or {key}=false"))
    if hint is int:
        if is_number and float(value).is_integer():
            return int(value)
        return problems.append(Problem(key, value, "must be a whole number", f"write a plain integer, e.g. {key}=2"))
    if hint is float:
        if is_number:
            return float(value)
        return problems.append(Problem(key, value, "must be a number", f"write a number, e.g. {key}=0.5 or 1e-4"))
    if hint is str:
        if isinstance(value, str):
            return value
        if is_number:
            return str(value)
        return problems.append(Problem(key, value, "must be a string", f"quote the value, e.g. {key}='...'"))
    if hint is list:
        return _convert_list(key, value, problems)
    raise TypeError(f"schema field {key} has a type the loader does not know: {hint!r}")


def _convert_list(key: str, value: Any, problems: list[Problem]) -> Any:
    if isinstance(value, str):
        value = [value]  # a single data prefix may be written without brackets
    if not isinstance(value, (list, tuple)):
        return problems.append(Problem(key, value, "must be a list", f"write {key}=[a,b] (YAML flow list)"))
    item_type = _LIST_ITEM_TYPES.get(key)
    if item_type is None:
        return list(value)
    before = len(problems)
    items = [_convert(f"{key}[{i}]", item, item_type, problems) for i, item in enumerate(value)]
    return items if len(problems) == before else None


def _not_a_mapping(section: str, body: Any) -> Problem:
    return Problem(section, body, "must be a mapping of keys", f"write '{section}:' then indented 'key: value' lines")


def _field_homes() -> dict[str, str]:
    """Field name -> its section, to point a key written in the wrong section to the right one."""
    return {name: section for section, (_, hints) in _section_types().items() for name in hints}


def config_from_dict(data: dict) -> Config:
    """Build a ``Config`` from nested dicts, checking every section, key and type. Missing keys keep defaults."""
    if not isinstance(data, dict):
        raise ConfigError("config", data, "must be a mapping of sections", "write 'section:' blocks, e.g. 'model:'")
    sections = _section_types()
    homes = _field_homes()
    problems: list[Problem] = []
    built = {}
    for section, body in data.items():
        if section not in sections:
            problems.append(Problem(str(section), body, "is not a config section", _suggestion(str(section), sections)))
            continue
        cls, hints = sections[section]
        body = {} if body is None else body
        if not isinstance(body, dict):
            problems.append(_not_a_mapping(section, body))
            continue
        values = {}
        for name, value in body.items():
            key = f"{section}.{name}"
            if name not in hints:
                others = {n: s for n, s in homes.items() if s != section}
                hint = _suggestion(str(name), hints, others)
                problems.append(Problem(key, value, f"is not a {section} setting", hint))
                continue
            values[name] = _convert(key, value, hints[name], problems)
        built[section] = (cls, values)
    if problems:
        raise ConfigError.of(problems)
    parallel = built.get("parallel", (None, {}))[1]
    if "virtual_pp" not in parallel and parallel.get("pipeline_schedule") is not None:
        # the schedule's own chunk count (a V's two), implied; the schedules are the pipeline's records, read here
        # by the one import of the config layer upwards (.importlinter says so)
        from ..pipeline.schedules import implied_chunks
        chunks = implied_chunks(parallel["pipeline_schedule"])
        if chunks is not None:
            parallel["virtual_pp"] = chunks
    return Config(**{section: cls(**values) for section, (cls, values) in built.items()})


def config_to_dict(cfg: Config) -> dict:
    """Nested plain dicts of every setting (the resolved config), in schema order."""
    return dataclasses.asdict(cfg)


def _deep_merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``: mappings merge key by key, anything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_file(path: str, chain: tuple[str, ...]) -> dict:
    """One file with its includes resolved. ``chain`` holds the files that include this one (cycle check)."""
    real = os.path.realpath(path)
    role = "include" if chain else "config"
    if real in chain:
        loop = " -> ".join(chain[chain.index(real):] + (real,))
        raise ConfigError("include", path, f"forms an include cycle ({loop})", "remove one of these includes")
    try:
        with open(real, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)
    except FileNotFoundError:
        raise ConfigError(role, path, "file not found",
                          "check the path (includes are relative to the including file)") from None
    except yaml.YAMLError as err:
        raise ConfigError(role, path, f"is not valid YAML ({_yaml_reason(err)})",
                          "fix the syntax at that position") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(role, path, "must hold a mapping of sections",
                          "start the file with 'model:', 'train:', ... blocks")
    includes = data.pop("include", None)
    includes = [includes] if isinstance(includes, str) else includes or []
    if not isinstance(includes, list) or not all(isinstance(p, str) for p in includes):
        raise ConfigError("include", includes, f"in {path} must be a path or a list of paths",
                          "write include: [../base.yaml]")
    merged: dict = {}
    for inc in includes:
        inc_path = inc if os.path.isabs(inc) else os.path.join(os.path.dirname(real), inc)
        merged = _deep_merge(merged, _read_file(inc_path, chain + (real,)))
    return _deep_merge(merged, data)


def _apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ConfigError(key or item, text, "an override must read section.key=value", "write e.g. parallel.tp=2")
        try:
            value = parse_yaml_value(text)
        except yaml.YAMLError as err:
            raise ConfigError(key, text, f"is not a valid YAML value ({_yaml_reason(err)})",
                              "quote strings and close brackets") from None
        section, name = parts
        body = {} if data.get(section) is None else data[section]
        if not isinstance(body, dict):
            raise ConfigError.of([_not_a_mapping(section, body)])
        data = {**data, section: {**body, name: value}}
    return data


def load_config(path: str | None, overrides: Iterable[str] = ()) -> Config:
    """Read ``path`` (or start from the defaults when None), apply ``section.key=value`` overrides, check types."""
    return config_with_overrides(_read_file(path, ()) if path is not None else {}, overrides)


def config_with_overrides(data: dict, overrides: Iterable[str] = ()) -> Config:
    """Nested dicts (a file's, or the config a checkpoint saved) with ``section.key=value`` overrides on top."""
    return config_from_dict(_apply_overrides(data, overrides))


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config as YAML that ``load_config`` reads back to an equal ``Config``.

    Written atomically (``files.atomic_open``), so a crash never leaves a half-written config beside a
    checkpoint.
    """
    text = yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=None)
    with atomic_open(path, encoding="utf-8") as f:
        f.write("# Resolved megatron_domino config: every setting, includes and overrides applied.\n")
        f.write(text)
