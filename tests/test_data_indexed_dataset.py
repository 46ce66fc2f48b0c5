"""MMIDIDX: byte-exact layout (assembled here with struct from the published format), round trip, errors."""
import os
import pickle
import struct

import numpy as np
import pytest

from megatron_domino.config.errors import DataError
from megatron_domino.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, token_dtype

DOCS = [[5, 6, 7], [1], [9, 9, 9, 9, 9], [2, 3]]


def expected_index_bytes(dtype_code: int, itemsize: int, sizes: list, doc_index: list) -> bytes:
    """The .idx as Megatron-LM writes it, assembled field by field."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_index))
    out += struct.pack(f"<{len(sizes)}i", *sizes)
    pointers, offset = [], 0
    for size in sizes:
        pointers.append(offset)
        offset += size * itemsize
    out += struct.pack(f"<{len(pointers)}q", *pointers)
    out += struct.pack(f"<{len(doc_index)}q", *doc_index)
    return out


def build(prefix, docs, dtype):
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()


@pytest.mark.parametrize("vocab, code, itemsize", [(50257, 8, 2), (128256, 4, 4)])
def test_bytes_match_the_format_exactly(tmp_path, vocab, code, itemsize):
    dtype = token_dtype(vocab)
    build(tmp_path / "d", DOCS, dtype)
    sizes = [len(d) for d in DOCS]
    assert (tmp_path / "d.idx").read_bytes() == expected_index_bytes(code, itemsize, sizes, [0, 1, 2, 3, 4])
    fmt = "<" + ("H" if itemsize == 2 else "i") * sum(sizes)
    assert (tmp_path / "d.bin").read_bytes() == struct.pack(fmt, *[t for d in DOCS for t in d])


def test_round_trip_and_document_structure(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16) as builder:
        builder.add_document([1, 2, 3, 4, 5], sequence_lengths=[2, 3])  # one document, two sequences
        builder.add_documents(np.array([7, 8, 9, 10]), np.array([1, 3]))
        builder.finalize()
    ds = IndexedDataset(str(tmp_path / "d"))
    assert len(ds) == 4 and ds.num_documents == 3
    assert [ds[i].tolist() for i in range(4)] == [[1, 2], [3, 4, 5], [7], [8, 9, 10]]
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    assert ds.get(3, 1, 2).tolist() == [9, 10]
    assert (tmp_path / "d.idx").read_bytes() == expected_index_bytes(8, 2, [2, 3, 1, 3], [0, 2, 3, 4])
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[1].tolist() == [3, 4, 5]
    with pytest.raises(IndexError):
        ds.get(0, 1, 5)


def test_reads_an_index_assembled_by_hand(tmp_path):
    """A file written by another tool (here: by hand, int32 tokens) loads."""
    sizes, tokens = [2, 4], [100000, 5, 6, 7, 8, 9]
    (tmp_path / "x.idx").write_bytes(expected_index_bytes(4, 4, sizes, [0, 2]))
    (tmp_path / "x.bin").write_bytes(struct.pack("<6i", *tokens))
    ds = IndexedDataset(str(tmp_path / "x"))
    assert ds.dtype == np.int32 and ds.num_documents == 1
    assert ds[0].tolist() == [100000, 5] and ds[1].tolist() == [6, 7, 8, 9]


def test_merge_with_add_index(tmp_path):
    build(tmp_path / "a", DOCS[:2], np.uint16)
    build(tmp_path / "b", DOCS[2:], np.uint16)
    with IndexedDatasetBuilder(str(tmp_path / "m"), np.uint16) as builder:
        builder.add_index(str(tmp_path / "a"))
        builder.add_index(str(tmp_path / "b"))
        builder.finalize()
    build(tmp_path / "direct", DOCS, np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("m" + ext)).read_bytes() == (tmp_path / ("direct" + ext)).read_bytes()


def test_an_aborted_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16) as builder:
            builder.add_document([1, 2])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_truncated_and_corrupt_files_give_clear_errors(tmp_path):
    build(tmp_path / "d", DOCS, np.uint16)
    idx, data = (tmp_path / "d.idx").read_bytes(), (tmp_path / "d.bin").read_bytes()

    def check(idx_bytes, bin_bytes, match):
        (tmp_path / "d.idx").write_bytes(idx_bytes)
        (tmp_path / "d.bin").write_bytes(bin_bytes)
        with pytest.raises(ValueError, match=match):
            IndexedDataset(str(tmp_path / "d"))

    check(idx[:20], data, "shorter than the 34-byte MMIDIDX header")
    check(idx[:-5], data, "truncated or corrupt")
    check(b"TNTIDX\x00\x00\x00" + idx[9:], data, "not a Megatron MMIDIDX index")
    check(idx[:9] + struct.pack("<Q", 2) + idx[17:], data, "index version 2")
    check(idx[:17] + b"\x63" + idx[18:], data, "dtype code 99")
    check(idx, data[:-3], "the .bin is truncated")
    bad_docs = bytearray(idx)
    bad_docs[-8:] = struct.pack("<q", 7)
    check(bytes(bad_docs), data, "document index must run from 0 to 4")
    os.remove(tmp_path / "d.bin")
    with pytest.raises(FileNotFoundError, match="d.bin not found"):
        IndexedDataset(str(tmp_path / "d"))


def test_a_bin_paired_with_another_index_is_refused_naming_both_files(tmp_path):
    build(tmp_path / "a", DOCS, np.uint16)
    build(tmp_path / "b", DOCS + [[4, 4, 4]], np.uint16)
    os.replace(tmp_path / "b.bin", tmp_path / "a.bin")  # a.idx now describes 3 tokens fewer than a.bin holds
    with pytest.raises(DataError) as error:  # a known error: reported as a short block, no traceback
        IndexedDataset(str(tmp_path / "a"))
    message = str(error.value)
    assert f"{tmp_path / 'a.bin'} is 28 bytes but {tmp_path / 'a.idx'} describes 22" in message
    assert "do not belong together" in message and "Fix:" in message


def test_token_dtype_follows_megatron():
    assert token_dtype(1000) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(128256) == np.int32
