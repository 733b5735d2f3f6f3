"""Evaluation: the mean loss and bits per byte on held-out samples, beside gzip -9 and xz -9 on the same bytes."""

from __future__ import annotations

import gzip
import lzma
import math

import torch

from loom.train.steps import read_batch


class Evaluator:
    def __init__(self, runner, val_data, tokenizer, micro_batch: int):
        self.runner, self.val_data, self.tokenizer, self.micro_batch = runner, val_data, tokenizer, micro_batch
        self._reference = None

    def reference(self) -> dict:
        """Bits per byte of gzip -9 and xz -9 on exactly the held-out bytes the model is scored on."""
        if self._reference is None:
            text = b"".join(self.tokenizer.token_bytes(self.val_data[i][1:].tolist()) for i in range(len(self.val_data)))
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
            batch = read_batch(self.val_data, start, min(mb, len(self.val_data) - start))
            total += self.runner.eval_loss_sum(batch).item()
            count += int(self.runner.loss.count(batch))
        model.train(was_training)
        return total, count

    def evaluate(self) -> dict:
        if hasattr(self.val_data, "batch"):  # rows the dataset makes (SFT): the mean loss over what it scores
            take = getattr(self.runner.loss, "take_sums", None)  # a recipe's statistics (loom/post/pref.py)
            if take is not None:
                take()  # start from zero
            total, count = self.loss_sum_and_count()
            sums = take() if take is not None else {}  # every rank scored the whole held-out set
            return {"val_loss": total / count, **{f"val_{k}": v.item() / count for k, v in sums.items()}}
        ref = self.reference()
        total, count = self.loss_sum_and_count()
        return {
            "val_loss": total / count,
            "val_bpb": total / math.log(2) / ref["bytes"],
            "gzip_bpb": ref["gzip_bpb"],
            "xz_bpb": ref["xz_bpb"],
        }
