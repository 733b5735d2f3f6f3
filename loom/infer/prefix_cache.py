"""The automatic prefix cache of paged key/value memory (`loom.infer.paged.PagedKV`, on unless
`Engine(prefix_cache=False)`): whole blocks of keys and values kept after the request that wrote them ends, found
again by the tokens they hold, so a later request whose prompt starts with the same tokens (a chat's system prompt,
a growing conversation, an RL group's shared instructions) lists them in its block table and prefills only the rest.

- Keys: block i of a sequence is named by a hash chain, digest_i = blake2b(digest_{i-1} || tokens of block i), so a
  block is found only after the blocks before it: its keys and values depend on every earlier token.
- References: the cache holds one reference of its own on each block it lists (`BlockPool`); the requests that list
  the block in their tables hold theirs. A block only the cache holds (reference count 1) can be evicted.
- Eviction: least recently used first. A lookup or insert marks a sequence's blocks used from its last block to its
  first, so a chain is evicted from its tail and its head (the part most prompts share) stays longest.
- What is cached: a prompt's whole blocks when it is admitted (their keys and values are written by the prefill of
  the same round, before any other request reads them: a packed prefill writes every row's keys of a layer before
  any row attends), and when a request ends, the whole blocks of its prompt and completion (less its last token,
  never written). A match stops one token short of the whole prompt: the logits at its last token are needed.

Pure bookkeeping on the host, like the pool: block ids and digests, no tensors. New weights (`Engine.refit`) make
every cached block stale: `clear`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict

from loom.infer.blocks import BlockPool


class PrefixCache:
    """Whole blocks of `block_size` tokens from `pool`, by the hash chain of the tokens up to their end.

    `stats`: "prefix_cache_queried_tokens" (prompt tokens of admitted requests looked up), "prefix_cache_hit_tokens"
    (those found cached: not prefilled), "prefix_cache_evicted_blocks" (an engine points it at its own stats)."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # digest -> block, least recently used first
        self.digest_of: dict[int, bytes] = {}  # block -> its digest (a block is listed under one digest)
        self.stats: Counter = Counter()

    def __len__(self) -> int:
        return len(self.blocks)

    def chain(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The digests of the first `blocks` whole blocks of `tokens`."""
        out, digest, size = [], b"", self.block_size
        for i in range(blocks):
            digest = hashlib.blake2b(digest + array("q", tokens[i * size:(i + 1) * size]).tobytes(),
                                     digest_size=16).digest()
            out.append(digest)
        return out

    def match(self, prompt: list[int]) -> list[int]:
        """The cached blocks holding the longest run of `prompt`'s first whole blocks, at most up to its
        second-to-last token (no reference taken: `PagedKV.admit` shares them once it admits). Counts the query."""
        digests = self.chain(prompt, (len(prompt) - 1) // self.block_size)
        hits = []
        for digest in digests:
            block = self.blocks.get(digest)
            if block is None:
                break
            hits.append(block)
        self._touch(digests[:len(hits)])
        return hits

    def count(self, prompt_tokens: int, hit_blocks: int) -> None:
        """An admitted prompt of `prompt_tokens` tokens found `hit_blocks` blocks cached."""
        self.stats["prefix_cache_queried_tokens"] += prompt_tokens
        self.stats["prefix_cache_hit_tokens"] += hit_blocks * self.block_size

    def insert(self, tokens: list[int], table: list[int]) -> None:
        """List the whole blocks of `tokens` (whose keys and values are, or this round will be, in the blocks of
        `table`, in order) under their digests; a digest already listed keeps its block."""
        digests = self.chain(tokens, min(len(tokens) // self.block_size, len(table)))
        for digest, block in zip(digests, table):
            if digest not in self.blocks and block not in self.digest_of:
                self.blocks[digest] = self.pool.share(block)
                self.digest_of[block] = digest
        self._touch(digests)

    def _touch(self, digests: list[bytes]) -> None:
        for digest in reversed(digests):  # the chain's head ends most recently used: evicted last
            if digest in self.blocks:
                self.blocks.move_to_end(digest)

    def evictable(self) -> int:
        """Blocks only the cache holds."""
        return sum(self.pool.refs[b] == 1 for b in self.blocks.values())

    def evict(self, n: int) -> int:
        """Give back up to `n` blocks only the cache holds, least recently used first; returns how many."""
        freed = 0
        for digest, block in list(self.blocks.items()):
            if freed >= n:
                break
            if self.pool.refs[block] == 1:
                self._forget(digest)
                freed += 1
        self.stats["prefix_cache_evicted_blocks"] += freed
        return freed

    def clear(self) -> None:
        """Forget every block (new weights, or a reset); blocks that requests still list stay theirs."""
        for digest in list(self.blocks):
            self._forget(digest)

    def _forget(self, digest: bytes) -> None:
        block = self.blocks.pop(digest)
        del self.digest_of[block]
        self.pool.drop(block)
