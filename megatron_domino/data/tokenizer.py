"""Tokenizers behind one small interface: ``encode``, ``decode``, ``vocab_size``, ``eod``, ``pad``.

Preprocessing only needs text -> ids; training only needs the special ids (EOD for packing flags) and the
vocabulary size. The type names are Megatron's, so ``--tokenizer-type`` values in existing recipes carry over.
``impl`` chooses between the Python reference and the Rust fast path (``fast_tokenizer.py``); ``backend``
names the one in use, for logs.
"""
from __future__ import annotations

import os

from megatron_domino.config.schema import TOKENIZERS, TokenizerConfig

from .fast_tokenizer import python_fallback_note, rust_name, use_rust


class BaseTokenizer:
    """What every tokenizer offers. ``eod`` ends a document; ``pad`` fills (equal to ``eod`` when there is none)."""

    vocab_size: int
    eod: int
    pad: int
    backend: str  # the implementation that encodes, e.g. "python (regex)" or "rust (tokenizers 0.23.3)"

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError


class GPT2BPETokenizer(BaseTokenizer):
    """GPT-2 byte-level BPE (see ``gpt2_bpe.py``); EOD is ``<|endoftext|>``, which also serves as padding.
    The Rust path is built from the tables the Python one read, so both give the same ids."""

    def __init__(self, vocab_file: str, merge_file: str, impl: str = "auto"):
        from .gpt2_bpe import END_OF_TEXT, GPT2BPE
        self._bpe = GPT2BPE(vocab_file, merge_file)
        if END_OF_TEXT not in self._bpe.encoder:
            raise ValueError(f"vocab file {vocab_file} has no {END_OF_TEXT} token, which GPT-2 uses to end documents; "
                             f"add it to vocab.json")
        self.vocab_size = len(self._bpe.encoder)
        self.eod = self.pad = self._bpe.encoder[END_OF_TEXT]
        self._rust = None
        if use_rust(impl):
            from .fast_tokenizer import rust_byte_level_bpe
            self._rust = rust_byte_level_bpe(self._bpe.encoder, self._bpe.ranks, self._bpe.special_tokens)
            self.backend = rust_name()
        else:
            self.backend = "python (regex)" + python_fallback_note(impl)

    def encode(self, text: str) -> list[int]:
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=False).ids
        return self._bpe.encode(text)

    def decode(self, ids) -> str:
        if self._rust is not None:
            return self._rust.decode([int(i) for i in ids], skip_special_tokens=False)
        return self._bpe.decode(ids)


class SentencePieceTokenizer(BaseTokenizer):
    """A SentencePiece .model (Llama-1/2 style). EOD is the model's EOS; no BOS is added, as in Megatron's type
    of the same name. Padding is the model's pad piece when it has one, else EOS."""

    def __init__(self, model_file: str):
        import sentencepiece
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"SentencePiece model {model_file} has no EOS piece, which ends documents here; "
                             f"train it with eos_id >= 0")
        self.backend = "sentencepiece (C++)"
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


class HuggingFaceTokenizer(BaseTokenizer):
    """Any HF tokenizer (Llama-3's tiktoken-style BPE included): a directory loaded with transformers'
    AutoTokenizer, or a single tokenizer.json loaded with ``tokenizers``. Special tokens are never added by
    ``encode``: documents are packed, and EOD is appended by the preprocessing where asked.

    The Rust path calls the directory's ``backend_tokenizer`` (the ``tokenizers`` object transformers
    configured) directly, skipping transformers' per-call Python work; a tokenizer.json is always Rust."""

    def __init__(self, path: str, impl: str = "auto"):
        rust = use_rust(impl)
        if os.path.isfile(path):
            from tokenizers import Tokenizer
            self._tok = self._rust = Tokenizer.from_file(path)
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
            pad = None
        else:
            from transformers import AutoTokenizer
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self._rust = getattr(self._tok, "backend_tokenizer", None) if rust else None
            if impl == "rust" and self._rust is None:
                raise ValueError(f"HF tokenizer {path} has no tokenizers (Rust) backend (no tokenizer.json); "
                                 f"use tokenizer implementation 'python'")
            self.vocab_size = len(self._tok)
            eos, pad = self._tok.eos_token_id, self._tok.pad_token_id
        self.backend = rust_name() if self._rust is not None else "python (transformers)" + python_fallback_note(impl)
        if eos is None:
            raise ValueError(f"HF tokenizer {path} names no end-of-sequence token (looked for eos_token and "
                             f"{_EOS_CANDIDATES}); set eos_token in its tokenizer_config.json")
        self.eod = int(eos)
        self.pad = int(pad) if pad is not None else self.eod

    def encode(self, text: str) -> list[int]:
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=False).ids
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class NullTokenizer(BaseTokenizer):
    """For data that is already token ids: ``encode`` reads space-separated integers; EOD is the last id."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = self.pad = self.vocab_size - 1
        self.backend = "python"

    def encode(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the NullTokenizer vocabulary [0, {self.vocab_size}); "
                             f"raise the vocab size")
        return ids

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(cfg: TokenizerConfig, vocab_size: int | None = None, impl: str = "auto") -> BaseTokenizer:
    """The tokenizer ``cfg`` names. ``vocab_size`` is required by NullTokenizer; for the others, when given, it is
    the model's vocabulary and must hold every id the tokenizer can produce. ``impl`` (auto, python, rust)
    matters to GPT2BPETokenizer and HuggingFaceTokenizer; the other types have one implementation."""
    kind = cfg.type
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("tokenizer.type=NullTokenizer needs a vocab size (model.vocab_size, or --vocab-size "
                             "for tools/preprocess_data.py): its EOD id is vocab_size - 1")
        return NullTokenizer(vocab_size)
    if kind == "GPT2BPETokenizer":
        _require(cfg, "vocab_file", "--vocab-file", "vocab.json")
        _require(cfg, "merge_file", "--merge-file", "merges.txt")
        tok = GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file, impl)
    elif kind == "SentencePieceTokenizer":
        _require(cfg, "model", "--tokenizer-model", "a SentencePiece .model file")
        tok = SentencePieceTokenizer(cfg.model)
    elif kind == "HuggingFaceTokenizer":
        _require(cfg, "model", "--tokenizer-model", "an HF tokenizer directory or tokenizer.json")
        tok = HuggingFaceTokenizer(cfg.model, impl)
    else:
        raise ValueError(f"tokenizer.type={kind!r} is unknown; use one of {', '.join(TOKENIZERS)}")
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} is smaller than the {kind} vocabulary ({tok.vocab_size}); "
                         f"set model.vocab_size: {tok.vocab_size} (TP padding is added on top automatically)")
    return tok


def _require(cfg: TokenizerConfig, field: str, flag: str, what: str) -> None:
    path = getattr(cfg, field)
    if not path:
        raise ValueError(f"tokenizer.type={cfg.type} needs tokenizer.{field} ({flag}): {what}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer.{field}={path!r} does not exist; point {flag} at {what}")
