"""A small, licence-clean corpus and tokenizer for the quick start, made on the user's machine.

The text is Python's own standard-library docstrings (under the PSF licence, like Python itself), read
with ``inspect`` from a fixed list of modules in a fixed order, so the corpus is the same on every run of
a given Python version and nothing is downloaded or shipped. A SentencePiece BPE model is trained on it
with Llama's settings (byte fallback, digits split, whitespace kept), so text round-trips exactly.
"""
from __future__ import annotations

import importlib
import inspect
import io
import json
import warnings

from ..files import atomic_open

QUICKSTART_MODULES = (
    "abc", "argparse", "ast", "asyncio.events", "asyncio.futures", "asyncio.locks", "asyncio.queues",
    "asyncio.streams", "asyncio.tasks", "base64", "bdb", "bisect", "builtins", "bz2", "calendar", "cmd", "code",
    "codecs", "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "doctest", "email.message", "email.utils", "enum", "filecmp",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip",
    "heapq", "hmac", "html.parser", "http.client", "http.cookiejar", "http.server", "imaplib", "inspect",
    "ipaddress", "json", "linecache", "locale", "logging", "logging.handlers", "lzma", "mailbox", "mimetypes",
    "multiprocessing.pool", "netrc", "numbers", "operator", "optparse", "pathlib", "pdb", "pickle",
    "pickletools", "platform", "plistlib", "poplib", "pprint", "profile", "pstats", "pydoc", "queue", "random",
    "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "types", "typing", "unittest.case", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
    "zoneinfo",
)
MAX_CORPUS_BYTES = 1_500_000
_MIN_DOC_CHARS = 80  # one-liners teach little and inflate the document count


def iter_docstrings(modules=QUICKSTART_MODULES):
    """(qualified name, docstring) for each module and its public classes, functions and methods, in
    sorted order. Only docstrings written on the object itself count (no inherited ones)."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a Python built without the module; the rest of the corpus stays the same
            continue
        yield module_name, module.__doc__
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            if inspect.isclass(obj):
                yield f"{module_name}.{name}", obj.__doc__
                for member_name, member in sorted(vars(obj).items()):
                    if not member_name.startswith("_") and (callable(member) or isinstance(member, property)):
                        yield f"{module_name}.{name}.{member_name}", getattr(member, "__doc__", None)
            elif inspect.isfunction(obj):
                yield f"{module_name}.{name}", obj.__doc__


def corpus_documents(max_bytes: int = MAX_CORPUS_BYTES) -> list[str]:
    """Documents ``"<qualified name>\\n\\n<docstring>"``, unique, until ``max_bytes`` of JSONL would be exceeded."""
    docs, seen, size = [], set(), 0
    with warnings.catch_warnings():  # some stdlib objects warn when their docstring is read (typing.io)
        warnings.simplefilter("ignore")
        named = list(iter_docstrings())
    for name, doc in named:
        if not isinstance(doc, str):
            continue
        body = inspect.cleandoc(doc)
        if len(body) < _MIN_DOC_CHARS or body in seen:
            continue
        text = f"{name}\n\n{body}"
        line_bytes = len(json.dumps({"text": text}).encode()) + 1
        if size + line_bytes > max_bytes:
            break
        seen.add(body)
        docs.append(text)
        size += line_bytes
    return docs


def write_corpus(path: str, documents: list[str]) -> None:
    """JSONL, one ``{"text": ...}`` a line, written atomically."""
    with atomic_open(path, encoding="utf-8") as f:
        for text in documents:
            f.write(json.dumps({"text": text}) + "\n")


def train_sentencepiece(documents: list[str], model_path: str, vocab_size: int = 1000) -> None:
    """A Llama-style SentencePiece BPE model (unk 0, bos 1, eos 2, no pad) trained on ``documents``."""
    import sentencepiece

    lines = [line for text in documents for line in text.split("\n") if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, add_dummy_prefix=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, shuffle_input_sentence=False,
        max_sentence_length=1 << 14, minloglevel=2)
    with atomic_open(model_path, "wb") as f:
        f.write(model.getvalue())
