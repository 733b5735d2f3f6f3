"""Expert parallelism: the routed experts of every MoE layer sharded over the `ep` mesh dimension, tokens
exchanged all-to-all.

Layout. `parallel.ep` ranks are carved from the data-parallel and context-parallel ranks (the mesh's
`(dp_replicate, dp_shard, cp)` ranks, flattened, are regrouped as `(edp, ep)`, ep innermost:
`loom/parallel/dims.py`). Under sequence parallelism (tp > 1, sp) with ep a multiple of tp the tensor-parallel
ranks join them (`(dp_replicate, dp_shard, cp, tp)` regrouped as `(edp, ep)`, tp dividing ep: Megatron-Core's expert
tensor parallelism 1, `loom.rules.experts_span_tp`): each tp rank then routes its own sequence shard
(loom/parallel/tensor.py keeps the MoE layer on it), so no rank computes another rank's tokens and no two
ranks of a tp group hold the same experts; the balance loss and Sinkhorn cover the tokens of the tp (or
cp x tp) group through `token_shards`. EP rank j holds experts [j*E/ep, (j+1)*E/ep) of every MoE layer. The
stacked expert weights become DTensors `Shard(0)` over the `ep` dimension rather than plain local tensors, because
then everything that already handles sharded parameters handles them unchanged: initialisation fills
each rank's slice with the values one process would hold there (`materialize`), checkpoints save and load
global tensors by name (so a checkpoint loads under any `ep`, or on one process), the gradient norm
combines the shards, and FSDP2 shards them again over the expert-data-parallel ranks (`edp`, the
`(dp_replicate x dp_shard x cp) / ep` ranks holding the same experts) as a 2-D (edp, ep) DTensor.

Token exchange (`ExpertParallel.__call__`, between the MoE's dispatch and combine stages): the rank's
rows, sorted expert-major, are sent to the ranks owning their experts with `all_to_all_single` and
variable splits (first the per-expert counts are exchanged, also all-to-all, with equal splits), regrouped
local-expert-major, computed by the rank's experts, put back in arrival order and returned by the reverse
all-to-all. SwiGLU experts' rows travel with their fp32 gate weights (one more all-to-all of 4 bytes a row),
which the experts fold into their activation (loom/models/swiglu.py), so the rows come back weighted and the
combine keeps none of them. Backward is PyTorch's own: `all_to_all_single_autograd` runs the same exchange with
the splits swapped. Every rank calls both exchanges and its experts (on zero rows if none arrive) in every forward
and backward, so a starved rank or expert never leaves a collective waiting.

Gradients. A rank's expert gradients hold the contributions of the tokens of its whole EP group. The
trainer scales every rank's loss by `grad_ranks / tokens` (data-parallel averaging divides by the dp x
cp ranks); summing expert gradients over the edp group and dividing by dp x cp (FSDP's divide factor on
the experts, `apply_data_parallel`) gives exactly the one-process gradient. With experts spread over tp
ranks the same holds: the tp ranks of a data-parallel rank compute one loss (each token's gradient counted
once, not tp times), an EP group holds whole tp groups, and an edp group (ranks with the same tp rank and
the same experts, one per remaining dp x cp position) is what FSDP reduces over; nothing is reduced over
the tp group for the experts. The router's and shared experts' weights, replicated over tp and used on
each rank's own tokens, get their partial gradients summed over tp by DTensor (as sequence-parallel norms).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard


class ExpertParallel:
    """The token exchange over one EP group; installed on every MoE module as `moe.expert_parallel`.
    `chunks` > 1 (`parallel.ep_overlap_chunks`): the exchange is pipelined with the experts (`_chunked`)."""

    def __init__(self, ep_mesh, chunks: int = 1):
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.chunks = chunks

    @torch.compiler.disable  # split sizes read on the host: eager in a compiled block (one graph break)
    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
        """`x` [N, hidden]: this rank's rows sorted expert-major, `counts[e]` rows for global expert e; `gate`
        [N] (SwiGLU experts): each row's gate weight, sent with it and folded into its expert's activation.
        Returns the rows through their experts (weighted by `gate` when given), in the same order."""
        if self.chunks > 1:
            return self._chunked(experts, x, counts, gate)
        ep = self.size
        local = counts.numel() // ep
        send_counts = counts.view(ep, local).contiguous()  # row j: rows for EP rank j's experts
        recv_counts = torch.empty_like(send_counts)  # row s: rows EP rank s sends for each of my experts
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # one host synchronisation
        send_splits, recv_splits = splits[:ep], splits[ep:]
        received = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        gates = None if gate is None else all_to_all_single_autograd(gate, recv_splits, send_splits, self.group)
        # Arrival order is source-major, then local-expert-major: regroup local-expert-major (stable, so
        # each expert's rows stay in source order).
        expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(
            recv_counts.reshape(-1), output_size=received.shape[0])
        order = torch.argsort(expert_of_row, stable=True)
        y = experts(received[order], recv_counts.sum(0), gate=None if gates is None else gates[order])
        y = y[torch.argsort(order)]  # back to arrival order
        return all_to_all_single_autograd(y, send_splits, recv_splits, self.group)


    def _chunked(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
        """The exchange in `chunks` pipelined parts, so that communication hides behind the experts' products.

        Each expert's rows are cut into `chunks` consecutive parts (sizes differing by at most one row), part c
        of every expert forming chunk c. One all-to-all exchanges every chunk's per-expert counts (one host
        synchronisation, as unchunked); then every chunk's dispatch is issued before any expert runs. The
        functional collectives return tensors that wait only when first read, so on a GPU (NCCL on its own
        stream) chunk c + 1's dispatch is in flight while chunk c's experts compute, and chunk c's combine
        while chunk c + 1's compute; backward runs the same exchanges reversed. Each row meets the same expert
        weights as unchunked: equal to it up to the products' summation order over fewer rows."""
        ep, c = self.size, self.chunks
        local = counts.numel() // ep
        # Part p of expert e: rows [start_e + bound(p), start_e + bound(p + 1)), bound(p) = floor(p * n_e / c).
        part = torch.arange(c + 1, device=counts.device)
        bounds = torch.div(counts.unsqueeze(0) * part.unsqueeze(1), c, rounding_mode="floor")  # [c + 1, E]
        chunk_counts = (bounds[1:] - bounds[:-1])  # [c, E]
        n = x.shape[0]
        expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts, output_size=n)
        within = torch.arange(n, device=x.device) - (torch.cumsum(counts, 0) - counts)[expert_of_row]
        # the part of each row: how many upper bounds it reaches (within >= bound(p) for p = 1..c-1)
        chunk_of_row = (within.unsqueeze(0) >= bounds[1:c, expert_of_row]).sum(0)
        order = torch.argsort(chunk_of_row * counts.numel() + expert_of_row, stable=True)  # chunk, then expert
        send_counts = chunk_counts.view(c, ep, local).transpose(0, 1).contiguous()  # [ep dest, c, local]
        recv_counts = torch.empty_like(send_counts)  # [ep source, c, my local experts]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sizes = torch.cat([send_counts.sum(2).t().reshape(-1), recv_counts.sum(2).t().reshape(-1)]).tolist()
        send, recv = sizes[: c * ep], sizes[c * ep:]  # [chunk][rank]
        sizes_c = [sum(send[i * ep:(i + 1) * ep]) for i in range(c)]

        def dispatch(rows: torch.Tensor) -> list:  # every chunk's dispatch in flight
            return [all_to_all_single_autograd(piece, recv[i * ep:(i + 1) * ep], send[i * ep:(i + 1) * ep], self.group)
                    for i, piece in enumerate(torch.split(rows[order], sizes_c))]

        received = dispatch(x)
        gates = [None] * c if gate is None else dispatch(gate)
        outs = []
        for i in range(c):
            got = recv_counts[:, i]  # [source, local expert]
            expert_of = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(
                got.reshape(-1), output_size=received[i].shape[0])
            regroup = torch.argsort(expert_of, stable=True)
            g = None if gates[i] is None else gates[i][regroup]
            y = experts(received[i][regroup], got.sum(0), gate=g)[torch.argsort(regroup)]
            outs.append(all_to_all_single_autograd(y, send[i * ep:(i + 1) * ep], recv[i * ep:(i + 1) * ep],
                                                   self.group))
        return torch.cat(outs)[torch.argsort(order)]


def apply_expert_parallel(model: nn.Module, ep_mesh, token_mesh=None, chunks: int = 1) -> None:
    """Shard the routed experts of every MoE layer of `model` over `ep_mesh` (on meta or real tensors: the
    rank keeps its slice as the local part of a `Shard(0)` DTensor) and install the token exchange.
    `token_mesh` (experts spread over tp ranks, `loom.rules.experts_span_tp`): the tp or flattened (cp, tp)
    mesh whose ranks hold the other tokens of the same sequences, installed as the layers' `token_shards`
    (in place of the cp group) so that the balance loss and Sinkhorn cover them all."""
    from loom.models.moe import moe_layers
    from loom.parallel.context import TokenShards

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    exchange = ExpertParallel(ep_mesh, chunks)
    for moe in moe_layers(model):
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            per_rank = p.shape[0] // ep
            whole = p.detach().to_local() if isinstance(p, DTensor) else p.detach()  # replicated under TP
            local = whole.narrow(0, rank * per_rank, per_rank).clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                         stride=p.stride())
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        moe.expert_parallel = exchange
        if token_mesh is not None:
            moe.token_shards = TokenShards(token_mesh.get_group(), token_mesh.size(), token_mesh.get_local_rank())
