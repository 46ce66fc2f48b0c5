"""Make the quick-start dataset: a docstring corpus, a SentencePiece tokenizer, and its .bin/.idx.

    python tools/prepare_quickstart_data.py --output-dir data/quickstart

writes corpus.jsonl (Python's own stdlib docstrings, < 2 MB), tokenizer.model (SentencePiece BPE, 1000
pieces) and corpus_text_document.bin/.idx (EOD appended). Runs in seconds, downloads nothing, and does
nothing when the outputs are already there and were made with the same settings and Python version.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.config.schema import TokenizerConfig  # noqa: E402
from megatron_domino.files import atomic_open  # noqa: E402
from megatron_domino.data.preprocessing import PreprocessOptions, output_prefix, preprocess  # noqa: E402
from megatron_domino.data.quickstart import (  # noqa: E402
    MAX_CORPUS_BYTES,
    QUICKSTART_MODULES,
    corpus_documents,
    train_sentencepiece,
    write_corpus,
)


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
