"""Quick-start data: small, deterministic, idempotent, and its .bin/.idx decodes back to the corpus."""
import json
import os

from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import IndexedDataset, build_tokenizer
from tests.tools import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prepare_quickstart_data(tmp_path, capsys):
    out = tmp_path / "qs"
    tool = load_tool("prepare_quickstart_data")
    assert tool.main(["--output-dir", str(out)]) == 0
    corpus = out / "corpus.jsonl"
    assert os.path.getsize(corpus) < 2 * 2**20
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert texts == tool.corpus_documents() and len(texts) > 500

    tok = build_tokenizer(TokenizerConfig(type="SentencePieceTokenizer", model=str(out / "tokenizer.model")),
                          vocab_size=1024)
    assert tok.vocab_size == 1000
    ds = IndexedDataset(str(out / "corpus_text_document"))
    assert ds.dtype.name == "uint16" and len(ds) == len(texts)
    for i in range(0, len(texts), 50):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == texts[i]

    stamp = os.path.getmtime(out / "corpus_text_document.bin")
    capsys.readouterr()
    assert tool.main(["--output-dir", str(out)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert os.path.getmtime(out / "corpus_text_document.bin") == stamp
