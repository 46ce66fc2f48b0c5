"""JSONL -> .bin/.idx: bad lines counted with their numbers, complete outputs, workers, resumable partitions."""
import json
import os
import random

import pytest

from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import IndexedDataset
from tests.tools import load_tool

preprocessing = load_tool("preprocessing")

VOCAB = 1000  # NullTokenizer: text is space-separated ids, EOD = 999
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path, n_docs=300, seed=0):
    """Good documents with a few bad lines mixed in; returns (expected docs in order, bad line numbers)."""
    rng = random.Random(seed)
    lines, good, bad = [], [], {}
    for i in range(n_docs):
        ids = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 40))]
        good.append(ids)
        lines.append(json.dumps({"text": " ".join(map(str, ids)), "meta": i}).encode())
        if i % 50 == 7:
            bad[len(lines) + 1] = "invalid JSON"
            lines.append(b'{"text": "1 2 3"')
        if i % 50 == 21:
            bad[len(lines) + 1] = "missing key 'text'"
            lines.append(b'{"body": "1 2"}')
        if i % 100 == 33:
            bad[len(lines) + 1] = "holds int"
            lines.append(b'{"text": 12}')
            bad[len(lines) + 1] = "not UTF-8"
            lines.append(b'{"text": "\xff\xfe"}')
            bad[len(lines) + 1] = "expected a JSON object"
            lines.append(b"[1, 2]")
            bad[len(lines) + 1] = "tokenizer failed"
            lines.append(b'{"text": "5 abc"}')
            lines.append(b"   ")  # blank: skipped, not bad
            lines.append(b'{"text": ""}')  # empty document: kept, with no sequence (as Megatron-LM writes it)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return good, bad


def options(tmp_path, **kw):
    base = dict(input=str(tmp_path / "corpus.jsonl"), output_prefix=str(tmp_path / "out" / "corpus"),
                tokenizer=TokenizerConfig(type="NullTokenizer"), vocab_size=VOCAB, append_eod=True)
    return preprocessing.PreprocessOptions(**{**base, **kw})


def read(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("workers", [1, 2])
def test_end_to_end_with_bad_lines(tmp_path, workers):
    good, bad = write_corpus(tmp_path / "corpus.jsonl")
    stats = preprocessing.preprocess(options(tmp_path, workers=workers))
    prefix = str(tmp_path / "out" / "corpus_text_document")
    assert read(prefix) == [ids + [VOCAB - 1] for ids in good]  # the sequences: no EOD alone for an empty one
    empty = 3
    assert IndexedDataset(prefix).num_documents == len(good) + empty
    assert stats.documents == len(good) + empty and stats.tokens == sum(len(d) + 1 for d in good)
    assert stats.bad_count == len(bad)
    assert [n for n, _ in stats.bad_lines] == sorted(bad)
    for line_no, reason in stats.bad_lines:
        assert bad[line_no] in reason
    assert stats.blank_lines == 3 and stats.empty_documents == empty
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_without_eod_and_with_two_keys(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"text": "1 2", "title": "7"}\n{"text": "3", "title": "8 9"}\n')
    preprocessing.preprocess(options(tmp_path, json_keys=("text", "title"), append_eod=False))
    assert read(str(tmp_path / "out" / "corpus_text_document")) == [[1, 2], [3]]
    assert read(str(tmp_path / "out" / "corpus_title_document")) == [[7], [8, 9]]


def test_partitions_resume_after_an_interruption(tmp_path, monkeypatch):
    good, bad = write_corpus(tmp_path / "corpus.jsonl", n_docs=400, seed=1)
    preprocessing.preprocess(options(tmp_path, output_prefix=str(tmp_path / "ref" / "corpus")))
    real_convert, calls = preprocessing._convert_range, []

    def failing_on_third_range(opts, byte_range, *args):
        calls.append(byte_range)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_convert(opts, byte_range, *args)

    monkeypatch.setattr(preprocessing, "_convert_range", failing_on_third_range)
    with pytest.raises(KeyboardInterrupt):
        preprocessing.preprocess(options(tmp_path, partitions=4))
    assert not os.path.exists(tmp_path / "out" / "corpus_text_document.idx")  # nothing final yet
    first_two = calls[:2]
    calls.clear()
    stats = preprocessing.preprocess(options(tmp_path, partitions=4))
    assert len(calls) == 2 and not set(calls) & set(first_two)  # finished ranges were not redone
    assert stats.bad_count == len(bad) and [n for n, _ in stats.bad_lines] == sorted(bad)
    for ext in (".bin", ".idx"):
        merged = (tmp_path / "out" / f"corpus_text_document{ext}").read_bytes()
        assert merged == (tmp_path / "ref" / f"corpus_text_document{ext}").read_bytes()
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def tool():
    return load_tool("preprocess_data")


def test_cli_reports_bad_lines_with_numbers(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"text": "1 2"}\nnot json\n{"text": "3"}\n{"txt": "4"}\n')
    rc = tool().main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod", "--workers", "1"])
    err = capsys.readouterr().err
    assert rc == 0 and "line 2: invalid JSON" in err and "line 4: missing key 'text'" in err
    assert read(str(tmp_path / "o_text_document")) == [[1, 2, 9], [3, 9]]
    assert "line 2:" in (tmp_path / "o_bad_lines.txt").read_text()


@pytest.mark.parametrize("text, reason", [("", "0 lines"), ('not json\n{"body": "1"}\n', "2 lines: 2 bad")])
def test_cli_fails_when_no_token_was_written(tmp_path, capsys, text, reason):
    (tmp_path / "c.jsonl").write_text(text)
    rc = tool().main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and f"gave no tokens ({reason}" in err and "dataset written is empty" in err, err


@pytest.mark.parametrize("args, message", [
    (["--output-prefix", "o"], "the following arguments are required: --input"),
    (["--input", "missing.jsonl", "--output-prefix", "o"], "--input missing.jsonl: no such file"),
    (["--input", "c.jsonl", "--output-prefix", "o", "--workers", "0"], "argument --workers: must be 1 or more"),
])
def test_cli_reports_bad_arguments_through_argparse(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"text": "1"}\n')
    with pytest.raises(SystemExit) as exit_:
        tool().main([*args, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cli_names_a_missing_tokenizer_flag(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"text": "1"}\n')
    with pytest.raises(SystemExit) as exit_:
        tool().main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", "o", "--tokenizer-type", "NullTokenizer"])
    assert exit_.value.code == 2 and "--vocab-size" in capsys.readouterr().err
