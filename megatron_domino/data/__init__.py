"""Data pipeline: tokenizers, Megatron-compatible indexed datasets, GPT samples, blending, per-rank loading."""
from .blended_dataset import BlendedDataset, build_blending_indices
from .builder import build_train_valid_test_datasets
from .gpt_dataset import GPTDataset, MockGPTDataset, SampleOptions
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, token_dtype
from .loader import MicroBatchLoader
from .sample import make_sample
from .tokenizer import (
    BaseTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)

__all__ = [
    "BaseTokenizer", "BlendedDataset", "GPT2BPETokenizer", "GPTDataset", "HuggingFaceTokenizer", "IndexedDataset",
    "IndexedDatasetBuilder", "MicroBatchLoader", "MockGPTDataset", "NullTokenizer", "SampleOptions",
    "SentencePieceTokenizer", "build_blending_indices", "build_tokenizer", "build_train_valid_test_datasets",
    "make_sample", "token_dtype",
]
