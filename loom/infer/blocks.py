"""The block pool of paged key/value memory (`loom.infer.paged.PagedKV`): fixed-size blocks of token positions,
handed out and taken back by reference count, so requests that share a prompt share its blocks.

Pure bookkeeping on the host: block ids only, no tensors. Block 0 is never handed out: it is the scratch block
that idle rows of a compiled step write into and nothing reads.
"""

from __future__ import annotations


class BlockPool:
    """`blocks` block ids (1..blocks-1 usable; 0 is scratch), each with a reference count.

    `take()` hands out a free block with one reference; `share(b)` adds one (another request's block table now
    lists it); `drop(b)` removes one and returns the block to the free list at zero. `promise(n)` sets n blocks
    aside for a request that will take them later (its worst case), so admitting a request never leaves a
    running one without blocks; `take(promised=True)` takes one of them."""

    def __init__(self, blocks: int):
        if blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is scratch), got {blocks}")
        self.blocks = blocks
        self.free = list(range(blocks - 1, 0, -1))  # a stack: the lowest ids come out first
        self.refs = [0] * blocks
        self.promised = 0  # blocks set aside for requests that will take them

    @property
    def available(self) -> int:
        """Free blocks not promised to anyone."""
        return len(self.free) - self.promised

    def promise(self, n: int) -> bool:
        """Set `n` blocks aside if that many are available; False (nothing set aside) if not."""
        if n > self.available:
            return False
        self.promised += n
        return True

    def unpromise(self, n: int) -> None:
        assert 0 <= n <= self.promised, (n, self.promised)
        self.promised -= n

    def take(self, promised: bool = False) -> int:
        if promised:
            self.unpromise(1)
        if not self.free or (not promised and self.available < 1):
            raise RuntimeError("the key/value block pool is out of blocks")
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def share(self, b: int) -> int:
        assert self.refs[b] > 0, f"block {b} is free"
        self.refs[b] += 1
        return b

    def drop(self, b: int) -> None:
        assert self.refs[b] > 0, f"block {b} is already free"
        self.refs[b] -= 1
        if not self.refs[b]:
            self.free.append(b)

    def in_use(self) -> int:
        """Blocks held by some reference (the scratch block aside)."""
        return self.blocks - 1 - len(self.free)
