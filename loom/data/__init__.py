"""Data: the embedded corpus, tokenizers, Megatron-compatible indexed datasets, fixed-length samples and blends."""

from loom.data.corpus import corpus_files, iter_documents
from loom.data.corpus_dataset import corpus_prefix
from loom.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from loom.data.preprocess import preprocess
from loom.data.samples import BlendedDataset, SampleDataset
from loom.data.tokenizer import Tokenizer, cache_dir, get_tokenizer, train_bpe

__all__ = [
    "BlendedDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "SampleDataset",
    "Tokenizer",
    "best_dtype",
    "cache_dir",
    "corpus_files",
    "corpus_prefix",
    "get_tokenizer",
    "iter_documents",
    "preprocess",
    "train_bpe",
]
