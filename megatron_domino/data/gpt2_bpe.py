"""GPT-2 byte-level BPE from vocab.json + merges.txt, with ids identical to HF's GPT2Tokenizer.

Written on ``regex`` so that users without ``tokenizers`` still get exactly the ids that Megatron and HF
produce from the same two files. Every byte of the input maps to one printable "byte symbol", the text is
cut into words by GPT-2's pre-tokenization pattern, and each word is merged pair by pair in merge-rank order.
Words repeat a lot in real text, so the ids of each word are cached.
"""
from __future__ import annotations

import json
from functools import lru_cache

import regex

# GPT-2's pre-tokenization: contractions, letter runs, digit runs, other symbols, and whitespace that is
# kept apart from the next word (so " word" keeps its leading space).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
END_OF_TEXT = "<|endoftext|>"
_CACHE_LIMIT = 1 << 19  # words; cleared when full so memory stays bounded on huge corpora


@lru_cache(maxsize=1)
def byte_symbols() -> list[str]:
    """The printable character standing for each byte value 0..255.

    Printable Latin-1 bytes stand for themselves; the rest (control characters, space, and a few
    others) are shifted to code points 256 and up, in byte order, so that no symbol is whitespace.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(
        range(ord("®"), ord("ÿ") + 1))
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


class GPT2BPE:
    """Byte-level BPE encoder/decoder loaded from a GPT-2 style vocab.json and merges.txt."""

    def __init__(self, vocab_file: str, merge_file: str):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {i: tok for tok, i in self.encoder.items()}
        self.ranks = _read_merges(merge_file)
        symbols = byte_symbols()
        missing = [f"0x{b:02x}" for b, s in enumerate(symbols) if s not in self.encoder]
        if missing:
            raise ValueError(f"vocab file {vocab_file} lacks byte-level symbols for bytes {missing[:8]}: a GPT-2 "
                             f"byte-level vocab holds all 256; re-export the vocab with its full byte alphabet")
        self._latin1_to_symbol = {i: s for i, s in enumerate(symbols)}
        self._byte_of_symbol = {s: i for i, s in enumerate(symbols)}
        self._split = regex.compile(GPT2_SPLIT_PATTERN)
        self.special_tokens = {t: self.encoder[t] for t in (END_OF_TEXT,) if t in self.encoder}
        self._special_split = (regex.compile("(" + "|".join(regex.escape(t) for t in self.special_tokens) + ")")
                               if self.special_tokens else None)
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special tokens written literally (``<|endoftext|>``) map to their own id, as in HF."""
        if self._special_split is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for i, part in enumerate(self._special_split.split(text)):
            if i % 2:
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(self._encode_ordinary(part))
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for word in self._split.findall(text):
            word_ids = cache.get(word)
            if word_ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                symbols = word.encode("utf-8").decode("latin-1").translate(self._latin1_to_symbol)
                word_ids = cache[word] = [self.encoder[piece] for piece in self._merge(symbols)]
            ids.extend(word_ids)
        return ids

    def _merge(self, symbols: str) -> list[str]:
        """Apply merges to one word: repeatedly join the adjacent pair of lowest rank, everywhere it occurs."""
        parts = list(symbols)
        ranks = self.ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            first, second = best
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def decode(self, ids) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 decode to U+FFFD, like HF's ``errors='replace'``."""
        out, pending = [], bytearray()
        for i in ids:
            token = self.decoder[int(i)]
            if token in self.special_tokens:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                out.append(token)
            else:
                pending.extend(self._byte_of_symbol[c] for c in token)
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def _read_merges(merge_file: str) -> dict[tuple[str, str], int]:
    """Merge ranks from merges.txt: one ``a b`` pair a line, after an optional ``#version`` header."""
    ranks: dict[tuple[str, str], int] = {}
    with open(merge_file, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line or (line_no == 1 and line.startswith("#version")):
                continue
            pair = line.split(" ")
            if len(pair) != 2:
                raise ValueError(f"{merge_file}:{line_no}: expected two space-separated symbols, got {line!r}; "
                                 f"is this a GPT-2 merges.txt?")
            ranks.setdefault((pair[0], pair[1]), len(ranks))
    return ranks
