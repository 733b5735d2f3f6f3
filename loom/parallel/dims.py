"""Parallel sizes: validation before any process exists, and the device mesh.

The mesh is `(pp, dp_replicate, dp_shard, tp)` with tensor parallelism innermost, so a tensor-parallel
group is made of consecutive ranks (the same node when `tp` fits in one). Data-parallel rank
`r = replicate_rank * dp_shard + shard_rank` reads slice `r` of every global batch; the ranks of one
tensor-parallel group share a data-parallel rank and so see identical data.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import Config, _divisors
from loom.errors import UserError


def valid_tp_sizes(cfg: Config) -> list[int]:
    m, t = cfg.model, cfg.train
    sizes = []
    for d in _divisors(m.heads):
        if m.kv_heads % d or m.vocab_size % d or m.ffn_hidden % d:
            continue
        if cfg.parallel.sp and t.seq_len % d:
            continue
        sizes.append(d)
    return sizes


def validate_layout(cfg: Config, world_size: int | None = None, measuring: bool = False) -> None:
    """Raise UserError naming the field, value and valid choices for a layout that cannot work.

    `measuring` (loom memory) allows dropout under tensor parallelism: its masks are measured, never
    trained with.
    """
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for name in ("cp", "ep"):
        if getattr(p, name) != 1:
            raise UserError(f"parallel.{name}={getattr(p, name)} is not supported yet; valid: 1")
    if p.sp and p.tp == 1:
        raise UserError("parallel.sp=true shards the sequence across the tensor-parallel group, so it needs "
                        "parallel.tp > 1; set parallel.sp=false or raise parallel.tp")
    if p.tp > 1:
        reasons = []
        if m.heads % p.tp:
            reasons.append(f"it does not divide model.heads={m.heads}")
        if m.kv_heads % p.tp:
            reasons.append(f"it does not divide model.kv_heads={m.kv_heads} (key/value heads are split, not replicated)")
        if m.vocab_size % p.tp:
            reasons.append(f"it does not divide model.vocab_size={m.vocab_size} (the embedding and head are split by vocabulary)")
        if m.ffn_hidden % p.tp:
            reasons.append(f"it does not divide model.ffn_hidden={m.ffn_hidden}")
        if p.sp and t.seq_len % p.tp:
            reasons.append(f"with parallel.sp=true it must divide train.seq_len={t.seq_len}")
        if reasons:
            raise UserError(
                f"parallel.tp={p.tp} is not possible: {'; '.join(reasons)}; valid tp sizes for this model: "
                f"{', '.join(map(str, valid_tp_sizes(cfg)))}"
            )
    if (m.dropout > 0 or m.attn_dropout > 0) and not measuring:
        if p.tp > 1:
            raise UserError(
                "dropout with parallel.tp > 1 needs per-rank random streams, which this build does not have yet; "
                "set model.dropout=0 and model.attn_dropout=0, or parallel.tp=1"
            )
    per_step = p.dp * t.micro_batch
    if t.global_batch % per_step:
        valid = [b for b in range(per_step, 8 * per_step + 1, per_step)]
        raise UserError(
            f"train.global_batch={t.global_batch} is not divisible by data-parallel size {p.dp} "
            f"(dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard}) x train.micro_batch={t.micro_batch} = {per_step}; "
            f"valid global batches: {', '.join(map(str, valid))}, ..."
        )
    from loom.parallel.pipeline import validate_pipeline

    validate_pipeline(cfg)
    if world_size is not None and p.world_size != world_size:
        raise UserError(
            f"the parallel sizes multiply to {p.world_size} (tp={p.tp} x dp_replicate={p.dp_replicate} x "
            f"dp_shard={p.dp_shard} x pp={p.pp}) but {world_size} processes were started; make the product "
            f"equal the process count (e.g. --nproc {p.world_size}) or change the sizes"
        )


@dataclass
class Layout:
    """The running process's place in the mesh (everything 0/1 when not distributed)."""

    mesh: object | None  # torch.distributed.device_mesh.DeviceMesh
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp: int = 1
    pp: int = 1
    pp_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def submesh(self, *names: str):
        return self.mesh[names if len(names) > 1 else names[0]]


def build_layout(cfg: Config, device_type: str, measuring: bool = False) -> Layout:
    """Create the mesh for an initialised process group (or a trivial layout on one process)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        validate_layout(cfg, 1, measuring)
        return Layout(mesh=None)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    validate_layout(cfg, world, measuring)
    p = cfg.parallel
    names = ("pp", "dp_replicate", "dp_shard", "tp")
    # The mesh's groups get train.collective_timeout_s too (new groups otherwise take PyTorch's default).
    options = _group_options(dist.get_backend(), cfg.train.collective_timeout_s)
    mesh = init_device_mesh(device_type, (p.pp, p.dp_replicate, p.dp_shard, p.tp), mesh_dim_names=names,
                            backend_override={n: options for n in names})
    dp_rank = mesh["dp_replicate"].get_local_rank() * p.dp_shard + mesh["dp_shard"].get_local_rank()
    return Layout(mesh=mesh, rank=dist.get_rank(), world_size=world, dp_rank=dp_rank, dp_size=p.dp, tp=p.tp,
                  pp=p.pp, pp_rank=mesh["pp"].get_local_rank())


def _group_options(backend: str, timeout_s: float):
    from datetime import timedelta

    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options(backend, timedelta(seconds=timeout_s))
