"""What one transformer block keeps for backward on one rank, compiled and eager, in each layout family, against
the planner's per-layer activation bytes (loom/planner/memory.py `memory`).

Each family runs loom's own training path (`place_in_mesh`, `build_runner` with train.compile on or off, the
default inductor backend) on gloo processes in bf16 (the model cast to bf16, as the GPU path computes), once
with one layer and once with two; one forward's saved tensors are counted with saved-tensor hooks (each storage
once; parameters, FSDP's unsharded weights and tensor-parallel weight shards left out; sequence parallelism's
kept shards reported by its own hooks through `SavedTensorLedger.active`). The two-layer count minus the
one-layer count is one block's, with nothing outside the blocks in it (the second block's input is the first
block's output; the final norm and head save the same in both).

    .venv/bin/python bench/compiled_saved_bytes.py [--families tp1,tp2,...] [--out bench/results/compiled_saved_bytes.json]

A family's rank count is tp x cp. The planner's figure is `memory(...)["activations"] / layers` for the same
model and layout (compile on or off, bf16). On the GPU path context parallelism passes no dense mask
(`causal_lower_right`), so the count leaves out the bottom-right causal masks the CPU path materialises.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

H, A, G, F, S, B = 256, 8, 2, 1024, 256, 2
BASE = [f"model.hidden={H}", f"model.heads={A}", f"model.kv_heads={G}", f"model.ffn_hidden={F}",
        "model.vocab_size=512", f"model.max_seq_len={S}", f"train.seq_len={S}", f"train.micro_batch={B}",
        f"train.global_batch={B}", "model.tie_embeddings=false", "train.dtype=bfloat16"]
FAMILIES = {"tp1": [], "tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"],
            "cp2": ["parallel.cp=2"], "tp2-sp-cp2": ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2"]}
# GPT-3's block (configs/gpt3-175b.toml): LayerNorm, GELU, biases, learned positions; and with its residual dropout
# (attention dropout left at 0: on a GPU flash/cuDNN attention keeps only its RNG seed for it, where the CPU's math
# attention would keep the probabilities)
GPT = ["model.norm=layernorm", "model.mlp=gelu", "model.position=learned", "model.bias=true"]
FAMILIES.update({"gpt-tp1": GPT, "gpt-tp1-dropout": GPT + ["model.dropout=0.1"],
                 "gpt-cp2-dropout": GPT + ["model.dropout=0.1", "parallel.cp=2"]})


def _saved_bytes(overrides: list[str], layers: int, compiled: bool) -> tuple[int, list]:
    """(bytes, [(shape, dtype, bytes)]) one forward of this rank saves for backward."""
    from torch.distributed.tensor import DTensor

    from loom.config import load_config
    from loom.ledger import SavedTensorLedger, _storage_key
    from loom.models.llama import build_model
    from loom.models.losses import TokenCrossEntropy, run_loss_chunk
    from loom.parallel import place_in_mesh
    from loom.parallel.tensor import loss_context
    from loom.train.steps import build_runner, to_device

    torch.set_num_threads(1)
    torch._dynamo.reset()
    cfg = load_config("tiny", BASE + overrides + [f"model.layers={layers}", f"train.compile={str(compiled).lower()}"])
    layout = place_in_mesh(cfg, "cpu")
    model = build_model(cfg.model, seed=3).to(torch.bfloat16)
    runner = build_runner(model, cfg, layout, TokenCrossEntropy(run_loss_chunk(cfg)), torch.device("cpu"), None)
    ids = torch.randint(0, 512, (B, S + 1), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    runner.forward_backward(batch, 1.0)  # compiles forward and backward
    micro = to_device(runner.cp_shard(batch), torch.device("cpu"))

    class Ledger(SavedTensorLedger):  # leaves out the weights as they are now (FSDP's unsharded ones) and lists shapes
        shapes: list = []

        def record(self, t):
            key, n = _storage_key(t)
            weights = {_storage_key(p._local_tensor if isinstance(p, DTensor) else p)[0]
                       for p in self.model.parameters()}  # as they are now: FSDP's unsharded ones
            if n == 0 or key in self.seen or key in weights or isinstance(t, torch.nn.Parameter):
                return
            self.seen[key] = True
            self.shapes.append((list(t.shape), str(t.dtype).removeprefix("torch."), n))
            self.bytes["all"] = self.bytes.get("all", 0) + n

    with Ledger(runner.model, module_hooks=False) as ledger, loss_context(layout.tp):
        runner.loss_sum(micro)
    return ledger.bytes.get("all", 0), ledger.shapes


def block_bytes(overrides: list[str], compiled: bool) -> dict:
    one, _ = _saved_bytes(overrides, 1, compiled)
    two, shapes = _saved_bytes(overrides, 2, compiled)
    return {"bytes": two - one, "two_layer_saved": shapes}


def predicted(overrides: list[str], compiled: bool) -> float:
    """The planner's per-layer activation bytes for this family (bf16, no recomputation)."""
    import dataclasses

    from loom.config import load_config
    from loom.planner.hardware import PRESETS
    from loom.planner.memory import memory
    from loom.planner.workload import Layout, Workload

    cfg = load_config("tiny", BASE + overrides + ["model.layers=2"])
    p = cfg.parallel
    gpu = dataclasses.replace(PRESETS["h200"], source="profile")
    w = Workload(cfg.model, S, B, p.tp * p.cp, gpu, compile="on" if compiled else "off", loss_chunk=0)
    lay = Layout(tp=p.tp, cp=p.cp, sp=p.sp, micro_batch=B, dp_style="replicate")
    return memory(w, lay)["activations"] / cfg.model.layers


def main(argv=None) -> int:
    from distributed import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows = []
    for name in args.families.split(","):
        if name not in FAMILIES:
            print(f"unknown family {name!r}; valid: {', '.join(FAMILIES)}", file=sys.stderr)
            return 2
        overrides = FAMILIES[name]
        world = 1
        for o in overrides:
            if o.startswith(("parallel.tp=", "parallel.cp=")):
                world *= int(o.split("=")[1])
        for compiled in (True, False):
            got = run_ranks(world, block_bytes, overrides, compiled) if world > 1 else [block_bytes(overrides, compiled)]
            measured = got[0]["bytes"]
            want = predicted(overrides, compiled)
            rows.append({"family": name, "compiled": compiled, "measured_bytes": measured, "planner_bytes": want,
                         "error": round(want / measured - 1, 4), "ranks": world,
                         "rank0_saved_two_layers": got[0]["two_layer_saved"]})
            print(f"{name:12s} {'compiled' if compiled else 'eager':8s} measured {measured:>9d} planner {want:>11.0f} "
                  f"({want / measured - 1:+.1%})", flush=True)
    if args.out:
        import platform
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        meta = {"torch": torch.__version__, "commit": commit,
                "machine": f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} cores",
                "command": " ".join(["bench/compiled_saved_bytes.py", *(argv or sys.argv[1:])]),
                "model": dict(hidden=H, heads=A, kv_heads=G, ffn_hidden=F, seq=S, micro_batch=B, dtype="bfloat16")}
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
