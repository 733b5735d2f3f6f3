"""Loss functions: a pluggable function of the model's output and the batch.

The step runners (loom/train/steps.py) call a loss as `loss(output, batch)` for one micro-batch and get
the loss *summed* over what it counts (tokens for cross-entropy), and `loss.count(batch)` for how many
units that sum covers. The runner divides by the count over the whole global batch, so gradient
accumulation and data parallelism give exactly the mean over the global batch whatever the
micro-batch size. A loss that counts data-dependent units (a masked SFT loss counts only the response
tokens) says so with `count_varies = True`; the runner then sums the counts over the data-parallel ranks
before the backward passes.

A batch is a dict of tensors whose first dimension is the sample: `input_ids` and `labels` today
(`labels[:, i]` is the token after `input_ids[:, i]`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

Batch = dict[str, torch.Tensor]


class Loss(Protocol):
    count_varies: bool

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor: ...

    def count(self, batch: Batch) -> int | torch.Tensor: ...


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over all tokens, computed in fp32 (on vocabulary shards under TP)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class TokenCrossEntropy:
    """Next-token cross-entropy summed over every position; counts every position."""

    count_varies = False

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        return token_loss_sum(output, batch["labels"])

    def count(self, batch: Batch) -> int:
        return batch["labels"].numel()
