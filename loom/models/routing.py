"""The routers' arithmetic for loom's mixture of experts (loom/models/moe.py, which re-exports it): Sinkhorn
balancing of router logits, Switch Transformer's balance loss and ST-MoE's z-loss.
"""

from __future__ import annotations

import math

import torch


@torch.compiler.disable  # iterates to a tolerance read on the host: eager in a compiled block (one graph break)
def sinkhorn(logits: torch.Tensor, tol: float = 1e-4, max_iters: int = 1000) -> torch.Tensor:
    """Sinkhorn balancing of router logits [T, E] in fp32, as Megatron-Core's S-BASE router does.

    Scales the rows and columns of exp(logits) alternately until the column scaling changes by less than
    `tol` (mean absolute change): the result's columns each sum to 1/E (the last scaling) and its rows to
    1/T up to the tolerance, i.e. every expert gets the same share of the tokens.
    """
    x = logits.detach().float()
    if x.device.type == "meta":  # shapes only (loom memory)
        return torch.empty_like(x)
    cost = torch.exp(x - x.max())  # a constant factor cancels in the scalings
    t, e = cost.shape
    eps = 1e-8
    d0 = torch.ones(t, dtype=cost.dtype, device=cost.device)
    d1 = torch.ones(e, dtype=cost.dtype, device=cost.device)
    for _ in range(max_iters):
        d0 = (1.0 / t) / ((cost * d1).sum(1) + eps)
        d1_new = (1.0 / e) / ((cost * d0[:, None]).sum(0) + eps)
        err = (d1_new - d1).abs().mean()
        d1 = d1_new
        if err.item() <= tol:
            break
    return cost * d0[:, None] * d1


def load_balance_loss(chosen: torch.Tensor, probs: torch.Tensor, experts: int, shards=None) -> torch.Tensor:
    """Switch Transformer's balance loss, unweighted: E * sum_i f_i * P_i, with f_i the share of the k * T
    assignments routed to expert i (before any capacity dropping) and P_i the mean router probability of
    expert i (1 when both are uniform). chosen [..., T, k], probs [..., T, E]: with a leading batch
    dimension, per sequence then averaged (the sequence-wise variant of DeepSeek-V3). `shards` (context
    parallelism): the tokens are this rank's part of the sequences; f and P are summed over the shards."""
    t, k = chosen.shape[-2], chosen.shape[-1]
    # Allocated flat, then viewed, as in `GroupedExperts._grouped`: zeros shaped as `probs` would be merged with
    # the ones the backward of the router's top-k creates, and a compiled block saved them, 4E bytes a token.
    shape = (*chosen.shape[:-1], experts)
    one_hot = torch.zeros(math.prod(shape), device=chosen.device, dtype=probs.dtype).view(shape)
    one_hot.scatter_add_(-1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    if shards is None:
        f, p = one_hot.sum(-2) / (t * k), probs.mean(-2)
    else:
        t = t * shards.size
        f, p = shards.sum(one_hot.sum(-2)) / (t * k), shards.sum(probs.sum(-2)) / t
    return (experts * (f * p).sum(-1)).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, unweighted: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
