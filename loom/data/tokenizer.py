"""Tokenizers: a thin wrapper over HuggingFace `tokenizers`, and a byte-level BPE trained on the corpus.

Any `tokenizer.json` works (GPT-2, Llama 3, ...). `get_tokenizer("bpe", vocab_size)` trains one on the
embedded corpus once and caches it under `cache_dir()/tokenizers/`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import sys
import tempfile
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from loom.data.corpus import iter_documents
from loom.errors import UserError
from loom.files import cache_dir, honour_umask  # cache_dir: tokenizers, datasets

EOD_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
SPECIAL_BYTES = b"\x00"  # what a special token counts as in token_bytes (one byte)


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable unicode table used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(spec: dict) -> bool:
    """True when the serialized tokenizer is a BPE model with a ByteLevel decoder."""
    dec = spec.get("decoder") or {}
    decs = dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and any((d or {}).get("type") == "ByteLevel" for d in decs)


class Tokenizer:
    """A `tokenizers.Tokenizer` with the handful of methods loom uses."""

    def __init__(self, tok: tokenizers.Tokenizer, path: str | os.PathLike | None = None) -> None:
        self.tok = tok
        self.path: pathlib.Path | None = pathlib.Path(path) if path is not None else None
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.eod_id: int | None = self._find_eod()  # None: the tokenizer has no end-of-document token
        self._json = tok.to_str(pretty=False)
        self._bytes_table: list[bytes] | None = self._build_bytes_table()

    def _find_eod(self) -> int | None:
        for name in (EOD_TOKEN, *EOS_CANDIDATES):
            idx = self.tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def special_tokens(self) -> list[str]:
        return [t.content for _, t in sorted(self.tok.get_added_tokens_decoder().items()) if t.special]

    def set_eod(self, token: str) -> None:
        """Use `token` as the end-of-document token."""
        idx = self.tok.token_to_id(token)
        if idx is None:
            where = f" {self.path}" if self.path else ""
            raise UserError(f"the tokenizer{where} has no token {token!r}; its special tokens are: "
                            f"{', '.join(self.special_tokens()) or 'none'}")
        self.eod_id = idx

    def require_eod(self, purpose: str, how: str) -> int:
        """The end-of-document id, or a UserError saying why it is needed, what the tokenizer has and how
        to name one (`how`)."""
        if self.eod_id is None:
            where = f" {self.path}" if self.path else ""
            raise UserError(
                f"{purpose} needs an end-of-document token, but the tokenizer{where} has none of "
                f"{', '.join(dict.fromkeys((EOD_TOKEN, *EOS_CANDIDATES)))}; its special tokens are: "
                f"{', '.join(self.special_tokens()) or 'none'}; {how}"
            )
        return self.eod_id

    def _build_bytes_table(self) -> list[bytes] | None:
        """id -> exact bytes for byte-level BPE; None for other tokenizers (decode is used instead)."""
        if not _is_byte_level(json.loads(self._json)):
            return None
        u2b = _unicode_to_byte()
        vocab = self.tok.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values()) + 1)
        for token, idx in vocab.items():
            try:
                table[idx] = bytes(u2b[c] for c in token)
            except KeyError:  # an added token written as plain text
                table[idx] = token.encode("utf-8")
        for idx, added in self.tok.get_added_tokens_decoder().items():
            table[idx] = SPECIAL_BYTES if added.special else added.content.encode("utf-8")
        return table

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (in parallel inside `tokenizers`)."""
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        """The UTF-8 bytes `ids` stand for; a special token counts as one byte (b"\\x00")."""
        if self._bytes_table is None:
            return self.decode(ids).encode("utf-8")
        table = self._bytes_table
        return b"".join(table[int(i)] for i in ids)

    def sha256(self) -> str:
        """Hex digest of the serialized tokenizer JSON."""
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json to `path` (atomically) and remember it as `self.path`."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.tok.to_str(pretty=True))
            honour_umask(tmp)
            os.replace(tmp, path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
        self.path = path

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a tokenizer.json (or a directory holding one)."""
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"tokenizer file {path} does not exist; give a tokenizer.json or a directory holding one")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise UserError(f"cannot read tokenizer {path}: {e}; expected a HuggingFace tokenizer.json") from None
        return cls(tok, path)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id}, path={self.path})"


def train_bpe(vocab_size: int, max_bytes: int = 0) -> Tokenizer:
    """Train a byte-level BPE with `<|endoftext|>` as id 0 on the corpus train split."""
    min_vocab = 256 + 2  # every byte, the end-of-document token, at least one merge
    if vocab_size < min_vocab:
        raise UserError(f"BPE vocab_size must be >= {min_vocab} (256 bytes + {EOD_TOKEN} + merges), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents("train", max_bytes), trainer=trainer)
    return Tokenizer(tok)


def bpe_cache_path(vocab_size: int, max_bytes: int = 0) -> pathlib.Path:
    """Where get_tokenizer("bpe", ...) caches its trained tokenizer."""
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return cache_dir() / "tokenizers" / f"bpe-v{vocab_size}-m{max_bytes}-{py}.json"


def get_tokenizer(spec: str, vocab_size: int, max_bytes: int = 0) -> Tokenizer:
    """`"bpe"`: a corpus-trained BPE (cached); anything else: a tokenizer.json path or its directory.

    The model's vocab size is not checked here; the caller compares it with `.vocab_size`.
    """
    if spec != "bpe":
        return Tokenizer.from_file(spec)
    path = bpe_cache_path(vocab_size, max_bytes)
    if path.is_file():
        return Tokenizer.from_file(path)
    tok = train_bpe(vocab_size, max_bytes)
    tok.save(path)
    return tok


def load_tokenizer(cfg) -> Tokenizer:
    """The run's tokenizer (`data.tokenizer`), refused when its vocabulary does not fit `model.vocab_size`."""
    from loom.errors import UserError

    tok = get_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.corpus_max_bytes)
    if tok.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer ({cfg.data.tokenizer}) has {tok.vocab_size} tokens but model.vocab_size="
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size} or use a smaller tokenizer"
        )
    return tok
