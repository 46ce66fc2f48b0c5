"""Make the quick-start dataset: a docstring corpus, a SentencePiece tokenizer, and its .bin/.idx.

    python tools/prepare_quickstart_data.py --output-dir data/quickstart

writes corpus.jsonl (Python's own stdlib docstrings, < 2 MB), tokenizer.model (SentencePiece BPE, 1000
pieces) and corpus_text_document.bin/.idx (EOD appended). Runs in seconds, downloads nothing, and does
nothing when the outputs are already there and were made with the same settings and Python version.

The docstrings are read with ``inspect`` from a fixed list of modules in a fixed order (PSF licence, like Python
itself), so the corpus is the same on every run of a given Python version and nothing is downloaded or shipped.
The tokenizer is trained with Llama's settings (byte fallback, digits split, whitespace kept), so text round-trips
exactly.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import io
import json
import os
import platform
import sys
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.config.schema import TokenizerConfig  # noqa: E402
from megatron_domino.files import atomic_open  # noqa: E402
from preprocessing import PreprocessOptions, output_prefix, preprocess  # noqa: E402

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="data/quickstart")
    p.add_argument("--vocab-size", type=int, default=1000, help="SentencePiece pieces (tiny configs use 1024)")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)

    out = args.output_dir
    corpus, model = os.path.join(out, "corpus.jsonl"), os.path.join(out, "tokenizer.model")
    prefix = output_prefix(os.path.join(out, "corpus"), "text")
    stamp_path = os.path.join(out, "quickstart.json")
    stamp = {"python": platform.python_version(), "modules": list(QUICKSTART_MODULES),
             "max_corpus_bytes": MAX_CORPUS_BYTES, "vocab_size": args.vocab_size}
    outputs = (corpus, model, prefix + ".bin", prefix + ".idx")
    if all(os.path.exists(f) for f in outputs) and _read_json(stamp_path) == stamp:
        print(f"quick-start data in {out} is up to date")
    else:
        os.makedirs(out, exist_ok=True)
        documents = corpus_documents()
        write_corpus(corpus, documents)
        train_sentencepiece(documents, model, args.vocab_size)
        stats = preprocess(PreprocessOptions(
            input=corpus, output_prefix=os.path.join(out, "corpus"),
            tokenizer=TokenizerConfig(type="SentencePieceTokenizer", model=model),
            json_keys=("text",), append_eod=True, workers=args.workers))
        with atomic_open(stamp_path, encoding="utf-8") as f:
            json.dump(stamp, f, indent=2)
        print(f"{len(documents)} documents ({os.path.getsize(corpus) / 2**20:.2f} MB) -> {stats.summary()}")
    print("use it with:\n"
          f"  data.path: [{prefix}]\n"
          f"  tokenizer.type: SentencePieceTokenizer\n"
          f"  tokenizer.model: {model}\n"
          f"  model.vocab_size: {max(args.vocab_size, 1024)}  # >= the {args.vocab_size} pieces")
    return 0


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
