"""Single-process CPU training throughput: loom's trainer vs a plain transformers + AdamW loop.

Same shape (the `tiny` config), same fp32 dtype, same batches from the embedded corpus, same loss
(mean token cross-entropy), same clipping. Each framework trains in its own process, as a user runs it
(loom's trainer tunes the C library's malloc for CPU training, which is process-wide; with --same-process
both share one process and that setting). They take turns in rounds whose order flips every round (loom
first, then transformers first), so that drift in the machine's speed and any first-runner effect hit both
equally. Each figure is total tokens over total time of its timed steps (warm-up steps excluded); the JSON
also keeps every round's ratio, their median, the fastest step of each, and the load average before and
after (the ratio is only as good as the machine was quiet).

    .venv/bin/python bench/cpu_vs_hf.py [--rounds 8] [--steps 3] [--same-process] [--profile-ops]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.config import load_config  # noqa: E402
from loom.data.token_datasets import build_datasets  # noqa: E402
from loom.data.tokenizer import load_tokenizer  # noqa: E402
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
            rows = self.data.batch(self.consumed + m * t.micro_batch, t.micro_batch)
            x, y = rows["input_ids"], rows["labels"]
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


def _make_runner(name: str, cfg, tmp: str):
    if name == "loom":
        return Trainer(cfg, Path(tmp) / "run", quiet=True)
    return HFLoop(cfg, build_datasets(cfg, load_tokenizer(cfg))[0])


def _timed_steps(runner, n: int) -> list[float]:
    took = []
    for _ in range(n):
        t = time.perf_counter()
        runner.train_step()
        took.append(time.perf_counter() - t)
    return took


def _worker(name: str, cfg, conn) -> None:
    """One framework in its own process: runs the steps it is asked for and answers their seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        runner = _make_runner(name, cfg, tmp)
        conn.send("ready")
        while (request := conn.recv()) is not None:
            conn.send(top_ops(runner) if request == "profile" else _timed_steps(runner, request))


class _Remote:
    def __init__(self, name: str, cfg):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(name, cfg, child), daemon=True)
        self.proc.start()

    def ready(self) -> None:
        assert self.conn.recv() == "ready"

    def steps(self, n: int) -> list[float]:
        self.conn.send(n)
        return self.conn.recv()

    def profile(self) -> dict:
        self.conn.send("profile")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join()


class _Local:
    def __init__(self, runner):
        self.runner = runner

    def ready(self) -> None:
        pass

    def steps(self, n: int) -> list[float]:
        return _timed_steps(self.runner, n)

    def profile(self) -> dict:
        return top_ops(self.runner)

    def close(self) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--rounds", type=int, default=8, help="rounds; odd rounds run transformers first")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round per framework")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps first (loom's heap settles in ~5)")
    ap.add_argument("--compile", action="store_true", help="loom with train.compile=true (transformers stays eager)")
    ap.add_argument("--same-process", action="store_true",
                    help="both in this process (loom's host-memory setting then applies to transformers too)")
    ap.add_argument("--profile-ops", action="store_true",
                    help="also record each framework's top operators over 3 steps (torch.profiler, self CPU time)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_vs_hf.json"))
    args = ap.parse_args()

    total_steps = args.warmup + args.rounds * args.steps + (3 if args.profile_ops else 0)
    cfg = load_config(args.config, [f"train.steps={total_steps}", "train.dtype=float32", "log.progress=none",
                                    "log.tensorboard=false", "train.device=cpu",
                                    f"train.compile={str(args.compile).lower()}"])
    names = ("loom", "transformers")
    with tempfile.TemporaryDirectory() as tmp:
        if args.same_process:
            runners = {name: _Local(_make_runner(name, cfg, tmp)) for name in names}
        else:
            runners = {name: _Remote(name, cfg) for name in names}
        for runner in runners.values():
            runner.ready()
        for runner in runners.values():
            runner.steps(args.warmup)
        load_before = os.getloadavg()
        rounds = []  # seconds per framework, one dict per round
        steps = {name: [] for name in names}  # every timed step's seconds
        for r in range(args.rounds):
            took = {}
            for name in names if r % 2 == 0 else names[::-1]:  # both orders, alternately
                t0 = time.perf_counter()
                steps[name] += runners[name].steps(args.steps)
                took[name] = time.perf_counter() - t0
            rounds.append(took)
        load_after = os.getloadavg()
        ops = {name: runner.profile() for name, runner in runners.items()} if args.profile_ops else None
        for runner in runners.values():
            runner.close()
    tokens = args.rounds * args.steps * cfg.train.global_batch * cfg.train.seq_len
    loom_tps = tokens / sum(r["loom"] for r in rounds)
    hf_tps = tokens / sum(r["transformers"] for r in rounds)
    round_ratios = [round(r["transformers"] / r["loom"], 3) for r in rounds]
    import transformers

    result = {
        "benchmark": "cpu_vs_hf",
        "config": args.config,
        "shape": {k: getattr(cfg.model, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size")},
        "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch, "seq_len": cfg.train.seq_len,
        "dtype": "float32",
        "loom_compiled": args.compile,
        "processes": "one" if args.same_process else "one per framework",
        "timed_tokens_each": tokens,
        "loom_tokens_per_s": round(loom_tps, 1),
        "transformers_tokens_per_s": round(hf_tps, 1),
        "ratio": round(loom_tps / hf_tps, 3),
        "round_ratios": round_ratios,
        "median_round_ratio": round(statistics.median(round_ratios), 3),
        # The fastest step of each: the estimate least disturbed by other work on the machine.
        "best_step_ratio": round(min(steps["transformers"]) / min(steps["loom"]), 3),
        "step_seconds": {k: [round(x, 4) for x in v] for k, v in steps.items()},
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
