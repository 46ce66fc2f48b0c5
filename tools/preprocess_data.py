"""Tokenize a JSONL corpus into Megatron's .bin/.idx format. Flag names are Megatron-LM's, so recipes carry over.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --json-keys text --append-eod --workers 8

writes data/corpus_text_document.bin/.idx. Use --partitions N on large inputs to make the run resumable.
With the tokenizers package (pip install megatron_domino[fast]) GPT-2 BPE and HF tokenizers encode in Rust,
with the same ids as the Python reference; --tokenizer-impl chooses, and the run says which it uses.
Bad arguments exit with status 2 (argparse's usage error); an input that yields no token exits with 1.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.config.schema import TOKENIZERS, TokenizerConfig  # noqa: E402
from megatron_domino.data.fast_tokenizer import IMPLS  # noqa: E402
from megatron_domino.data.tokenizer import build_tokenizer  # noqa: E402
from preprocessing import PreprocessOptions, output_prefix, preprocess, write_bad_line_report  # noqa: E402

_BAD_LINES_SHOWN = 20


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked before any work: the input exists and the tokenizer loads from its flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize, each into its own dataset")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZERS)
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, or HF tokenizer directory / tokenizer.json")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: vocabulary size (EOD is vocab_size - 1)")
    p.add_argument("--tokenizer-impl", choices=IMPLS, default="auto",
                   help="GPT2BPETokenizer and HF directories: 'rust' encodes with the tokenizers package (same ids; "
                        "faster on text of many distinct words, slower than the regex path's word cache on typical "
                        "prose: see docs/data.md), 'python' with the reference (regex / transformers); "
                        "'auto' (default) takes rust when tokenizers imports")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's EOD id")
    p.add_argument("--workers", type=_positive, default=1, help="tokenizer processes")
    p.add_argument("--partitions", type=_positive, default=1,
                   help="cut the input into this many ranges, each kept when done, so a rerun resumes")
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    try:
        build_tokenizer(_tokenizer_config(args), args.vocab_size, args.tokenizer_impl)
    except (ValueError, OSError) as error:
        p.error(str(error))
    return args


def _tokenizer_config(args) -> TokenizerConfig:
    return TokenizerConfig(type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           model=args.tokenizer_model)


def main(argv=None) -> int:
    args = parse_args(argv)
    options = PreprocessOptions(
        input=args.input, output_prefix=args.output_prefix, tokenizer=_tokenizer_config(args),
        vocab_size=args.vocab_size, json_keys=tuple(args.json_keys), append_eod=args.append_eod,
        workers=args.workers, partitions=args.partitions, tokenizer_impl=args.tokenizer_impl)
    stats = preprocess(options)
    print(stats.summary())
    _report_bad_lines(stats, options.output_prefix)
    if not stats.tokens:
        print(f"error: {options.input} gave no tokens ({stats.lines:,} lines: {stats.bad_count:,} bad, "
              f"{stats.blank_lines:,} blank, {stats.empty_documents:,} empty documents), so the dataset written is "
              f"empty. Fix: check --input and --json-keys {' '.join(options.json_keys)}", file=sys.stderr)
        return 1
    for key in options.json_keys:
        print(f"wrote {output_prefix(options.output_prefix, key)}.bin/.idx")
    return 0


def _report_bad_lines(stats, prefix: str) -> None:
    """The first bad lines on the console, all of them in PREFIX_bad_lines.txt."""
    if stats.bad_count:
        report = prefix + "_bad_lines.txt"
        write_bad_line_report(stats, report)
        print(f"{stats.bad_count:,} bad lines skipped; first ones:", file=sys.stderr)
        for line_no, reason in stats.bad_lines[:_BAD_LINES_SHOWN]:
            print(f"  line {line_no}: {reason}", file=sys.stderr)
        print(f"all of them: {report}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
