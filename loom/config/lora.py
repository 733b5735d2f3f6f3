"""`lora.*`: low-rank adapters (Hu et al. 2021) on chosen linear layers, for `loom sft`, `dpo`, `rm` and `rl`.

With `lora.rank > 0` every weight of the model is frozen (kept in train.dtype, with no gradient and no
optimizer state) and each targeted projection W gains two trained matrices A [rank, in] and B [out, rank]:
y = W x + (alpha / rank) B A dropout(x). A starts Kaiming-uniform and B at zero (PEFT's initialisation), so
step 0 computes exactly the base model. Targets are projection names, in Hugging Face / PEFT spelling or
loom's own: `TARGETS` maps one onto the other. The module is loom/models/lora.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loom.config.section import Section
from loom.errors import UserError

# Hugging Face / PEFT projection name -> loom's module name (loom/models/llama.py).
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w1", "up_proj": "w3",
           "down_proj": "w2"}
MLP_TARGETS = ("w1", "w2", "w3")
ALL_LINEAR = "all-linear"  # PEFT's spelling of "every linear layer but the LM head"


def loom_targets(targets: list[str]) -> list[str]:
    """loom module names (wq, ..., w3) of `lora.targets`, in loom's order, each once."""
    names = set()
    for t in targets:
        names.update(TARGETS.values() if t == ALL_LINEAR else [TARGETS.get(t, t)])
    return [n for n in TARGETS.values() if n in names]


def hf_target(name: str) -> str:
    """The Hugging Face name of loom module `name` (wq -> q_proj)."""
    return {v: k for k, v in TARGETS.items()}[name]


def check_lora_model(lora: "LoRAConfig", model) -> None:
    """UserError for MLP targets on a mixture-of-experts model: its stacked expert weights take no adapters."""
    if not (lora.enabled and model.moe.experts):
        return
    mlp = [t for t in lora.targets if TARGETS.get(t, t) in MLP_TARGETS or t == ALL_LINEAR]
    if mlp:
        raise UserError(f"lora.targets={','.join(lora.targets)} adapts MLP projections ({', '.join(mlp)}), but this "
                        "model's MLPs are mixtures of experts, whose stacked expert weights take no adapters; target "
                        "the attention projections (q_proj,k_proj,v_proj,o_proj)")


@dataclass
class LoRAConfig(Section):
    """Low-rank adapters: rank 0 trains every weight (full fine-tuning)."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input only
    # Projections to adapt: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or loom's wq, wk, wv,
    # wo, w1, w3, w2), or "all-linear" (all seven; never the LM head or the embedding).
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 0:
            raise UserError(f"lora.rank={self.rank} must be >= 0 (0: no adapters, full fine-tuning; typical: 8 to 64)")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise UserError(f"lora.alpha={self.alpha} must be a finite number > 0 (the update is scaled by "
                            "alpha / rank; typical: 16 or 2 x rank)")
        if not 0 <= self.dropout < 1:
            raise UserError(f"lora.dropout={self.dropout} must be in [0, 1)")
        valid = [*TARGETS, ALL_LINEAR, *TARGETS.values()]
        unknown = [t for t in self.targets if t not in valid]
        if unknown:
            raise UserError(f"lora.targets has {', '.join(repr(t) for t in unknown)}, which names no projection; "
                            f"valid: {', '.join(TARGETS)} (Hugging Face names), {', '.join(TARGETS.values())} "
                            f"(loom's), or {ALL_LINEAR}")
        if self.rank and not self.targets:
            raise UserError(f"lora.rank={self.rank} but lora.targets is empty; name the projections to adapt, e.g. "
                            f"--lora.targets=q_proj,v_proj or {ALL_LINEAR}")
