"""Loss functions: a pluggable function of the model's output and the batch.

The step runners (loom/train/steps.py) call a loss as `loss(output, batch)` for one micro-batch and get
the loss *summed* over what it counts (tokens for cross-entropy), and `loss.count(batch)` for how many
units that sum covers. The runner divides by the count over the whole global batch, so gradient
accumulation and data parallelism give exactly the mean over the global batch whatever the
micro-batch size. A loss that counts data-dependent units (a masked SFT loss counts only the response
tokens) says so with `count_varies = True`; the runner then sums the counts over the data-parallel ranks
before the backward passes.

A batch is a dict of tensors whose first dimension is the sample: `input_ids` and `labels`
(`labels[:, i]` is the token after `input_ids[:, i]`), and what a recipe's loss reads.

A loss whose `wants_hidden` is true gets a `HeadInput` (the final hidden states and the LM head module)
instead of logits, and applies the head itself: `TokenCrossEntropy(chunk_tokens=N)` computes head and
cross-entropy N tokens at a time and recomputes each chunk's logits in backward, so the fp32 logits of
the whole micro-batch (4 bytes x tokens x vocabulary: 4 GiB per 8k tokens at vocabulary 128k) never exist.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from loom.ledger import SavedTensorLedger

Batch = dict[str, torch.Tensor]


class Loss:
    """A loss of the model's output and a micro-batch, summed over what it counts (see the module docstring).

    - `__call__(output, batch)`: the summed loss (`output`: logits, or a `HeadInput` when `wants_hidden`);
    - `count(batch)`: how many units that sum covers;
    - `count_varies`: whether the count depends on the data (summed over ranks before the backward passes);
    - `wants_hidden`: whether it takes the final hidden states and the LM head instead of logits;
    - `take_sums()`: statistics summed over the units counted since the last call ({name: tensor}), logged as
      their means with each step and, prefixed val_, with each evaluation.
    """

    count_varies: bool = False
    wants_hidden: bool = False

    def __call__(self, output, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def count(self, batch: Batch) -> int | torch.Tensor:
        raise NotImplementedError

    def take_sums(self) -> dict[str, torch.Tensor]:
        return {}


class HeadInput(NamedTuple):
    """What a `wants_hidden` loss receives: hidden states [batch, seq, hidden] after the final norm, and
    the LM head (a bias-free Linear) to apply to them."""

    hidden: torch.Tensor
    head: nn.Module


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def chunked_token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """`token_loss_sum(hidden @ weight.T, targets)` computed `chunk_tokens` tokens at a time.

    Each chunk is a non-reentrant checkpoint: forward keeps only its inputs (views of `hidden`, and the
    head weight), backward recomputes that chunk's logits, so at most one chunk's fp32 logits (and their
    gradient) are alive at once. Costs one more head forward (2 x tokens x hidden x vocab FLOPs).
    """
    h, y = hidden.flatten(0, 1), targets.flatten()
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if grad and SavedTensorLedger.active is not None:  # a checkpoint keeps its inputs outside autograd's
        SavedTensorLedger.active.record(h)  # saved tensors: tell the ledger
    total = None
    for i in range(0, h.shape[0], chunk_tokens):
        args = (h[i:i + chunk_tokens], weight, y[i:i + chunk_tokens])
        part = checkpoint(_chunk_loss_sum, *args, use_reentrant=False) if grad else _chunk_loss_sum(*args)
        total = part if total is None else total + part
    return total


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over all tokens, computed in fp32 (on vocabulary shards under TP)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class TokenCrossEntropy(Loss):
    """Next-token cross-entropy summed over every position; counts every position.

    `chunk_tokens > 0`: the loss takes the hidden states and the head (`wants_hidden`) and never holds
    the whole micro-batch's logits (`chunked_token_loss_sum`); it also accepts logits, as the plain loss.
    """

    count_varies = False

    def __init__(self, chunk_tokens: int = 0):
        self.chunk_tokens = chunk_tokens
        self.wants_hidden = chunk_tokens > 0

    def __call__(self, output, batch: Batch) -> torch.Tensor:
        if isinstance(output, HeadInput):
            return chunked_token_loss_sum(output.hidden, output.head.weight, batch["labels"], self.chunk_tokens)
        return token_loss_sum(output, batch["labels"])

    def count(self, batch: Batch) -> int:
        return batch["labels"].numel()


IGNORE = -100  # a label that is not scored (prompt tokens, padding), as in PyTorch and Hugging Face


class MaskedTokenCrossEntropy(TokenCrossEntropy):
    """Next-token cross-entropy summed over the positions whose label is not `IGNORE` (-100); counts those.

    Supervised fine-tuning scores only the response tokens (cross-entropy skips ignore_index=-100). The
    count depends on the data (`count_varies`), so the runner divides by the supervised tokens of the whole
    global batch, summed over micro-batches and data-parallel ranks: accumulation and data parallelism give
    exactly the mean over the global batch's supervised tokens. The labels carry the mask, so pipeline
    stages need nothing else.
    """

    count_varies = True

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch["labels"] != IGNORE).sum()
