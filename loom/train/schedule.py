"""Learning-rate schedule: linear warmup, then cosine or linear decay to `min_lr`, then flat.

A pure function of the step, so a resumed run needs only the step number.
"""

from __future__ import annotations

import math

from loom.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.decay == "constant":
        return optim.lr
    decay_steps = optim.decay_steps or max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    if optim.decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * factor
