"""Parallel sizes: validation before any process exists, and the device mesh.

The mesh is `(pp, dp_replicate, dp_shard, cp, tp)` (torchtitan's order) with tensor parallelism innermost,
so a tensor-parallel group is made of consecutive ranks (the same node when `tp` fits in one), and context
parallelism next to it. Data-parallel rank `r = replicate_rank * dp_shard + shard_rank` reads slice `r` of
every global batch; the ranks of one tensor- or context-parallel group share a data-parallel rank and so
read identical data (a cp rank then keeps its chunks of every sequence). With cp > 1 the cp ranks also
join FSDP's shard group, the flattened `dp_shard_cp` dimension (as Megatron-Core and torchtitan do).

Expert parallelism adds no mesh dimension of its own to the world: the `(dp_replicate, dp_shard, cp)`
ranks, flattened (cp fastest), are regrouped as `(edp, ep)` with ep innermost. An `ep` group holds one
copy of all experts (each rank E/ep of them) and exchanges tokens all-to-all; an `edp` group (expert data
parallelism, `(dp_replicate x dp_shard x cp) / ep` ranks) holds the same experts and averages their
gradients, sharded by FSDP. Both are sliced from the same root mesh, as FSDP needs for 2-D parameters.
Under sequence parallelism with ep > 1 a multiple of tp (`loom.rules.experts_span_tp`) the tp ranks join them: the
`(dp_replicate, dp_shard, cp, tp)` ranks (tp fastest) are regrouped as `(edp, ep)`, so an ep group is made of
whole tensor-parallel groups (tp divides ep) and an edp group of ranks with the same tp rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import Config
from loom.rules import check_layout, experts_span_tp


@dataclass
class MeshPlace:
    """Where the running process sits in the device mesh (everything 0/1 when not distributed).

    Not a layout description: the layout is `loom.config.ParallelConfig` (the sizes), checked by the
    rule book `loom/rules.py`; the planner's `planner.workload.Layout` adds the knobs it searches and
    converts to a loom config in exactly one place, `planner.report.to_loom_config`."""

    mesh: object | None  # torch.distributed.device_mesh.DeviceMesh
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp: int = 1
    pp: int = 1
    pp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    ep: int = 1
    experts_span_tp: bool = False  # ep groups span tp ranks; each rank routes its own tokens (loom.rules)
    flattened: dict | None = None  # name -> the mesh `_flatten` returned (sliced from the root, torch warns)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def grad_ranks(self) -> int:
        """Ranks over which FSDP averages gradients: the data-parallel ranks and, with cp > 1, their cp ranks
        (each holds the gradient of its chunks of the same samples)."""
        return self.dp_size * self.cp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def submesh(self, *names: str):
        if len(names) == 1 and names[0] in (self.flattened or {}):
            return self.flattened[names[0]]
        return self.mesh[names if len(names) > 1 else names[0]]


def place_in_mesh(cfg: Config, device_type: str) -> MeshPlace:
    """Create the mesh for an initialised process group (or a trivial layout on one process)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        check_layout(cfg, 1)
        return MeshPlace(mesh=None)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_layout(cfg, world)
    p = cfg.parallel
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    # The mesh's groups get train.collective_timeout_s too (new groups otherwise take PyTorch's default).
    options = _group_options(dist.get_backend(), cfg.train.collective_timeout_s)
    mesh = init_device_mesh(device_type, (p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp), mesh_dim_names=names,
                            backend_override={n: options for n in names} if options is not None else None)
    flattened = {}
    if p.cp > 1:  # FSDP's shard group: the data-parallel shards and their cp ranks together
        flattened["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if p.ep > 1:  # expert parallelism: (dp_replicate, dp_shard, cp[, tp]) regrouped as (edp, ep)
        span_tp = experts_span_tp(p.tp, p.sp, p.ep)
        dims = ("dp_replicate", "dp_shard", "cp") + (("tp",) if span_tp else ())
        ranks = p.dp_replicate * p.dp_shard * p.cp * (p.tp if span_tp else 1)
        carved = mesh[dims]._flatten("dp_cp_tp" if span_tp else "dp_cp", backend_override=options)
        experts = carved._unflatten(0, (ranks // p.ep, p.ep), ("edp", "ep"),
                                    backend_override={n: options for n in ("edp", "ep")} if options else None)
        flattened.update(edp=experts["edp"], ep=experts["ep"], edp_ep=experts)  # edp_ep: the 2-D (edp, ep)
        if span_tp and p.cp > 1:  # the ranks holding the other tokens of the same sequences (MoE token shards)
            flattened["cp_tp"] = mesh["cp", "tp"]._flatten("cp_tp", backend_override=options)
    dp_rank = mesh["dp_replicate"].get_local_rank() * p.dp_shard + mesh["dp_shard"].get_local_rank()
    return MeshPlace(mesh=mesh, rank=dist.get_rank(), world_size=world, dp_rank=dp_rank, dp_size=p.dp, tp=p.tp,
                     pp=p.pp, pp_rank=mesh["pp"].get_local_rank(), cp=p.cp, cp_rank=mesh["cp"].get_local_rank(),
                     ep=p.ep, experts_span_tp=experts_span_tp(p.tp, p.sp, p.ep), flattened=flattened)


def _group_options(backend: str, timeout_s: float):
    from datetime import timedelta

    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return options
    if backend != "gloo":  # e.g. the "fake" backend that builds a large layout in one process (tests)
        return None
    from torch._C._distributed_c10d import Backend

    return Backend.Options(backend, timedelta(seconds=timeout_s))
