"""One GPU, one command: loom vs torchtitan vs transformers(+Liger) training throughput on Llama-3.2 shapes.

    python bench/gpu_train.py --out bench/results/gpu_train.json            # on a GPU machine
    python bench/gpu_train.py --smoke --out /tmp/smoke.json                 # tiny shape on CPU (a test runs it)

Every framework trains the same architecture (Llama-3.2-1B / -3B shapes: GQA, SwiGLU, tied embeddings,
vocabulary 128256) from random initialisation on the same synthetic tokens, with the same tokens per step
(`--tokens-per-step`, split into sequences of 4096 or 8192), bf16 compute with fp32 master weights and
AdamW, the same activation recomputation (none for 1B, full for 3B by default, so that 3B fits 80 GB).
Per run it reports tokens/s, model TFLOP/s per device in both conventions (attention counted causally,
i.e. the half of the score matrix a causal kernel computes, and non-causally as Megatron/loom's MFU
does), MFU of each against `--peak-tflops` (989: H100/H200 dense bf16), peak device memory, and the
machine (device, torch, CUDA, the packages' versions). A framework that cannot run here (not installed,
an incompatible version, out of memory) gets a row with its error instead of numbers; the others go on.

- loom: its own runner (per-block torch.compile, chunked cross-entropy `train.loss_chunk`, fused SDPA
  backends), exactly what `loom train` runs per step, minus data loading.
- torchtitan (PyPI `torchtitan`): its Llama 3 model, built with the same shape and trained in the same
  loop (its own parallelize is for multi-GPU meshes; on one GPU this is its model + per-block compile).
- transformers: `LlamaForCausalLM` from a config (nothing downloaded), sdpa attention; with Liger
  (`liger-kernel`) when importable: its fused RMSNorm/SwiGLU/RoPE and fused linear cross-entropy.

No number is estimated: only what ran is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom.config import ModelConfig  # noqa: E402
from loom.flops import train_flops_per_token  # noqa: E402

SHAPES = {  # Llama-3.2 (config.json of meta-llama/Llama-3.2-1B / -3B), rope scaling left out (no effect on speed)
    "llama3.2-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab_size=128256),
    "llama3.2-3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, ffn_hidden=8192, vocab_size=128256),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512),
}
RECOMPUTE = {"llama3.2-1b": "none", "llama3.2-3b": "full", "tiny": "none"}


def model_config(shape: str, seq: int) -> ModelConfig:
    return ModelConfig(**SHAPES[shape], max_seq_len=seq, rope_theta=500000.0, tie_embeddings=True, norm_eps=1e-5)


def flops_per_token(shape: str, seq: int, causal: bool) -> float:
    """Training model FLOPs per token (3x forward, recomputation not counted): loom's exact matmul count,
    which counts the full s x s score matrix; `causal` removes the half a causal kernel skips."""
    cfg = model_config(shape, seq)
    full = train_flops_per_token(cfg, seq)
    if not causal:
        return float(full)
    attention = 3 * cfg.layers * 4 * seq * cfg.heads * cfg.head_dim  # scores + values, fwd+bwd
    return full - attention / 2


def machine(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or
           platform.machine(), "device": "cpu"}
    if device.type == "cuda":
        out.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(),
                   memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1))
    for pkg in ("torchtitan", "transformers", "liger_kernel", "torchao"):
        try:
            from importlib.metadata import version

            out[pkg] = version(pkg.replace("_", "-"))
        except Exception:
            out[pkg] = None
    return out


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, device, steps: int, warmup: int) -> dict:
    """Run `warmup` then `steps` timed steps; seconds per step (median and all) and peak memory."""
    for _ in range(warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step_s": sorted(times)[len(times) // 2], "step_times_s": times, "loss": losses[-1],
            "peak_memory_gib": peak}


def synthetic_batch(vocab: int, batch: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


# --- the frameworks -------------------------------------------------------------------------------


def run_loom(shape, seq, batch, device, args):
    from loom.config import load_config
    from loom.models.llama import build_model
    from loom.models.losses import TokenCrossEntropy
    from loom.parallel import build_layout
    from loom.parallel.distributed import clip_grad_norm
    from loom.train.optim import build_optimizer
    from loom.train.steps import SPMDRunner

    cuda = device.type == "cuda"
    m = SHAPES[shape]
    overrides = [f"model.{k}={v}" for k, v in m.items()] + [
        f"model.max_seq_len={seq}", "model.rope_theta=500000.0", "model.tie_embeddings=true",
        f"train.seq_len={seq}", f"train.micro_batch={batch}", f"train.global_batch={batch}",
        f"train.dtype={'bfloat16' if cuda else 'float32'}", f"train.compile={str(args.compile and cuda).lower()}",
        f"train.loss_chunk={args.loss_chunk}", f"recompute.mode={args.recompute or RECOMPUTE[shape]}",
        f"train.fp8={args.fp8}",
    ]
    cfg = load_config(None, overrides)
    layout = build_layout(cfg, device.type)
    model = build_model(cfg.model, device=device, seed=0)
    loss = TokenCrossEntropy(cfg.train.loss_chunk)
    runner = SPMDRunner(model, cfg, layout, loss, device, torch.bfloat16 if cuda else None)
    opt = build_optimizer(runner.model, cfg.optim)
    tokens = synthetic_batch(cfg.model.vocab_size, batch, seq, device)
    data = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    total = batch * seq

    def step():
        loss_sum = runner.forward_backward(data, 1.0 / total)
        clip_grad_norm(runner.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum / total

    return time_steps(step, device, args.steps, args.warmup), {"settings": overrides[len(m):]}


def run_torchtitan(shape, seq, batch, device, args):
    """torchtitan's Llama 3 model with the same shape, per-block compiled as its parallelize does."""
    try:  # torchtitan 0.1/0.2 layout
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    except ImportError as exc:
        raise RuntimeError(f"this torchtitan has no torchtitan.models.llama3.Transformer/TransformerModelArgs "
                           f"(0.1/0.2 API) : {exc}") from None
    m = SHAPES[shape]
    margs = TransformerModelArgs(dim=m["hidden"], n_layers=m["layers"], n_heads=m["heads"], n_kv_heads=m["kv_heads"],
                                 vocab_size=m["vocab_size"], max_seq_len=seq, rope_theta=500000.0)
    # its FeedForward derives the hidden size from dim, multiplier and multiple_of: pick them to give ffn_hidden
    margs.ffn_dim_multiplier = None
    margs.multiple_of = m["ffn_hidden"]
    with torch.device(device):
        model = Transformer(margs)
        model.init_weights()
    if hasattr(model, "output") and hasattr(model, "tok_embeddings"):
        model.output.weight = model.tok_embeddings.weight  # tied, as Llama-3.2 (and loom's run)
    recompute = (args.recompute or RECOMPUTE[shape]) == "full"
    from torch.utils.checkpoint import checkpoint

    for name, block in list(model.layers.items()):
        if recompute:
            fwd = block.forward
            block.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        if args.compile and device.type == "cuda":
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    tokens = synthetic_batch(m["vocab_size"], batch, seq, device)

    def step():
        with autocast(device):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return time_steps(step, device, args.steps, args.warmup), {"note": "torchtitan model, this script's loop"}


def run_hf(shape, seq, batch, device, args, liger: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if liger:
        if device.type != "cuda":
            raise RuntimeError("Liger's Triton kernels need a CUDA device")
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    m = SHAPES[shape]
    config = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden"], intermediate_size=m["ffn_hidden"],
                         num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                         num_key_value_heads=m["kv_heads"], max_position_embeddings=seq, rope_theta=500000.0,
                         tie_word_embeddings=True, attn_implementation="sdpa", rms_norm_eps=1e-5)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if (args.recompute or RECOMPUTE[shape]) == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    tokens = synthetic_batch(m["vocab_size"], batch, seq, device)
    # HF shifts labels itself: pass seq+1 tokens' first seq as input and labels, and the same count of targets.
    ids = tokens[:, :-1]

    def step():
        with autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return time_steps(step, device, args.steps, args.warmup), {}


FRAMEWORKS = {
    "loom": run_loom,
    "torchtitan": run_torchtitan,
    "transformers": lambda *a: run_hf(*a, liger=False),
    "transformers+liger": lambda *a: run_hf(*a, liger=True),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default="loom,torchtitan,transformers,transformers+liger",
                    help="each runs in its own process (Liger patches transformers' modules process-wide)")
    ap.add_argument("--models", default="llama3.2-1b,llama3.2-3b")
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                    help="for every framework (default: none for 1B, full for 3B)")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="loom's train.loss_chunk (0: plain loss)")
    ap.add_argument("--fp8", default="off", help="loom's train.fp8")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, CPU, 2 steps: checks the script runs")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.seqs, args.tokens_per_step, args.steps, args.warmup = "tiny", "32", 64, 2, 1
        args.loss_chunk = 16
        device = torch.device("cpu")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"machine": machine(device), "command": " ".join(sys.argv), "peak_tflops": args.peak_tflops,
              "tokens_per_step": args.tokens_per_step, "runs": []}
    frameworks = args.frameworks.split(",")
    if len(frameworks) > 1:  # one process per framework, results merged
        import subprocess
        import tempfile

        argv = list(sys.argv[1:] if argv is None else argv)
        for fw in frameworks:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                rest = [a for i, a in enumerate(argv) if a not in ("--frameworks", "--out")
                        and not a.startswith(("--frameworks=", "--out="))
                        and (i == 0 or argv[i - 1] not in ("--frameworks", "--out"))]
                proc = subprocess.run([sys.executable, __file__, *rest, "--frameworks", fw, "--out", str(out)])
                if out.exists():
                    report["runs"] += json.loads(out.read_text())["runs"]
                else:
                    report["runs"].append({"framework": fw, "error": f"its process exited {proc.returncode}"})
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1))
        return 0
    for shape in args.models.split(","):
        for seq in map(int, args.seqs.split(",")):
            if args.tokens_per_step % seq:
                raise SystemExit(f"--tokens-per-step={args.tokens_per_step} is not a multiple of sequence {seq}")
            batch = args.tokens_per_step // seq
            for fw in frameworks:
                row = {"framework": fw, "model": shape, "seq_len": seq, "batch": batch,
                       "tokens_per_step": batch * seq, "recompute": args.recompute or RECOMPUTE[shape]}
                try:
                    timing, extra = FRAMEWORKS[fw](shape, seq, batch, device, args)
                    tps = batch * seq / timing["step_s"]
                    for conv in ("causal", "noncausal"):
                        tf = tps * flops_per_token(shape, seq, conv == "causal") / 1e12
                        row[f"tflops_{conv}"] = float(f"{tf:.4g}")
                        row[f"mfu_{conv}"] = float(f"{tf / args.peak_tflops:.4g}")
                    row.update(tokens_per_s=round(tps, 1), **timing, **extra)
                except Exception as exc:  # one framework failing does not stop the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    row["traceback"] = traceback.format_exc()[-3000:]
                report["runs"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "step_times_s")}),
                      flush=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
