"""An independent encoding of preference pairs for tests/test_dpo.py and tests/test_rm.py: the ChatML text
written out by hand, tokenized whole, the reply's tokens found by character offsets; plain pairs as
prompt ids + reply ids + end-of-document."""

from __future__ import annotations

import torch

from loom.data.tokenizer import Tokenizer


def encode_side(tok: Tokenizer, record: dict, side: str) -> tuple[list[int], int]:
    """(token ids, index of the first scored token) of one side of a pair record."""
    if isinstance(record["prompt"], str):
        prompt = tok.encode(record["prompt"])
        return prompt + tok.encode(record[side]) + [tok.eod_id], len(prompt)
    question, answer = record["prompt"][0]["content"], record[side][0]["content"]
    head = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    enc = tok.tok.encode(head + answer + "<|im_end|>\n", add_special_tokens=False)
    first = next(i for i, (start, _) in enumerate(enc.offsets) if start >= len(head))
    return enc.ids, first


def reply_logprob(model, ids: list[int], first: int) -> float:
    """Summed log-probability of ids[first:] given what precedes, in float64 from one unpadded forward."""
    x = torch.tensor([ids[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0].double(), -1)
    return sum(logp[t - 1, ids[t]].item() for t in range(first, len(ids)))


def last_hidden(model, ids: list[int]) -> torch.Tensor:
    """The final-norm hidden state at the last input position (inputs = ids[:-1])."""
    with torch.no_grad():
        return model(torch.tensor([ids[:-1]]), return_hidden=True)[0, -1]
