"""Worker of test_pretrained's multi-process load test (kept apart so spawned ranks skip transformers)."""

from __future__ import annotations

import torch

from loom.config import load_config
from loom.interop.pretrained import load_pretrained, resolve_init_from
from loom.models.llama import build_model


def load_on_rank(src: str, overrides: list[str]):
    """One rank: parallelise a seed-initialised model, load `src` into it, compare every full weight."""
    from torch.distributed.tensor import DTensor

    from loom.interop.hf_io import hf_to_loom_state, load_hf_state_dict
    from loom.parallel import place_in_mesh, parallelize

    cfg = resolve_init_from(load_config("tiny", overrides, validate=False), overrides)
    layout = place_in_mesh(cfg, "cpu")
    model = parallelize(build_model(cfg.model, seed=1), layout, cfg, None)
    info = load_pretrained(model, src)
    want = hf_to_loom_state(load_hf_state_dict(src), cfg.model)
    local = 0
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        local += p.to_local().numel()
        full = p.full_tensor()
        assert torch.equal(full, want[name]), name
    return info["elements_read"], local, sum(t.numel() for t in want.values())
