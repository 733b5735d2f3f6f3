"""One GPU, one command: loom vs torchtitan (0.3.0, 0.2.2) vs transformers(+Liger) training throughput on
Llama-3.2 shapes.

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
an incompatible version, out of memory, past `--row-timeout`) gets a row with its error instead of
numbers; the others go on. Each row runs in its own process (Liger patches transformers process-wide; a
torchtitan version is found on its own `--pythonpath`), and the JSON is rewritten after every row, so a
run cut short keeps the rows it finished.

Every row states its loss (`loss_kind`, `loss_setting`), because the loss is not the same work everywhere:

- `plain`: the whole micro-batch's logits, one cross-entropy: loom with `train.loss_chunk=0`,
  transformers, torchtitan 0.2.2. These rows do equal work.
- `chunked`: loom with `train.loss_chunk=8192` (LM head + loss 8192 tokens at a time, the head's gradients
  computed in forward: memory-light, no extra head forward; bench/results/h200-2026-11-26-loss-chunk), and
  torchtitan 0.3.0's default `ChunkedLossWrapper` (8 sequence chunks, each chunk's head + loss run
  forward and backward at once: memory-light, no recompute).
- `fused_linear_ce`: transformers + Liger's fused linear cross-entropy (memory-light), the anchor for
  loom's chunked loss.

loom runs once per `--loss-chunk` value (default 0 and 8192).

- loom: its own runner (per-block torch.compile, `train.loss_chunk`, fused SDPA backends), exactly what
  `loom train` runs per step, minus data loading.
- torchtitan-0.3.0: its own Llama 3 model (`torchtitan.models.llama3.llama3_configs["1B"/"3B"]`: flex
  attention, fused QKV), its loss (`ChunkedLossWrapper`), optimizer container (`default_adamw`),
  gradient clipping, activation checkpointing (`FullAC` where the bench recomputes), and its CUDA-graph
  forward+backward (`wrap_with_cuda_graph`, on by default in 0.3.0: `training.disable_cuda_graphs=False`),
  in this script's loop, which follows its `Trainer.train_step`. Its default config leaves torch.compile
  off (`--torchtitan-compile` applies its `apply_compile`). What differs from its own trainer is listed
  in each row's `notes`.
- torchtitan-0.2.2: its `Transformer`/`TransformerModelArgs` with the same shape, its loss and clipping,
  its `apply_ac` where the bench recomputes, torch.autocast as its trainer uses on one GPU; torch.compile
  off as in its default config (`--torchtitan-compile` applies its `apply_compile`).
- transformers: `LlamaForCausalLM` from a config (nothing downloaded), sdpa attention; with Liger
  (`liger-kernel`): its fused RMSNorm/SwiGLU/RoPE and fused linear cross-entropy.

No number is estimated: only what ran is reported.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before torch's import: a row's `timing_started_s` counts from here

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom import compile_cache  # noqa: E402
from loom.config import ModelConfig  # noqa: E402
from loom.flops import train_flops_per_token  # noqa: E402

SHAPES = {  # Llama-3.2 (config.json of meta-llama/Llama-3.2-1B / -3B), rope scaling left out (no effect on speed)
    "llama3.2-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab_size=128256),
    "llama3.2-3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, ffn_hidden=8192, vocab_size=128256),
    # Llama 2 7B (config.json of meta-llama/Llama-2-7b-hf): multi-head attention, untied head, rope_theta 1e4;
    # the shape of NeMo's published Llama 2 7B pre-training figure (issue 39)
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab_size=32000),
    # Qwen3-30B-A3B (configs/qwen3-30b-a3b.toml) cut to 4 of its 48 layers to fit one GPU with AdamW: 128
    # experts of 768, top 8, heads of 128, q/k norm, untied head; 3,114,814,464 parameters (loom, meta device)
    "qwen3-30b-a3b-4l": dict(layers=4, hidden=2048, heads=32, kv_heads=4, ffn_hidden=6144, vocab_size=151936),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512),
    "tiny-moe": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512),
}
# What differs from the Llama-3.2 defaults (tied embeddings, rope_theta 500000)
SHAPE_EXTRA = {
    "llama2-7b": dict(tie_embeddings=False, rope_theta=10000.0),
    "qwen3-30b-a3b-4l": dict(tie_embeddings=False, rope_theta=1000000.0, explicit_head_dim=128, qk_norm=True,
                             moe=dict(experts=128, top_k=8, ffn_hidden=768, renormalize=True, load_balance_coeff=0.001)),
    "tiny-moe": dict(moe=dict(experts=8, top_k=2, ffn_hidden=64, renormalize=True)),
}
RECOMPUTE = {"llama3.2-1b": "none", "llama3.2-3b": "full", "llama2-7b": "full", "qwen3-30b-a3b-4l": "none",
             "tiny": "none", "tiny-moe": "none"}
TITAN_FLAVOR = {"llama3.2-1b": "1B", "llama3.2-3b": "3B"}  # torchtitan 0.3.0's own Llama 3 flavors of these shapes
FRAMEWORKS = ("loom", "torchtitan-0.3.0", "torchtitan-0.2.2", "transformers", "transformers+liger")

PLAIN = "plain: the whole micro-batch's logits, one cross-entropy"
LOSS = {  # framework -> (loss_kind, loss_setting); loom's depends on its loss_chunk (see loom_loss)
    "torchtitan-0.3.0": ("chunked", "chunked: torchtitan's ChunkedLossWrapper (its default), 8 sequence chunks, "
                         "each chunk's LM head + cross-entropy forward and backward at once, no recompute; "
                         "memory-light, compare with loom's chunked loss and transformers+liger"),
    "torchtitan-0.2.2": ("plain", PLAIN + " in fp32 (torchtitan's cross_entropy_loss); the same work as "
                         "loom's train.loss_chunk=0 and transformers"),
    "transformers": ("plain", PLAIN + " (LlamaForCausalLM's loss); the same work as loom's train.loss_chunk=0"),
    "transformers+liger": ("fused_linear_ce", "fused linear cross-entropy (Liger): the LM head and loss in "
                           "chunks, logits never whole; memory-light, the anchor for loom's chunked loss"),
}


def loom_loss(chunk: int) -> tuple[str, str]:
    if chunk == 0:
        return "plain", (PLAIN + " (train.loss_chunk=0); the same loss work as transformers and "
                         "torchtitan-0.2.2")
    return "chunked", (f"chunked: LM head + cross-entropy {chunk} tokens at a time, its gradients computed in "
                       f"forward (train.loss_chunk={chunk}); memory-light, no head matmul recomputed; compare "
                       "with transformers+liger's fused linear cross-entropy and torchtitan-0.3.0's chunked loss")


def shape_extra(shape: str) -> dict:
    return {"tie_embeddings": True, "rope_theta": 500000.0, **SHAPE_EXTRA.get(shape, {})}


def model_config(shape: str, seq: int) -> ModelConfig:
    from loom.config.model import MoEConfig

    extra = dict(shape_extra(shape))
    if "moe" in extra:
        extra["moe"] = MoEConfig(**extra["moe"])
    return ModelConfig(**SHAPES[shape], **extra, max_seq_len=seq, norm_eps=1e-5)


def extra_overrides(shape: str) -> list[str]:
    """loom's model.* settings of SHAPE_EXTRA beyond the head and rope (head_dim, qk_norm, model.moe.*)."""
    out = []
    for key, value in shape_extra(shape).items():
        if key == "moe":
            out += [f"model.moe.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in value.items()]
        elif key == "explicit_head_dim":
            out.append(f"model.head_dim={value}")
        elif key not in ("tie_embeddings", "rope_theta"):
            out.append(f"model.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def flops_per_token(shape: str, seq: int, causal: bool) -> float:
    """Training model FLOPs per token (3x forward, recomputation not counted): loom's exact matmul count,
    which counts the full s x s score matrix; `causal` removes the half a causal kernel skips."""
    cfg = model_config(shape, seq)
    full = train_flops_per_token(cfg, seq)
    if not causal:
        return float(full)
    attention = 3 * cfg.layers * 4 * seq * cfg.heads * cfg.head_dim  # scores + values, fwd+bwd
    return full - attention / 2


def llama_params(shape: str) -> int:
    """Parameters of SHAPES[shape] (tied embeddings unless SHAPE_EXTRA unties them): what each framework's
    model must hold."""
    m = SHAPES[shape]
    d, hd = m["hidden"], m["hidden"] // m["heads"]
    layer = d * m["heads"] * hd * 2 + d * m["kv_heads"] * hd * 2 + 3 * d * m["ffn_hidden"] + 2 * d
    heads = 1 if shape_extra(shape)["tie_embeddings"] else 2
    return heads * m["vocab_size"] * d + m["layers"] * layer + d


def check_params(model: torch.nn.Module, shape: str, who: str) -> int:
    n = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
    if n != llama_params(shape):
        raise RuntimeError(f"{who} built {n:,} parameters, the {shape} shape has {llama_params(shape):,}")
    return n


def version_of(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or
           platform.machine(), "device": "cpu"}
    if device.type == "cuda":
        out.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(),
                   memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1))
    for pkg in ("transformers", "liger_kernel", "torchao"):
        out[pkg] = version_of(pkg.replace("_", "-"))
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
    started = time.perf_counter() - PROCESS_START  # the carried compile cache's target: the 1B row within 30 s
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
    out = {"step_s": sorted(times)[len(times) // 2], "step_times_s": times, "loss": losses[-1],
           "peak_memory_gib": peak, "timing_started_s": round(started, 2)}
    if KERNELS and device.type == "cuda":  # one more step under the profiler: where its device time went
        out["device_time"] = profiled_step(step, device, KERNELS)
    return out


KERNELS = 0  # --kernels: the top kernels of one profiled step after the timed ones (0: none)


def profiled_step(step, device, top: int) -> dict:
    """One step under torch's profiler: its wall time and its top kernels by device time (a failure is the
    field's error, not the row's)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        sys.path.insert(0, str(ROOT / "bench"))
        from kernel_table import top_kernels

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            synchronize(device)
            wall = time.perf_counter() - t0
        return {"wall_ms": round(1e3 * wall, 3), **top_kernels(prof, top)}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def synthetic_batch(vocab: int, batch: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)


def autocast(device, cache_enabled: bool = True):
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)


def recompute_of(shape: str, args) -> str:
    return args.recompute or RECOMPUTE[shape]


# --- the frameworks -------------------------------------------------------------------------------


def run_loom(shape, seq, batch, device, args):
    from loom.config import load_config
    from loom.models.llama import build_model
    from loom.models.losses import TokenCrossEntropy
    from loom.parallel import place_in_mesh
    from loom.parallel.distributed import clip_grad_norm
    from loom.train.optim import build_optimizer
    from loom.train.steps import SPMDRunner

    cuda = device.type == "cuda"
    m = SHAPES[shape]
    chunk = int(args.loss_chunk)
    micro = args.micro_batch or batch
    if batch % micro:
        raise SystemExit(f"--micro-batch {micro} does not divide the step's {batch} sequences")
    extra = shape_extra(shape)
    overrides = [f"model.{k}={v}" for k, v in m.items()] + [
        f"model.max_seq_len={seq}", f"model.rope_theta={extra['rope_theta']}",
        f"model.tie_embeddings={str(extra['tie_embeddings']).lower()}", *extra_overrides(shape),
        f"optim.state_dtype={args.state_dtype}",
        f"train.seq_len={seq}", f"train.micro_batch={micro}", f"train.global_batch={batch}",
        f"train.dtype={'bfloat16' if cuda else 'float32'}", f"train.compile={str(args.compile and cuda).lower()}",
        f"train.loss_chunk={chunk}", f"recompute.mode={recompute_of(shape, args)}",
        f"train.fp8={args.fp8}", f"recompute.memory_gib={args.recompute_memory_gib}",
    ]
    cfg = load_config(None, overrides)
    layout = place_in_mesh(cfg, device.type)
    layer_plan, plan_note = None, None
    if cfg.recompute.mode == "auto":  # as the trainer plans it: before the model takes any GPU memory
        from loom.memory import auto_memory_bytes, describe_plan, plan_auto

        plan = plan_auto(cfg, layout, "meta", auto_memory_bytes(cfg, device))
        layer_plan, plan_note = plan["plan"], describe_plan(plan)
    model = build_model(cfg.model, device=device, seed=0)
    loss = TokenCrossEntropy(cfg.train.loss_chunk)
    runner = SPMDRunner(model, cfg, layout, loss, device, torch.bfloat16 if cuda else None, layer_plan)
    opt = build_optimizer(runner.model, cfg.optim)
    tokens = synthetic_batch(cfg.model.vocab_size, batch, seq, device)
    data = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if args.doc_len:  # packed rows: each token attends within its document only, positions restart
        data.update(packed_documents(batch, seq, args.doc_len, device))
    total = batch * seq

    def step():
        loss_sum = runner.forward_backward(data, 1.0 / total)
        clip_grad_norm(runner.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum / total

    kind, setting = loom_loss(chunk)
    extra = {"settings": overrides[len(m):], "loss_kind": kind, "loss_setting": setting, "micro_batch": micro}
    if plan_note:
        extra["recompute_plan"] = plan_note
    if args.doc_len:
        extra["packing"] = (f"documents of {args.doc_len // 2}-{args.doc_len * 3 // 2} tokens packed into each row "
                            f"(mean {data['doc_ids'].max(1).values.float().mean().item() + 1:.1f} a row): doc_ids "
                            "and restarting positions, as SFT packing and data.document_mask pass them")
    return time_steps(step, device, args.steps, args.warmup), extra


def packed_documents(batch: int, seq: int, doc_len: int, device) -> dict:
    """doc_ids and positions [batch, seq] of rows packed with documents of doc_len/2 .. 3 doc_len/2 tokens
    (uniform, a fixed seed; the last one cut at the row's end), numbered as data.document_mask numbers them
    (`loom.data.samples.documents` over the documents' last tokens)."""
    from loom.data.samples import documents

    g = torch.Generator().manual_seed(0)
    ends = torch.zeros(batch, seq, dtype=torch.long)
    for r in range(batch):
        at = 0
        while at < seq:
            at += int(torch.randint(doc_len // 2, doc_len * 3 // 2 + 1, (), generator=g))
            if at <= seq:
                ends[r, at - 1] = 1
    return {k: v.to(device) for k, v in documents(ends, 1).items()}


def torchtitan_version(wanted: str) -> str:
    """The torchtitan on sys.path, refused unless it is `wanted` (each version runs on its own --pythonpath)."""
    found = version_of("torchtitan")
    if found is None:
        raise RuntimeError(f"torchtitan {wanted} is not installed here (bench/fetch_wheels.sh fetches it; "
                           "give its folder with --pythonpath torchtitan-" + wanted + "=DIR)")
    if found != wanted:
        raise RuntimeError(f"torchtitan {found} found on sys.path, {wanted} asked (--pythonpath "
                           f"torchtitan-{wanted}=DIR puts the right one first)")
    return found


def torch_compat_for_torchtitan_030() -> list[str]:
    """torchtitan 0.3.0 is written against torch >= 2.12. On an older torch (the GPU machines carry 2.11),
    fill the two gaps its single-GPU path meets, and say so in the row: a placeholder for
    `torch.distributed.fsdp.DataParallelMeshDims` (imported at module level, used only by its multi-GPU
    FSDP path) and `create_block_mask(separate_full_blocks=True)` (older torch separates full blocks
    always, which is what True asks for)."""
    import inspect

    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    shims = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass
        class DataParallelMeshDims:  # placeholder: never constructed on one GPU
            pass

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        shims.append(f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims: a "
                     "placeholder class is added before importing torchtitan (its multi-GPU FSDP path only)")
    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        original = flex.create_block_mask

        def create_block_mask(*a, separate_full_blocks: bool = True, **k):
            if not separate_full_blocks:
                raise NotImplementedError("create_block_mask(separate_full_blocks=False) needs torch >= 2.12")
            return original(*a, **k)

        flex.create_block_mask = create_block_mask
        shims.append(f"torch {torch.__version__}'s create_block_mask has no separate_full_blocks argument: "
                     "torchtitan's True (the older default behaviour) is dropped before the call")
    return shims


def titan_030_config(shape: str, seq: int, device):
    """torchtitan 0.3.0's Llama3Model.Config for `shape`: its own "1B"/"3B" flavor for the Llama-3.2 shapes
    (checked against SHAPES by the CPU test), built from the same helpers for the tiny shape. On the CPU,
    where flex attention has no backward, the inner attention is torchtitan's own
    ScaledDotProductAttention (causal)."""
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    if shape in TITAN_FLAVOR:
        cfg = L.llama3_configs[TITAN_FLAVOR[shape]](attn_backend="flex")
    else:
        m = SHAPES[shape]
        dim, vocab = m["hidden"], m["vocab_size"]
        cfg = L.Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=True,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=L._EMBEDDING_SKIP_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
            layers=L._build_llama3_layers(
                fuse_qkv=True, n_layers=m["layers"], dim=dim, n_heads=m["heads"], n_kv_heads=m["kv_heads"],
                hidden_dim=m["ffn_hidden"], attn_backend="flex",
                rope=ComplexRoPE.Config(dim=dim // m["heads"], max_seq_len=131072, theta=500000, scaling="llama")))
    # Trainer.Config.update_from_config: the RoPE cache sized to training.seq_len
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq)
    if device.type != "cuda":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        cfg = copy.deepcopy(cfg)
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def build_titan_030(shape: str, seq: int, device):
    """Its config and its model on the meta device (as its Trainer builds it), checked against the shape."""
    cfg = titan_030_config(shape, seq, device)
    with torch.device("meta"):
        model = cfg.build()
    check_params(model, shape, "torchtitan 0.3.0")
    return cfg, model


def run_torchtitan_030(shape, seq, batch, device, args):
    """torchtitan 0.3.0's model and train step (see the module doc); settings and differences in the row."""
    found = torchtitan_version("0.3.0")
    shims = torch_compat_for_torchtitan_030()
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.cudagraph import cudagraph_teardown, wrap_with_cuda_graph
    from torchtitan.models.common.attention import FlexAttention

    cuda = device.type == "cuda"
    recompute = recompute_of(shape, args)
    if recompute == "selective":
        raise RuntimeError("recompute=selective: loom's selective recompute is not torchtitan's SelectiveAC; "
                           "compare with none or full")
    compile_config = CompileConfig(enable=bool(args.torchtitan_compile))
    cfg, model = build_titan_030(shape, seq, device)
    if recompute == "full":
        FullAC.Config().build(dump_folder=tempfile.gettempdir()).apply(model)
    if compile_config.enable and cuda:
        from torchtitan.config import ParallelismConfig
        from torchtitan.distributed.compile import apply_compile
        from torchtitan.distributed.parallel_dims import ParallelDims

        apply_compile(model, compile_config=compile_config,
                      parallel_dims=ParallelDims.from_config(ParallelismConfig(), 1))
    model.to_empty(device=device)
    with torch.no_grad():  # as its Trainer: init_weights on the materialised model, no autograd
        model.init_weights(buffer_device=None)  # ties lm_head and tok_embeddings again (Decoder.init_states)
    model.train()
    if model.lm_head.weight is not model.tok_embeddings.weight:
        raise RuntimeError("torchtitan 0.3.0's lm_head came untied from tok_embeddings")
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size)).build(
        compile_config=compile_config)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = default_adamw(lr=3e-4).build(model_parts=[model])
    tokens = synthetic_batch(cfg.vocab_size, batch, seq, device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(seq, device=device).expand(batch, seq).contiguous()  # one document per row
    flex = isinstance(cfg.layers[0].attention.inner_attention, FlexAttention.Config)
    global_valid_tokens = torch.tensor(labels.numel(), device=device)

    def forward_backward(inputs, labels, global_valid_tokens, extra_kwargs):  # its _forward_backward_body
        with autocast(device, cache_enabled=False):  # a CUDA graph replays no autocast weight cache
            pred = model(inputs, **extra_kwargs)
            loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra_kwargs["positions"])
            del pred
            loss.backward()
        return loss

    fwd_bwd = wrap_with_cuda_graph(forward_backward) if cuda else forward_backward
    params = [p for p in model.parameters()]

    def step():  # its train_step: one micro-batch, no pipeline, no data parallel
        optimizers.zero_grad(set_to_none=False)  # as its trainer with CUDA graphs on
        extra = {"positions": positions}
        if flex:  # its post_dataloading_process builds the block mask outside the graph, every step
            extra["attention_masks"] = model.get_attention_masks(positions=positions)
        loss = fwd_bwd(inputs, labels, global_valid_tokens, extra)
        loss = loss.detach().clone()  # the graph owns its output until the next replay
        dist_utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizers.step()
        return loss

    try:
        timing = time_steps(step, device, args.steps, args.warmup)
    finally:
        if cuda:
            cudagraph_teardown()
    settings = [
        (f"model=torchtitan.models.llama3.llama3_configs[{TITAN_FLAVOR[shape]!r}]" if shape in TITAN_FLAVOR
         else "model=Llama3Model.Config from torchtitan.models.llama3's own helpers at the tiny shape"),
        f"attention={'flex (its default)' if flex else 'sdpa (CPU: flex attention has no backward there)'}",
        f"training.disable_cuda_graphs={not cuda}" + (" (its default: graphs on)" if cuda else " (CPU)"),
        f"compile.enable={str(compile_config.enable).lower()}" + ("" if compile_config.enable else " (its default)"),
        f"activation_checkpoint={'FullAC' if recompute == 'full' else 'none'} (the bench's recompute={recompute}; "
        "its default is SelectiveAC)",
        "loss=ChunkedLossWrapper(CrossEntropyLoss), num_chunks=8 (its llama3 configs' default)",
        "optimizer=default_adamw(lr=3e-4): AdamW betas (0.9, 0.95), eps 1e-8, weight_decay 0.1, implementation fused",
        "training.max_norm=1.0 (its clip_grad_norm_, foreach)",
        "mixed precision=torch.autocast bf16 (cache_enabled=False)" if cuda else "precision=float32 (CPU)",
        f"local_batch_size={batch}", f"seq_len={seq}",
    ]
    notes = [
        f"its model, loss, optimizer, clipping and {'CUDA-graph ' if cuda else ''}forward+backward in this "
        "script's loop, which follows Trainer.train_step (zero_grad(set_to_none=False), masks built outside "
        "the graph each step, fwd+bwd, clip, optimizer step)",
        "not its Trainer: no process group, no fully_shard; its trainer casts to bf16 through fully_shard's "
        "MixedPrecisionPolicy on a one-GPU mesh (torch >= 2.12's fully_shard(dp_mesh_dims)), this loop "
        "through torch.autocast",
        "no data loader, tokenizer, metrics, checkpointing or lr schedule step (constant lr); synthetic "
        "tokens, one document per row (its block-causal mask is then causal)",
        *shims,
    ]
    kind, setting = LOSS["torchtitan-0.3.0"]
    return timing, {"framework_version": found, "settings": settings, "notes": notes,
                    "loss_kind": kind, "loss_setting": setting}


def titan_022_args(shape: str, seq: int):
    """TransformerModelArgs of torchtitan 0.2.2 giving SHAPES[shape]: its FeedForward makes the hidden size
    int(2 * 4 * dim / 3), times ffn_dim_multiplier, rounded up to multiple_of."""
    from torchtitan.models.llama3 import TransformerModelArgs

    m = SHAPES[shape]
    base = int(2 * 4 * m["hidden"] / 3)
    return TransformerModelArgs(dim=m["hidden"], n_layers=m["layers"], n_heads=m["heads"], n_kv_heads=m["kv_heads"],
                                vocab_size=m["vocab_size"], max_seq_len=seq, rope_theta=500000.0,
                                multiple_of=m["ffn_hidden"],
                                ffn_dim_multiplier=m["ffn_hidden"] / base if base > m["ffn_hidden"] else None)


def build_titan_022(shape: str, seq: int):
    """Its model args and model on the meta device, output tied to the embedding (Llama-3.2), checked
    against the shape."""
    try:  # torchtitan 0.1/0.2 layout
        from torchtitan.models.llama3 import Transformer
    except ImportError as exc:
        raise RuntimeError(f"torchtitan {version_of('torchtitan')} has no torchtitan.models.llama3.Transformer "
                           f"(0.1/0.2 API): {exc}") from None
    margs = titan_022_args(shape, seq)
    with torch.device("meta"):
        model = Transformer(margs)
    model.output.weight = model.tok_embeddings.weight  # tied before init: the output's init wins, as in 0.3.0
    check_params(model, shape, "torchtitan 0.2.2")
    return margs, model


def run_torchtitan_022(shape, seq, batch, device, args):
    """torchtitan 0.2.2's Llama 3 model with the same shape, in this loop (see the module doc)."""
    found = torchtitan_version("0.2.2")
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    cuda = device.type == "cuda"
    recompute = recompute_of(shape, args)
    if recompute == "selective":
        raise RuntimeError("recompute=selective: compare torchtitan with none or full")
    margs, model = build_titan_022(shape, seq)
    if recompute == "full":
        from torchtitan.config.job_config import ActivationCheckpoint
        from torchtitan.distributed.activation_checkpoint import apply_ac

        apply_ac(model, ActivationCheckpoint(mode="full"), model_compile_enabled=bool(args.torchtitan_compile),
                 op_sac_save_list=set(), base_folder=tempfile.gettempdir())
    if args.torchtitan_compile and cuda:
        from torchtitan.config.job_config import Compile
        from torchtitan.models.llama3.infra.parallelize import apply_compile

        apply_compile(model, Compile(enable=True))
    model.to_empty(device=device)
    model.output.weight = model.tok_embeddings.weight  # to_empty gives each module its own copy: tie again
    with torch.no_grad():  # as its Trainer (init_weights in place on parameters that require grad)
        model.init_weights(buffer_device=device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=cuda)
    tokens = synthetic_batch(margs.vocab_size, batch, seq, device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    total = labels.numel()
    params = list(model.parameters())

    def step():
        opt.zero_grad()
        with autocast(device):  # its maybe_enable_amp on one device
            pred = model(inputs)
            loss = cross_entropy_loss(pred, labels) / total
            del pred
        loss.backward()
        dist_utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        return loss.detach()

    settings = [
        f"model=TransformerModelArgs(dim={margs.dim}, n_layers={margs.n_layers}, n_heads={margs.n_heads}, "
        f"n_kv_heads={margs.n_kv_heads}, multiple_of={margs.multiple_of}, ffn_dim_multiplier="
        f"{margs.ffn_dim_multiplier}, attn_type={margs.attn_type}), output tied to tok_embeddings",
        f"compile.enable={str(bool(args.torchtitan_compile) and cuda).lower()}"
        + ("" if args.torchtitan_compile else " (its default)"),
        f"activation_checkpoint.mode={'full' if recompute == 'full' else 'none'} (the bench's recompute={recompute}; "
        "its default is selective)",
        "loss=cross_entropy_loss (fp32 logits, sum / tokens)",
        "optimizer=AdamW lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1, fused (its defaults but lr)",
        "training.max_norm=1.0 (its clip_grad_norm_, foreach)",
        "mixed precision=torch.autocast bf16 (its maybe_enable_amp on one GPU)" if cuda else "precision=float32 (CPU)",
        f"local_batch_size={batch}", f"seq_len={seq}",
    ]
    notes = ["its model, loss, clipping and (for full recompute) apply_ac in this script's loop; no Trainer, "
             "data loader, metrics or lr schedule step",
             "its weights are built on meta and initialised in place under torch.no_grad() as its Trainer does"]
    kind, setting = LOSS["torchtitan-0.2.2"]
    return time_steps(step, device, args.steps, args.warmup), {
        "framework_version": found, "settings": settings, "notes": notes, "loss_kind": kind, "loss_setting": setting}


def run_hf(shape, seq, batch, device, args, liger: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    if not liger and "liger" in modeling_llama.LlamaRMSNorm.__module__:
        raise RuntimeError("Liger has patched transformers in this process: run the rows in their own processes")

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
    if recompute_of(shape, args) == "full":
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

    kind, setting = LOSS["transformers+liger" if liger else "transformers"]
    extra = {"framework_version": version_of("liger-kernel" if liger else "transformers"), "loss_kind": kind,
             "loss_setting": setting}
    return time_steps(step, device, args.steps, args.warmup), extra


RUNNERS = {
    "loom": run_loom,
    "torchtitan-0.3.0": run_torchtitan_030,
    "torchtitan-0.2.2": run_torchtitan_022,
    "transformers": lambda *a: run_hf(*a, liger=False),
    "transformers+liger": lambda *a: run_hf(*a, liger=True),
}


# --- rows -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    framework: str
    shape: str
    seq: int
    loss_chunk: int | None = None  # loom only

    def head(self, args) -> dict:
        batch = args.tokens_per_step // self.seq
        return {"framework": self.framework, "model": self.shape, "seq_len": self.seq, "batch": batch,
                "tokens_per_step": batch * self.seq, "recompute": recompute_of(self.shape, args)}


def plan_rows(args) -> list[Row]:
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = [f for f in frameworks if f not in RUNNERS]
    if unknown:
        raise SystemExit(f"--frameworks: unknown {unknown}; choose from {list(RUNNERS)}")
    rows = []
    for shape in args.models.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--models: unknown {shape!r}; choose from {list(SHAPES)}")
        for seq in map(int, args.seqs.split(",")):
            if args.tokens_per_step % seq:
                raise SystemExit(f"--tokens-per-step={args.tokens_per_step} is not a multiple of sequence {seq}")
            for fw in frameworks:
                if fw == "loom":
                    rows += [Row(fw, shape, seq, int(c)) for c in str(args.loss_chunk).split(",")]
                else:
                    rows.append(Row(fw, shape, seq))
    return rows


def run_row(row: Row, device, args) -> dict:
    """Run one row in this process; a failure becomes the row's error."""
    out = row.head(args)
    if row.framework != "loom":
        kind, setting = LOSS[row.framework]
        out.update(loss_kind=kind, loss_setting=setting)
    else:
        kind, setting = loom_loss(row.loss_chunk)
        out.update(loss_kind=kind, loss_setting=setting)
    if getattr(args, "variant_name", None):
        out["row"] = args.variant_name
    hits0, t0 = compile_cache.hits(), time.perf_counter()
    try:
        if args.fp8 != "off" and row.framework != "loom":
            raise RuntimeError(f"--fp8 {args.fp8} is loom's train.fp8; {row.framework} runs without it here")
        one = argparse.Namespace(**{**vars(args), "loss_chunk": row.loss_chunk})
        timing, extra = RUNNERS[row.framework](row.shape, row.seq, out["batch"], device, one)
        tps = out["tokens_per_step"] / timing["step_s"]
        for conv in ("causal", "noncausal"):
            tf = tps * flops_per_token(row.shape, row.seq, conv == "causal") / 1e12
            out[f"tflops_{conv}"] = float(f"{tf:.4g}")
            out[f"mfu_{conv}"] = float(f"{tf / args.peak_tflops:.4g}")
        out.update(tokens_per_s=round(tps, 1), **timing, **extra)
    except Exception as exc:  # one framework failing does not stop the others
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["traceback"] = traceback.format_exc()[-3000:]
    out["row_s"] = round(time.perf_counter() - t0, 2)  # build + compile + warm-up + timed steps
    hits1 = compile_cache.hits()
    out["compile_cache"] = {k: hits1[k] - hits0[k] for k in hits1}
    compile_cache.save_active()  # a later row's cut-off keeps this one's artifacts
    return out


def child_argv(row: Row, args, out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--frameworks", row.framework,
            "--models", row.shape, "--seqs", str(row.seq), "--tokens-per-step", str(args.tokens_per_step),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--peak-tflops", str(args.peak_tflops),
            "--fp8", args.fp8, "--state-dtype", args.state_dtype, "--doc-len", str(args.doc_len), "--kernels", str(args.kernels),
            "--micro-batch", str(args.micro_batch), "--recompute-memory-gib", str(args.recompute_memory_gib),
            "--out", str(out)]
    if row.loss_chunk is not None:
        argv += ["--loss-chunk", str(row.loss_chunk)]
    if args.recompute:
        argv += ["--recompute", args.recompute]
    if not args.compile:
        argv.append("--no-compile")
    if args.torchtitan_compile:
        argv.append("--torchtitan-compile")
    if args.cpu:
        argv.append("--cpu")
    if getattr(args, "variant_name", None):
        argv += ["--variant", f"{args.variant_name}:"]  # the name only: the child gets the settings as flags
    return argv


def run_row_in_child(row: Row, args, pythonpaths: dict[str, str]) -> tuple[dict, dict | None]:
    """Run one row in its own process (with its framework's --pythonpath first); a crash or a timeout
    becomes the row's error. Returns the row and the child's machine (None if it wrote none)."""
    env = dict(os.environ)
    if row.framework in pythonpaths:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpaths[row.framework], env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        try:
            proc = subprocess.run(child_argv(row, args, out), env=env, timeout=args.row_timeout or None)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        if out.exists():
            child = json.loads(out.read_text())
            if child["runs"]:
                return child["runs"][0], child["machine"]
    head = row.head(args)
    kind, setting = loom_loss(row.loss_chunk) if row.framework == "loom" else LOSS[row.framework]
    head.update(loss_kind=kind, loss_setting=setting)
    if getattr(args, "variant_name", None):
        head["row"] = args.variant_name
    head["error"] = (f"timed out after --row-timeout {args.row_timeout} s" if code is None
                     else f"its process exited {code} without a result")
    return head, None


FIXED = ("variant", "out", "child", "in_process", "smoke", "cpu", "pythonpath", "row_timeout")


def variants(args) -> list[argparse.Namespace]:
    """--variant NAME:KEY=VALUE:...: copies of `args` with those options changed (typed as their defaults),
    each named; no --variant: `args` alone."""
    out = []
    for spec in args.variant:
        name, _, rest = spec.partition(":")
        v = argparse.Namespace(**{**vars(args), "variant_name": name})
        for item in filter(None, rest.split(":")):
            key, sep, text = item.partition("=")
            if not sep or key not in vars(args) or key in FIXED:
                allowed = sorted(set(vars(args)) - set(FIXED))
                raise SystemExit(f"--variant {spec!r}: {item!r} is not KEY=VALUE with KEY one of {allowed}")
            default = vars(args)[key]
            if isinstance(default, bool):
                if text not in ("true", "false"):
                    raise SystemExit(f"--variant {spec!r}: {key} takes true or false, not {text!r}")
                value = text == "true"
            else:
                value = type(default)(text) if default is not None else text
            setattr(v, key, value)
        if args.smoke and v.models != args.models:
            raise SystemExit(f"--variant {spec!r}: --smoke runs the tiny shape only")
        out.append(v)
    return out or [args]


def write(path: str | None, report: dict) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"any of {', '.join(FRAMEWORKS)}")
    ap.add_argument("--models", default="llama3.2-1b,llama3.2-3b")
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (torchtitan 0.3.0 records its "
                    "CUDA graph on the second)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    ap.add_argument("--recompute", choices=["none", "selective", "full", "auto"], default=None,
                    help="for every framework (default: none for 1B, full for 3B); auto: loom rows only, "
                    "recompute.mode=auto (the cheapest per-layer recomputation that fits the GPU's free memory)")
    ap.add_argument("--recompute-memory-gib", type=float, default=0.0,
                    help="loom's recompute.memory_gib for --recompute auto (0: the GPU's free memory)")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="loom rows: sequences per micro-batch, gradients accumulated over the step's "
                    "micro-batches (0: the whole step in one)")
    ap.add_argument("--loss-chunk", default="0,8192",
                    help="loom's train.loss_chunk, comma-separated: one loom row per value (0: plain loss)")
    ap.add_argument("--fp8", default="off", help="loom's train.fp8 (loom rows only)")
    ap.add_argument("--doc-len", type=int, default=0,
                    help="loom rows on packed rows: documents of about this many tokens (doc_ids + positions), 0: none")
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="loom's optim.state_dtype, the AdamW moments' storage (loom rows only)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="loom without torch.compile")
    ap.add_argument("--torchtitan-compile", action="store_true",
                    help="apply torchtitan's own per-block compile (its compile.enable; off in its defaults)")
    ap.add_argument("--pythonpath", action="append", default=[], metavar="FRAMEWORK=DIR",
                    help="put DIR first on that framework's PYTHONPATH (torchtitan-0.3.0=/tmp/tt030 ...)")
    ap.add_argument("--kernels", type=int, default=0,
                    help="on a GPU, profile one more step and record its top N kernels by device time (0: none)")
    ap.add_argument("--row-timeout", type=float, default=0, help="seconds per row, 0: none")
    ap.add_argument("--in-process", action="store_true",
                    help="run every row in this process (the CPU smoke; on a GPU Liger would patch later rows)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, CPU, 2 steps: checks the script runs")
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # children of a --smoke run
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one row, in this process
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE:...",
                    help="run the planned rows with these settings (this script's option names with _, e.g. "
                    "eager_1b:loss_chunk=0:compile=false), each result named NAME in its `row`; repeatable, in "
                    "order; with --in-process every variant shares one process (one torch import, one CUDA context)")
    ap.add_argument("--out", default=None, help="write the JSON report here (rewritten after every row)")
    args = ap.parse_args(argv)
    global KERNELS
    KERNELS = args.kernels
    if args.smoke:
        small = args.models if args.models.startswith("tiny") else "tiny"  # tiny or tiny-moe
        args.models, args.seqs, args.tokens_per_step, args.steps, args.warmup = small, "32", 64, 2, 1
        if args.loss_chunk == ap.get_default("loss_chunk"):
            args.loss_chunk = "0,16"
        args.cpu = True
    runs = variants(args)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    pythonpaths = {}
    for item in args.pythonpath:
        fw, sep, path = item.partition("=")
        if not sep or fw not in RUNNERS:
            raise SystemExit(f"--pythonpath {item!r}: expected FRAMEWORK=DIR with FRAMEWORK in {list(RUNNERS)}")
        pythonpaths[fw] = str(Path(path).resolve())
    if args.recompute == "auto" and set(args.frameworks.split(",")) - {"loom"}:
        raise SystemExit("--recompute auto is loom's recompute.mode=auto: give --frameworks loom")
    rows = [(v, row) for v in runs for row in plan_rows(v)]
    parent = not (args.child or args.in_process)  # keeps off the GPU: its children report the machine
    command = " ".join(sys.argv if argv is None else ["bench/gpu_train.py", *argv])
    report = {"machine": machine(torch.device("cpu") if parent else device), "command": command,
              "peak_tflops": args.peak_tflops, "tokens_per_step": args.tokens_per_step,
              "pythonpath": pythonpaths, "runs": []}
    write(args.out, report)
    compile_cache.activate("gpu_train")  # LOOM_COMPILE_CACHE_LOAD / _SAVE (bench/DEVICE.md)
    for v, row in rows:
        if parent:
            result, seen = run_row_in_child(row, v, pythonpaths)
            if seen and report["machine"]["device"] == "cpu":
                report["machine"] = seen
        else:
            result = run_row(row, device, v)
        report["runs"].append(result)
        write(args.out, report)
        if not args.child:
            print(json.dumps({k: v for k, v in result.items()
                              if k not in ("traceback", "step_times_s", "settings", "notes", "loss_setting")}),
                  flush=True)
        if not parent:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
