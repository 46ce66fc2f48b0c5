"""Megatron's MMIDIDX indexed dataset (version 1): a flat token file (.bin) and an index (.idx), memory-mapped.

Files written by Megatron-LM's tools load here and files written here load there, so the layout is kept
byte for byte. The .idx holds, little-endian:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version (1)
    <B        dtype code of the tokens in .bin (Megatron's codes, DTYPE_BY_CODE)
    <Q        sequence count N
    <Q        document-index count D (= documents + 1)
    int32[N]  sequence lengths in tokens
    int64[N]  sequence byte offsets into .bin
    int64[D]  document index: document k is sequences [doc[k], doc[k+1]); starts with 0, ends with N

A "sequence" is what Megatron's GPT dataset packs; with one sequence per document (no sentence splitting)
sequences and documents coincide, except that an empty document has no sequence (as Megatron's writer
leaves it), so that document k stays line k + 1 of the corpus. The .bin holds exactly the tokens the index
describes; any other size means the two files do not belong together.
"""
from __future__ import annotations

import os
import struct
from array import array

import numpy as np

from megatron_domino.config.errors import DataError
from megatron_domino.files import publish

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
DTYPE_BY_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                 8: np.uint16}
CODE_BY_DTYPE = {np.dtype(t): code for code, t in DTYPE_BY_CODE.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice of token storage: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def index_path(prefix: str) -> str:
    return prefix + ".idx"


def data_path(prefix: str) -> str:
    return prefix + ".bin"


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx. ``ds[i]`` is sequence i as a numpy array (a view into the mmap)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_file, bin_file = index_path(prefix), data_path(prefix)
        for path in (idx_file, bin_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found: a dataset prefix needs both {prefix}.bin and .idx; make "
                                        f"them with tools/preprocess_data.py --output-prefix ...")
        with open(idx_file, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise DataError(f"{idx_file} is truncated: {len(header)} bytes, shorter than the {HEADER_BYTES}-byte "
                             f"MMIDIDX header; re-run the preprocessing")
        if header[:len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise DataError(f"{idx_file} is not a Megatron MMIDIDX index (starts with {header[:9]!r}, expected "
                             f"{INDEX_MAGIC!r}); the old 'cached'/'lazy' formats are not supported, re-run the "
                             f"preprocessing")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise DataError(f"{idx_file} has index version {version}; only version {INDEX_VERSION} is supported")
        if code not in DTYPE_BY_CODE:
            raise DataError(f"{idx_file} has dtype code {code}; known codes are {sorted(DTYPE_BY_CODE)}")
        self.dtype = np.dtype(DTYPE_BY_CODE[code])
        expected = HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
        actual = os.path.getsize(idx_file)
        if actual not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal mode bytes, ignored here
            raise DataError(f"{idx_file} is {actual} bytes but its header ({n_seq} sequences, {n_doc} document "
                             f"entries) needs {expected}: the file is truncated or corrupt; re-run the preprocessing")
        if n_doc == 0:
            raise DataError(f"{idx_file} has an empty document index (it always starts with 0); the file is corrupt")
        index = np.memmap(idx_file, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(index, np.int32, n_seq, HEADER_BYTES)
        self.pointers = np.frombuffer(index, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)
        self.document_indices = np.frombuffer(index, np.int64, n_doc, HEADER_BYTES + 12 * n_seq)
        self._index = index
        if self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise DataError(f"{idx_file}: the document index must run from 0 to {n_seq} but runs from "
                             f"{self.document_indices[0]} to {self.document_indices[-1]}; the file is corrupt")
        need = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n_seq else 0
        have = os.path.getsize(bin_file)
        if have != need:
            what = "the .bin is truncated" if have < need else "the .bin holds more than its index describes"
            raise DataError(f"{bin_file} is {have} bytes but {idx_file} describes {need} ({n_seq} sequences of "
                            f"{self.dtype}): {what}, so the two files do not belong together or one is damaged. "
                            f"Fix: keep each .bin with the .idx written beside it, or re-run the preprocessing")
        self._data = np.memmap(bin_file, dtype=np.uint8, mode="r") if have else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def tokens(self) -> np.ndarray:
        """Every token of the .bin, sequences back to back (a view into the mmap)."""
        return np.frombuffer(self._data, self.dtype)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when ``length`` is None)."""
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {i} of length {size}")
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._data, self.dtype, length, start)

    def __getstate__(self):
        return self.prefix  # re-open the maps in the receiving process instead of pickling their contents

    def __setstate__(self, prefix):
        self.__init__(prefix)


def write_index(path: str, dtype, sizes, document_indices) -> None:
    """Write an MMIDIDX .idx for sequences of ``sizes`` tokens stored back to back as ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_BY_DTYPE:
        raise ValueError(f"token dtype {dtype} has no MMIDIDX code; use one of {sorted(map(str, CODE_BY_DTYPE))}")
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    documents = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<QBQQ", INDEX_VERSION, CODE_BY_DTYPE[dtype], len(sizes), len(documents)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(documents.tobytes())


class IndexedDatasetBuilder:
    """Writes PREFIX.bin/.idx. Everything goes to temporary names first; ``finalize`` renames them, so a reader
    never sees a half-written dataset. Use as a context manager: an exception removes the temporaries."""

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp, self._idx_tmp = data_path(prefix) + suffix, index_path(prefix) + suffix
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = array("i")
        self._documents = array("q", [0])

    def add_document(self, tokens, sequence_lengths=None) -> None:
        """One document; ``sequence_lengths`` cuts it into several sequences (default: one, none when empty)."""
        tokens = np.asarray(tokens, dtype=self.dtype)
        lengths = ([len(tokens)] if len(tokens) else []) if sequence_lengths is None else list(sequence_lengths)
        if sum(lengths) != len(tokens):
            raise ValueError(f"sequence lengths sum to {sum(lengths)} but the document has {len(tokens)} tokens")
        self._bin.write(tokens.tobytes())
        self._sizes.extend(lengths)
        self._documents.append(len(self._sizes))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many documents at once: ``tokens`` is their concatenation, ``lengths`` their sizes; each is one
        sequence, an empty one none (its document-index entry repeats the previous one)."""
        tokens = np.asarray(tokens, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"document lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        start = len(self._sizes)
        self._bin.write(tokens.tobytes())
        self._sizes.extend(lengths[lengths > 0].astype(np.int32).tolist())
        self._documents.extend((start + np.cumsum(lengths > 0)).tolist())

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (used to merge preprocessing partitions)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} (tokens {other.dtype}) into a {self.dtype} dataset")
        start = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._documents.extend((other.document_indices[1:] + start).tolist())
        with open(data_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self) -> None:
        """Write the index, then move both files to their final names (.bin first, .idx last)."""
        self._bin.close()
        write_index(self._idx_tmp, self.dtype, np.frombuffer(self._sizes, np.int32), self._documents)
        publish(self._bin_tmp, data_path(self.prefix))
        publish(self._idx_tmp, index_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
