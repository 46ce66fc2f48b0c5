"""The docs stay true to the code: the generated page and pictures are current, every config key has a meaning,
pages stay short, and every link, file, module and config key a page names exists."""
from __future__ import annotations

import dataclasses
import glob
import os
import re

import pytest
import yaml

from megatron_domino.config import config_from_dict
from tests.tools import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("model", "parallel", "train", "optimizer", "data", "tokenizer", "checkpoint", "log", "eval")
ROOTS = ("megatron_domino", "tools", "configs", "scripts", "benchmarks", "tests", "docs")
EXTENSIONS = (".py", ".sh", ".yaml", ".md", ".cpp", ".sbatch", ".svg", ".cfg", ".ini")


def pages() -> list[str]:
    found = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "benchmarks/README.md"]
    for pattern in ("docs/**/*.md", "benchmarks/reports/*.md"):
        found += sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, pattern), recursive=True))
    return found


def read(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def prose(text: str) -> str:
    """The page without its fenced blocks (commands and outputs are checked apart)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def test_the_configuration_page_is_what_the_schema_gives():
    tool = load_tool("config_reference")
    assert read("docs/configuration.md") == tool.render(), "stale: run python tools/config_reference.py"


def test_every_config_key_has_a_meaning():
    tool = load_tool("config_reference")
    keys = tool.config_keys()
    assert len(keys) >= 175
    missing = [key for key, _, doc in keys if not tool.split_allowed(doc)[1]]
    assert not missing, f"add a comment beside these fields in megatron_domino/config/: {missing}"
    page = read("docs/configuration.md")
    assert all(f"| `{key}` |" in page for key, _, _ in keys)


def test_a_field_without_a_comment_has_no_meaning():
    @dataclasses.dataclass
    class Section:
        explained: int = 1  # what it means
        # DOMINO_SPLITS: the batch, the weights or both
        choice: str = "row"
        bare: float = 0.5

    tool = load_tool("config_reference")
    docs = tool.field_docs(Section)
    assert docs["explained"] == "what it means" and docs["bare"] == ""
    assert tool.split_allowed(docs["choice"]) == (("row", "column", "2d"), "the batch, the weights or both")


def test_the_pictures_are_what_the_schedules_give():
    tool = load_tool("draw_schedules")
    drawn = tool.pictures()
    assert len(drawn) == 6
    stale = [name for name, svg in drawn.items() if read(f"docs/images/{name}") != svg]
    assert not stale, f"stale pictures {stale}: run python tools/draw_schedules.py"


def test_pages_are_short():
    assert len(read("README.md").splitlines()) <= 200
    long = {page: n for page in pages() if page.startswith("docs/") and (n := len(read(page).splitlines())) > 250}
    assert not long, f"pages over 250 lines: {long}"


def test_relative_links_lead_somewhere():
    broken = []
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+://", path) and not os.path.exists(
                    os.path.join(REPO, os.path.dirname(page), path)):
                broken.append(f"{page}: {target}")
    assert not broken, broken


def _named_path_exists(token: str, page: str) -> bool:
    bases = (REPO, os.path.join(REPO, "megatron_domino"), os.path.join(REPO, os.path.dirname(page)))
    return any(os.path.exists(os.path.join(base, token.rstrip("/"))) for base in bases)


def _is_path(token: str) -> bool:
    outputs = ("runs/", "data/", "benchmarks/results")  # what the commands write, not files of the repository
    if not re.fullmatch(r"[\w.\-/]+", token) or "/" not in token or token.startswith(outputs):
        return False
    return token.endswith(EXTENSIONS) or token.rstrip("/").endswith(tuple(f"/{r}" for r in ROOTS)) \
        or token.split("/")[0] in ROOTS


def _module_exists(dotted: str) -> bool:
    """megatron_domino.a.b names a module (a file or package) or a name defined in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        base = os.path.join(REPO, *parts[:cut])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(path):
                rest = parts[cut:]
                return not rest or (len(rest) == 1 and re.search(rf"^(def|class) {rest[0]}\b|^{rest[0]} =",
                                                                   read(os.path.relpath(path, REPO)), re.MULTILINE))
    return False


def test_every_named_file_and_module_exists():
    """Every page but the dated reports, which name the files of the commit they were measured at."""
    missing = []
    for page in (page for page in pages() if not page.startswith("benchmarks/reports/")):
        text = read(page)
        tokens = set(re.findall(r"`([^`\s]+)`", prose(text)))
        path_pattern = r"(?<![\w/.])((?:tools|scripts|configs|benchmarks|tests)/[\w./-]+\.(?:py|sh|yaml|sbatch))"
        tokens |= set(re.findall(path_pattern, text))
        missing += [f"{page}: {t}" for t in tokens if _is_path(t) and not _named_path_exists(t, page)]
        missing += [f"{page}: {m}" for m in set(re.findall(r"\bmegatron_domino(?:\.\w+)+", text))
                    if not _module_exists(m.rstrip("."))]
    assert not missing, missing


def test_every_named_config_key_exists():
    tool = load_tool("config_reference")
    known = {key for key, _, _ in tool.config_keys()}
    unknown = []
    for page in pages():
        for section, name in re.findall(rf"`({'|'.join(SECTIONS)})\.(\w+)(?=[`=: \[])", prose(read(page))):
            if f"{section}.{name}" not in known and name not in ("py", "json", "yaml"):  # files: checkpoint.py
                unknown.append(f"{page}: {section}.{name}")
    assert not unknown, unknown


@pytest.mark.parametrize("page", [p for p in pages() if p.startswith("docs/")])
def test_yaml_examples_are_valid_configs(page):
    for block in re.findall(r"^```yaml\n(.*?)^```", read(page), flags=re.DOTALL | re.MULTILINE):
        config_from_dict(yaml.safe_load(block))
