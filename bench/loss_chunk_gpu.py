"""LM head + cross-entropy alone, forward and backward, on one GPU: the plain loss (whole fp32 logits)
against loom's chunked loss (`loom.models.losses.chunked_token_loss_sum`, gradients computed in forward)
and, for reference, the earlier chunked loss that recomputed each chunk's logits in backward (a
non-reentrant checkpoint per chunk, kept here only to measure against).

As loom's single-GPU runner calls it: fp32 weight and hidden states under bf16 autocast. Prints one JSON
row per variant: milliseconds per forward+backward and peak memory above what was allocated before.

    python3 bench/loss_chunk_gpu.py --tokens 16384 --hidden 2048 --vocab 128256 --chunks 8192,4096
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loom.models.losses import chunked_token_loss_sum, token_loss_sum  # noqa: E402


def recompute_chunked(h, w, y, chunk):
    """The earlier implementation: each chunk a checkpoint, its logits recomputed in backward."""
    def part(hc, yc):
        return F.cross_entropy(F.linear(hc, w).float(), yc, reduction="sum")

    h, y = h.flatten(0, 1), y.flatten()
    return sum(checkpoint(part, h[i:i + chunk], y[i:i + chunk], use_reentrant=False)
               for i in range(0, h.shape[0], chunk))


def measure(fn, h, w, y, steps, warmup):
    def once():
        h.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, y)
        (loss * 0.5).backward()
        return loss

    for _ in range(warmup):
        once()
    torch.cuda.synchronize()
    h.grad = w.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        loss = once()
    end.record()
    torch.cuda.synchronize()
    return {"ms": round(start.elapsed_time(end) / steps, 3),
            "peak_gib_above_inputs": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3),
            "loss": float(loss.detach()), "grad_h": h.grad.float().clone(), "grad_w": w.grad.float().clone()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunks", default="8192,4096")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    h = (torch.randn(1, args.tokens, args.hidden, device=dev)).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device=dev) * 0.02).requires_grad_()
    y = torch.randint(0, args.vocab, (1, args.tokens), device=dev)
    variants = {"plain": lambda h, w, y: token_loss_sum(F.linear(h, w), y)}
    for c in (int(c) for c in args.chunks.split(",")):
        variants[f"chunked_{c}"] = lambda h, w, y, c=c: chunked_token_loss_sum(h, w, y, c)
        variants[f"recompute_{c}"] = lambda h, w, y, c=c: recompute_chunked(h, w, y, c)
    ref = None
    for name, fn in variants.items():
        row = measure(fn, h, w, y, args.steps, args.warmup)
        gh, gw = row.pop("grad_h"), row.pop("grad_w")
        if ref is None:
            ref = row["loss"], gh, gw
        row["loss_rel_diff"] = abs(row["loss"] / ref[0] - 1)
        row["grad_h_max_rel"] = float((gh - ref[1]).abs().max() / ref[1].abs().max())
        row["grad_w_max_rel"] = float((gw - ref[2]).abs().max() / ref[2].abs().max())
        print(json.dumps({"variant": name, "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                          "device": torch.cuda.get_device_name(), "torch": torch.__version__, **row}), flush=True)


if __name__ == "__main__":
    main()
