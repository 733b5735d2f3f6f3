"""Asynchronous RL (`rl.mode=async`): generation on its own ranks, running ahead of training by at most
`rl.max_staleness` (K) policy versions.

Processes. `loom rl --nproc N` with `rl.generation_ranks=G` starts N - G training ranks (the layout loom
accepts for N - G ranks; they are the run's process group) and training rank 0 starts the G generation ranks
as child processes. They meet through a TCP store that rank 0 opens: rollouts travel through it (token ids and
log-probs: small), weights through gloo process groups, one per training rank r, {r, every generation rank}.

Versions. The policy's version is the number of optimizer steps applied to it. Generation rank g produces
the rollouts of step s for the data-parallel ranks d with d % G == g (the prompts and seeds the synchronous
loop draws for (s, d): the same completions whatever the layout) with the newest weights it holds, after
waiting until that version is at least s - K: a deterministic schedule (version max(s - K, start)), so a run
is reproducible and K = 0 is the synchronous loop. Each rollout carries the version that produced it; the
trainer drops (masks out of the loss, `stale_dropped`) any older than K versions, and logs `staleness_mean`,
`staleness_max` and the time it waited (`rollout_wait_s`). The loss's truncated importance weights
(`rl.tis_cap`: min(pi_train / pi_gen, cap) per token, pi_train the policy before this step's update) correct
for the staleness; their mean and max are logged (`is_weight_mean`, `is_weight_max`).

Weights. After each optimizer step every training rank broadcasts, in its own group, the parameter chunks it
is the first holder of (its local shard of a DTensor whose coordinates on the replicated mesh dimensions are
0; a plain tensor from training rank 0), cast to the engine's dtype and packed into buckets; a generation
rank places each chunk at its global offset and refits its engine from the assembled tensors
(`Engine.refit`, so the engine's buffers stay where they are). No rank gathers the whole model: the
generation ranks hold whole copies, as the engine does in the synchronous loop, unless rl.generation_tp > 1
(below). The trainer blocks in the broadcast until the generation ranks finish the batch they are making, so a
step takes about max(generation, training) + the broadcast.

Tensor-parallel generation (`rl.generation_tp` = T). The G generation ranks form G / T engine groups: ranks
jT..jT+T-1 are group j, whose process group (this process's default one, met under its own prefix of the
store) carries a one-dimensional device mesh over which the engine's model is sharded as `loom serve --nproc`
shards it (`apply_tensor_parallel`, sp off). Every rank of a group runs the same rollouts (the same requests in
the same order; the engine gathers the logits before sampling, so all draw the same tokens); the group makes
the rollouts of the data-parallel ranks d with d % (G / T) == j, and its rank 0 reports them. A generation rank
receives every chunk of the broadcast and keeps only the part its shard holds (`_box`, `_overlap`), copied into
the engine's local shards in place (`Engine.refit(..., local=True)`). T must divide G and be a size the model
can be split by (`loom.rules.tp_problems`), checked before launch (`check_async`, `RLConfig.validate`).

Preemption and resume. In-flight rollouts are not saved: a resumed run's generation ranks start from the
checkpoint's weights (version = the resumed step) and regenerate the steps that follow, so a resumed async run
with K > 0 trains on fresher rollouts than the uninterrupted one would have (K = 0 resumes exactly).

Environments (`rl.environment`): the episodes run on the generation ranks, which own the engine (the synchronous
loop's `RL.rollouts`, its environment loaded there); the `Episode`s (transcript ids, the model-token mask, the
environment's rewards, the engine's log-probs) travel to the trainers as single completions do. Bad input met
on a generation rank (an environment's or a reward's `UserError`) is raised by the trainers as such (exit 2).

Dynamic sampling (`rl.dynamic_sampling`): a generation rank scores its rollouts (`RL.score`, with rl.reward and
the reward model if set, built there) and refills the uniform groups with `RL.refill_groups`, the synchronous
loop's draws (prompts and seeds a function of train.seed, step, round and the data-parallel rank's place); the
trainers take the refilled groups with their rewards and log `refilled_groups` and `dynamic_sampling_rounds`
(summed / the most over ranks) as the synchronous loop does. `reward_s` and `dynamic_sampling_s` are then the
generation rank's seconds.

LoRA (`lora.rank` > 0): the chunks broadcast are those of the merged weights W + (alpha / rank) B A
(`merged_state_dict`, as the synchronous loop refits its engine), so the generation ranks need no adapters; the
merge costs one B A product per adapted weight and step on the training ranks.

Not yet: generation ranks on other nodes than training rank 0, PPO (refused
before launch, `check_async`).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from loom.post.rl.weight_sync import (BUCKET_BYTES, WeightReceiver, _box, _broadcast, _buckets, _chunks,  # noqa: F401
                                      _narrow, _overlap, _pair_group, _weights)

ERROR_KEY = "generation-error"
USER_ERROR_KEY = "generation-user-error"  # bad input met on a generation rank (an environment's, a reward's)


def staleness_keep(step: int, versions: list[int], max_staleness: int) -> torch.Tensor:
    """1 for the rollouts of `step` made by a policy at most `max_staleness` versions old, else 0 (dropped)."""
    return torch.tensor([float(step - v <= max_staleness) for v in versions])


def check_async(cfg) -> None:
    """What rl.mode=async does not do yet, refused before launch."""
    from loom.errors import UserError

    from loom.rules import tp_problems, valid_tp_sizes

    rl = cfg.rl
    if rl.algorithm != "grpo":
        raise UserError(f"rl.mode=async trains rl.algorithm=grpo only (got {rl.algorithm!r}); use rl.mode=sync for ppo")
    if rl.generation_tp > 1 and (problems := tp_problems(rl.generation_tp, cfg.model, cfg.train.seq_len, sp=False)):
        valid = [d for d in valid_tp_sizes(cfg.model, cfg.train.seq_len, sp=False) if rl.generation_ranks % d == 0]
        raise UserError(f"rl.generation_tp={rl.generation_tp} cannot shard the model: {'; '.join(problems)}; valid "
                        f"here (model and rl.generation_ranks={rl.generation_ranks}): {valid}")


def training_processes(cfg, nproc: int, nnodes: int) -> int:
    """The training ranks of `loom rl --nproc nproc`: all of them, or with rl.mode=async nproc minus the
    generation ranks (which training rank 0 starts)."""
    from loom.errors import UserError

    rl = cfg.rl
    if rl.mode != "async":
        return nproc
    if nnodes > 1:
        raise UserError(f"rl.mode=async runs on one node for now (got --nnodes={nnodes}); use rl.mode=sync")
    if nproc <= rl.generation_ranks:
        raise UserError(f"rl.mode=async with rl.generation_ranks={rl.generation_ranks} needs --nproc > "
                        f"{rl.generation_ranks} (the rest train); got --nproc={nproc}")
    return nproc - rl.generation_ranks


class AsyncRollouts:
    """The training ranks' side: opens the store and starts the generation ranks (rank 0) as soon as the process
    group exists (`RL.datasets`), so that their start-up overlaps the trainer's; `connect` once the policy holds
    its weights; then takes each step's rollouts and publishes the weights after every update."""

    def __init__(self, cfg):
        self.rl = cfg.rl
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        timeout = cfg.train.collective_timeout_s
        self.procs = []
        address = None
        if self.rank == 0:
            self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout))
            host = "127.0.0.1" if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world else socket.gethostname()
            address = [host, self.store.port]
        if distributed:
            box = [address]
            dist.broadcast_object_list(box, src=0)
            address = box[0]
        if self.rank != 0:
            self.store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=timeout))
        self.timeout = timeout
        self.world = world
        self.threads = torch.get_num_threads()
        self.address = address
        self.cfg = cfg

    def start(self, recipe_class) -> None:
        """Rank 0: start the generation ranks (they build their engine, then wait for `connect`)."""
        if self.rank != 0:
            return
        ctx = multiprocessing.get_context("spawn")
        for g in range(self.rl.generation_ranks):
            proc = ctx.Process(target=generation_rank, daemon=True, name=f"loom-rl-generation-{g}",
                               args=(recipe_class, self.cfg, "127.0.0.1", self.address[1], g, self.world,
                                     self.threads, os.getpid()))
            proc.start()
            self.procs.append(proc)

    def connect(self, trainer, engine_dtype: torch.dtype) -> "AsyncRollouts":
        """Tell the generation ranks the starting step, this rank's data-parallel rank and chunks; join the pair
        group; publish the policy's weights (version = the starting step)."""
        self.dp_rank = trainer.layout.dp_rank
        self.dtype = engine_dtype
        if self.rank == 0:
            self.store.set("start", str(trainer.state.step))
        self.model = trainer.model
        self.chunks = _chunks(self.model, self.rank)
        self.store.set(f"trainer/{self.rank}", pickle.dumps(
            (self.dp_rank, [(n, off, shape, full) for n, _, off, shape, full in self.chunks])))
        self.group = self._guarded(lambda: _pair_group(self.store, self.rank, 0, self.rl.generation_ranks,
                                                       self.timeout))
        self.buckets = _buckets([c[1].numel() for c in self.chunks], torch.empty((), dtype=self.dtype).element_size())
        self.publish(trainer.state.step)
        return self

    def _guarded(self, fn):
        """`fn()`, with a generation rank's own error (left in the store) raised instead of a broken pipe."""
        try:
            return fn()
        except Exception as exc:
            self._raise_generation_error(exc)
            raise

    def _raise_generation_error(self, cause: Exception | None = None) -> None:
        """Raise a generation rank's error if one left it in the store: bad input (an environment's or a reward's
        UserError) as UserError, so the run exits 2 naming it; anything else as RuntimeError with its traceback."""
        from loom.errors import UserError

        if self.store.check([USER_ERROR_KEY]):
            raise UserError(self.store.get(USER_ERROR_KEY).decode()) from cause
        if self.store.check([ERROR_KEY]):
            raise RuntimeError(self.store.get(ERROR_KEY).decode()) from cause

    def take(self, step: int):
        """This data-parallel rank's rollouts of `step`: (prompts, completions, the version of each, and with
        rl.dynamic_sampling what the generation rank scored and refilled, else None: `_made`'s dict)."""
        key = f"rollouts/{step}/{self.dp_rank}"
        t0 = time.perf_counter()
        while not self.store.check([key]):  # wait, failing at once with a generation rank's error
            self._raise_generation_error()
            if self.procs and not all(p.is_alive() for p in self.procs):
                raise RuntimeError(f"a generation rank exited (codes {[p.exitcode for p in self.procs]}) before "
                                   f"the rollouts of step {step + 1}")
            time.sleep(0.002)
        version, prompts, done, made = pickle.loads(self.store.get(key))
        self.store.set(f"read/{step}/{self.dp_rank}/{self.rank}", b"1")
        self.waited_s = time.perf_counter() - t0
        return prompts, done, [version] * len(done), made

    def staleness(self, recipe, batch: dict, step: int, versions: list[int]) -> dict:
        """Drop (mask out of the loss) the rows made by a policy more than rl.max_staleness versions before
        `step`'s; the step's staleness metrics over the global batch."""
        keep = staleness_keep(step, versions, self.rl.max_staleness)
        if (keep == 0).any():
            batch["mask"] = batch["mask"] * keep[:, None]
        lag = [step - v for v in versions]
        mean, = recipe._global_mean([(sum(lag), len(lag))])
        return {"staleness_mean": mean, "staleness_max": recipe._global_max(float(max(lag))),
                "stale_dropped": int(recipe._global_sum(float((keep == 0).sum()))),
                "rollout_wait_s": self.waited_s}

    def publish(self, version: int) -> float:
        """Broadcast this rank's chunks of the policy (its `version`-th update) to the generation ranks; the
        seconds it took."""
        t0 = time.perf_counter()
        self.chunks = _chunks(self.model, self.rank)  # the same chunks, their current tensors
        with torch.no_grad():
            for bucket in self.buckets:
                flat = torch.cat([self.chunks[i][1].detach().reshape(-1).to(self.dtype) for i in bucket]).cpu()
                self._guarded(lambda: _broadcast(self.group, flat))
        return time.perf_counter() - t0

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()


def _watch_parent(parent_pid: int) -> None:
    """Exit when the training rank that started this process is gone (killed without running its exit hooks)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def generation_rank(recipe_class, cfg, host: str, port: int, index: int, trainers: int, threads: int,
                    parent_pid: int) -> None:
    """A generation rank (sampling with `recipe_class`'s `rollouts`, the synchronous loop's): the rollouts of
    steps start..train.steps-1 for its data-parallel ranks, each with the newest weights it holds once their
    version is at least step - rl.max_staleness."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    timeout = cfg.train.collective_timeout_s
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    try:
        _generate(recipe_class, cfg, store, index, trainers, threads)
    except BaseException as exc:  # the trainers raise this instead of waiting for a collective to time out
        from loom.errors import UserError

        if isinstance(exc, UserError):
            store.set(USER_ERROR_KEY, str(exc))
        store.set(ERROR_KEY, f"generation rank {index} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        os._exit(1)


def _made(side, data, step: int, first: int, indices, prompts, done, texts):
    """rl.dynamic_sampling on a generation rank: the rollouts scored and their uniform groups refilled as the
    synchronous loop does (`RL.refill_groups`: the same prompts and seeds); (prompts, completions, {indices,
    rewards, refilled, rounds, reward_s, dynamic_sampling_s}) for the trainers."""
    from loom.post.rl.dynamic import Groups

    group_size = side.trainer.cfg.rl.group_size
    t0 = time.perf_counter()
    rewards = side.score(data, indices, group_size, prompts, done, texts)
    t1 = time.perf_counter()
    groups, refilled, rounds = side.refill_groups(data, step, first, Groups(list(indices), prompts, done, texts,
                                                                            rewards))
    return groups.prompts, groups.done, {"indices": groups.indices, "rewards": groups.rewards, "refilled": refilled,
                                         "rounds": rounds, "reward_s": t1 - t0,
                                         "dynamic_sampling_s": time.perf_counter() - t1}


def _engine_place(cfg, store, device: torch.device, group: int, tp_rank: int):
    """`place` for this generation rank's engine model: whole, or with rl.generation_tp = T > 1 sharded by tensor
    parallelism over a one-dimensional mesh of its group's T ranks (`loom serve --nproc`'s layout), whose process
    group is this process's default one (it meets the group's other ranks under its own prefix of the store)."""
    from loom.build import tensor_parallel, whole
    from loom.parallel.dims import MeshPlace

    tp = cfg.rl.generation_tp
    if tp == 1:
        return tensor_parallel(MeshPlace(mesh=None))
    from torch.distributed.device_mesh import init_device_mesh

    from loom.parallel.tensor import apply_tensor_parallel

    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(f"generation-tp{group}/", store), rank=tp_rank,
                            world_size=tp, timeout=timedelta(seconds=cfg.train.collective_timeout_s))
    mesh = init_device_mesh(device.type, (tp,))

    def place(model: nn.Module):
        apply_tensor_parallel(model, mesh, sp=False)
        return whole(model)
    return place


def _generate(recipe_class, cfg, store, index: int, trainers: int, threads: int) -> None:
    from types import SimpleNamespace

    from loom.build import build_in_layout, torch_dtype
    from loom.data.tokenizer import load_tokenizer
    from loom.parallel.distributed import pick_device
    from loom.post.rl.environments import Turns, load_environment
    from loom.post.rl.prompts import build_datasets
    from loom.post.rl.rollouts import rollout_engine, rollout_seed, stops

    torch.set_num_threads(threads)
    rl, t = cfg.rl, cfg.train
    device = pick_device(t.device)
    if device.type == "cuda":  # the devices after the training ranks'
        device = torch.device("cuda", (trainers + index) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    tokenizer = load_tokenizer(cfg)
    train_data, _ = build_datasets(cfg, tokenizer)
    # rl.generation_tp = T: this rank is shard `tp_rank` of engine group `group` (ranks group*T .. group*T + T-1)
    group, tp_rank = divmod(index, rl.generation_tp)
    model = build_in_layout(cfg, device, _engine_place(cfg, store, device, group, tp_rank), dtype=torch_dtype(cfg),
                            seed=0).model
    # The synchronous loop's own sampling code (RL.rollouts), on this rank's engine.
    side = recipe_class()
    side.trainer = SimpleNamespace(cfg=cfg, tokenizer=tokenizer)
    side.engine = rollout_engine(cfg, model, tokenizer.decode)
    side.stop_ids, side.stop_texts = stops(cfg, tokenizer)
    # rl.environment: the episodes run here, on this rank's engine (Episode objects travel to the trainers)
    side.environment = load_environment(rl.environment) if rl.environment else None
    side.turns = Turns(tokenizer, side.chat_template(cfg))
    if rl.dynamic_sampling:  # the refill needs the rewards: scored here (the trainers take them as they are)
        from loom.post.rl.rewards import Rewards

        side.rewards = Rewards(cfg, tokenizer, device)
    start = int(store.get("start"))  # set by training rank 0 once its policy holds its weights (`connect`)
    receiver = WeightReceiver(store, index, trainers, rl.generation_ranks, side.engine, t.collective_timeout_s)
    receiver.receive()
    version = start
    dp_size = max(receiver.dp_ranks) + 1
    groups = rl.generation_ranks // rl.generation_tp
    mine = sorted({d for d in receiver.dp_ranks if d % groups == group})
    reports = tp_rank == 0  # a group's rollouts are made by all its ranks in lockstep, reported by its first
    prompts_per_step = t.global_batch // rl.group_size
    per_rank = prompts_per_step // dp_size
    for step in range(start, t.steps):
        while version < step - rl.max_staleness:
            receiver.receive()
            version += 1
        for d in mine:
            first = step * prompts_per_step + d * per_rank
            indices = train_data.take(first, per_rank, t.seed)
            seeds = [rollout_seed(t.seed, step, first * rl.group_size + k) for k in range(per_rank * rl.group_size)]
            prompts, done, texts = side.rollouts(train_data, indices, rl.group_size, seeds, greedy=False)
            made = None
            if rl.dynamic_sampling:
                prompts, done, made = _made(side, train_data, step, first, indices, prompts, done, texts)
            if reports:
                store.set(f"rollouts/{step}/{d}", pickle.dumps((version, prompts, done, made)))
        if step >= 1 and reports:  # what every trainer has read is dropped from the store
            for d in mine:
                readers = [r for r in range(trainers) if receiver.dp_ranks[r] == d]
                if all(store.check([f"read/{step - 1}/{d}/{r}"]) for r in readers):
                    store.delete_key(f"rollouts/{step - 1}/{d}")
    while version < t.steps:  # the trainers publish after every step, the last one too
        receiver.receive()
        version += 1
