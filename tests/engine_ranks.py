"""Worker of test_engine's tensor-parallel test (kept apart so spawned ranks skip transformers)."""

from __future__ import annotations

import loom
from loom.infer.engine import Engine


def generate_tp(path, new_path, prompts, params):
    """One rank: shard the model over all ranks, refit it from a plain (unsharded) model, generate."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loom.parallel.tensor import apply_tensor_parallel

    model = loom.load_model(path)
    apply_tensor_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)), sp=False)
    engine = Engine(model, max_batch=3, max_len=40)
    kv_local = engine.slab.k[0].shape[1]
    engine.refit(loom.load_model(new_path))
    done = engine.generate(prompts, params)
    return kv_local, [d.tokens for d in done], [d.logprobs for d in done]
