"""One transformer block at a tensor-parallel rank's shape, eager against compiled, on one GPU (issue 52 item 5).

    .venv/bin/python bench/block_gpu.py --out F.json [--profile P.json | --gpu h200] [--shapes A,B] [--smoke]

`loom plan` prices the blocks of every layout loom compiles (tp, cp, pp, MoE since issue 52) at the rate a tp = 1
dense block was measured to reach compiled. This measures the block a tensor-parallel rank runs: the model's
layer with heads, key/value heads and MLP width divided by tp (hidden size and head size unchanged), forward and
backward of one micro-batch in bf16, eager and `torch.compile`d, the collectives left out (one GPU has none to
run). Each row also carries the planner's time for the same block from the profile (`--profile`, else the GPU
preset `--gpu`), written before anything runs: the layer's forward and backward terms less its tensor-parallel
collectives, at the profile's compiled and eager rates. The device check runs it after the profile step.

`--smoke` (CPU): a tiny shape, fp32, torch.compile's `aot_eager` backend, two timed iterations: the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import write_stamped  # noqa: E402

# name: (model config, tp, sequence length, micro-batch)
SHAPES = {
    "llama3-70b-tp8": ("llama3-70b", 8, 8192, 1),
    "llama3-8b-tp4": ("llama3-8b", 4, 8192, 1),
    "gpt3-175b-tp4": ("gpt3-175b", 4, 2048, 1),
}
SMOKE = {"tiny-tp2": ("tiny", 2, 64, 2)}


def rank_config(model, tp: int):
    """The model with one tensor-parallel rank's share of the layer: heads, key/value heads and MLP width / tp."""
    if model.heads % tp or model.kv_heads % tp or model.ffn_hidden % tp:
        raise SystemExit(f"tp={tp} does not divide heads {model.heads}, kv_heads {model.kv_heads} and "
                         f"ffn_hidden {model.ffn_hidden}")
    return replace(model, heads=model.heads // tp, kv_heads=model.kv_heads // tp, ffn_hidden=model.ffn_hidden // tp,
                   explicit_head_dim=model.head_dim, layers=1)


def predicted_ms(model, tp: int, seq: int, mbs: int, gpu) -> dict:
    """The planner's forward + backward of one layer at this shape, less its tensor-parallel collectives, with
    its blocks compiled and eager (ms)."""
    from loom.planner.layertime import layer_times
    from loom.planner.workload import Workload

    out = {}
    for mode in ("on", "off"):
        w = Workload(model, seq, mbs, tp, gpu, compile=mode)
        t = layer_times(w, tp, 1, mbs, False, "none")
        total = sum(t.fwd.values()) + sum(t.bwd.values())
        total -= t.fwd["tp_comm"] + t.bwd["tp_comm"]
        out["compiled" if mode == "on" else "eager"] = round(total * 1e3, 3)
    return out


def measure(model, seq: int, mbs: int, device: str, dtype, compiled: bool, iters: int, backend: str) -> float:
    """Median ms of forward + backward of one block (input gradient included) over `iters` timed iterations."""
    import torch

    from loom.models.llama import TransformerBlock, rope_tables
    from loom.train.steps import attention_kernels

    torch.manual_seed(0)
    block = TransformerBlock(model, 0).to(device=device, dtype=dtype)
    cos, sin = rope_tables(model.head_dim, seq, model.rope_theta, model)
    rope = (cos.to(device), sin.to(device)) if model.position == "rope" else None
    x = torch.randn(mbs, seq, model.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    run = torch.compile(block, backend=backend) if compiled else block
    dev = torch.device(device)
    times = []
    with attention_kernels(dev):
        for i in range(iters + 3):  # three warm-ups: compilation, autotuning, allocator
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(x, rope).backward(grad)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
            x.grad = None
            block.zero_grad(set_to_none=True)
    return round(statistics.median(times), 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", default="", help="a hardware profile JSON (loom plan --profile-hardware)")
    ap.add_argument("--gpu", default="h200", help="the planner preset when no profile is given")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from loom.config import load_config
    from loom.planner.hardware import load_gpu

    command = "python bench/block_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in args.shapes.split(",")}
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    backend = "aot_eager" if args.smoke else "inductor"
    iters = 2 if args.smoke else args.iters
    gpu = load_gpu(args.profile or args.gpu)
    rows = []
    for name, (config, tp, seq, mbs) in shapes.items():
        full = load_config(config).model
        row = {"shape": name, "model": config, "tp": tp, "seq": seq, "micro_batch": mbs,
               "predicted_ms": predicted_ms(full, tp, seq, mbs, gpu), "prediction_from": gpu.name}
        rows.append(row)  # the prediction is written before the measurement
        write_stamped(Path(args.out), {"rows": rows, "device": device, "dtype": str(dtype)}, command)
        local = rank_config(full, tp)
        row["eager_ms"] = measure(local, seq, mbs, device, dtype, False, iters, backend)
        row["compiled_ms"] = measure(local, seq, mbs, device, dtype, True, iters, backend)
        row["compiled_speedup"] = round(row["eager_ms"] / row["compiled_ms"], 3)
        for mode, key in (("compiled", "compiled_ms"), ("eager", "eager_ms")):
            row[f"{mode}_error"] = round(row["predicted_ms"][mode] / row[key] - 1, 3)
        write_stamped(Path(args.out), {"rows": rows, "device": device, "dtype": str(dtype)}, command)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
