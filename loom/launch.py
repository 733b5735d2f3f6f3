"""`loom train|memory --nproc N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]`: start the workers.

The launcher validates the config and the layout against the process count *before* any worker
exists, prepares the tokenizer and token datasets once (so N workers do not race to build the same
cache), then hands over to PyTorch's elastic launcher (`torch.distributed.run`, i.e. torchrun) with a
c10d rendezvous. Each worker runs `python -m loom.cli train ...` with the same arguments and joins the
process group from the environment torchrun sets (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

from loom.config import Config
from loom.errors import UserError


def in_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch(cfg: Config, command: list[str], overrides: list[str], nproc: int, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: str | None = None, max_restarts: int = 0,
           prepare_data=None, recipe: str = "train") -> int:
    """Start `python -m loom.cli COMMAND... --OVERRIDES` on nproc x nnodes workers.

    `prepare_data()` builds the run's shared data caches once, in this process, after the layout is checked
    (for `recipe`, loom/rules.py) and before the workers start.

    Without a data-parallel size in the config (dp_replicate = dp_shard = 1), `parallel.dp_shard` is
    inferred from the process count, as Megatron infers its data-parallel size, and passed on to the
    workers as an override."""
    from loom.rules import check_layout, infer_dp_shard

    if nproc < 1 or nnodes < 1:
        raise UserError(f"--nproc={nproc} and --nnodes={nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank={node_rank} must be in 0..{nnodes - 1}")
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the address of node 0, reachable by all)")
    from loom.train.control import LAUNCHED_AT

    started = os.environ.get(LAUNCHED_AT)
    os.environ[LAUNCHED_AT] = repr(time.time())  # the workers' train.exit_after_minutes counts from here
    try:
        inferred = infer_dp_shard(cfg.parallel, nproc * nnodes)
        if inferred:
            cfg.parallel.dp_shard = inferred[0]
            overrides = [*overrides, f"parallel.dp_shard={inferred[0]}"]
            print(f"loom {command[0]}: {inferred[1]}", file=sys.stderr, flush=True)
        check_layout(cfg, nproc * nnodes, recipe=recipe)
        if prepare_data is not None:
            prepare_data()
        return start_workers(command, overrides, nproc, nnodes, node_rank, rdzv_endpoint, max_restarts)
    finally:
        if started is None:
            os.environ.pop(LAUNCHED_AT, None)
        else:
            os.environ[LAUNCHED_AT] = started


def start_workers(command: list[str], overrides: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, max_restarts: int = 0) -> int:
    """torchrun `python -m loom.cli COMMAND... --OVERRIDES` on nproc x nnodes workers (arguments checked by the
    caller); its exit code: 0, 2 when every failed worker exited 2 (bad input), else 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
    if nnodes == 1 and not rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4().hex[:8]}"]
    else:
        argv += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                 f"--rdzv-id={os.environ.get('LOOM_RUN_ID', 'loom')}"]
    argv += ["--module", "loom.cli", *command]
    argv += [f"--{o}" for o in overrides]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts > 0:
        # By default torchrun's workers share the rendezvous' TCP store across restart rounds without a
        # per-round key prefix, so restarted gloo workers can read a dead peer's address from the first
        # round and fail with "connectFullMesh ... Connection refused". A store per round avoids that.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    started = time.time()
    try:
        run(parse_args(argv))
    except SignalException as exc:
        # SIGTERM/SIGINT reached the launcher (Ctrl-C, a scheduler's preemption): torchrun has passed SIGTERM
        # on to the workers and waited for them; they finish the step, checkpoint, and leave a stop record.
        return _stopped(command, started, exc.sigval)
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        print(f"loom {command[0]}: {len(exc.failures)} worker(s) failed (exit codes {sorted(codes)}); see their output above",
              file=sys.stderr)
        if "--run-dir" in command:  # an NCCL watchdog kill leaves flight-recorder dumps (parallel/distributed.py)
            from loom.parallel.distributed import nccl_trace_hint

            if hint := nccl_trace_hint(os.path.join(command[command.index("--run-dir") + 1], "nccl-trace")):
                print(f"loom {command[0]}: {hint}", file=sys.stderr)
        # Workers the launcher itself stopped (killed by a signal: negative codes) do not count: when the
        # rest failed on bad input (2), so did the job.
        return 2 if {c for c in codes if c >= 0} == {2} else 1
    return 0


def _stopped(command: list[str], started: float, sigval) -> int:
    """Exit 0 when the workers checkpointed after the signal (and say how to resume), else 1."""
    from loom.train.control import STOP_RECORD

    record = None
    if "--run-dir" in command:
        path = Path(command[command.index("--run-dir") + 1]) / STOP_RECORD
        if path.is_file() and path.stat().st_mtime >= started:
            record = json.loads(path.read_text())
    if record is None:
        print(f"loom {command[0]}: stopped by signal {sigval} before the workers saved a checkpoint", file=sys.stderr)
        return 1
    print(f"loom {command[0]}: stopped by signal {sigval} after step {record['step']}; checkpoint saved. "
          f"Resume with: {record['resume_command']}", file=sys.stderr, flush=True)
    return 0
