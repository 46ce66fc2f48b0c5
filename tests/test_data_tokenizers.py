"""SentencePiece, HF passthrough and null tokenizers behind the common interface."""
import pytest

from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import build_tokenizer
from tests.tools import load_tool

TEXTS = ["Hello world.", "  two  spaces\tand a tab\n\nnew lines", "digits 1234567890 and 3.14159",
         "Ünïcödé: 日本語, Привет, 🎉👍🏽", "def f(x):\n    return x ** 2  # code", ""]
TRAINING = [f"Document {i}: the quick brown fox jumps over the lazy dog {i * 7} times.\n"
            f"    def step_{i}(self): return self.value + {i}" for i in range(300)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "tok.model"
    load_tool("prepare_quickstart_data").train_sentencepiece(TRAINING, str(path), vocab_size=400)
    return path


def test_sentencepiece_round_trip_and_specials(sp_model):
    import sentencepiece
    tok = build_tokenizer(TokenizerConfig(type="SentencePieceTokenizer", model=str(sp_model)), vocab_size=512)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    assert tok.vocab_size == 400
    assert tok.eod == reference.piece_to_id("</s>") == 2
    assert tok.pad == tok.eod  # the model has no pad piece
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text)  # no BOS/EOS added
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text  # byte fallback + identity normalisation: exact round trip
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learned


def test_model_vocab_too_small_is_an_error(sp_model):
    with pytest.raises(ValueError, match="model.vocab_size=256 is smaller"):
        build_tokenizer(TokenizerConfig(type="SentencePieceTokenizer", model=str(sp_model)), vocab_size=256)


def test_hf_passthrough_directory_and_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(TRAINING, vocab_size=600, min_frequency=2, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(tmp_path))
    reference = transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))
    hf_dir = tmp_path / "hf"
    reference.save_pretrained(str(hf_dir))
    trainer.save(str(tmp_path / "tokenizer.json"))
    from_dir = build_tokenizer(TokenizerConfig(type="HuggingFaceTokenizer", model=str(hf_dir)))
    from_json = build_tokenizer(TokenizerConfig(type="HuggingFaceTokenizer", model=str(tmp_path / "tokenizer.json")))
    gpt2 = build_tokenizer(TokenizerConfig(type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                           merge_file=str(tmp_path / "merges.txt")))
    for tok in (from_dir, from_json):
        assert tok.eod == tok.pad == reference.eos_token_id
        assert tok.vocab_size == len(reference)
        for text in TEXTS:
            assert tok.encode(text) == gpt2.encode(text) == reference(text)["input_ids"]
            assert tok.decode(tok.encode(text)) == text


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig(type="NullTokenizer"), vocab_size=100)
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, 99, 99)
    assert tok.encode("5 17  3\n42") == [5, 17, 3, 42]
    assert tok.decode([5, 17]) == "5 17"
    with pytest.raises(ValueError, match="outside the NullTokenizer vocabulary"):
        tok.encode("100")
    with pytest.raises(ValueError, match="needs a vocab size"):
        build_tokenizer(TokenizerConfig(type="NullTokenizer"))


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.type='Bert'"):
        build_tokenizer(TokenizerConfig(type="Bert"))
    with pytest.raises(ValueError, match="tokenizer.model"):
        build_tokenizer(TokenizerConfig(type="SentencePieceTokenizer"))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(TokenizerConfig(type="SentencePieceTokenizer", model=str(tmp_path / "nope.model")))
