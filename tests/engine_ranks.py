"""Worker of test_engine's tensor-parallel test (kept apart so spawned ranks skip transformers)."""

from __future__ import annotations

import loom
from loom.infer.engine import Engine


def generate_tp(path, new_path, prompts, params, compile=False, paged=False):
    """One rank: shard the model over all ranks by tensor parallelism, refit it from a training-layout model
    (the new weights fully sharded by FSDP over the same ranks: dim-0 shards, gathered and resharded into
    the engine's column/row split), generate."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from loom.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = loom.load_model(path)
    apply_tensor_parallel(model, mesh, sp=False)
    engine = Engine(model, max_batch=3, max_len=40, compile=compile, paged=paged, block_size=8)
    kv_local = engine.slab.k[0].shape[1]
    trained = loom.load_model(new_path)
    for block in trained.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(trained, mesh=mesh)
    placements = {str(p.placements) for p in trained.parameters()}
    engine.refit(trained)
    done = engine.generate(prompts, params)
    return kv_local, placements, [d.tokens for d in done], [d.logprobs for d in done]
