"""Token ids outside the vocabulary are refused, naming the file, the document and the vocabulary, once per file."""
import os

import numpy as np
import pytest

from megatron_domino.config.errors import DataError
from megatron_domino.data import IndexedDataset, IndexedDatasetBuilder
from megatron_domino.data import token_check

VOCAB = 100


def build(prefix, docs, dtype=np.uint16) -> IndexedDataset:
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()
    return IndexedDataset(str(prefix))


def test_an_id_beyond_the_vocabulary_names_file_document_and_vocabulary(tmp_path):
    # document 2 is empty (no sequence), so the bad document 3 is sequence 2: the message counts documents
    indexed = build(tmp_path / "d", [[1, 2, 3], [4], [], [5, 6, 150, 7], [8]])
    with pytest.raises(DataError) as error:
        token_check.check_token_ids(indexed, VOCAB, str(tmp_path / "cache"))
    message = str(error.value)
    assert f"{tmp_path / 'd.bin'}: document 3" in message and "token id 150" in message
    assert "model.vocab_size = 100" in message and "Fix:" in message and "at least 151" in message


def test_a_negative_id_is_refused(tmp_path):
    indexed = build(tmp_path / "d", [[1, 2], [3, -4]], dtype=np.int32)
    with pytest.raises(DataError, match="document 1 .* holds token id -4"):
        token_check.check_token_ids(indexed, VOCAB, str(tmp_path / "cache"))


def test_the_pass_runs_once_per_file_and_is_redone_when_it_changes(tmp_path, monkeypatch):
    indexed = build(tmp_path / "d", [[1, 2, 3], [99]])
    passes = []
    real = token_check.token_extremes
    monkeypatch.setattr(token_check, "token_extremes", lambda ds: passes.append(1) or real(ds))
    for _ in range(2):
        token_check.check_token_ids(indexed, VOCAB, str(tmp_path / "cache"))
    assert len(passes) == 1
    indexed = build(tmp_path / "d", [[1, 2, 3], [100]])  # rewritten with the same lengths
    os.utime(tmp_path / "d.bin", ns=(0, 0))  # a different date, however fast the rewrite was
    with pytest.raises(DataError, match="token id 100"):
        token_check.check_token_ids(indexed, VOCAB, str(tmp_path / "cache"))
    assert len(passes) == 2


def test_a_file_without_tokens_passes(tmp_path):
    token_check.check_token_ids(build(tmp_path / "d", [[], []]), VOCAB, str(tmp_path / "cache"))
