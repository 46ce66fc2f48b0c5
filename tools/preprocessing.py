"""JSONL -> Megatron MMIDIDX (PREFIX_<key>_document.bin/.idx), with worker processes and resumable partitions: the
work behind ``tools/preprocess_data.py`` and ``tools/prepare_quickstart_data.py`` (the package only reads these files).

One JSON object per line; each ``json_keys`` field is tokenized into its own dataset, one document per line.
An empty text stays an empty document (no sequence, as Megatron-LM's tool writes it), so document k is
line k + 1 of a clean input. A blank line is skipped and counted. A line that cannot be used (not UTF-8,
not JSON, not an object, key missing or not a string, tokenizer failure) is skipped for every key, counted
and reported with its line number; it never stops the run.
The tokenizer runs in ``workers`` processes, on the Rust path when ``tokenizer_impl`` allows it (same
ids, see ``fast_tokenizer.py``); the run names the implementation it uses on the progress stream.
Outputs are written under temporary names and renamed when complete. With ``partitions`` > 1 the input
is cut into byte ranges processed one after another, each finished range kept on disk, so an
interrupted run resumes at the first unfinished range.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import itertools
import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import numpy as np

from jsonl_ranges import partition_ranges, read_batches
from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data.indexed_dataset import IndexedDatasetBuilder, token_dtype
from megatron_domino.data.progress import Progress
from megatron_domino.data.tokenizer import build_tokenizer
from megatron_domino.files import atomic_open

_BAD_LINES_KEPT = 10_000


@dataclass
class PreprocessOptions:
    input: str
    output_prefix: str
    tokenizer: TokenizerConfig
    vocab_size: int | None = None  # NullTokenizer only
    json_keys: tuple = ("text",)
    append_eod: bool = False
    workers: int = 1
    partitions: int = 1
    tokenizer_impl: str = "auto"  # auto | python | rust: same ids, so not part of a resumed run's signature


@dataclass
class PreprocessStats:
    lines: int = 0
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    blank_lines: int = 0  # whitespace-only lines, skipped silently
    empty_documents: int = 0  # documents with no tokens, kept (counted in ``documents`` too)
    bad_count: int = 0
    bad_lines: list = field(default_factory=list)  # (line number, reason), the first _BAD_LINES_KEPT
    seconds: float = 0.0

    def add(self, other: "PreprocessStats") -> None:
        for f in ("lines", "documents", "tokens", "bytes", "blank_lines", "empty_documents", "bad_count"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.bad_lines.extend(other.bad_lines[:_BAD_LINES_KEPT - len(self.bad_lines)])

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        return (f"{self.documents:,} documents, {self.tokens:,} tokens from {self.lines:,} lines "
                f"({self.bytes / 2**20:.1f} MB) in {self.seconds:.1f} s: {self.documents / s:,.0f} docs/s, "
                f"{self.tokens / s:,.0f} tokens/s, {self.bytes / s / 2**20:.2f} MB/s; {self.empty_documents:,} empty "
                f"documents kept; skipped {self.bad_count:,} bad lines, {self.blank_lines:,} blank lines")


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's naming: ``--output-prefix my`` and key ``text`` give ``my_text_document``."""
    return f"{prefix}_{key}_document"


# ----------------------------------------------------------------------------------------------- workers

_worker_state: dict = {}


def _init_worker(options: PreprocessOptions, tokenizer=None) -> None:
    """Per worker process (or in process with one worker, reusing the driver's ``tokenizer``)."""
    _worker_state["tokenizer"] = tokenizer or build_tokenizer(options.tokenizer, options.vocab_size,
                                                              options.tokenizer_impl)
    _worker_state["options"] = options


def _encode_batch(task: tuple[int, list[bytes]]) -> tuple[dict, PreprocessStats]:
    """Tokenize one batch of raw lines; returns per key (concatenated tokens, document lengths) and its stats."""
    first_line, lines = task
    tok, options = _worker_state["tokenizer"], _worker_state["options"]
    dtype = token_dtype(tok.vocab_size)
    stats = PreprocessStats(lines=len(lines), bytes=sum(len(x) for x in lines))
    per_key = {key: ([], []) for key in options.json_keys}
    for line_no, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            stats.blank_lines += 1
            continue
        try:
            docs = _encode_line(raw, tok, options)
        except _BadLine as e:
            stats.bad_count += 1
            stats.bad_lines.append((line_no, str(e)))
            continue
        if not any(len(d) for d in docs.values()):
            stats.empty_documents += 1
        for key, ids in docs.items():
            per_key[key][0].append(ids)
            per_key[key][1].append(len(ids))
        stats.documents += 1
        stats.tokens += sum(len(d) for d in docs.values())
    out = {key: (np.fromiter(itertools.chain.from_iterable(chunks), dtype=dtype, count=sum(lengths)),
                 np.array(lengths, dtype=np.int64)) for key, (chunks, lengths) in per_key.items()}
    return out, stats


class _BadLine(Exception):
    pass


def _encode_line(raw: bytes, tok, options: PreprocessOptions) -> dict:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _BadLine(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"expected a JSON object, got {type(obj).__name__}")
    docs = {}
    for key in options.json_keys:
        if key not in obj:
            raise _BadLine(f"missing key {key!r} (keys: {sorted(obj)[:5]})")
        if not isinstance(obj[key], str):
            raise _BadLine(f"key {key!r} holds {type(obj[key]).__name__}, expected a string")
        try:
            ids = tok.encode(obj[key])
        except Exception as e:  # noqa: BLE001 - a tokenizer error on one document must not stop the run
            raise _BadLine(f"tokenizer failed on key {key!r}: {type(e).__name__}: {e}") from None
        if ids and options.append_eod:
            ids = ids + [tok.eod]
        docs[key] = ids
    return docs


# ------------------------------------------------------------------------------------------------ driver

def preprocess(options: PreprocessOptions, progress_stream=None) -> PreprocessStats:
    """Run the whole conversion; returns the statistics (also used to report throughput)."""
    if not os.path.isfile(options.input):
        raise FileNotFoundError(f"--input {options.input} does not exist")
    if options.workers < 1 or options.partitions < 1:
        raise ValueError(f"--workers ({options.workers}) and --partitions ({options.partitions}) must be >= 1")
    if os.path.dirname(options.output_prefix):
        os.makedirs(os.path.dirname(options.output_prefix), exist_ok=True)
    tokenizer = build_tokenizer(options.tokenizer, options.vocab_size, options.tokenizer_impl)
    dtype = token_dtype(tokenizer.vocab_size)
    ranges = partition_ranges(options.input, options.partitions)
    start, total = time.monotonic(), PreprocessStats()
    progress = Progress(os.path.getsize(options.input), stream=progress_stream, rated=("tokens",))
    print(f"tokenizer: {options.tokenizer.type}, {tokenizer.backend}; {options.workers} worker"
          f"{'s' if options.workers > 1 else ''}", file=progress.stream, flush=True)
    pool = (multiprocessing.Pool(options.workers, initializer=_init_worker, initargs=(options,))
            if options.workers > 1 else None)
    if pool is None:
        _init_worker(options, tokenizer)
    try:
        if len(ranges) == 1:
            total.add(_convert_range(options, ranges[0], {k: output_prefix(options.output_prefix, k)
                                                          for k in options.json_keys}, dtype, pool, progress))
        else:
            total.add(_convert_partitions(options, ranges, dtype, pool, progress))
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    progress.close()
    total.seconds = time.monotonic() - start
    return total


def _convert_range(options, byte_range, prefixes: dict, dtype, pool, progress) -> PreprocessStats:
    """Tokenize lines in ``byte_range`` into one dataset per key; outputs appear only when complete."""
    stats = PreprocessStats()
    builders = {key: IndexedDatasetBuilder(prefix, dtype) for key, prefix in prefixes.items()}
    try:
        for out, batch_stats in _encoded(read_batches(options.input, byte_range), pool, 4 * options.workers):
            for key, (tokens, lengths) in out.items():
                builders[key].add_documents(tokens, lengths)
            stats.add(batch_stats)
            progress.update(batch_stats.bytes, batch_stats.documents, tokens=batch_stats.tokens,
                            bad_lines=batch_stats.bad_count)
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    return stats


def _encoded(tasks, pool, window: int):
    """Results of ``_encode_batch`` in input order, with at most ``window`` batches in flight, so memory stays
    bounded however large the input (``Pool.imap`` would read the whole file ahead)."""
    if pool is None:
        yield from map(_encode_batch, tasks)
        return
    pending = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_batch, (task,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _convert_partitions(options, ranges, dtype, pool, progress) -> PreprocessStats:
    """Each byte range to its own part files (skipped when already done by an earlier run), then merged."""
    manifest = options.output_prefix + ".partitions.json"
    signature = _signature(options)
    if not os.path.exists(manifest) or _read_json(manifest) != signature:
        _remove_parts(options.output_prefix)
        _write_json(manifest, signature)
    total = PreprocessStats()
    for k, byte_range in enumerate(ranges):
        tag = f"{options.output_prefix}.part{k:04d}-of-{len(ranges):04d}"
        prefixes = {key: f"{tag}_{key}" for key in options.json_keys}
        if os.path.exists(tag + ".done.json"):
            done = PreprocessStats(**_read_json(tag + ".done.json"))
            progress.update(done.bytes, done.documents, tokens=done.tokens, bad_lines=done.bad_count)
        else:
            progress.label = f"[part {k + 1}/{len(ranges)}] "
            done = _convert_range(options, byte_range, prefixes, dtype, pool, progress)
            _write_json(tag + ".done.json", dataclasses.asdict(done))
        total.add(done)
    for key in options.json_keys:
        with IndexedDatasetBuilder(output_prefix(options.output_prefix, key), dtype) as merged:
            for k in range(len(ranges)):
                merged.add_index(f"{options.output_prefix}.part{k:04d}-of-{len(ranges):04d}_{key}")
            merged.finalize()
    _remove_parts(options.output_prefix)
    return total


def _signature(options: PreprocessOptions) -> dict:
    st = os.stat(options.input)
    return {"input": os.path.abspath(options.input), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer": dataclasses.asdict(options.tokenizer), "vocab_size": options.vocab_size,
            "json_keys": list(options.json_keys), "append_eod": options.append_eod, "partitions": options.partitions}


def _remove_parts(prefix: str) -> None:
    for path in glob.glob(glob.escape(prefix) + ".part*-of-*") + glob.glob(glob.escape(prefix) + ".partitions.json"):
        os.remove(path)


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, value) -> None:
    with atomic_open(path, encoding="utf-8") as f:
        json.dump(value, f)


def write_bad_line_report(stats: PreprocessStats, path: str) -> None:
    """All kept bad lines, one ``line N: reason`` a line, for the person fixing the corpus."""
    with open(path, "w") as f:
        for line_no, reason in stats.bad_lines:
            f.write(f"line {line_no}: {reason}\n")
        if stats.bad_count > len(stats.bad_lines):
            f.write(f"... and {stats.bad_count - len(stats.bad_lines):,} more\n")
