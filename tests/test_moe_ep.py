"""Expert parallelism (parallel.ep) computes what one process computes.

- The token exchange, with routing forced so that one EP rank (and one expert of the other) receives no
  rows: outputs, input gradients, router and expert gradients equal one process's in float64, and every
  rank took part in every collective (the run finishes).
- `parallelize` shards the experts over (edp, ep) and installs the exchange (so the runs below use it).
- `loom train` runs (CPU, gloo, fp32, 6 steps, dropless) for top-2 of 8 experts and Sinkhorn top-1: per-step
  losses and grad norms, final evaluation and final parameters within 1e-5 of one process, for ep=2 over
  dp_shard=2, ep=4 over dp_shard=4, ep=2 over dp_shard=4 (EP smaller than DP) and ep=4 over HSDP 2 x 2;
  a checkpoint written under ep=2 resumes under ep=1.
"""

import shutil

import pytest
import torch

from loom.config import load_config
from loom.errors import UserError
from test_parallel import MODEL, assert_same_run, launch, single_runs

ROUTERS = {
    "top2of8": ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden=32",
                "model.moe.z_loss_coeff=0.001"],
    "sinkhorn_top1": ["model.moe.experts=8", "model.moe.top_k=1", "model.moe.ffn_hidden=32",
                      "model.moe.router=sinkhorn"],
    "top1of2": ["model.moe.experts=2", "model.moe.top_k=1", "model.moe.ffn_hidden=32"],
}

# --- the token exchange against one process -------------------------------------------------------

LAYER = ["model.hidden=16", "model.heads=2", "model.kv_heads=2", "model.moe.experts=8", "model.moe.top_k=2",
         "model.moe.ffn_hidden=8", "model.moe.load_balance_coeff=0", "model.moe.z_loss_coeff=0",
         "train.global_batch=8", "train.micro_batch=2", "parallel.dp_shard=2", "parallel.ep=2"]
TOKENS = 12  # per rank


def _starving_layer_and_data():
    """A float64 MoE layer whose router sends every token to experts 0-2 (EP rank 0 of 2; expert 3 gets
    none either) and the two ranks' inputs and output weights."""
    from loom.models.llama import build_moe

    cfg = load_config("tiny", LAYER)
    torch.manual_seed(0)
    layer = build_moe(cfg.model).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
        w = layer.router.weight
        w[:, 0] = torch.tensor([3.0, 3.0, 3.0, 0.0, -3.0, -3.0, -3.0, -3.0])
        w[:, 1:] *= 0.1
    x = torch.randn(2 * TOKENS, 16, dtype=torch.float64)
    x[:, 0] = 4.0  # logits ~12 for experts 0-2, ~0 for 3, ~-12 for 4-7
    grad_out = torch.randn(2 * TOKENS, 16, dtype=torch.float64)
    return cfg, layer, x, grad_out


def _exchange_worker(chunks: int = 1):
    import torch.distributed as dist

    from loom.models.llama import build_model
    from loom.models.moe import moe_layers
    from loom.parallel import place_in_mesh, parallelize
    from loom.parallel.expert import apply_expert_parallel

    cfg, layer, x, grad_out = _starving_layer_and_data()
    cfg.parallel.ep_overlap_chunks = chunks
    layout = place_in_mesh(cfg, "cpu")
    rank = dist.get_rank()
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    apply_expert_parallel(layer, layout.submesh("ep"), chunks=chunks)
    xr = x[rows].clone().requires_grad_()
    import loom.parallel.expert as expert

    exchanges, plain = [], expert.all_to_all_single_autograd
    expert.all_to_all_single_autograd = lambda *a: (exchanges.append(a[1]), plain(*a))[1]
    try:
        out = layer(xr)
    finally:
        expert.all_to_all_single_autograd = plain
    out.backward(grad_out[rows])
    routed = torch.bincount(layer.router(x[rows])[0].reshape(-1), minlength=8)
    result = {"out": out.detach(), "x_grad": xr.grad, "router_grad": layer.router.weight.grad,
              "expert_grads": {n: p.grad.to_local() for n, p in layer.experts.named_parameters()},
              "local_shape": tuple(layer.experts.w1.to_local().shape), "routed": routed,
              "exchanges": len(exchanges)}
    # What `loom train` builds: a model on meta, parallelised (EP, then FSDP over edp).
    model = parallelize(build_model(cfg.model, device="meta"), layout, cfg, None)
    result["placements"] = [(tuple(m.experts.w1.device_mesh.mesh_dim_names), tuple(m.experts.w1.to_local().shape),
                             m.expert_parallel.chunks) for m in moe_layers(model)]
    # numpy arrays: sent by value (a tensor travels as shared memory the exiting worker takes with it)
    return {k: v.numpy() if torch.is_tensor(v) else {n: g.numpy() for n, g in v.items()} if isinstance(v, dict)
            else v for k, v in result.items()}


@pytest.mark.parametrize("chunks", [1, 3])
def test_exchange_matches_one_process_when_a_rank_gets_no_tokens(chunks):
    """chunks=3 (parallel.ep_overlap_chunks): the exchange pipelined in three parts, some of them empty for an
    expert with one or two rows, equal to one process all the same."""
    from distributed import shared_pool

    ranks = [{k: torch.from_numpy(v) if hasattr(v, "dtype") else {n: torch.from_numpy(g) for n, g in v.items()}
              if isinstance(v, dict) else v for k, v in r.items()} for r in shared_pool(2).run(_exchange_worker, chunks)]
    _, layer, x, grad_out = _starving_layer_and_data()
    xr = x.clone().requires_grad_()
    out = layer(xr)
    out.backward(grad_out)
    # per chunk a dispatch, its rows' gates (the SwiGLU experts fold them in) and a combine: the chunked path ran
    assert ranks[0]["exchanges"] == 3 * chunks
    # Routing was forced: everything to experts 0-2, so EP rank 1 (experts 4-7) and expert 3 got no rows.
    routed = ranks[0]["routed"] + ranks[1]["routed"]
    assert routed[:3].sum() == 2 * 2 * TOKENS and routed[3:].sum() == 0, routed
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), out.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), xr.grad, rtol=1e-12, atol=1e-12)
    # The router computes in fp32 whatever the activations: its gradient, summed in another order, to fp32.
    torch.testing.assert_close(ranks[0]["router_grad"] + ranks[1]["router_grad"], layer.router.weight.grad,
                               rtol=1e-4, atol=1e-4)
    for name, p in layer.experts.named_parameters():
        assert ranks[0]["local_shape"] == (4, 16, 8)
        whole = torch.cat([r["expert_grads"][name] for r in ranks])
        torch.testing.assert_close(whole, p.grad, rtol=1e-12, atol=1e-12)
        assert p.grad[:3].abs().sum() > 0 and p.grad[3:].abs().sum() == 0  # the starved experts: exactly 0
    # parallelize: every MoE layer's experts are a (edp, ep) DTensor, 4 of the 8 experts per rank
    # (FSDP over edp = 1 keeps them whole), with the exchange installed.
    assert ranks[0]["placements"] and set(ranks[0]["placements"]) == {(("edp", "ep"), (4, 16, 8), chunks)}


# --- loom train against one process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One single-process run per router, made on first use."""
    return single_runs(tmp_path_factory, {r: MODEL + ROUTERS[r] for r in ROUTERS})


CASES = {  # top2of8 with ep=2 over dp_shard=2: test_checkpoint_under_ep_resumes_under_another_ep
    "sinkhorn_top1-ep2": ("sinkhorn_top1", 2, ["parallel.dp_shard=2", "parallel.ep=2"]),
    "top2of8-ep4": ("top2of8", 4, ["parallel.dp_shard=4", "parallel.ep=4"]),
    "sinkhorn_top1-ep4": ("sinkhorn_top1", 4, ["parallel.dp_shard=4", "parallel.ep=4"]),
    # EP smaller than DP: experts sharded 2 ways by EP and 2 ways by FSDP over the expert-dp group.
    "top2of8-ep2-dp_shard4": ("top2of8", 4, ["parallel.dp_shard=4", "parallel.ep=2"]),
    "sinkhorn_top1-ep2-dp_shard4": ("sinkhorn_top1", 4, ["parallel.dp_shard=4", "parallel.ep=2"]),
    # EP across the replicas of HSDP.
    "top2of8-ep2-hsdp": ("top2of8", 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=4"]),
}
# make test: expert parallelism smaller than data parallelism (experts sharded by EP and by FSDP over the expert-dp
# group); EP equal to DP is in make test through test_checkpoint_under_ep_resumes_under_another_ep (ep=2, dp_shard=2).
FAST = {"top2of8-ep2-dp_shard4"}


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_expert_parallel_matches_single_process(name, references, tmp_path):
    router, nproc, layout = CASES[name]
    launch(tmp_path / "run", nproc, *ROUTERS[router], *layout)
    assert_same_run(tmp_path / "run", references(router))


def test_checkpoint_under_ep_resumes_under_another_ep(references, tmp_path):
    """ep=2 over dp_shard=2 equals one process; its step-3 checkpoint (expert shards saved as global tensors
    by DCP) resumed without expert parallelism (ep=1, dp_shard=2) equals one process again."""
    run = tmp_path / "run"
    launch(run, 2, *ROUTERS["top2of8"], "parallel.dp_shard=2", "parallel.ep=2", "checkpoint.interval=3")
    reference = references("top2of8")
    assert_same_run(run, reference)
    shutil.rmtree(run / "checkpoints" / "step-6")
    (run / "checkpoints" / "latest").write_text("step-3\n")
    launch(run, 2, *ROUTERS["top2of8"], "parallel.dp_shard=2", "checkpoint.resume=true")
    assert_same_run(run, reference)


def _expert_shards(tmp):
    """The local shape of a rank's shard of each MoE layer's w1 under FSDP, and its storage's elements."""
    from pathlib import Path

    from loom.config import load_config
    from loom.train.trainer import Trainer

    cfg = load_config("tiny", MODEL + ROUTERS["top1of2"] + ["parallel.dp_shard=4", "parallel.ep=2",
                                                             "train.steps=1", "train.device=cpu"])
    trainer = Trainer(cfg, Path(tmp) / "run", quiet=True)
    out = []
    for name, p in trainer.model.named_parameters():
        if name.endswith("experts.w1"):
            local = p._local_tensor
            out.append((tuple(p.shape), tuple(local.shape), local.untyped_storage().nbytes() // local.element_size()))
    return out


def test_fewer_local_experts_than_expert_data_parallel_ranks(references, tmp_path):
    """ep=2 over dp_shard=4 with 2 experts: each ep rank holds one expert, split over its 2 edp ranks. FSDP2 would
    split the expert dimension (1 row over 2 ranks: one rank holding the whole expert, the other a padded copy's
    worth of nothing); loom splits the expert's rows (`loom.parallel.data.shard_dim`): every rank stores half an
    expert. The run equals one process."""
    from distributed import shared_pool
    from loom.parallel.data import shard_dim

    assert shard_dim((1, 64, 32), 2) == 1 and shard_dim((8, 64, 32), 2) == 0 and shard_dim((1, 3, 32), 2) == 2
    for rank in shared_pool(4).run(_expert_shards, str(tmp_path / "shapes")):
        assert rank and all(local == (1, 32, 32) and stored == 32 * 32 for _, local, stored in rank), rank
    run = tmp_path / "run"
    launch(run, 4, *ROUTERS["top1of2"], "parallel.dp_shard=4", "parallel.ep=2", "checkpoint.interval=3")
    assert_same_run(run, references("top1of2"))
    # Its step-3 checkpoint (experts saved split along their hidden dimension) resumed with the experts split by
    # rows (ep=1 over dp_shard=2: one expert per rank): one process's run again
    shutil.rmtree(run / "checkpoints" / "step-6")
    (run / "checkpoints" / "latest").write_text("step-3\n")
    launch(run, 2, *ROUTERS["top1of2"], "parallel.dp_shard=2", "checkpoint.resume=true")
    assert_same_run(run, references("top1of2"))


# --- rules ----------------------------------------------------------------------------------------


def test_ep_refusals_name_the_valid_sizes():
    moe = MODEL + ROUTERS["top2of8"]
    with pytest.raises(UserError, match=r"parallel.ep=2 .* model.moe.experts=0 .* set parallel.ep=1"):
        load_config("tiny", MODEL + ["parallel.dp_shard=2", "parallel.ep=2"])
    with pytest.raises(UserError, match=r"parallel.ep=4 must divide dp_replicate x dp_shard x cp = 1 x 2 x 1 = 2 "
                                        r".* valid ep sizes for this layout: 1, 2, or raise parallel.dp_shard \(e.g. parallel.dp_shard=4\)$"):
        load_config("tiny", moe + ["parallel.dp_shard=2", "parallel.ep=4"])
    with pytest.raises(UserError, match=r"parallel.ep=3 must divide model.moe.experts=8 .* valid ep sizes for this "
                                        r"layout: 1, 2$"):
        load_config("tiny", moe + ["parallel.dp_shard=6", "train.global_batch=12", "parallel.ep=3"])
    cfg = load_config("tiny", moe + ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=4"])
    assert cfg.parallel.ep == 4 and cfg.parallel.world_size == 4  # ep does not multiply the world
