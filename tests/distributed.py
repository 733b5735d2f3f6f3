"""Run a function on N local ranks (gloo) and gather what each returns."""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, fn(*args), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without the interpreter's teardown of torch (about a second per process, as loom.cli._exit):
    # once the queue's feeder thread has handed the result over, nothing is left to do.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn, *args) -> list:
    """fn(*args) on `world` processes; returns the results in rank order (re-raises a worker's error)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, value, error = queue.get(timeout=300)
        if error:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        results[rank] = value
    for p in procs:
        p.join(timeout=60)
    return [results[r] for r in range(world)]
