"""Dropout under tensor and context parallelism (loom/parallel/rng.py): each rank's shards draw their own masks,
copies every rank of a group holds draw the same one, and recomputation replays them."""

from __future__ import annotations

import copy

import pytest
import torch

from loom.config import load_config
from loom.models.llama import Dropout, Transformer
from loom.parallel import rng
from loom.parallel.recompute import apply_recompute

from test_parallel import MODEL

DROPOUT = ["model.dropout=0.2", "model.attn_dropout=0.2"]


@pytest.fixture
def streams_cleared():
    """The process's streams as they were: `install` keeps its streams for the process's life."""
    before = dict(rng._STREAMS)
    yield
    rng._STREAMS.clear()
    rng._STREAMS.update(before)


def _mask(stream, shape=(64, 64)) -> torch.Tensor:
    with stream(torch.empty(0)):
        return torch.native_dropout(torch.ones(shape), 0.5, True)[1]


def test_a_stream_is_the_same_on_every_rank_for_one_offset_and_leaves_the_default_generator(streams_cleared):
    a, b = rng.DropoutStreams(7), rng.DropoutStreams(7)  # two ranks' streams, the same seed
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    m0, m1 = _mask(rng.Stream(a, 0)), _mask(rng.Stream(b, 1))
    assert not torch.equal(m0, m1)  # other offsets (ranks holding other shards): other masks
    assert torch.equal(torch.random.get_rng_state(), before)  # the default generator is put back
    a.begin_step(3), b.begin_step(3)
    assert torch.equal(_mask(rng.Stream(a, 2)), _mask(rng.Stream(b, 2)))  # one offset: the same mask
    a.begin_step(3)
    first = _mask(rng.Stream(a, 2))
    assert not torch.equal(first, _mask(rng.Stream(a, 2)))  # each call draws anew
    a.begin_step(4)
    assert not torch.equal(first, _mask(rng.Stream(a, 2)))  # and each step
    assert 0.4 < first.float().mean().item() < 0.6  # a fair mask of p = 0.5


@pytest.mark.parametrize("tp, tp_rank, sp, cp, cp_rank, hidden, attention", [
    (2, 1, False, 1, 0, 0, 1),  # TP alone: the residual stream is whole on both ranks, the heads are not
    (2, 1, True, 1, 0, 1, 1),  # SP: each rank holds a slice of the sequence
    (2, 1, False, 2, 1, 2, 3),  # cp rank 1: its chunks; tp rank 1 within it: its heads
    (1, 0, False, 4, 3, 3, 3),
])
def test_install_gives_each_kind_of_dropout_its_ranks_offset(streams_cleared, tp, tp_rank, sp, cp, cp_rank, hidden,
                                                              attention):
    cfg = load_config("tiny", MODEL + DROPOUT)
    model = Transformer(cfg.model)
    rng.install(model, cfg.train.seed, tp, tp_rank, sp, cp, cp_rank)
    drops = [m for m in model.modules() if isinstance(m, Dropout)]
    assert len(drops) == 1 + cfg.model.layers  # the embedding's and each block's
    assert {m.stream.offset for m in drops} == {hidden}
    assert {block.attention.core.stream.offset for block in model.layers.values()} == {attention}
    assert model.dropout_streams is rng._STREAMS[cfg.train.seed]
    plain = Transformer(cfg.model)
    rng.install(plain, cfg.train.seed, 1, 0, False, 1, 0)  # one rank of each: nothing changes
    assert all(m.stream is None for m in plain.modules() if isinstance(m, Dropout))
    assert not hasattr(plain, "dropout_streams")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_replays_the_streams_masks(streams_cleared, mode):
    """A recomputed layer (or attention core) draws the masks its forward drew: the gradients equal those of
    the same model without recomputation, from the same streams. Without the replay they differ."""
    cfg = load_config("tiny", MODEL + DROPOUT + [f"recompute.mode={mode}"])
    torch.manual_seed(0)
    plain = Transformer(cfg.model)
    checkpointed = copy.deepcopy(plain)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    grads = []
    for model, recompute in ((plain, False), (checkpointed, True)):
        rng.install(model, cfg.train.seed, 2, 1, True, 1, 0)
        if recompute:
            apply_recompute(model, cfg)
        model.train()
        rng.begin_step(0)
        model(tokens).float().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-7), name
    # The check can fail: the same model once more, its streams one step on, gives other gradients.
    plain.zero_grad()
    rng.begin_step(1)
    plain(tokens).float().square().mean().backward()
    assert not torch.allclose(plain.layers["0"].attention.wq.weight.grad, grads[0]["layers.0.attention.wq.weight"])


def _train_recording_masks(run_dir, overrides):
    """Train on this rank; the dropped positions of the first residual-stream dropout calls, and the local values
    of the parameters every tensor-parallel rank holds whole (the norms')."""
    import os

    from loom.train.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    masks = []

    def hook(module, args, output):
        if isinstance(module, Dropout) and module.training and len(masks) < 3:
            masks.append(output.detach() == 0)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        trainer = Trainer(load_config("tiny", MODEL + overrides), run_dir, quiet=True)
        trainer.fit()
    finally:
        handle.remove()
    norms = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for name, p in trainer.model.named_parameters() if "norm" in name}
    return masks, norms


@pytest.mark.parametrize("layout, same", [
    (["parallel.tp=2", "recompute.mode=full"], True),  # the residual stream is whole on both ranks
    (["parallel.tp=2", "parallel.sp=true"], False),  # each rank's slice of the sequence
    (["parallel.cp=2", "recompute.mode=selective"], False),  # each rank's chunks
])
def test_ranks_draw_the_masks_their_shards_need(tmp_path, layout, same):
    """Two ranks training with dropout: under TP alone both apply the same mask to the residual stream they each
    hold whole, and their norm weights stay equal (different masks would drift them apart); under SP or CP
    their slices get different masks (one stream on both would give each slice the same pattern)."""
    from distributed import shared_pool

    # one micro-batch of 2 sequences per step (MODEL's global batch of 16 would be 8): the masks are the first three
    # dropout calls of step 1, and three steps still move the norms by Adam's running moments
    overrides = DROPOUT + layout + ["train.steps=3", "train.global_batch=2", "train.eval_samples=2"]
    results = shared_pool(2).run(_train_recording_masks, str(tmp_path / "run"), overrides)
    (masks0, norms0), (masks1, norms1) = results
    assert len(masks0) == len(masks1) == 3
    for a, b in zip(masks0, masks1):
        assert a.shape == b.shape
        assert 0.1 < a.float().mean().item() < 0.3  # p = 0.2 of each slice dropped
        assert torch.equal(a, b) == same
    if same:
        assert norms0.keys() == norms1.keys() and norms0
        for name in norms0:
            assert torch.equal(norms0[name], norms1[name]), name


def test_install_streams_lora_dropout_without_model_dropout(streams_cleared):
    """LoRA's dropout acts on a cp rank's own tokens: it gets the rank's stream even when the model has none."""
    from loom.models.lora import apply_lora

    cfg = load_config("tiny", MODEL + ["lora.rank=4", "lora.dropout=0.1", "parallel.cp=2"])
    model = Transformer(cfg.model)
    apply_lora(model, cfg.lora, torch.float32)
    drops = [m for m in model.modules() if isinstance(m, Dropout)]
    assert drops and cfg.model.dropout == cfg.model.attn_dropout == 0
    rng.install(model, cfg.train.seed, 1, 0, False, 2, 1)
    assert {m.stream.offset for m in drops} == {1}
