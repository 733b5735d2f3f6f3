"""Process-group set-up and the few collective helpers every execution style shares."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.errors import UserError


def pick_device(choice: str, setting: str = "train.device") -> torch.device:
    """The device `choice` (auto, cpu, cuda) names here; `setting` is how the user gave it, for the message
    when cuda is asked for without a CUDA device (`train.device`, or a command's `--device`)."""
    if choice == "cuda" and not torch.cuda.is_available():
        given = f"{setting} cuda" if setting.startswith("--") else f"{setting}=cuda"
        raise UserError(f"{given} but no CUDA device is available; valid here: auto, cpu")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def init_distributed(device: torch.device, timeout_s: float | None = None, trace_dir=None) -> None:
    """Join the process group when started by the launcher (torchrun sets WORLD_SIZE etc.).

    A collective that waits longer than `timeout_s` raises instead of hanging (gloo). NCCL's watchdog
    instead tears the process down before Python sees an error, so on CUDA the NCCL flight recorder is
    switched on (unless the environment already says otherwise): on a timeout every rank dumps its last
    collectives to `trace_dir/nccl_trace_rank_N`, which `nccl_trace_hint` tells how to read.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if trace_dir is not None:
                os.makedirs(trace_dir, exist_ok=True)
                os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
                os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
                os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(str(trace_dir), "nccl_trace_rank_"))
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)


def nccl_trace_hint(trace_dir) -> str | None:
    """What to run on the flight-recorder dumps of a run whose NCCL watchdog fired, or None if none."""
    if not trace_dir or not os.path.isdir(trace_dir) or not any(
            name.startswith("nccl_trace_rank_") for name in os.listdir(trace_dir)):
        return None
    return (f"NCCL flight-recorder dumps are in {trace_dir}; the rank(s) that did not reach the hung collective "
            f"are named by: python -m torch.distributed.flight_recorder.fr_trace {trace_dir} -p nccl_trace_rank_")


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `t` in place over `group` (all ranks by default); a no-op on one process."""
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards (e.g. the vocabulary-parallel loss), a plain one as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(parameters, max_norm: float, pp_group=None, also_clip=()) -> torch.Tensor:
    """Global gradient norm over every shard of every parameter; clip to max_norm (0: no clipping).

    With pipeline parallelism each rank holds some stages: squared norms are summed over `pp_group`.
    """
    params = [p for p in parameters if p.grad is not None]
    # Group by mesh: sharded (DTensor) gradients need their shards' norms combined across ranks;
    # plain gradients (replicated parameters such as norms under TP without SP) are whole on every rank.
    groups: dict = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [full_tensor(torch.nn.utils.get_total_norm([p.grad for p in group])) for group in groups.values()]
    norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_group is not None:
        norm = all_reduce_sum(norm.double() ** 2, pp_group).sqrt().float()
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        if also_clip:  # copies of a shared weight (a pipeline's tied head): clipped, not counted twice
            torch.nn.utils.clip_grads_with_norm_(list(also_clip), max_norm, norm)
    return norm
