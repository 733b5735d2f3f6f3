"""The data section (`data.*`): pretraining datasets, their blend and split, the tokenizer; and the checks
every recipe's data lists share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loom.config.section import Section
from loom.errors import UserError


@dataclass
class DataConfig(Section):
    # Empty: the embedded corpus (the Python standard library's .py files). Otherwise prefixes of
    # Megatron-style .bin/.idx datasets made by `loom preprocess`.
    paths: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # blending weights, one per path
    valid_paths: list[str] = field(default_factory=list)  # held-out datasets; default: data.split of data.paths
    # Megatron-style document split of each data.paths dataset into train, validation and test shares
    # (contiguous document ranges, deterministic); used for validation whenever data.valid_paths is empty.
    split: str = "969,30,1"
    tokenizer: str = "bpe"  # "bpe": byte-level BPE trained on the corpus; else a tokenizer.json path
    corpus_max_bytes: int = 0  # use only the first N bytes of the embedded corpus (0: all)
    prefetch: bool = True  # read the next step's batch in a background thread during the current step
    # Attention stays inside each document of a sample (documents end with the tokenizer's end-of-document
    # token) and positions restart at each document, as Llama 3 pretrained.
    document_mask: bool = False

    def validate(self) -> None:
        if self.weights and len(self.weights) != len(self.paths):
            raise UserError(
                f"data.weights has {len(self.weights)} entries but data.paths has {len(self.paths)}; "
                "give one weight per path or none"
            )
        if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) <= 0):
            raise UserError(f"data.weights={self.weights} must be >= 0 with a positive sum")
        if self.corpus_max_bytes < 0:
            raise UserError(f"data.corpus_max_bytes={self.corpus_max_bytes} must be >= 0 (0: all)")
        split_shares(self.split)

    def split_ranges(self, documents: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(train, valid, test) document ranges [lo, hi) of a dataset of `documents` documents."""
        return split_ranges(split_shares(self.split), documents)


def split_shares(text: str) -> tuple[float, float, float]:
    """`data.split` ("969,30,1", "98,2", "1") as fractions (train, valid, test)."""
    try:
        parts = [float(x) for x in str(text).replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(x) or x < 0 for x in parts) or not parts[0] > 0:
        raise UserError(f"data.split={text!r} must be up to three shares train,valid,test of non-negative numbers "
                        "with a positive train share, e.g. 969,30,1 (Megatron's default) or 98,2,0")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


def split_ranges(shares: tuple[float, float, float], documents: int):
    """Contiguous document ranges for the shares, as Megatron cuts them (rounded cumulative bounds); a
    non-zero validation share gets at least one document, taken from the end of the training range."""
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + share)
    cut = [round(b * documents) for b in bounds]
    cut[-1] = documents
    if shares[1] > 0 and cut[2] == cut[1] and cut[1] >= 2:
        cut[1] -= 1
    return (cut[0], cut[1]), (cut[1], cut[2]), (cut[2], cut[3])


def check_data_lists(section: str, obj: Section, train: str, valid: str, files: str, what: str) -> None:
    """A recipe's training and held-out data lists: no empty entry, and held-out data only beside training
    data. `files` says what an entry may be, `what` what the training list holds."""
    values = vars(obj)
    for name in (train, valid):
        if any(not str(p).strip() for p in values[name]):
            raise UserError(f"{section}.{name}={values[name]} holds an empty path; give {files}")
    if values[valid] and not values[train]:
        raise UserError(f"{section}.{valid} is set but {section}.{train} is empty; give the training {what} in "
                        f"{section}.{train}")
