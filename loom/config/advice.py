"""Settings that are valid but probably not what the user meant: printed under the run's banner, never refused
(a smoke run of 3 steps with the default warmup is legitimate)."""

from __future__ import annotations

from loom.config.schema import Config

# Above this, a preference or RL run from trained weights is using a from-scratch learning rate (TRL's DPOTrainer
# defaults to 1e-6; bench/results/dpo_lr_from_sft.json measures tiny-dpo from a tiny-sft run at several rates).
PREFERENCE_LR_FROM_TRAINED = 1e-4


def run_advice(cfg: Config, command: str) -> list[str]:
    """One line per questionable setting of a run of `loom COMMAND`."""
    out = []
    o, t = cfg.optim, cfg.train
    if o.warmup_steps > t.steps:
        peak = o.lr * t.steps / o.warmup_steps
        out.append(f"note: optim.warmup_steps={o.warmup_steps} > train.steps={t.steps}: the learning rate rises to "
                   f"{peak:.2e} at most and never reaches optim.lr={o.lr:g}; lower optim.warmup_steps to run at "
                   "optim.lr")
    if command in ("dpo", "rm", "rl") and t.init_from and o.lr > PREFERENCE_LR_FROM_TRAINED:
        out.append(f"note: optim.lr={o.lr:g} starting from trained weights (train.init_from): preference and RL "
                   "training of a trained model usually takes 1e-6 to 1e-4 (TRL's DPO default: 1e-6; "
                   "bench/dpo_lr_from_sft.py compares rates on the tiny configs); a from-scratch rate like this "
                   "one learns less and can make the loss rise")
    return out
