"""Sharded gradient accumulation under FSDP: every micro-batch's gradients are reduce-scattered into the
rank's shard, so no rank holds the whole model's gradients; the unsharded option keeps them whole until
the last micro-batch. Both compute the same step."""

import pytest

from distributed import shared_pool
from loom.config import load_config

MODEL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=128",
         "model.vocab_size=512", "model.max_seq_len=32", "train.seq_len=32", "train.micro_batch=2",
         "train.global_batch=8", "train.steps=2", "data.corpus_max_bytes=200000", "log.progress=none",
         "log.tensorboard=false", "train.device=cpu", "train.threads=1"]


def _held(t):
    """The elements this rank stores: a DTensor's local shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def _run(tmp, overrides):
    """Two steps; before each micro-batch, what this rank holds as gradients."""
    from pathlib import Path

    import torch.distributed as dist

    from loom.train.trainer import Trainer

    cfg = load_config("tiny", MODEL + overrides)
    trainer = Trainer(cfg, Path(tmp) / f"run-{dist.get_rank() if dist.is_initialized() else 0}", quiet=True)
    seen = []
    inner = trainer.runner.loss_sum

    def watched(batch):
        grads = [p.grad for p in trainer.model.parameters()]
        seen.append({"with_grad": sum(g is not None for g in grads),
                     "grad_elements": sum(_held(g).numel() for g in grads if g is not None)})
        return inner(batch)

    trainer.runner.loss_sum = watched
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    full = sum(p.numel() for p in trainer.model.parameters())
    return {"losses": losses, "seen": seen, "params": len(list(trainer.model.parameters())), "full": full}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(str(tmp_path_factory.mktemp("one")), [])


@pytest.mark.parametrize("policy", ["sharded", "unsharded"])
def test_fsdp_gradient_accumulation_policy(policy, single, tmp_path):
    ranks = shared_pool(2).run(_run, str(tmp_path), ["parallel.dp_shard=2", f"parallel.grad_accum={policy}"])
    for got in ranks:
        # Same losses as one process, whichever way the gradients are accumulated.
        for a, b in zip(got["losses"], single["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (policy, got["losses"], single["losses"])
        # Two micro-batches per rank and step: before the second one, what does the rank hold?
        second = got["seen"][1]
        if policy == "sharded":
            # Every parameter already has its gradient, and only its shard of it: half the model.
            assert second["with_grad"] == got["params"]
            assert second["grad_elements"] <= got["full"] // 2 + 64
        else:
            # Gradients stay inside FSDP, whole, until the last micro-batch reduces them.
            assert second["with_grad"] == 0


@pytest.mark.parametrize("policy", ["sharded", "unsharded"])
@pytest.mark.parametrize("tp,dp,cp,style", [(1, 4, 1, "fsdp"), (2, 2, 1, "fsdp"), (2, 4, 1, "replicate"),
                                            (1, 1, 1, "fsdp"), (1, 2, 2, "fsdp"), (2, 1, 2, "replicate")])
def test_loom_memory_and_the_planner_agree_on_state(policy, tp, dp, cp, style):
    """params, gradients and optimizer state per rank: `loom memory` (counted on the model built on meta)
    and the planner (formula), for the same layout and accumulation policy; cp ranks join the shard group."""
    from loom.memory import state_bytes
    from loom.planner.memory import memory
    from loom.planner.workload import Estimate, Layout, Workload
    from loom.planner.hardware import load_gpu
    from loom.planner.report import to_loom_config

    model = load_config("tiny").model
    w = Workload(model=model, seq_len=256, global_batch=32, gpus=tp * dp * cp, gpu=load_gpu("h100"),
                 grad_accum=policy)
    lay = Layout(tp=tp, dp=dp, cp=cp, dp_style=style, micro_batch=2)  # 16 / dp micro-batches per rank
    cfg = to_loom_config(Estimate(lay, 0.0, {}, {}, True, 0.0, 0.0, 0.0), w, "tiny")
    assert cfg.parallel.cp == cp
    counted, priced = state_bytes(cfg), memory(w, lay)
    for ours, theirs in (("params_bytes", "params"), ("grads_bytes", "grads"), ("optimizer_bytes", "optimizer")):
        # tp replicates the norms (a few hundred parameters); everything else divides exactly
        assert counted[ours] == pytest.approx(priced[theirs], rel=2e-3), (ours, counted[ours], priced[theirs])
    whole = 4 * counted["params_total"] / tp
    shard = dp * cp if style == "fsdp" else cp  # replicated data parallelism still shards over cp (HSDP)
    assert counted["optimizer_bytes"] == pytest.approx(2 * whole / shard, rel=2e-3)
    expect_grads = whole if (policy == "unsharded" and shard > 1) else whole / shard
    assert counted["grads_bytes"] == pytest.approx(expect_grads, rel=2e-3)
