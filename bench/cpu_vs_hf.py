"""Single-process CPU training throughput: loom's trainer vs a plain transformers + AdamW loop.

Same shape (the `tiny` config), same fp32 dtype, same batches from the embedded corpus, same loss
(mean token cross-entropy), same clipping. The two are run side by side in one invocation, in
alternating rounds (loom first, then transformers first) so that drift in the machine's speed hits both equally; each figure is total
tokens over total time of its timed steps (warm-up steps excluded).

    .venv/bin/python bench/cpu_vs_hf.py [--rounds 4] [--steps 5] [--out bench/results/cpu_vs_hf.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.config import load_config  # noqa: E402
from loom.data.loader import batch  # noqa: E402
from loom.provenance import stamp  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402


class HFLoop:
    """The loop a transformers user writes: LlamaForCausalLM, torch.optim.AdamW, clip, step."""

    def __init__(self, cfg, data):
        from transformers import LlamaConfig, LlamaForCausalLM

        m = cfg.model
        hf_cfg = LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
            num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
            max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
            tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False,
        )
        hf_cfg._attn_implementation = "sdpa"
        torch.manual_seed(cfg.train.seed)
        self.model = LlamaForCausalLM(hf_cfg).train()
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                     weight_decay=o.weight_decay)
        self.cfg, self.data, self.consumed = cfg, data, 0

    def train_step(self) -> float:
        t = self.cfg.train
        total = t.global_batch * t.seq_len
        for m in range(t.global_batch // t.micro_batch):
            x, y = batch(self.data, self.consumed + m * t.micro_batch, t.micro_batch)
            logits = self.model(input_ids=x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.consumed += t.global_batch
        return loss.item()


def top_ops(runner, steps: int = 3, top: int = 8) -> dict:
    """Self CPU time per operator over `steps` steps: where a step's time goes, operator by operator."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.train_step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"self_cpu_s_total": round(sum(e.self_cpu_time_total for e in rows) / 1e6, 3),
            "operator_calls": sum(e.count for e in rows if e.key.startswith("aten::")),
            "top": [{"op": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count}
                    for e in rows[:top]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round per framework")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="loom with train.compile=true (transformers stays eager)")
    ap.add_argument("--profile-ops", action="store_true",
                    help="also record each framework's top operators over 3 steps (torch.profiler, self CPU time)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_vs_hf.json"))
    args = ap.parse_args()

    total_steps = args.warmup + args.rounds * args.steps + (3 if args.profile_ops else 0)
    cfg = load_config(args.config, [f"train.steps={total_steps}", "train.dtype=float32", "log.progress=none",
                                    "log.tensorboard=false", "train.device=cpu",
                                    f"train.compile={str(args.compile).lower()}"])
    with tempfile.TemporaryDirectory() as tmp:
        loom = Trainer(cfg, Path(tmp) / "run", quiet=True)
        hf = HFLoop(cfg, loom.train_data)
        for _ in range(args.warmup):
            loom.train_step()
            hf.train_step()
        times = {"loom": 0.0, "transformers": 0.0}
        rounds = []
        load_before = os.getloadavg()
        for r in range(args.rounds):
            order = (("loom", loom), ("transformers", hf))
            for name, runner in order if r % 2 == 0 else order[::-1]:  # both orders, alternately
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    runner.train_step()
                dt = time.perf_counter() - t0
                times[name] += dt
                rounds.append({"round": r, "framework": name, "seconds": round(dt, 3)})
        load_after = os.getloadavg()
        ops = {name: top_ops(runner) for name, runner in (("loom", loom), ("transformers", hf))} if args.profile_ops else None
    tokens = args.rounds * args.steps * cfg.train.global_batch * cfg.train.seq_len
    loom_tps, hf_tps = tokens / times["loom"], tokens / times["transformers"]
    import transformers

    result = {
        "benchmark": "cpu_vs_hf",
        "config": args.config,
        "shape": {k: getattr(cfg.model, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size")},
        "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch, "seq_len": cfg.train.seq_len,
        "dtype": "float32",
        "loom_compiled": args.compile,
        "timed_tokens_each": tokens,
        "loom_tokens_per_s": round(loom_tps, 1),
        "transformers_tokens_per_s": round(hf_tps, 1),
        "ratio": round(loom_tps / hf_tps, 3),
        "round_ratios": [round(next(x["seconds"] for x in rounds if x["round"] == r and x["framework"] == "transformers")
                               / next(x["seconds"] for x in rounds if x["round"] == r and x["framework"] == "loom"), 3)
                         for r in range(args.rounds)],
        "rounds": rounds,
        "load_average_1min_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        **({"profile_3_steps": ops} if ops else {}),
        "transformers": transformers.__version__,
        **stamp("python bench/cpu_vs_hf.py " + " ".join(sys.argv[1:])),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
