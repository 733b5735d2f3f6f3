"""The distributed optimizer (`parallel.distributed_optimizer=true`, loom/parallel/distopt.py): weights whole,
master weights and moments split by rows over the data-parallel ranks, gradients reduced once per step. The
same losses as one process; checkpoints that resume bit for bit and load into FSDP or one process."""

from pathlib import Path

import pytest

from distributed import shared_pool
from loom.config import load_config

MODEL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=134",
         "model.vocab_size=510", "model.max_seq_len=32", "train.seq_len=32", "train.micro_batch=2",
         "train.global_batch=8", "data.corpus_max_bytes=200000", "log.progress=none", "optim.warmup_steps=1",
         "log.tensorboard=false", "train.device=cpu", "train.threads=1", "train.grad_clip=0.5", "optim.lr=3e-3"]


def _run(tmp, overrides, steps=3, save_at=0, resume=False):
    """`steps` steps (saving at `save_at`, or resuming from tmp's checkpoint); the losses, grad norms and what the
    rank holds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from loom.train.trainer import Trainer

    rank = dist.get_rank() if dist.is_initialized() else 0
    extra = ["checkpoint.resume=true"] if resume else []
    cfg = load_config("tiny", MODEL + [f"train.steps={steps}", *extra, *overrides])
    trainer = Trainer(cfg, Path(tmp) / "run", quiet=True)
    rows = [trainer.train_step() for _ in range(steps - trainer.state.step)]
    if save_at:
        assert trainer.state.step == save_at
        trainer.save()
        trainer.checkpointer.wait()
    opt = trainer.optimizer
    if hasattr(opt, "gather_all"):  # sharded weights (loom/parallel/zero.py): released between steps
        opt.gather_all()
    held = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k == "exp_avg")
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
               for n, p in trainer.model.named_parameters()}
    return {"losses": [r["loss"] for r in rows], "norms": [r["grad_norm"] for r in rows], "rank": rank,
            "moments": held, "params": sum(p.numel() for p in trainer.model.parameters()),
            "fsdp": any(isinstance(m, FSDPModule) for m in trainer.model.modules()),
            "dtype": str(next(trainer.model.parameters()).dtype), "weights": weights,
            "grads_kept": sum(p.grad is not None for p in trainer.model.parameters()),
            "threads": torch.get_num_threads(), "fused_linears": getattr(opt, "fused_linears", 0),
            "head": (head.fusions, head.added) if (head := getattr(opt, "head_grad", None)) else None}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(str(tmp_path_factory.mktemp("one")), [])


def _close(a, b, rel=2e-5):
    assert len(a) == len(b) and all(abs(x - y) <= rel * max(abs(y), 1e-6) for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("fused", [True, False])
def test_distributed_optimizer_equals_one_process_and_splits_its_state(single, tmp_path, fused):
    """With the linear layers' weight gradients written into the buffer by their backward (fused, the default),
    and through the post-accumulate hook alone."""
    ranks = shared_pool(2).run(_run, str(tmp_path), ["parallel.dp_shard=2", "parallel.distributed_optimizer=true",
                                                     f"parallel.distopt_fused_wgrad={str(fused).lower()}"])
    for got in ranks:
        assert got["fused_linears"] == (2 * 7 if fused else 0)  # wq wk wv wo w1 w2 w3 of both blocks
        _close(got["losses"], single["losses"])
        _close(got["norms"], single["norms"])  # the clipped norm (0.5) is crossed: clipping counts every row
        assert max(single["norms"]) > 0.5
        assert not got["fsdp"] and got["grads_kept"] == 0  # no FSDP; gradients live in the optimizer's buffer
        # Each rank holds the moments of its rows only, rows split as torch.chunk splits them.
        mine = 0
        for w in got["weights"].values():
            rows, k = w.shape[0], -(-w.shape[0] // 2)
            mine += max(0, min(k, rows - got["rank"] * k)) * (w.numel() // rows)
        assert got["moments"] == mine
        for name, w in got["weights"].items():  # weights whole and equal on every rank
            assert (w - ranks[0]["weights"][name]).abs().max() == 0
            assert (w - single["weights"][name]).abs().max() < 1e-5
    assert sum(r["moments"] for r in ranks) == ranks[0]["params"]


@pytest.mark.parametrize("sharded", [False, True], ids=["distopt", "zero3"])
def test_biased_linears_write_their_weight_gradients_into_the_buffer(tmp_path, sharded):
    """GPT-style linear layers with biases (model.bias=true, GELU MLP): each weight's gradient goes straight into the
    buffer from its backward's product, its bias's through autograd (dy summed over the tokens); the same losses
    and clipped norms as one process."""
    gpt = ["model.bias=true", "model.mlp=gelu", "model.tie_embeddings=false"]
    one = _run(str(tmp_path / "one"), gpt, 2)
    layout = ["parallel.dp_shard=2", "parallel.distributed_optimizer=true"]
    layout += ["parallel.distopt_shard_weights=true"] if sharded else []
    for got in shared_pool(2).run(_run, str(tmp_path / "two"), gpt + layout, 2):
        assert got["fused_linears"] == 2 * 6 and got["grads_kept"] == 0  # wq wk wv wo w1 w2 of both blocks
        _close(got["losses"], one["losses"])
        _close(got["norms"], one["norms"])


def test_bf16_weights_computed_as_fsdp_mixed_precision(tmp_path):
    """train.dtype=bfloat16: weights held in bf16 (FSDP2 casts its fp32 shards to bf16 per block: the same
    arithmetic), so the losses equal FSDP's to bf16's precision."""
    bf16 = ["parallel.dp_shard=2", "train.dtype=bfloat16"]
    fsdp = shared_pool(2).run(_run, str(tmp_path / "fsdp"), bf16)
    dist = shared_pool(2).run(_run, str(tmp_path / "dist"), bf16 + ["parallel.distributed_optimizer=true"])
    assert dist[0]["dtype"] == "torch.bfloat16"
    _close(dist[0]["losses"], fsdp[0]["losses"], rel=2e-3)


def test_resume_is_exact_and_checkpoints_load_into_fsdp_and_back(single, tmp_path):
    distopt = ["parallel.dp_shard=2", "parallel.distributed_optimizer=true"]
    pool = shared_pool(2)
    full = pool.run(_run, str(tmp_path / "full"), distopt, 4)
    pool.run(_run, str(tmp_path / "cut"), distopt, 2, 2)
    resumed = pool.run(_run, str(tmp_path / "cut"), distopt, 4, 0, True)
    assert resumed[0]["losses"] == full[0]["losses"][2:]  # bit for bit
    # The same checkpoint into FSDP on two ranks and into one process: the same continuation.
    pool.run(_run, str(tmp_path / "cut2"), distopt, 2, 2)
    as_fsdp = pool.run(_run, str(tmp_path / "cut2"), ["parallel.dp_shard=2"], 4, 0, True)
    _close(as_fsdp[0]["losses"], full[0]["losses"][2:])
    # And the other way: an FSDP checkpoint resumed by the distributed optimizer.
    pool.run(_run, str(tmp_path / "cut3"), ["parallel.dp_shard=2"], 2, 2)
    back = pool.run(_run, str(tmp_path / "cut3"), distopt, 4, 0, True)
    _close(back[0]["losses"], full[0]["losses"][2:])


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.distributed_optimizer=true"], "one (dp_shard=1, cp=1)"),
    (["parallel.distributed_optimizer=true", "parallel.dp_replicate=2", "parallel.dp_shard=2"], "dp_replicate=2"),
])
def test_layouts_it_does_not_run_are_refused(overrides, needle):
    from loom.errors import UserError

    with pytest.raises(UserError, match="distributed_optimizer") as err:
        load_config("tiny", MODEL + overrides)
    assert needle in str(err.value)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _run(str(tmp_path_factory.mktemp("untied")), ["model.tie_embeddings=false"])


@pytest.mark.parametrize("layout", [["parallel.cp=2"], ["parallel.tp=2", "parallel.dp_shard=2", "parallel.sp=true"],
                                    ["parallel.pp=2", "parallel.dp_shard=2", "model.tie_embeddings=false"]],
                         ids=["cp2", "tp2-sp-dp2", "pp2-dp2"])
def test_composes_with_context_tensor_and_pipeline_parallelism(layout, request, tmp_path):
    """Two steps equal to one process, saved; the third step resumed in the same layout and in one process."""
    single = request.getfixturevalue("untied" if "model.tie_embeddings=false" in layout else "single")
    distopt = layout + ["parallel.distributed_optimizer=true"]
    pool = shared_pool(2 if "parallel.cp=2" in layout else 4)
    for got in pool.run(_run, str(tmp_path), distopt, 2, 2):
        _close(got["losses"], single["losses"][:2])
        _close(got["norms"], single["norms"][:2])
    resumed = pool.run(_run, str(tmp_path), distopt, 3, 0, True)
    _close(resumed[0]["losses"], single["losses"][2:])
    (tmp_path / "run" / "metrics.jsonl").unlink(missing_ok=True)
    one = _run(str(tmp_path), [x for x in layout if x.startswith("model.")], 3, 0, True)
    _close(one["losses"], single["losses"][2:])


@pytest.mark.parametrize("tp,dp,cp", [(1, 4, 1), (2, 2, 1), (1, 2, 2)])
def test_loom_memory_and_the_planner_price_its_state_alike(tp, dp, cp):
    """Bytes per rank: `loom memory` (counted on the model built on meta) and the planner's formula for the
    distopt layout the planner writes as parallel.distributed_optimizer=true: 16-bit weights and fp32 gradients
    whole, fp32 master rows and moments split over dp x cp."""
    from loom.memory import state_bytes
    from loom.planner.hardware import load_gpu
    from loom.planner.memory import memory
    from loom.planner.report import to_loom_config
    from loom.planner.workload import Estimate, Layout, Workload

    w = Workload(model=load_config("tiny").model, seq_len=256, global_batch=32, gpus=tp * dp * cp,
                 gpu=load_gpu("h100"))
    lay = Layout(tp=tp, dp=dp, cp=cp, dp_style="distopt", micro_batch=2)
    cfg = to_loom_config(Estimate(lay, 0.0, {}, {}, True, 0.0, 0.0, 0.0), w, "tiny")
    assert cfg.parallel.distributed_optimizer and cfg.train.dtype == "bfloat16"
    counted, priced = state_bytes(cfg), memory(w, lay)
    whole = counted["params_total"] / tp
    for ours, theirs, expect in (("params_bytes", "params", 2 * whole), ("grads_bytes", "grads", 4 * whole),
                                 ("optimizer_bytes", "optimizer", 12 * whole / (dp * cp))):
        # tp replicates the norms (a few hundred parameters); everything else divides exactly
        assert counted[ours] == pytest.approx(priced[theirs], rel=2e-3) == pytest.approx(expect, rel=2e-3), ours


def _run_compiled(tmp, overrides):
    """`_run` with every block compiled (aot_eager on CPU, as tests/test_compile_layouts.py), and how many were."""
    import os

    os.environ["LOOM_COMPILE_BACKEND"] = "aot_eager"
    try:
        from loom.parallel import is_compiled
        from loom.train import trainer as trainer_module

        built = []
        real = trainer_module.Trainer.__init__

        def init(self, *args, **kwargs):
            real(self, *args, **kwargs)
            built.append(sum(is_compiled(b) for b in self.model.layers.values()))

        trainer_module.Trainer.__init__ = init
        try:
            out = _run(tmp, overrides + ["train.compile=true"], 2)
        finally:
            trainer_module.Trainer.__init__ = real
        return {**out, "compiled_blocks": built[0]}
    finally:
        del os.environ["LOOM_COMPILE_BACKEND"]


def test_compiled_blocks_under_the_distributed_optimizer(single, tmp_path):
    for got in shared_pool(2).run(_run_compiled, str(tmp_path),
                                  ["parallel.dp_shard=2", "parallel.distributed_optimizer=true"]):
        assert got["compiled_blocks"] == 2  # both blocks compiled, none fell back to eager
        _close(got["losses"], single["losses"][:2], rel=1e-4)
        _close(got["norms"], single["norms"][:2], rel=1e-4)


MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden=32"]


@pytest.mark.parametrize("experts", [8, 2], ids=["four-per-rank", "one-per-rank"])
def test_experts_split_over_their_expert_data_parallel_ranks(tmp_path, experts):
    """ep=2 over dp_shard=4: routed experts' rows split over the 2 edp ranks, the rest over all 4; two steps
    equal to one process, and the checkpoint resumed by one process. With 2 experts an ep rank's one expert is
    split along its second dimension (a stack of one: no rank holds a whole padded expert)."""
    moe = [o if not o.startswith("model.moe.experts=") else f"model.moe.experts={experts}" for o in MOE]
    single = _run(str(tmp_path / "one"), moe)
    layout = moe + ["parallel.dp_shard=4", "parallel.ep=2", "parallel.distributed_optimizer=true"]
    for got in shared_pool(4).run(_run, str(tmp_path / "ep"), layout, 2, 2):
        _close(got["losses"], single["losses"][:2])
        _close(got["norms"], single["norms"][:2])
    one = _run(str(tmp_path / "ep"), moe, 3, 0, True)
    _close(one["losses"], single["losses"][2:])


@pytest.mark.gpu
def test_weight_gradient_lands_in_a_rank_major_buffer_inside_the_gemm_on_cuda():
    """The fused path's product on CUDA (loom.parallel.wgrad.LinearIntoBuffer, `out_dtype`): bf16 inputs
    accumulated into fp32 rows of a [ranks, S] buffer, against float64; beta=0 ignores what the rows held."""
    import torch

    from loom.parallel.wgrad import fused_out_dtype_works

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run by bench/device_check.sh)")
    dev = torch.device("cuda")
    assert fused_out_dtype_works(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    dy = torch.randn(512, 96, device=dev, generator=g).bfloat16()
    x = torch.randn(512, 64, device=dev, generator=g).bfloat16()
    buf = torch.full((2, 48 * 64 + 100), float("nan"), device=dev)
    for r in range(2):
        seg = buf[r, 100:100 + 48 * 64].view(48, 64)
        torch.addmm(seg, dy[:, r * 48:(r + 1) * 48].t(), x, beta=0, out_dtype=torch.float32, out=seg)
        torch.addmm(seg, dy[:, r * 48:(r + 1) * 48].t(), x, out_dtype=torch.float32, out=seg)
    want = 2 * (dy.double().t() @ x.double())
    got = torch.cat([buf[r, 100:].view(48, 64) for r in range(2)]).double()
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-2)


def _reduced_during_backward(tmp, overrides):
    """One step; how many of the rank's buckets had their reduce-scatter started before backward ended."""
    from loom.train.trainer import Trainer

    trainer = Trainer(load_config("tiny", MODEL + ["train.steps=1", *overrides]), Path(tmp) / "run", quiet=True)
    opt, seen = trainer.optimizer, {}
    real = opt._finish_reduction

    def spy():
        seen.update(started=sum(b.work is not None for b in opt.buckets), buckets=len(opt.buckets))
        real()

    opt._finish_reduction = spy
    trainer.train_step()
    return seen


def test_pipeline_stages_reduce_each_bucket_once_its_last_micro_batch_filled_it(tmp_path):
    """Under pp a stage's backward runs inside the schedule, with no runner call between micro-batches: a
    parameter's gradient is complete once it has arrived once per micro-batch, and its bucket's reduce-scatter
    starts then, overlapping the rest of the stage's backward (before: every bucket after the whole backward)."""
    layout = ["parallel.pp=2", "parallel.dp_shard=2", "model.tie_embeddings=false", "parallel.distributed_optimizer=true"]
    for got in shared_pool(4).run(_reduced_during_backward, str(tmp_path), layout):
        assert got["buckets"] > 0 and got["started"] == got["buckets"], got


CHUNKED = ["model.tie_embeddings=false", "train.loss_chunk=16"]  # 4 chunks of a micro-batch's 64 tokens


def test_chunked_loss_writes_the_head_gradient_into_the_buffer(tmp_path):
    """train.loss_chunk with an untied head (loom/parallel/headgrad.py): a step's first micro-batch writes each
    chunk's head-gradient product straight into the optimizer's fp32 buffer, the second (two per rank: gradient
    accumulation) adds its fp32 accumulator scaled in backward; no `.grad` either way. The same losses and norms as
    one process and as the unfused path (the hook adding the head's `.grad`)."""
    one = _run(str(tmp_path / "one"), CHUNKED, 2)
    layout = CHUNKED + ["parallel.dp_shard=2", "parallel.distributed_optimizer=true"]
    pool = shared_pool(2)
    fused = pool.run(_run, str(tmp_path / "fused"), layout, 2)
    plain = pool.run(_run, str(tmp_path / "plain"), layout + ["parallel.distopt_fused_wgrad=false"], 2)
    for got, ref in zip(fused, plain):
        assert got["head"] == (2, 2) and ref["head"] is None  # per step: one micro-batch fused, one added
        assert got["grads_kept"] == 0
        for run in (got, ref):
            _close(run["losses"], one["losses"])
            _close(run["norms"], one["norms"])
        _close(got["norms"], ref["norms"], rel=1e-6)


def test_head_gradient_rows_in_a_rank_major_buffer_one_process():
    """loom/parallel/headgrad.py alone, on a stand-in optimizer: the chunked loss's head gradient lands in rank-major
    rows (7 vocabulary rows over 2 ranks: 4 and 3) equal to autograd's, scaled by grad_output; a step's second
    micro-batch adds its accumulator; a second loss before the first one's backward, and a second backward, are
    refused; a backward for the inputs only leaves the slot unfilled."""
    from types import SimpleNamespace

    import torch

    from loom.models.losses import chunked_token_loss_sum
    from loom.parallel.distopt import _Bucket, _matching, _Slot
    from loom.parallel.headgrad import HeadGrad

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(7, 5))
    h = torch.randn(2, 6, 5, requires_grad=True)
    y = torch.randint(0, 7, (2, 6))
    y[0, 1] = -100
    slot = _Slot(weight, "output.weight", 7, 5, 4, 3, 1)  # columns 3.. of the buffer's rows
    bucket = _Bucket([slot], 3 + 20, SimpleNamespace(n=2, experts=False))
    arrived = []
    opt = SimpleNamespace(PER_PARAM=False, fused_gemm=False, _grad_buffer=lambda b: buf,
                          _arrived=lambda b, s: (arrived.append(s), setattr(s, "filled", True)))
    buf = torch.full((2, 23), float("nan"))
    node = weight.view_as(weight).grad_fn.next_functions[0][0]
    weight._loom_grad_into = into = HeadGrad(opt, bucket, slot, node)

    def rows():  # the weight's gradient as the buffer holds it
        out = torch.empty(35)
        for dst, src in _matching(buf, out, slot):
            src.copy_(dst)
        return out.view(7, 5)

    reference = torch.nn.Parameter(weight.detach().clone())  # no `_loom_grad_into`: autograd's path
    (chunked_token_loss_sum(h, reference, y, 4) * 0.25).backward()
    want = h.grad
    loss = chunked_token_loss_sum(h, weight, y, 4)
    with pytest.raises(RuntimeError, match="second chunked loss"):
        chunked_token_loss_sum(h, weight, y, 4)
    h.grad = None
    (loss * 0.25).backward()
    assert weight.grad is None and into.fusions == 1 and len(arrived) == 1
    assert torch.allclose(h.grad, want) and torch.allclose(rows(), reference.grad, atol=1e-6)
    (chunked_token_loss_sum(h, weight, y, 4) * 0.25).backward()  # filled: the accumulator, added
    assert into.added == 1 and torch.allclose(rows(), 2 * reference.grad, atol=1e-6)
    slot.filled = False
    torch.autograd.grad(chunked_token_loss_sum(h, weight, y, 4), [h])  # inputs only: nothing arrives
    assert into.fusions == 2 and len(arrived) == 2 and not slot.filled and into.pending is None
    loss = chunked_token_loss_sum(h.detach(), weight, y, 4)  # no hidden-state gradient to guard it
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
