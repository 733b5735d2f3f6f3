"""The embedded corpus, tokenized once into a cached indexed dataset."""

from __future__ import annotations

from loom.data.corpus import iter_documents
from loom.data.indexed import IndexedDatasetBuilder, best_dtype
from loom.data.tokenizer import Tokenizer, cache_dir

BATCH_DOCS = 64


def corpus_prefix(tokenizer: Tokenizer, split: str, max_bytes: int = 0) -> str:
    """Prefix of the corpus split tokenized by `tokenizer` (each document followed by eod); built once."""
    prefix = cache_dir() / "datasets" / f"corpus-{split}-{tokenizer.sha256()[:12]}-m{max_bytes}"
    if prefix.with_name(prefix.name + ".idx").is_file() and prefix.with_name(prefix.name + ".bin").is_file():
        return str(prefix)
    docs = iter_documents(split, max_bytes)  # validates split before anything is written
    with IndexedDatasetBuilder(prefix, dtype=best_dtype(tokenizer.vocab_size)) as builder:
        batch: list[str] = []
        for text in docs:
            batch.append(text)
            if len(batch) == BATCH_DOCS:
                _add(builder, tokenizer, batch)
                batch = []
        _add(builder, tokenizer, batch)
    return str(prefix)


def _add(builder: IndexedDatasetBuilder, tokenizer: Tokenizer, texts: list[str]) -> None:
    eod = tokenizer.require_eod("the embedded corpus (its documents are separated by it)",
                                "use data.tokenizer=bpe or a tokenizer that has one")
    for ids in tokenizer.encode_batch(texts) if texts else []:
        builder.add_document(ids + [eod])
