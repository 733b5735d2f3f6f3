"""Key/value storage of the generation engine: `KVSlab`, every slot's keys and values allocated once, and the
attention of a forward's rows to their own slots (the model calls `attend`, loom/models/llama.py `KVCache`).

Row b of a forward belongs to slot `rows[b]` and its tokens sit at `positions[b]`: keys and values are
written there, and a query at position p attends to keys 0..p of its own slot only, so neither padding nor
another slot's (or an earlier request's) stale entries are ever seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

class KVSlab:
    """Keys and values of every slot, allocated once: per layer [slots, kv_heads, max_len, head_dim].

    `bind` says which slot each row of the next forward is and where its tokens go; every attention layer
    then calls `attend`, which writes that layer's new keys and values and attends within each slot.

    Host work per layer. An eager decode step (a GPU engine without compile, whose time is the host's: every op
    is dispatched one by one) does everything that is the same for all layers once, in `bind`: the mask
    (additive, in the activations' dtype, folded for the query heads of each key/value head: what SDPA would
    otherwise convert from a boolean mask in every layer), and the index that writes each row's new keys and
    values. The slab's view of the bound slots is kept per layer while the batch keeps its size, and nothing in
    `attend` reads a tensor back to the host. bench/engine_ops.py counts the ops (results/engine_ops_cpu.json)."""

    # Key positions an additive mask's rows are padded to in memory: CUDA's memory-efficient attention pads a
    # mask whose rows are not aligned (a copy per layer) before it runs.
    MASK_ALIGN = 16

    def __init__(self, layer_ids, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, next(iter(self.k.values())).device
        self.rows = self.positions = self.mask = None  # rows: the slots as a tensor, when not slots 0..n-1
        self.static = False  # bound by bind_static (a compiled step)
        self.prefix = 0  # > 0: the rows are slots 0..prefix-1 in order (read the slab without copying)
        self.keys = 0  # key positions a query can see: 0..keys-1
        self.packed = None  # a packed prefill: (slot, row and position of each token), see bind_packed
        self.offset = None  # a packed prefill whose rows start past position 0: `offset_mask`
        self._folded = None  # (rep, dtype, the step's mask as attention takes it for rep query heads per kv head)
        self._rows = None  # the list `rows` was made from (bind)
        self._write = None  # bind with prefix rows: each row's positions, expanded over heads and head_dim
        self._views = {}  # layer -> (K, V) of slots 0..prefix-1 (views, kept while the bound batch size stays)
        # Decode attention of fp32 CPU tensors through this kernel instead of SDPA (loom/infer/cpu; the engine sets it).
        self.decode_kernel = None

    def bind(self, rows: list[int], positions: torch.Tensor, keys: int | None = None) -> None:
        """Row b of the next forward is slot rows[b]; its tokens sit at positions[b] ([rows, seq]). `keys`:
        one past the highest position, if the caller knows it (else read back from `positions`)."""
        if self._rows != rows:  # a decode window binds the same rows every step: at most one copy
            self._rows, self.static = list(rows), False
            self.prefix = len(rows) if rows == list(range(len(rows))) else 0
            self.rows = None if self.prefix else upload(torch.tensor(rows), self.device)
        self.positions = positions if positions.device == self.device else positions.to(self.device)
        self.keys = int(positions.max()) + 1 if keys is None else keys
        self.packed = self._folded = None
        # Query at position p sees keys 0..p of its own slot: [rows, 1, seq, keys].
        self.mask = (torch.arange(self.keys, device=self.device) <= self.positions[..., None]).unsqueeze(1)
        if self.prefix:  # scatter_ index of the new keys and values: [rows, kv_heads, seq, head_dim]
            n, seq = self.positions.shape
            self._write = self.positions[:, None, :, None].expand(n, self.kv_heads, seq, self.head_dim)

    def bind_static(self, positions: torch.Tensor, mask: torch.Tensor) -> None:
        """For a compiled decode step: the rows are slots 0..rows-1 and every size comes from the tensors'
        shapes (no Python number that a compiled graph would specialise on). positions [rows, 1]; mask
        [rows, 1, q, keys], True where a query may attend (q = 1, or the query heads per key/value head
        when the CPU folds them into queries, see `attend`)."""
        self.rows, self.positions, self.mask, self.packed, self._rows = None, positions, mask, None, None
        self.static = True
        self._folded = (mask.shape[2], None, mask) if mask.shape[2] > 1 else None
        self.prefix = self.keys = -1  # sizes are taken from q and the mask

    def bind_packed(self, rows: list[int], lengths: list[int], starts: list[int] | None = None) -> torch.Tensor:
        """The next forward is one packed row: the prompts of slots `rows` (lengths[b] tokens each, from
        position 0, or from position starts[b] when the slot already holds the keys and values before it: a
        prefix cache's hit, a speculative step's verification) laid end to end, no padding. Returns the tokens'
        positions [1, total] for the model's rotary tables. The linear layers see only real tokens; `attend`
        spreads queries, keys and values out per slot for the attention itself and packs the output back. Each
        token's slot, row and position are worked out on the host and go to the device in one copy (nothing is
        read back)."""
        self.rows, self._rows, self.static = upload(torch.tensor(rows), self.device), None, False
        self.prefix = len(rows) if rows == list(range(len(rows))) else 0
        starts = [0] * len(rows) if starts is None else list(starts)
        self.keys = max(s + n for s, n in zip(starts, lengths))
        row_of = [b for b, n in enumerate(lengths) for _ in range(n)]
        pos_of = [s + i for s, n in zip(starts, lengths) for i in range(n)]
        table = upload(torch.tensor([[rows[b] for b in row_of], row_of, pos_of,
                                     [i for n in lengths for i in range(n)]]), self.device)
        self.packed = (table[0], table[1], table[2])  # slot, row and position of each token
        self.offset = offset_mask(table[1], table[2], table[3], len(rows), max(lengths), self.keys) \
            if any(starts) else None
        self.positions = table[2][None]
        self.mask = self._folded = None
        return self.positions

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [rows, heads, seq, d], k/v [rows, kv_heads, seq, d] -> attention output [rows, heads, seq, d]."""
        if self.packed is not None:
            return self._attend_packed(layer_id, q, k, v)
        K, V = self.k[layer_id], self.v[layer_id]
        k, v = (t if t.dtype == K.dtype else t.to(K.dtype) for t in (k, v))
        if self.static:
            rows = torch.arange(q.shape[0], device=q.device)
            where = (rows[:, None], slice(None), self.positions)  # -> [rows, seq, kv_heads, d]
            K[where], V[where] = k.transpose(1, 2), v.transpose(1, 2)
            keys, values = K[:q.shape[0], :, :self.mask.shape[-1]], V[:q.shape[0], :, :self.mask.shape[-1]]
        elif self.prefix:  # slots 0..n-1: write in place, read a view
            Kn, Vn = self._slots(layer_id)
            Kn.scatter_(2, self._write, k)
            Vn.scatter_(2, self._write, v)
            keys, values = Kn[:, :, :self.keys], Vn[:, :, :self.keys]
        else:
            where = (self.rows[:, None], slice(None), self.positions)  # -> [rows, seq, kv_heads, d]
            K[where], V[where] = k.transpose(1, 2), v.transpose(1, 2)
            keys, values = self._bound(K), self._bound(V)
        rows, heads, seq, d = q.shape
        kv_heads = keys.shape[1]
        rep = heads // kv_heads
        # Grouped-query attention: SDPA with a mask and enable_gqa takes a slow path (on CUDA only the math kernel
        # takes both), and copying each key/value head for its query heads costs a copy of the cache per layer and
        # step. Instead the query heads
        # that share a key/value head become more queries of it: [rows, kv_heads, rep * seq, d] against the cache
        # as it is, each query keeping its own position's mask.
        kernel = (self.decode_kernel is not None and q.dtype == keys.dtype == torch.float32
                  and q.device.type == "cpu")
        out = self._sdpa(q.reshape(rows, kv_heads, rep * seq, d), keys, values, self._step_mask(rep, q.dtype, kernel),
                         kernel)
        # reshape, not view: CUDA's attention kernels return [rows, queries, kv_heads, d] in memory (not contiguous)
        return out.reshape(rows, heads, seq, d)

    def _slots(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_id`'s keys and values of slots 0..prefix-1 (views, made again when the batch size changes)."""
        views = self._views.get(layer_id)
        if views is None or views[0].shape[0] != self.prefix:
            views = self._views[layer_id] = (self.k[layer_id][:self.prefix], self.v[layer_id][:self.prefix])
        return views

    def _step_mask(self, rep: int, dtype: torch.dtype, kernel: bool) -> torch.Tensor:
        """The bound mask as this step's attention takes it, made at the first layer and kept for the others:
        repeated for `rep` query heads per key/value head, and for SDPA in an eager step additive in `dtype` (0
        where a query may attend, -inf elsewhere: what SDPA makes of a boolean mask, once instead of per
        layer), its rows padded to `MASK_ALIGN` in memory. The CPU kernel and a compiled step take it boolean."""
        want = None if kernel or self.static else dtype
        if self._folded is not None and self._folded[:2] == (rep, want):
            return self._folded[2]
        mask = self.mask if rep == 1 else self.mask.repeat(1, 1, rep, 1)
        if want is not None:
            width = -(-mask.shape[-1] // self.MASK_ALIGN) * self.MASK_ALIGN
            bias = torch.full((*mask.shape[:-1], width), float("-inf"), dtype=want, device=mask.device)
            mask = bias[..., :mask.shape[-1]].masked_fill_(mask, 0.0)
        self._folded = (rep, want, mask)
        return mask

    def _sdpa(self, q, keys, values, mask, kernel: bool = False):
        """Masked attention of q [rows, kv_heads, queries, d] to the bound keys and values [rows, kv_heads, keys, d]:
        SDPA, or on a CPU with fp32 tensors (`kernel`) the decode kernel (loom/infer/cpu), which reads only the
        key and value rows some query may attend to."""
        if kernel:
            return self.decode_kernel(q, keys, values, mask)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def _attend_packed(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, heads, total, d], k/v [1, kv_heads, total, d] of a packed prefill (`bind_packed`). Keys and
        values go straight to their slots; the queries are spread to [rows, heads, longest, d] and attend
        causally to their own slot's keys 0..p, all written by this prefill. A padding query (past its
        prompt's end) sees only its own slot too and its output is dropped when packing back."""
        K, V = self.k[layer_id], self.v[layer_id]
        slots, row_of, pos_of = self.packed
        K[slots, :, pos_of] = k[0].transpose(0, 1).to(K.dtype)  # [total, kv_heads, d]
        V[slots, :, pos_of] = v[0].transpose(0, 1).to(V.dtype)
        keys, values = self._bound(K), self._bound(V)
        if self.offset is not None:  # rows that start past position 0 read their slots' earlier keys too
            return attend_offset(q, keys, values, self.offset)
        heads, d = q.shape[1], q.shape[3]
        spread = q.new_zeros(len(self.rows), self.keys, heads, d)
        spread[row_of, pos_of] = q[0].transpose(0, 1)
        out = F.scaled_dot_product_attention(spread.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                             is_causal=True, enable_gqa=heads != keys.shape[1])
        return out.transpose(1, 2)[row_of, pos_of].transpose(0, 1)[None]

    def _bound(self, cache: torch.Tensor) -> torch.Tensor:
        """Key positions 0..keys-1 of the bound rows' slots: a view when they are slots 0..n-1, else a copy."""
        if self.prefix:
            return cache[:self.prefix, :, :self.keys]
        return cache[self.rows, :, :self.keys]

    def move(self, src: int, dst: int) -> None:
        """Copy slot src's keys and values of every layer into slot dst (in place: addresses stay)."""
        for cache in (self.k, self.v):
            for t in cache.values():
                t[dst].copy_(t[src])

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in (*self.k.values(), *self.v.values())]

    # The engine's calls about memory, which paged keys and values answer (loom/infer/paged.py `PagedKV`): a
    # slab holds every slot's whole length from the start and shares nothing.
    def fits(self, tokens: int) -> bool:
        return True

    def expect(self, prompts) -> None:
        pass

    def withdraw(self, prompt) -> None:
        pass

    def reset(self) -> None:
        pass

    def admit(self, slot: int, prompt, most: int) -> str:
        return "fresh"

    def remember(self, prompt, head) -> None:
        pass

    def head_of(self, prompt):
        return None

    def settle(self) -> None:
        pass

    def evict(self) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def keep(self, slot: int, tokens) -> None:
        pass

    def reused(self, slot: int) -> int:
        """Prompt positions of the request just admitted into `slot` whose keys and values it found cached."""
        return 0

    def prepare(self, slots, starts, ends, size) -> None:
        pass


def offset_mask(row_of: torch.Tensor, pos_of: torch.Tensor, index_of: torch.Tensor, rows: int, longest: int,
                keys: int) -> tuple:
    """A packed forward whose rows start at positions past 0 (`bind_packed` with `starts`): each token's row,
    position and index within its row's tokens [total] -> (row_of, index_of, the attention mask [rows, 1,
    longest, keys]: a query at position p sees its row's keys 0..p; a padding query sees key 0 and is dropped)."""
    query_pos = torch.zeros(rows, longest, dtype=torch.long, device=pos_of.device)
    query_pos[row_of, index_of] = pos_of
    mask = torch.arange(keys, device=pos_of.device) <= query_pos[..., None]
    return row_of, index_of, mask[:, None]


def attend_offset(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: tuple) -> torch.Tensor:
    """q [1, heads, total, d] of a packed forward (`offset_mask`'s tokens) against each row's keys and values
    [rows, kv_heads, keys, d] -> the output [1, heads, total, d], packed back."""
    row_of, index_of, mask = offset
    heads, d = q.shape[1], q.shape[3]
    spread = q.new_zeros(mask.shape[0], mask.shape[2], heads, d)
    spread[row_of, index_of] = q[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(spread.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=mask, enable_gqa=heads != keys.shape[1])
    return out.transpose(1, 2)[row_of, index_of].transpose(0, 1)[None]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor made on the host, on `device`. To a GPU through pinned memory without waiting for the device
    (an ordinary copy from pageable memory synchronises the stream); the caching host allocator keeps the pinned
    block until the copy is done, and the caller never writes `host` again."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)

