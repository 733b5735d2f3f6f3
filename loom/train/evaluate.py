"""Evaluation: the mean loss on held-out data, with the loss's statistics; where the loss scores every token,
bits per byte beside gzip -9 and xz -9 on the same bytes."""

from __future__ import annotations

import gzip
import lzma
import math

import torch


class Evaluator:
    def __init__(self, runner, val_data, tokenizer, micro_batch: int):
        self.runner, self.val_data, self.tokenizer, self.micro_batch = runner, val_data, tokenizer, micro_batch
        self._reference: dict | None = None
        self._scored = False

    def reference(self) -> dict | None:
        """Bits per byte of gzip -9 and xz -9 on exactly the held-out bytes the model is scored on (None when the
        held-out data does not score every token)."""
        if not self._scored:
            self._scored = True
            text = self.val_data.scored_bytes(self.tokenizer)
            if text is not None:
                self._reference = {
                    "bytes": len(text),
                    "gzip_bpb": 8 * len(gzip.compress(text, compresslevel=9)) / len(text),
                    "xz_bpb": 8 * len(lzma.compress(text, preset=9)) / len(text),
                }
        return self._reference

    @torch.no_grad()
    def loss_sum_and_count(self) -> tuple[float, int]:
        """The summed loss and what it counts over the whole held-out set."""
        model = self.runner.model
        was_training = model.training
        model.eval()
        total, count, mb = 0.0, 0, self.micro_batch
        # Every rank scores the whole held-out set (all ranks of a layout take part in each forward).
        for start in range(0, len(self.val_data), mb):
            batch = self.val_data.batch(start, min(mb, len(self.val_data) - start))
            total += self.runner.eval_loss_sum(batch).item()
            count += int(self.runner.loss.count(batch))
        model.train(was_training)
        return total, count

    def evaluate(self) -> dict:
        ref = self.reference()
        loss = self.runner.loss
        loss.take_sums()  # start from zero
        total, count = self.loss_sum_and_count()
        sums = loss.take_sums()  # every rank scored the whole held-out set: a recipe's statistics (pref.py)
        out = {"val_loss": total / count, **{f"val_{k}": v.item() / count for k, v in sums.items()}}
        if ref is not None:
            out.update(val_bpb=total / math.log(2) / ref["bytes"], gzip_bpb=ref["gzip_bpb"], xz_bpb=ref["xz_bpb"])
        return out
