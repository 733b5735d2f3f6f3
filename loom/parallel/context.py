"""Context parallelism: every sequence split across the `cp` ranks, attention over all-gathered keys/values.

Load-balanced causal sharding: a sequence of S tokens is cut into 2·cp chunks of c = S / (2·cp) tokens and
cp rank i holds chunks i and 2·cp−1−i. Under a causal mask an early chunk attends to few keys and a late
one to many; pairing them gives every rank the same attention work (Megatron-Core and torchtitan do the
same). Inputs and labels are sliced alike (`shard_batch`), so each token's loss is computed on exactly one
cp rank and the loss sums over the cp group.

Attention (Llama 3's choice, Dubey et al. 2024 §3.3.2): each rank all-gathers the keys and values of its
cp group, only the key/value heads (GQA shrinks the exchange), and attends its two query chunks to them;
backward reduce-scatters the key/value gradients to their owners (`_GatherKV`). Chunk i needs keys
0..(i+1)·c−1 and chunk 2·cp−1−i keys 0..(2·cp−i)·c−1: two causal attention calls on key prefixes, so no
rank computes blocks above the diagonal beyond its own chunks.

Why all-gather rather than a ring: one collective per layer and direction instead of cp−1 dependent
point-to-point rounds; any attention kernel works unchanged (fused SDPA on GPU, the math path with its
measured activations on CPU); with GQA the keys/values are a fraction of the activations (Llama 3 ran it at
128K tokens). A ring overlaps its exchange with compute and never holds the whole K/V, which matters only
when S x kv_heads x head_dim per layer no longer fits beside the rest — see README "Context parallelism"
and bench/cp_comm.py for the numbers.

Positions: a rank's tokens are not contiguous, so `shard_batch` gives the batch a `positions` entry (each
token's position in its sequence, sharded with the tokens) that the model takes as its `positions` argument,
as it takes packed sequences' positions; the model has no process-group code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.models.llama import attention_core


def rank_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions (of 0..seq_len-1) of the tokens cp rank `rank` holds: chunks rank and 2·cp−1−rank."""
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


WHOLE_ROWS = ("doc_ids",)  # batch entries every cp rank keeps whole: attention masks keys of the whole row


def shard_batch(batch: dict, seq_len: int, cp: int, rank: int) -> dict:
    """This cp rank's tokens of every sequence: each [batch, seq_len, ...] tensor sliced along dim 1 (but
    `WHOLE_ROWS`), `positions` [batch, seq_len / cp] among them: the batch's own (packed sequences), else
    0..seq_len-1 of every row, so that the model places the rank's tokens where they sit in the sequence."""
    if cp == 1:
        return batch
    idx = rank_positions(seq_len, cp, rank)
    if "positions" not in batch:
        ids = batch["input_ids"]
        batch = {**batch, "positions": torch.arange(seq_len, device=ids.device).expand(ids.shape[0], seq_len)}
    out = {}
    for k, v in batch.items():
        if v.dim() >= 2 and v.shape[1] == seq_len and k not in WHOLE_ROWS:
            v = v.index_select(1, idx.to(v.device))
        out[k] = v
    return out


# torch 2.13 renames the single-tensor collectives (the old names warn); 2.11 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherKV(torch.autograd.Function):
    """[b, h, L, d] on each of the cp ranks -> [cp, b, h, L, d] on every rank; backward reduce-scatters."""

    traffic = {"gathered_bytes": 0, "scattered_bytes": 0}  # this process's, read by tests and bench/cp_comm.py

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # ranks along dim 0 (gloo wants it flat)
        _ALL_GATHER(out, x, group=group)
        _GatherKV.traffic["gathered_bytes"] += x.numel() * x.element_size() * (size - 1)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        _REDUCE_SCATTER(out, grad.flatten(0, 1), group=ctx.group)
        _GatherKV.traffic["scattered_bytes"] += out.numel() * out.element_size() * (ctx.size - 1)
        return out, None, None


def gather_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The cp group's [b, h, 2c, d] shards (chunks r and 2·cp−1−r on rank r) as [b, h, S, d] in order."""
    parts = _GatherKV.apply(x, group, cp)
    c = x.shape[2] // 2
    first = [parts[r, :, :, :c] for r in range(cp)]
    second = [parts[r, :, :, c:] for r in reversed(range(cp))]
    return torch.cat(first + second, dim=2)


def local_core_slot(attention) -> tuple[object, str]:
    """Where an Attention module keeps the core that computes on this rank's data: (owner, attribute name).
    A core that exchanges data first (`ContextParallelCore`'s key/value all-gather) exposes its local
    computation as `inner`, which is what recomputation and dropout streams wrap; otherwise the module's
    `core` itself."""
    return (attention.core, "inner") if hasattr(attention.core, "inner") else (attention, "core")


class ContextParallelCore:
    """The attention core of one cp rank: its two query chunks against the gathered keys/values. `inner`
    is the local attention (what selective recomputation wraps; the all-gather is not recomputed)."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self.inner = attention_core

    def __call__(self, q, k, v, kind: str, dropout: float, doc_ids=None) -> torch.Tensor:
        """`doc_ids`: packed sequences' document ids of whole rows [b, S] (`shard_batch` leaves them whole),
        so each chunk's mask needs no exchange: its queries' and keys' documents are a slice of them."""
        k, v = self.exchange(k, v)
        c = q.shape[2] // 2
        a, b = self.rank, 2 * self.cp - 1 - self.rank
        docs = () if doc_ids is None else (doc_ids,)
        # Chunk a attends keys [0, (a+1)c), chunk b keys [0, (b+1)c): causal, aligned bottom-right.
        out_a = self.inner(q[:, :, :c], k[:, :, :(a + 1) * c], v[:, :, :(a + 1) * c], kind, dropout, *docs)
        out_b = self.inner(q[:, :, c:], k[:, :, :(b + 1) * c], v[:, :, :(b + 1) * c], kind, dropout, *docs)
        return torch.cat([out_a, out_b], dim=2)

    @torch.compiler.disable  # the exchange stays outside a compiled block's graphs (one graph break)
    def exchange(self, k, v):
        return gather_sequence(k, self.group, self.cp), gather_sequence(v, self.group, self.cp)


class _SumOverShards(torch.autograd.Function):
    """All-reduce (sum) over a group whose backward sums the gradients over it too: every rank uses the sum,
    so each rank's part gets the gradients of all ranks' uses."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SumOverShards.apply(grad, ctx.group), None


class TokenShards:
    """The cp group seen from an MoE layer (`moe.token_shards`, loom/models/moe.py): the ranks holding the
    other tokens of the same sequences, over which the balance loss's per-expert sums and Sinkhorn's
    balancing run, so that they equal one process's."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    @torch.compiler.disable  # collectives stay outside a compiled block's graphs
    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks (differentiable)."""
        return _SumOverShards.apply(x, self.group)

    @torch.compiler.disable
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along dim 0, rank after rank (no gradient)."""
        x = x.detach().contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _ALL_GATHER(out, x, group=self.group)
        return out


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Make `model` (the whole model or one pipeline stage) run on this cp rank's chunks of every sequence:
    the cp attention core in every block and the cp group on its MoE layers. The caller feeds it
    `shard_batch` inputs, their `positions` included."""
    from loom.models.moe import moe_layers

    group, cp, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    for block in model.layers.values():
        block.attention.core = ContextParallelCore(group, cp, rank)
    for moe in moe_layers(model):
        moe.token_shards = TokenShards(group, cp, rank)
