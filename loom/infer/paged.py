"""Paged key/value memory for the generation engine (`Engine(..., paged=True)`): `PagedKV`, a drop-in for
`KVSlab` whose keys and values live in fixed-size blocks of a pool (`blocks.BlockPool`) listed by a block table
per request.

- Memory follows the tokens held: a request takes blocks as it grows and gives them back when it finishes, so
  the batch is bounded by the pool (`kv_tokens`), not by max_batch x max_len. A request is admitted only when
  the pool can promise it its worst case (prompt + max_new_tokens), so a running request never runs out.
- Shared prompts: requests with the same prompt ids waiting together (a GRPO group, one `generate` call, a
  server request's `n` samples) prefill it once; the others list its blocks in their tables (reference counts)
  and take the first token's distribution from the same logits. The last, partial block is copied before a
  request writes into it (copy on write). The prompt's blocks and logits stay held while requests with that
  prompt still wait (`pending`), then go back.
- Prefix cache (`prefix_cache=True`, loom/infer/prefix_cache.py): whole blocks stay after their request ends,
  found by the hash chain of their tokens; a request whose prompt starts with cached blocks lists them and
  prefills only the rest (`reused`), its packed prefill reading the cached keys from the pool. Cached blocks
  only the cache holds are evicted least recently used when a request needs blocks.
- Decode attention (`read="split"`) reads each request's visible keys only: on a CPU with fp32 through the
  kernel `decode_attention_paged` (loom/infer/cpu, eager and compiled), on a GPU through the Triton kernels
  `triton_decode.paged_decode` (eager and compiled: it reads the step's table and positions on the device),
  elsewhere eagerly through `paged_attention.split_kv_decode`. `read="gather"` (and a compiled step off both
  kernels, e.g. a GPU without Triton) gathers the table's
  blocks into a dense [rows, kv_heads, keys, d] view masked by position, as `KVSlab` reads its slots.
- Compiled decode: a window's block table is one tensor [max_batch, max_blocks]; a step takes the rows and
  block columns of its bucket (fixed shapes per bucket). Idle rows point at the scratch block 0.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from loom.infer.blocks import BlockPool
from loom.infer.kv import KVSlab, attend_offset, offset_mask, upload
from loom.infer.paged_attention import split_kv_decode
from loom.infer.prefix_cache import PrefixCache


class _Prefix:
    """A prompt held for the requests with it that still wait: its blocks (one reference of its own) and the
    head's (logits, argmax, log-sum-exp) at its last position, once prefilled."""

    def __init__(self, blocks: list[int]):
        self.blocks, self.head = blocks, None


class PagedKV(KVSlab):
    """Keys and values in `blocks` blocks of `block_size` positions: per layer [blocks, kv_heads, block_size,
    head_dim]; `tables[slot]` lists the blocks of the request in slot `slot`.

    `read`: "split" (visible keys only: the CPU kernel `paged_kernel`, on a GPU the Triton kernels
    (`triton_kernel`), else eagerly `split_kv_decode`) or
    "gather" (the table's blocks as a dense masked view, through SDPA or the CPU decode kernel)."""

    def __init__(self, layer_ids, slots: int, kv_heads: int, blocks: int, block_size: int, head_dim: int,
                 max_len: int, dtype, device, read: str = "split", prefix_cache: bool = False):
        shape = (blocks, kv_heads, block_size, head_dim)
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.kv_heads, self.head_dim, self.block_size = kv_heads, head_dim, block_size
        self.device = next(iter(self.k.values())).device
        self.read = read
        self.pool = BlockPool(blocks)
        self.cache = PrefixCache(self.pool, block_size) if prefix_cache else None
        # one block column past max_len: a step's table never spans the whole window table (one graph fewer)
        self.max_blocks = -(-max_len // block_size) + 1
        # GPU split reads: (`triton_decode.paged_decode`, splits, programs); None without CUDA or Triton
        self.triton_kernel = None
        if self.device.type == "cuda":  # imported only here: Triton's op brings in torch's compiler (seconds)
            from loom.infer import triton_decode
            if triton_decode.available():
                self.triton_kernel = (triton_decode.paged_decode,
                                      *triton_decode.splits_for(self.max_blocks, self.device))
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.owed = [0] * slots  # blocks promised to a slot's request and not yet taken
        self.hits = [0] * slots  # prompt positions the request admitted into a slot found cached
        self.prefixes: dict[tuple, _Prefix] = {}
        self.pending: Counter = Counter()  # prompt -> requests with it not yet admitted
        self.rows = self.positions = self.mask = self.packed = self._folded = self.offset = None
        self.static, self.prefix, self.keys, self.decode_kernel = False, 0, 0, None
        self.paged_kernel = None  # CPU, fp32: split reads through loom/infer/cpu's decode_attention_paged
        self.window_table = None  # [rows of the window, max_blocks] on the device (`prepare`)
        self.splits = None  # (row, block, start) of every block the window's rows may read
        self.table = None  # the bound step's table [rows, blocks]
        self.stats = Counter()  # prefilled / shared prompts, copied blocks

    # --- blocks -----------------------------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits(self, tokens: int) -> bool:
        """Whether one request of `tokens` positions fits the pool at all."""
        return self.blocks_for(tokens) <= self.pool.blocks - 1

    def expect(self, prompts: list[list[int]]) -> None:
        """Requests with these prompts were submitted (they wait): which prompts will be shared."""
        self.pending.update(map(tuple, prompts))

    def withdraw(self, prompt: list[int]) -> None:
        """A waiting request with `prompt` was cancelled: it will not take the prompt's blocks."""
        self.pending[tuple(prompt)] -= 1
        self.settle()

    def reset(self) -> None:
        """Every slot empty, nothing held or expected (after a step cut short by an exception)."""
        self.evict()
        for slot in range(len(self.tables)):
            self.release(slot)
        self.pending = Counter()
        if self.cache is not None:
            self.cache.clear()

    def admit(self, slot: int, prompt: list[int], most: int) -> str | None:
        """Slot `slot` takes a request with `prompt` that holds at most `most` positions: "fresh" (its prompt
        must be prefilled; its blocks are taken), "shared" (the prompt's blocks are listed, nothing to prefill),
        or None (the pool cannot promise its worst case now; nothing changed)."""
        key = tuple(prompt)
        entry = self.prefixes.get(key)
        hits = self.cache.match(prompt) if entry is None and self.cache is not None else []
        full = len(prompt) // self.block_size if entry is not None else len(hits)  # blocks it never writes
        need = self.blocks_for(most) - full
        if entry is None and self.pending[key] > 1 and len(prompt) % self.block_size:
            need += 1  # it will hold the prompt for others: its own first write copies the shared partial block
        hits = [self.pool.share(b) for b in hits]  # not evicted to make room for the request that lists them
        if not self._promise(need):
            for b in hits:
                self.pool.drop(b)
            return None
        self.pending[key] -= 1
        if entry is not None:
            self.tables[slot] = [self.pool.share(b) for b in entry.blocks]
            self.owed[slot], self.hits[slot] = need, 0
            self.stats["shared"] += 1
            return "shared"
        table = hits + [self.pool.take(promised=True) for _ in range(self.blocks_for(len(prompt)) - len(hits))]
        self.tables[slot], self.owed[slot] = table, need - (len(table) - len(hits))
        self.hits[slot] = len(hits) * self.block_size
        if self.cache is not None:  # its whole blocks, written by this round's prefill, for later prompts
            self.cache.count(len(prompt), len(hits))
            self.cache.insert(prompt, table)
        if self.pending[key] > 0:  # requests with this prompt still to come: hold its blocks for them
            self.prefixes[key] = _Prefix([self.pool.share(b) for b in table])
        self.stats["prefilled"] += 1
        return "fresh"

    def _promise(self, need: int) -> bool:
        """Set `need` blocks aside, evicting cached blocks nobody lists if the free ones are too few."""
        if self.pool.promise(need):
            return True
        if self.cache is not None and self.cache.evict(need - self.pool.available):
            return self.pool.promise(need)
        return False

    def reused(self, slot: int) -> int:
        """Prompt positions of the request just admitted into `slot` found in the prefix cache (not prefilled)."""
        return self.hits[slot]

    def keep(self, slot: int, tokens: list[int]) -> None:
        """The request in `slot` ends; `tokens` (its prompt and completion up to the last position it wrote) go
        to the prefix cache with the whole blocks that hold them."""
        if self.cache is not None:
            self.cache.insert(tokens, self.tables[slot])

    def remember(self, prompt: list[int], head: tuple) -> None:
        """The head's outputs at the last position of a prompt just prefilled, for requests that share it."""
        entry = self.prefixes.get(tuple(prompt))
        if entry is not None and entry.head is None:
            entry.head = head

    def head_of(self, prompt: list[int]):
        entry = self.prefixes.get(tuple(prompt))
        return None if entry is None else entry.head

    def settle(self) -> None:
        """Let go of the prompts no waiting request has."""
        for key in [k for k in self.prefixes if self.pending[k] <= 0]:
            self._drop_prefix(key)
        for key in [k for k, n in self.pending.items() if n <= 0]:  # a server's stream of prompts: no leftovers
            del self.pending[key]

    def evict(self) -> None:
        """Let go of every held prompt (the pool is needed for the requests that run)."""
        for key in list(self.prefixes):
            self._drop_prefix(key)

    def _drop_prefix(self, key: tuple) -> None:
        for b in self.prefixes.pop(key).blocks:
            self.pool.drop(b)

    def release(self, slot: int) -> None:
        """The request in `slot` finished: its blocks go back (a shared one when its last holder lets go)."""
        for b in self.tables[slot]:
            self.pool.drop(b)
        self.pool.unpromise(self.owed[slot])
        self.tables[slot], self.owed[slot] = [], 0

    def move(self, src: int, dst: int) -> None:
        """The request in `src` now sits in `dst`: its table moves, no key or value is copied."""
        self.tables[dst], self.tables[src] = self.tables[src], []
        self.owed[dst], self.owed[src] = self.owed[src], 0

    def _writable(self, slot: int, start: int, end: int) -> None:
        """Slot `slot`'s table covers positions < end, and the blocks holding positions start..end-1 are its
        own: a shared block there is copied first (copy on write), missing ones are taken (promised)."""
        table = self.tables[slot]
        for i in range(start // self.block_size, self.blocks_for(end)):
            if i == len(table):
                table.append(self.pool.take(promised=True))
                self.owed[slot] -= 1
            elif self.pool.refs[table[i]] > 1:
                fresh = self.pool.take(promised=True)
                self.owed[slot] -= 1
                for cache in (self.k, self.v):
                    for t in cache.values():
                        t[fresh].copy_(t[table[i]])
                self.pool.drop(table[i])
                table[i] = fresh
                self.stats["copied_blocks"] += 1

    def prepare(self, slots: list[int], starts: list[int], ends: list[int], size: int | None) -> None:
        """Before a decode window: the requests in `slots` write positions starts[b]..ends[b]-1. Takes their
        blocks, then uploads the window's block table (rows: the slots in order, or with `size` a compiled
        bucket's slots 0..size-1, idle ones on the scratch block) and, for split reads, every block a row may
        read, in one copy."""
        for slot, start, end in zip(slots, starts, ends):
            self._writable(slot, start, end)
        order = slots if size is None else list(range(size))
        width = self.max_blocks
        table = [(self.tables[s] + [0] * width)[:width] for s in order]
        if size is not None:
            table += [[0] * width] * (self.tables_rows() - size)
        flat = torch.tensor(table).flatten().tolist()
        split = [[], [], []]
        if size is None:
            for b, (slot, end) in enumerate(zip(slots, ends)):
                n = self.blocks_for(end)
                split[0] += [b] * n
                split[1] += self.tables[slot][:n]
                split[2] += [i * self.block_size for i in range(n)]
        host = upload(torch.tensor(flat + split[0] + split[1] + split[2]), self.device)
        self.window_table = host[:len(flat)].view(len(table), width)
        n = len(split[0])
        self.splits = tuple(host[len(flat) + i * n:len(flat) + (i + 1) * n] for i in range(3))

    def tables_rows(self) -> int:
        return len(self.tables)

    def idle_table(self) -> None:
        """A window table on the scratch block for every slot (a compiled step's warm-up)."""
        self.window_table = torch.zeros(len(self.tables), self.max_blocks, dtype=torch.long, device=self.device)

    # --- the forward's side (the model calls `attend`) --------------------------------------------------------

    def bind(self, rows: list[int], positions: torch.Tensor, keys: int | None = None) -> None:
        """An eager decode step of the window's rows (`prepare`); `keys` as in `KVSlab.bind`."""
        self.positions = positions if positions.device == self.device else positions.to(self.device)
        self.keys = int(positions.max()) + 1 if keys is None else keys
        self.static, self.packed, self._folded = False, None, None
        blocks = self.blocks_for(self.keys)
        self.table = self.window_table[:, :blocks]
        span = torch.arange(blocks * self.block_size, device=self.device)
        self.mask = (span <= self.positions[..., None]).unsqueeze(1)

    def bind_static(self, positions: torch.Tensor, mask: torch.Tensor, table: torch.Tensor | None = None) -> None:
        """A compiled step: positions [rows, 1], mask [rows, 1, fold, blocks x block_size], table [rows, blocks]."""
        self.positions, self.mask, self.table, self.packed = positions, mask, table, None
        self.static = True
        self._folded = (mask.shape[2], None, mask) if mask.shape[2] > 1 else None

    def bind_packed(self, rows: list[int], lengths: list[int], starts: list[int] | None = None) -> torch.Tensor:
        """A packed prefill of the prompts of slots `rows` (see `KVSlab.bind_packed`; `starts`: the positions
        they start at, their slots' blocks holding the keys and values before); each token's block and offset
        come from its slot's table."""
        size = self.block_size
        starts = [0] * len(rows) if starts is None else list(starts)
        row_of = [b for b, n in enumerate(lengths) for _ in range(n)]
        pos_of = [s + i for s, n in zip(starts, lengths) for i in range(n)]
        blocks = [self.tables[rows[b]][p // size] for b, p in zip(row_of, pos_of)]
        index_of = [i for n in lengths for i in range(n)]
        self.offset = None
        if any(starts):  # rows read their earlier keys from their blocks: each row's table, padded with scratch
            width = self.blocks_for(max(s + n for s, n in zip(starts, lengths)))
            read = [(self.tables[r] + [0] * width)[:width] for r in rows]
            host = torch.tensor(blocks + [p % size for p in pos_of] + row_of + pos_of + index_of + sum(read, []))
            dev = upload(host, self.device)
            n = len(pos_of)
            table = dev[:5 * n].view(5, n)
            self.offset = (dev[5 * n:].view(len(rows), width),
                           offset_mask(table[2], table[3], table[4], len(rows), max(lengths), width * size))
        else:
            table = upload(torch.tensor([blocks, [p % size for p in pos_of], row_of, pos_of]), self.device)
        self.packed = (table[0], table[1], table[2], table[3], len(rows), max(lengths))
        self.positions = table[3][None]
        self.mask = self._folded = None
        self.static = False
        return self.positions

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [rows, heads, 1, d], k/v [rows, kv_heads, 1, d] of a decode step (or a packed prefill)."""
        if self.packed is not None:
            return self._attend_packed(layer_id, q, k, v)
        K, V = self.k[layer_id], self.v[layer_id]
        size = self.block_size
        pos = self.positions  # [rows, 1]
        block = self.table.gather(1, torch.div(pos, size, rounding_mode="floor"))[:, 0]
        K[block, :, pos[:, 0] % size] = k[:, :, 0].to(K.dtype)
        V[block, :, pos[:, 0] % size] = v[:, :, 0].to(V.dtype)
        rows, heads, seq, d = q.shape
        rep = heads // self.kv_heads
        folded = q.reshape(rows, self.kv_heads, rep * seq, d)  # query heads of a kv head as its queries
        on_cpu = q.dtype == K.dtype == torch.float32 and q.device.type == "cpu"
        if self.read == "split" and self.paged_kernel is not None and on_cpu:  # visible keys, from the blocks
            out = self.paged_kernel(folded, K, V, self.table, pos)
            return out.reshape(rows, heads, seq, d)
        if self.read == "split" and self.triton_kernel is not None and seq == 1:  # GPU: visible keys, any step
            kernel, splits, programs = self.triton_kernel
            out = kernel(folded, K, V, self.table, pos[:, 0], splits, programs)
            return out.reshape(rows, heads, seq, d)
        if self.read == "split" and not self.static:
            row, blk, start = self.splits
            out = split_kv_decode(folded, K, V, row, blk, start, pos[:, 0]).to(q.dtype)
            return out.reshape(rows, heads, seq, d)
        # gather: the table's blocks as [rows, kv_heads, blocks x size, d], masked by position
        keys = K[self.table].transpose(1, 2).flatten(2, 3)
        values = V[self.table].transpose(1, 2).flatten(2, 3)
        kernel = (self.decode_kernel is not None and q.dtype == keys.dtype == torch.float32
                  and q.device.type == "cpu")
        out = self._sdpa(folded, keys, values, self._step_mask(rep, q.dtype, kernel), kernel)
        return out.reshape(rows, heads, seq, d)

    def _attend_packed(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A packed prefill from position 0: keys and values go to their blocks; the prompts attend causally to
        this forward's own keys and values, spread out per prompt (nothing is read from the pool)."""
        K, V = self.k[layer_id], self.v[layer_id]
        blocks, offsets, row_of, pos_of, rows, longest = self.packed
        K[blocks, :, offsets] = k[0].transpose(0, 1).to(K.dtype)  # [total, kv_heads, d]
        V[blocks, :, offsets] = v[0].transpose(0, 1).to(V.dtype)
        if self.offset is not None:  # rows past position 0: every row's keys from its blocks (this forward's too)
            read, offset = self.offset
            keys, values = (t[read].transpose(1, 2).flatten(2, 3) for t in (K, V))  # [rows, kv_heads, keys, d]
            return attend_offset(q, keys, values, offset)

        def spread(t):
            out = t.new_zeros(rows, longest, t.shape[1], t.shape[3])
            out[row_of, pos_of] = t[0].transpose(0, 1)
            return out.transpose(1, 2)

        keys, values = (spread(t.to(K.dtype)).to(q.dtype) for t in (k, v))
        out = F.scaled_dot_product_attention(spread(q), keys, values, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)[row_of, pos_of].transpose(0, 1)[None]
