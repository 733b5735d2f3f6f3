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
cross-entropy N tokens at a time, so the fp32 logits of the whole micro-batch (4 bytes x tokens x
vocabulary: 4 GiB per 8k tokens at vocabulary 128k) never exist. As fused linear cross-entropy kernels do,
its forward also computes the gradients of the hidden states and the head weight, chunk by chunk, and
backward only scales them (`chunked_token_loss_sum`): the head's matmuls are the plain loss's three, none
recomputed; what stays alive from forward to backward is the hidden states' gradient and an fp32 copy of
the head weight's. Where the distributed optimizer holds an untied head (`parallel.distributed_optimizer`,
with `distopt_fused_wgrad`), that copy is its fp32 gradient buffer: the weight's `_loom_grad_into`
(loom/parallel/headgrad.py) takes each chunk's product straight into the weight's rows there, backward scales
them in place and autograd gets no weight gradient (with sharded weights every micro-batch; with whole weights
a step's first, whose rows hold nothing yet: later micro-batches keep their own fp32 copy, added into the
buffer in backward). Tied heads, FSDP and one process keep the copy and return the gradient to autograd.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]
IGNORE = -100  # a label that is not scored (prompt tokens, padding), as in PyTorch and Hugging Face


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


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` computes in here: autocast's, else the inputs' common dtype."""
    dev = hidden.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _autocast_off(device: torch.device):
    """The chunk loop casts explicitly (`_matmul_dtype`); autocast must not cast again."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else nullcontext()


def _fp32_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with an fp32 result (added into `out` when given): on CUDA a 16-bit matmul writes fp32 itself
    (no 16-bit result, no cast pass); elsewhere the result is cast, or the matmul is fp32 already."""
    if a.dtype == torch.float32:
        return torch.mm(a, b) if out is None else out.addmm_(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32) if out is None else torch.addmm(
            out, a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a, b).float() if out is None else out.add_(torch.mm(a, b))


def _chunk_loss(h: torch.Tensor, weight_t: torch.Tensor, y: torch.Tensor):
    """One chunk: its fp32 logits, shifted by their row maxima and exponentiated in place (`e`), the rows'
    sums of `e`, which rows count, their targets made safe to index, and the chunk's summed loss."""
    logits = _fp32_mm(h, weight_t)
    valid = y != IGNORE
    safe = torch.where(valid, y, 0)
    top = logits.amax(dim=1)
    target = logits.gather(1, safe[:, None]).squeeze(1)
    e = logits.sub_(top[:, None]).exp_()
    sums = e.sum(dim=1)
    loss = torch.where(valid, sums.log() + top - target, 0.0).sum()  # log-sum-exp minus the target's logit
    return e, sums, valid, safe, loss


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T` whose forward also computes the gradients (for a
    grad_output of 1), chunk by chunk; backward only scales them. See `chunked_token_loss_sum`."""

    @staticmethod
    def forward(ctx, h, weight, y, chunk_tokens):
        dtype = _matmul_dtype(h, weight)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.dtypes = (h.dtype, weight.dtype)
        # The distributed optimizer's fp32 rows of the weight's gradient (loom/parallel/headgrad.py): this forward's
        # products go straight there when they hold none of the step's gradient yet (`fused`).
        ctx.into = getattr(weight, "_loom_grad_into", None) if want_w else None
        fused = ctx.into is not None and h.shape[0] > 0 and ctx.into.start(ctx)
        ctx.fused = fused
        with _autocast_off(h.device):
            w = weight.to(dtype)
            w_t = w.t()
            grad_h = torch.empty(h.shape, dtype=dtype, device=h.device) if want_h else None
            grad_w = None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for i in range(0, h.shape[0], chunk_tokens):
                hc = h[i:i + chunk_tokens].to(dtype)
                e, sums, valid, safe, part = _chunk_loss(hc, w_t, y[i:i + chunk_tokens])
                total += part
                # d loss / d logits = softmax - one-hot = (e - sum * one-hot) / sum, 0 for ignored rows: the
                # one-hot in place on the fp32 chunk, the division, mask and cast in one pass
                e.scatter_add_(1, safe[:, None], -sums[:, None])
                scale = torch.where(valid, sums.reciprocal(), 0.0)[:, None]
                if dtype == torch.float32:
                    grad = e.mul_(scale)
                else:
                    grad = torch.empty(e.shape, dtype=dtype, device=e.device)
                    torch.mul(e, scale, out=grad)
                del e
                if want_h:
                    torch.mm(grad, w, out=grad_h[i:i + chunk_tokens])
                if want_w and fused:
                    ctx.into.add(grad.t(), hc, first=i == 0)
                elif want_w:
                    grad_w = _fp32_mm(grad.t(), hc, out=grad_w)
                del grad
        # What backward needs is these two gradients (the inputs are not kept): autograd's saved tensors,
        # so saved-tensor hooks (loom memory's ledger) see them.
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        # Scaled in place (no second copy of the fp32 weight gradient): a second backward through the same
        # graph (retain_graph) is refused by autograd's in-place check (the fused head's rows: by `finish`).
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = grad_h.to(h_dtype).mul_(grad_output) if grad_h is not None else None
        if ctx.into is not None:  # the weight's gradient goes into the optimizer's buffer, not to autograd
            if ctx.fused:
                ctx.into.finish(ctx, grad_output)
            elif grad_w is not None:
                ctx.into.add_scaled(grad_w.mul_(grad_output))
            return dh, None, None, None
        dw = grad_w.mul_(grad_output).to(w_dtype) if grad_w is not None else None
        return dh, dw, None, None


def chunked_token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """`token_loss_sum(hidden @ weight.T, targets)` computed `chunk_tokens` tokens at a time, the logits of
    the whole micro-batch never held (labels IGNORE = -100 score nothing).

    When a gradient is wanted, forward computes it too, as fused linear cross-entropy kernels do: per chunk
    the logits (matmul in the compute dtype, then fp32), the loss, softmax minus one-hot in place on those
    fp32 logits, the hidden states' gradient (stored per chunk into one tensor the shape of `hidden`) and
    the weight's gradient (accumulated in fp32). Backward only scales the two by grad_output: nothing is
    recomputed, the head's matmuls are the plain loss's three. Alive: one chunk's fp32 logits (and their
    16-bit copy), then until backward the hidden states' gradient and an fp32 copy of the weight's, or, where
    the weight has a `_loom_grad_into` (the distributed optimizer's, loom/parallel/headgrad.py), its rows of the
    optimizer's fp32 gradient buffer instead (backward scales them there and returns no weight gradient).
    """
    h, y = hidden.flatten(0, 1), targets.flatten()
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, y, chunk_tokens)
    dtype = _matmul_dtype(h, weight)  # no gradient: the loss alone, chunk by chunk
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    with _autocast_off(h.device):
        w_t = weight.to(dtype).t()
        for i in range(0, h.shape[0], chunk_tokens):
            total += _chunk_loss(h[i:i + chunk_tokens].to(dtype), w_t, y[i:i + chunk_tokens])[-1]
    return total


def run_loss_chunk(cfg) -> int:
    """The tokens per loss chunk of a run of `cfg` (`loom.rules.loss_chunk_tokens` on the device train.device
    names here: auto, a GPU if there is one)."""
    from loom.rules import loss_chunk_tokens

    device = cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return loss_chunk_tokens(cfg.train.loss_chunk, device, cfg.parallel.tp, cfg.parallel.pp)


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
