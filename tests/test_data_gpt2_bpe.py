"""GPT-2 byte-level BPE against HF's GPT2Tokenizer, both loaded from the same vocab.json/merges.txt.

The files are trained here with the ``tokenizers`` library on generated text (no download). The reference
is HF's own implementation; ours shares no code with it.
"""
import random
import unicodedata

import pytest

from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import build_tokenizer
from megatron_domino.data.gpt2_bpe import GPT2BPE, byte_symbols

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

WORDS = ("the of and to in is was it for on that with as by at from his an were are which this be or have had one "
         "not but all they their there been has when who will more no if out so said what up its about into than "
         "them can only other new some could time these two may then do first any my now such like our over man "
         "even most made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "\u2019s", "'", "''"]
SPACES = [" ", "  ", "\t", "\n", "\n\n", " \n", "\r\n", "\u00a0", "\u3000", "   \t ", "\u2028", "\x0b", "\x0c",
          "\u200b", "\u1680", "\u2003 "]
FOREIGN = ["café", "naïve", "Straße", "日本語", "中文字符", "Привет", "мир", "مرحبا", "नमस्ते", "한국어", "ελληνικά",
           "עברית", "ñandú", "e\u0301", "ﬁ", "Ⅻ", "²³", "١٢٣", "๑๒", "İstanbul", "ǅ"]
EMOJI = ["🎉", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🤖", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "😀😃"]


def _random_char(rng: random.Random) -> str:
    """A random code point from all planes, skipping surrogates and characters unassigned in Python's Unicode
    database: the newest assignments (Unicode 17) are letters to ``regex`` but not yet to HF's Rust regex
    tables, a library version skew rather than a tokenizer difference."""
    while True:
        cp = rng.choice([rng.randint(0, 0x1F), rng.randint(0x20, 0x2FF), rng.randint(0x300, 0x2FFF),
                         rng.randint(0x3000, 0xD7FF), rng.randint(0xE000, 0xFFFD), rng.randint(0x10000, 0x10FFFF)])
        if not 0xD800 <= cp <= 0xDFFF and unicodedata.category(chr(cp)) != "Cn":
            return chr(cp)


def random_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(0, 14)):
        r = rng.random()
        if r < 0.33:
            word = rng.choice(WORDS)
            pieces.append(rng.choice([word, word.capitalize(), word.upper()]))
        elif r < 0.43:
            pieces.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        elif r < 0.50:
            pieces.append(rng.choice(CONTRACTIONS))
        elif r < 0.60:
            pieces.append(rng.choice(SPACES))
        elif r < 0.68:
            pieces.append(rng.choice(".,;:!?-_()[]{}<>/\\\"@#$%^&*~`|+=") * rng.randint(1, 3))
        elif r < 0.76:
            pieces.append(rng.choice(FOREIGN))
        elif r < 0.82:
            pieces.append(rng.choice(EMOJI))
        elif r < 0.84:
            pieces.append("<|endoftext|>")
        elif r < 0.94:
            pieces.append("".join(_random_char(rng) for _ in range(rng.randint(1, 3))))
        else:
            pieces.append(rng.choice(WORDS) + rng.choice(WORDS))
        if rng.random() < 0.6:
            pieces.append(" ")
    return "".join(pieces)


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    rng = random.Random(0)
    corpus = [random_text(rng) for _ in range(3000)]
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus, vocab_size=3000, min_frequency=2, special_tokens=["<|endoftext|>"])
    directory = tmp_path_factory.mktemp("gpt2_bpe")
    trainer.save_model(str(directory))
    return directory


def test_ids_equal_hf_gpt2_tokenizer_on_10k_strings(bpe_files):
    hf = transformers.GPT2Tokenizer.from_pretrained(str(bpe_files))
    ours = GPT2BPE(str(bpe_files / "vocab.json"), str(bpe_files / "merges.txt"))
    assert len(ours.ranks) > 1000  # a real merge table, not a byte-only vocab
    rng = random.Random(1)
    texts = [random_text(rng) for _ in range(10_000)] + ["", " ", "\n\n\n", "  leading", "trailing  ", "a\tb",
                                                          "<|endoftext|><|endoftext|>", "x<|endoftext|>y", "'s's"]
    expected = hf(texts)["input_ids"]
    mismatches = [(t, e, ours.encode(t)) for t, e in zip(texts, expected) if ours.encode(t) != e]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"
    for text, ids in zip(texts[:2000], expected):
        assert ours.decode(ids) == hf.decode(ids) == text


def test_build_tokenizer_gives_gpt2_specials(bpe_files):
    tok = build_tokenizer(TokenizerConfig(type="GPT2BPETokenizer", vocab_file=str(bpe_files / "vocab.json"),
                                          merge_file=str(bpe_files / "merges.txt")))
    hf = transformers.GPT2Tokenizer.from_pretrained(str(bpe_files))
    assert tok.eod == tok.pad == hf.eos_token_id
    assert tok.vocab_size == len(hf)
    assert tok.encode("hello<|endoftext|>") == tok.encode("hello") + [tok.eod]


def test_byte_symbols_are_a_printable_bijection():
    symbols = byte_symbols()
    assert len(set(symbols)) == 256
    assert all(not s.isspace() and s.isprintable() for s in symbols)
    assert symbols[ord("A")] == "A" and symbols[ord(" ")] == "\u0120"  # GPT-2's well-known 'Ġ' for space


def test_bad_files_are_reported(tmp_path, bpe_files):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt:2"):
        GPT2BPE(str(bpe_files / "vocab.json"), str(merges))
    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"a": 0}', encoding="utf-8")
    with pytest.raises(ValueError, match="byte-level symbols"):
        GPT2BPE(str(vocab), str(bpe_files / "merges.txt"))
    with pytest.raises(FileNotFoundError, match="vocab_file"):
        build_tokenizer(TokenizerConfig(type="GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"),
                                        merge_file=str(merges)))
