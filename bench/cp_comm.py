"""Context parallelism's exchange against its attention compute, measured (CPU, gloo, N local processes).

For each cp size, every rank runs the cp attention core (loom/parallel/context.py) forward + backward on
its 2 chunks of a sequence, and separately the key/value all-gather + gradient reduce-scatter alone. It
reports bytes each rank sends per layer (all-gather and a ring exchange move the same bytes: (cp-1)/cp of
the keys/values; a ring just splits them into cp-1 dependent rounds), the exchange's share of the
attention time, and attention time per rank against cp=1 (load balance: ideally 1/cp).

  .venv/bin/python bench/cp_comm.py [--seq 4096] [--heads 8 --kv-heads 2 --head-dim 64] [--out FILE]

On gloo the exchange runs over local sockets, far slower than NVLink relative to compute, so the share
measured here bounds what a GPU node sees from above; it is not a GPU number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _rank(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from loom.models.llama import attention_core
    from loom.parallel.context import ContextParallelCore, _GatherKV, gather_sequence, rank_positions

    group = dist.new_group(list(range(world)))
    s = args.seq // world
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, args.heads, s, args.head_dim, generator=g, requires_grad=True)
    k = torch.randn(1, args.kv_heads, s, args.head_dim, generator=g, requires_grad=True)
    v = torch.randn(1, args.kv_heads, s, args.head_dim, generator=g, requires_grad=True)
    grad = torch.randn(1, args.heads, s, args.head_dim, generator=g)

    if world == 1:
        def attend():
            attention_core(q, k, v, "sdpa", 0.0).backward(grad)
    else:
        core = ContextParallelCore(group, world, rank)

        def attend():
            core(q, k, v, "sdpa", 0.0).backward(grad)

    def exchange():
        kk, vv = gather_sequence(k, group, world), gather_sequence(v, group, world)
        (kk.sum() + vv.sum()).backward()

    total = _best(attend, args.repeat)
    comm = _best(exchange, args.repeat) if world > 1 else 0.0
    _GatherKV.traffic.update(gathered_bytes=0, scattered_bytes=0)
    if world > 1:
        exchange()
    queue.put((rank, {"attention_fwd_bwd_s": total, "exchange_s": comm, **dict(_GatherKV.traffic),
                      "positions_first": rank_positions(args.seq, world, rank)[:1].item()}))
    dist.destroy_process_group()


def run(world: int, args) -> list[dict]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    base = None
    for cp in args.cp:
        ranks = run(cp, args)
        attn = max(r["attention_fwd_bwd_s"] for r in ranks)
        base = base or attn
        kv = 2 * args.seq // cp * args.kv_heads * args.head_dim * 4  # this rank's K and V, fp32
        row = {"cp": cp, "attention_fwd_bwd_s_slowest_rank": round(attn, 5),
               "attention_per_rank_vs_cp1": round(attn / base, 3),
               "per_rank_attention_s": [round(r["attention_fwd_bwd_s"], 5) for r in ranks],
               "exchange_s": round(max(r["exchange_s"] for r in ranks), 5),
               "exchange_share_of_attention": round(max(r["exchange_s"] for r in ranks) / attn, 3),
               "sent_bytes_per_rank_per_layer": ranks[0]["gathered_bytes"] + ranks[0]["scattered_bytes"],
               "ring_would_send_bytes": 2 * kv * (cp - 1)}
        rows.append(row)
        print(json.dumps(row))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU, gloo)",
              "torch": torch.__version__, "commit": commit, "command": "python bench/cp_comm.py " + " ".join(sys.argv[1:]),
              "shape": {"seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                        "batch": 1, "dtype": "float32"},
              "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
