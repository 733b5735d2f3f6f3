"""The LM head's weight gradient written by the chunked loss straight into the distributed optimizer's fp32 buffer.

The chunked cross-entropy (`train.loss_chunk`, loom/models/losses.py) computes the head weight's gradient in its
forward, chunk by chunk. Without this it accumulates it into an fp32 tensor of its own, kept until backward, which
returns it cast to the weight's dtype as `.grad` for the optimizer's hook to add into its fp32 buffer: the head's
gradient three times over (4.2 GB of fp32 alone for Llama-3-70B's 1.05B-parameter head). With this, as Megatron's
gradient-accumulation fusion does for its linear layers, each chunk's product goes into the weight's place in the
optimizer's buffer (`HeadGrad.add`: beta=0 for the first, on CUDA inside the GEMM, `out_dtype`) and backward only
scales those rows by its grad_output (`HeadGrad.finish`) and tells the optimizer the gradient arrived; autograd
gets no gradient for the weight.

When: the head is a plain bias-free `nn.Linear` whose weight is the optimizer's (not a DTensor: no tp, which the
chunked loss does not run anyway), with `parallel.distopt_fused_wgrad` (the default). A tied embedding's only with
sharded weights (loom/parallel/zero.py): backward scales its rows and leaves them filled (no reduction yet) for the
embedding's gradient, which arrives through autograd at the end of backward, to be added in, and releases the
gathered weight, which nothing in backward reads (the chunked loss computed the hidden states' gradient in forward;
the embedding's backward reads only the token ids). The rows must hold no gradient of the step yet, since backward
scales all they hold: with sharded weights (loom/parallel/zero.py) every micro-batch's buffer is fresh, so every
micro-batch is fused; the whole-weights distributed optimizer (distopt.py) accumulates micro-batches in the buffer,
so there only a step's first micro-batch is, and later ones keep the fp32 accumulator until backward, which adds
it, scaled, into the buffer (`HeadGrad.add_scaled`; no 16-bit `.grad` either).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class HeadGrad:
    """The LM head weight's fp32 gradient rows in a `DistributedOptimizer`'s buffer, as the chunked loss writes
    them (the weight's `_loom_grad_into`; see the module docstring). `fusions`: the micro-batches whose products went
    straight into the buffer; `added`: those whose fp32 accumulator was added in backward."""

    def __init__(self, opt, bucket, slot, node, tied: bool = False):
        self.opt, self.bucket, self.slot, self.node, self.tied = opt, bucket, slot, node, tied
        self.pending = None  # a weak reference to the forward whose unscaled products the rows hold
        self.fusions = self.added = 0

    def start(self, ctx) -> bool:
        """Whether forward `ctx` may write its products into the buffer: the rows hold none of this step's gradient
        (False: forward keeps its own fp32 accumulator). Backward scales every row, so two forwards' products cannot
        share them: a second chunked loss of the head before the first one's backward is refused (loom's runners
        run one loss per backward)."""
        if self.pending is not None and self.pending() is not None:
            raise RuntimeError("a second chunked loss of the LM head before the first one's backward: the head's "
                               "gradient is written into the distributed optimizer's buffer (loom/parallel/"
                               "headgrad.py), one forward at a time; run backward in between, or "
                               "parallel.distopt_fused_wgrad=false")
        if self.slot.filled:
            return False
        self.pending = weakref.ref(ctx)
        self.fusions += 1
        return True

    def _rows(self) -> list[tuple[int, torch.Tensor]]:
        """(first weight row, its fp32 rows of the buffer) per rank holding rows: one piece with sharded weights,
        whose rank-major buffer is the weight's rows in order."""
        slot, buf = self.slot, self.opt._grad_buffer(self.bucket)
        if self.opt.PER_PARAM:
            return [(0, buf.view(-1)[:slot.rows * slot.width].view(slot.rows, slot.width))]
        out = []
        for r in range(self.bucket.where.n):
            rows = slot.my_rows(r)
            if not rows:
                break
            out.append((r * slot.per_rank, buf[r, slot.offset:slot.offset + rows * slot.width].view(rows, slot.width)))
        return out

    def add(self, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
        """The weight's rows += a @ b (`first`: =), a [vocab, tokens] the chunk's logit gradient transposed, b its
        [tokens, hidden] inputs: on CUDA with 16-bit inputs inside the GEMM (`out_dtype`), elsewhere computed, then
        added or copied."""
        for start, seg in self._rows():
            part = a[start:start + seg.shape[0]]
            if a.dtype == torch.float32:
                torch.mm(part, b, out=seg) if first else seg.addmm_(part, b)
            elif self.opt.fused_gemm:
                torch.addmm(seg, part, b, beta=0 if first else 1, out_dtype=torch.float32, out=seg)
            else:
                seg.copy_(part @ b) if first else seg.add_(part @ b)

    def _runs(self) -> bool:
        """Whether this backward accumulates the weight's gradient (not `torch.autograd.grad` for inputs only)."""
        return torch._C._will_engine_execute_node(self.node)

    def finish(self, ctx, scale: torch.Tensor) -> None:
        """Backward of forward `ctx`, which `start` admitted: its rows scaled by `scale` (grad_output), and the
        optimizer told the gradient arrived. A backward that does not accumulate the weight's gradient drops them
        (the slot is not filled: the next gradient overwrites them, a reduction zeroes them)."""
        if self.pending is None or self.pending() is not ctx:
            raise RuntimeError("a second backward through the chunked loss (retain_graph): its head gradient was "
                               "written into the distributed optimizer's buffer and scaled by the first")
        self.pending = None
        if not self._runs():
            if self.opt.PER_PARAM:
                self.bucket.grad = None
            return
        for _, seg in self._rows():
            seg.mul_(scale)
        self._done()

    def _done(self) -> None:
        """The head's part of the gradient is in the rows: reduce them, or, tied, leave them for the embedding's."""
        if self.tied:  # (the embedding's gradient is added in by the optimizer's hook, which then reduces them)
            self.slot.filled = True
            self.opt._release_bucket(self.bucket)
        else:
            self.opt._arrived(self.bucket, self.slot)

    def add_scaled(self, grad: torch.Tensor) -> None:
        """Backward of a forward that kept its own fp32 accumulator: `grad` (the weight's shape, scaled) added into
        the buffer, as the optimizer's hook adds a `.grad`."""
        if not self._runs():
            return
        self.added += 1
        for start, seg in self._rows():
            src = grad[start:start + seg.shape[0]]
            seg.add_(src) if self.slot.filled else seg.copy_(src)
        self._done()


def attach_head(opt, parts: list[nn.Module]) -> HeadGrad | None:
    """Give the LM head's weight (untied; or tied, with sharded weights) its `HeadGrad` as `_loom_grad_into` (see
    the module docstring); returns it, or None where the head is not fused."""
    where = {id(slot.param): (bucket, slot) for bucket in opt.buckets for slot in bucket.slots
             if not bucket.where.experts}
    for part in parts:
        head, embed = getattr(part, "output", None), getattr(part, "tok_embeddings", None)
        if type(head) is not nn.Linear or head.bias is not None:  # fp8 (Float8Linear) and LoRA heads are not
            continue
        weight = head.weight
        tied = embed is not None and getattr(embed, "weight", None) is weight
        if isinstance(weight, DTensor) or id(weight) not in where or (tied and not opt.PER_PARAM):
            continue
        with torch.enable_grad():
            node = weight.view_as(weight).grad_fn.next_functions[0][0]  # its AccumulateGrad node
        weight._loom_grad_into = HeadGrad(opt, *where[id(weight)], node, tied)
        return weight._loom_grad_into
    return None
