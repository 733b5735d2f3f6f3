"""Run a function on N local ranks (gloo) and gather what each returns."""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _leave(results):
    """Leave without the interpreter's teardown of torch (about a second per process, as loom.cli._exit):
    once the queue's feeder thread has handed the results over, nothing is left to do."""
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank, world, port, fn, args, queue):
    try:
        _join(rank, world, port)
        queue.put((rank, fn(*args), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _leave(queue)


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


def release_groups() -> int:
    """Destroy every process group but the default one; returns how many. Each gloo group a layout's device mesh
    makes holds its own threads for the life of the process, so a rank that runs many layouts would otherwise
    gather hundreds of them (issue 53: over 1,000 threads in one rank during the MoE matrix)."""
    import torch
    from torch.distributed.distributed_c10d import GroupMember, _world

    groups = [pg for pg in list(_world.pg_map) if pg is not GroupMember.WORLD]
    for pg in groups:
        dist.destroy_process_group(pg)
    # DTensor's caches hold meshes equal (by layout) to the next task's, whose groups are now gone
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    for fn in vars(_redistribute).values():
        if callable(getattr(fn, "cache_clear", None)):
            fn.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's copy of the same
    return len(groups)


def _pool_worker(rank, world, port, tasks, results):
    _join(rank, world, port)
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            value, error = fn(*args), None
        except BaseException:
            value, error = None, traceback.format_exc()
        if error is None:  # every rank ends the task before any destroys a group another rank may still use
            try:  # (a failed task closes the pool: its error goes out at once, the other ranks may be stuck)
                dist.barrier()
                release_groups()
            except BaseException:
                error = traceback.format_exc()
        results.put((rank, value, error))
    dist.destroy_process_group()
    _leave(results)


class RankPool:
    """`world` gloo rank processes kept alive between calls: `run(fn, *args)` runs fn(*args) on every rank
    and returns the results in rank order, as `run_ranks` does, without starting processes again (importing
    torch and loom and joining the group take longer than a short training run). A failure on any rank
    closes the pool, since the other ranks may be waiting in a collective, and re-raises."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world, port, self.tasks[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 600) -> list:
        if not self.alive:
            raise RuntimeError("the rank pool was closed by an earlier failure")
        for q in self.tasks:
            q.put((fn, args))
        results, deadline = {}, time.monotonic() + timeout
        try:
            while len(results) < self.world:
                try:
                    rank, value, error = self.results.get(timeout=5)
                except queue.Empty:  # a rank that died (killed, crashed in C++) never answers
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"ranks {dead} died" if dead else f"no answer in {timeout} s") from None
                    continue
                if error:
                    raise RuntimeError(f"rank {rank} failed:\n{error}")
                results[rank] = value
        except BaseException:
            self.close(kill=True)
            raise
        return [results[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


_SHARED: dict[int, RankPool] = {}


def shared_pool(world: int) -> RankPool:
    """The session's rank pool of `world` processes, started on first use and closed when pytest exits: the
    equivalence tests' training runs share it instead of each starting torch and joining a group again."""
    pool = _SHARED.get(world)
    if pool is None or not pool.alive:
        if not _SHARED:
            import atexit

            atexit.register(lambda: [p.close() for p in _SHARED.values()])
        pool = _SHARED[world] = RankPool(world)
    return pool
