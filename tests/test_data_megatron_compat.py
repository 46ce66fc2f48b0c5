"""Cross-check with Megatron-LM's own indexed dataset code, when megatron-core is importable.

Install it without its heavy dependencies to run this: ``pip install --no-deps megatron-core``.
"""
import warnings

import numpy as np
import pytest
import torch

from megatron_domino.data import IndexedDataset, IndexedDatasetBuilder

DOCS = [[5, 6, 7], [1], [9, 9, 9, 9, 9], [2, 3], [40000, 1]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_are_interchangeable_with_megatron(tmp_path, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns that apex / Transformer Engine are missing
        megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    theirs = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for doc in DOCS:
        theirs.add_document(torch.tensor(doc), [len(doc)])
    theirs.finalize(str(tmp_path / "m.idx"))
    with IndexedDatasetBuilder(str(tmp_path / "o"), dtype) as ours:
        for doc in DOCS:
            ours.add_document(doc)
        ours.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"o{ext}").read_bytes()
    read_theirs = IndexedDataset(str(tmp_path / "m"))
    read_ours = megatron_indexed.IndexedDataset(str(tmp_path / "o"))
    assert [read_theirs[i].tolist() for i in range(len(DOCS))] == DOCS
    assert [read_ours[i].tolist() for i in range(len(DOCS))] == DOCS
    assert read_ours.document_indices.tolist() == read_theirs.document_indices.tolist()
