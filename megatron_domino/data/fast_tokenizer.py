"""The optional fast path: encoding through HF ``tokenizers`` (Rust) instead of Python.

Preprocessing a large corpus is bound by the tokenizer. The Python implementations stay the reference
(``gpt2_bpe.py`` on ``regex``; transformers' Python API for an HF tokenizer directory) and the default
when ``tokenizers`` is not installed. With it installed (``pip install megatron_domino[fast]``), ``auto``
takes the Rust path, whose ids are the same: tests/test_data_fast_tokenizer.py checks them on varied text.
"""
from __future__ import annotations

IMPLS = ("auto", "python", "rust")
_INSTALL_HINT = "pip install megatron_domino[fast] (or pip install tokenizers)"


def tokenizers_version() -> str | None:
    """The installed ``tokenizers`` version, or None when it cannot be imported."""
    try:
        import tokenizers
    except ImportError:
        return None
    return tokenizers.__version__


def use_rust(impl: str) -> bool:
    """Whether ``impl`` means the Rust path: ``auto`` when ``tokenizers`` imports, ``rust`` always (an error
    naming the fix when it does not import), ``python`` never."""
    if impl not in IMPLS:
        raise ValueError(f"tokenizer implementation {impl!r} is unknown; use one of {', '.join(IMPLS)}")
    if impl == "python":
        return False
    if tokenizers_version() is not None:
        return True
    if impl == "rust":
        raise ValueError(f"tokenizer implementation 'rust' needs the tokenizers package, which does not import; "
                         f"{_INSTALL_HINT}, or use 'auto' / 'python'")
    return False


def rust_name() -> str:
    """How logs name the Rust path."""
    return f"rust (tokenizers {tokenizers_version()})"


def python_fallback_note(impl: str) -> str:
    """The fix, for the log line, when ``auto`` stayed on Python because ``tokenizers`` does not import."""
    return f"; {_INSTALL_HINT} for the rust path" if impl == "auto" and tokenizers_version() is None else ""


def rust_byte_level_bpe(encoder: dict[str, int], ranks: dict[tuple[str, str], int], special_tokens):
    """A ``tokenizers.Tokenizer`` with GPT-2's settings, from the vocab and merge ranks ``gpt2_bpe`` read.

    Sharing the parsed tables (not re-reading the files) means both paths see one vocabulary and one merge
    order. GPT-2 adds no prefix space and splits words with the same pattern as ``gpt2_bpe``; special tokens
    written literally in the text map to their own id, as there.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    merges = sorted(ranks, key=ranks.__getitem__)
    try:
        tok = Tokenizer(models.BPE(vocab=dict(encoder), merges=merges))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception for inconsistent tables
        raise ValueError(f"tokenizers cannot build the GPT-2 BPE from these vocab/merges files ({e}); fix the files "
                         f"or use tokenizer implementation 'python'") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok
