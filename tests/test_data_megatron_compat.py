"""Cross-check with Megatron-LM's own indexed dataset code, when megatron-core is importable.

Install it without its heavy dependencies to run this: ``pip install --no-deps megatron-core``.
"""
import json
import warnings

import numpy as np
import pytest
import torch

from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import IndexedDataset, IndexedDatasetBuilder
from tests.tools import load_tool

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


def test_preprocess_writes_what_megatrons_tool_writes_for_empty_documents(tmp_path):
    """tools/preprocess_data.py against Megatron-LM's: its ``Encoder.encode`` gives an empty text no sequence
    and no EOD, and ``process_json_file`` still adds the document, so document k is line k + 1."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    texts = ["5 6 7", "", "1", "", "", "9 9"]
    vocab, eod = 100, 99
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocessing = load_tool("preprocessing")
    preprocessing.preprocess(preprocessing.PreprocessOptions(
        input=str(tmp_path / "c.jsonl"), output_prefix=str(tmp_path / "o"),
        tokenizer=TokenizerConfig(type="NullTokenizer"), vocab_size=vocab, append_eod=True))
    theirs = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for text in texts:  # Megatron's tool, step by step, with NullTokenizer's ids
        ids = [int(x) for x in text.split()]
        theirs.add_document(ids + [eod] if ids else [], [len(ids) + 1] if ids else [])
    theirs.finalize(str(tmp_path / "m.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"o_text_document{ext}").read_bytes()
    ours = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ours.num_documents == len(texts) and ours.document_indices.tolist() == [0, 1, 1, 2, 2, 2, 3]
