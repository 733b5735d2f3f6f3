"""Sharded weights for the distributed optimizer (`parallel.distopt_shard_weights=true`, loom/parallel/zero.py):
each rank keeps its rows of every weight, a unit's weights are gathered straight into the parameters before it
runs and released after. The same losses as one process, in the layouts it runs; none of FSDP2's copies;
checkpoints that resume bit for bit and load into FSDP and one process."""

from __future__ import annotations

import pytest

from distributed import shared_pool
from test_distopt import CHUNKED, MOE, MODEL, _close, _run, _run_compiled

UNTIED = ["model.tie_embeddings=false"]
SHARDED = ["parallel.distributed_optimizer=true", "parallel.distopt_shard_weights=true"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(str(tmp_path_factory.mktemp("one")), UNTIED)


def _held(tmp, overrides):
    """One step; then what the rank holds between steps: the units still gathered, its rows in the compute
    dtype, and whether every parameter's storage is its gather output."""
    from pathlib import Path

    from loom.config import load_config
    from loom.train.trainer import Trainer

    import torch

    trainer = Trainer(load_config("tiny", MODEL + ["train.steps=1", *overrides]), Path(tmp) / "run", quiet=True)
    trainer.train_step()
    opt = trainer.optimizer
    local = lambda p: getattr(p, "_local_tensor", p)  # noqa: E731  (a routed expert's local part under ep)
    released = {local(p).untyped_storage().nbytes() for p in trainer.model.parameters()}
    out = {"gathered": opt.gathered_units(), "released_bytes": released,
           "rows": sum(b.master.numel() for b in opt.buckets),
           "kept_copies": sum(getattr(b, "source", None) is not None for b in opt.buckets),
           # bytes of every tensor a bucket holds between steps but its released gather output: the fp32 master rows
           # and gradient rows (8 bytes a row element), and nothing else (no compute-dtype copy of the rows)
           "kept_bytes": sum(t.untyped_storage().nbytes() for b in opt.buckets for k, t in vars(b).items()
                             if torch.is_tensor(t) and k != "full"),
           "params": sum(p.numel() for p in trainer.model.parameters()),
           "units": [u.name for u in opt.units]}
    opt.gather_all()
    out["views"] = all(local(p).untyped_storage().data_ptr() == b.full.untyped_storage().data_ptr()
                       for b in opt.buckets for p in [b.slots[0].param])
    return out


def test_sharded_weights_equal_one_process_and_are_released_between_steps(single, tmp_path):
    pool = shared_pool(2)
    for got in pool.run(_run, str(tmp_path / "a"), UNTIED + ["parallel.dp_shard=2", *SHARDED]):
        _close(got["losses"], single["losses"])
        _close(got["norms"], single["norms"])
        assert got["fused_linears"] == 2 * 7 and got["grads_kept"] == 0 and not got["fsdp"]
    for held in pool.run(_held, str(tmp_path / "b"), UNTIED + ["parallel.dp_shard=2", *SHARDED]):
        assert held["gathered"] == [] and held["released_bytes"] == {0}  # nothing whole between steps
        assert held["units"] == ["embed", "layers.0", "layers.1", "head"]
        # each rank's master rows: half of every weight (rows rounded up as torch.chunk splits them), and no
        # compute-dtype copy of them kept between gathers
        assert held["params"] / 2 <= held["rows"] <= held["params"] / 2 + 600 and held["kept_copies"] == 0
        assert held["views"]  # gathered, each parameter's storage is its all-gather output


def test_bf16_gathers_cast_the_master_rows_as_fsdp_casts_its_shards(tmp_path):
    """train.dtype=bfloat16: each gather sends the fp32 master rows cast to bf16 (FSDP2 casts its fp32 shards the
    same way per block): the losses equal FSDP's to bf16's precision, the parameters are bf16, and between steps
    no rank keeps a bf16 copy of its rows."""
    bf16 = UNTIED + ["parallel.dp_shard=2", "train.dtype=bfloat16"]
    pool = shared_pool(2)
    fsdp = pool.run(_run, str(tmp_path / "fsdp"), bf16)
    ours = pool.run(_run, str(tmp_path / "ours"), bf16 + SHARDED)
    assert ours[0]["dtype"] == "torch.bfloat16"
    _close(ours[0]["losses"], fsdp[0]["losses"], rel=2e-3)
    for held in pool.run(_held, str(tmp_path / "held"), bf16 + SHARDED):
        assert held["kept_copies"] == 0 and held["released_bytes"] == {0} and held["kept_bytes"] == 8 * held["rows"]
    # Past 8 micro-batches a step (10 here) the bf16 rows are cast once after the step and kept: 2 bytes more
    # (loom.rules.zero3_keeps_compute_rows, which the planner and `loom memory` price the same way)
    many = bf16 + SHARDED + ["train.global_batch=40"]
    for held in pool.run(_held, str(tmp_path / "many"), many):
        assert held["kept_bytes"] == 10 * held["rows"]
    kept = pool.run(_run, str(tmp_path / "kept"), many, 2)
    as_fsdp = pool.run(_run, str(tmp_path / "fsdp40"), bf16 + ["train.global_batch=40"], 2)
    _close(kept[0]["losses"], as_fsdp[0]["losses"], rel=2e-3)


def _copied_bytes(tmp, overrides):
    """Bytes the ops that copy tensors (copy_, FSDP2's split_with_sizes_copy and chunk_cat, cat) write in one
    step's forward and backward on this rank."""
    from pathlib import Path

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from loom.config import load_config
    from loom.train.trainer import Trainer

    copies = {"aten.copy_.default", "aten.split_with_sizes_copy.out", "aten._chunk_cat.out", "aten.cat.default",
              "aten._to_copy.default"}
    counted = {"bytes": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func) in copies or str(func).startswith("fsdp."):
                written = (kwargs or {}).get("out", out)  # out= variants write into their argument
                for t in (written if isinstance(written, (list, tuple)) else [written]):
                    if isinstance(t, torch.Tensor):
                        counted["bytes"] += t.numel() * t.element_size()
                        counted[str(func)] = counted.get(str(func), 0) + t.numel() * t.element_size()
            return out

    trainer = Trainer(load_config("tiny", MODEL + ["train.steps=2", *overrides]), Path(tmp) / "run", quiet=True)
    trainer.train_step()  # first step outside the count (set-up)
    batch = trainer.rank_batch(trainer.cfg.train.global_batch)  # the second step's samples
    with Count():
        trainer.runner.forward_backward(batch, 1.0)
    return counted["bytes"]


def test_none_of_fsdp2s_copies(tmp_path):
    """The same step's copy traffic with FSDP2 and with sharded weights (fp32 on a CPU: FSDP2's unshard is one
    copy per element and micro-batch, its reduction a chunk_cat): sharded weights copy only the gradients of the
    parameters whose backward is not fused (norms, embedding, head)."""
    pool = shared_pool(2)
    fsdp = pool.run(_copied_bytes, str(tmp_path / "f"), UNTIED + ["parallel.dp_shard=2"])[0]
    ours = pool.run(_copied_bytes, str(tmp_path / "s"), UNTIED + ["parallel.dp_shard=2", *SHARDED])[0]
    assert ours < 0.3 * fsdp, (ours, fsdp)  # measured: 1.09 MB against FSDP2's 5.30 MB


def _drawn(tmp, overrides):
    """Every value the set-up writes into a weight or a master row (loom/models/init.py's `fill`), per parameter:
    (elements written, the parameter's elements), and whether any parameter is whole after the set-up."""
    from pathlib import Path

    import loom.models.init as init
    import loom.parallel.materialize as materialize
    from loom.config import load_config
    from loom.train.trainer import Trainer

    written: dict[str, list[int]] = {}
    plain = init.fill

    def counting(out, full_shape, offset, seed, name, *spec):
        count = written.setdefault(name, [0, 0])
        count[0] += out.numel()
        count[1] = int(torch.Size(full_shape).numel())
        plain(out, full_shape, offset, seed, name, *spec)

    import torch

    init.fill = materialize.fill = counting
    try:
        trainer = Trainer(load_config("tiny", MODEL + ["train.steps=1", *overrides]), Path(tmp) / "run", quiet=True)
    finally:
        init.fill = materialize.fill = plain
    whole = [n for n, p in trainer.model.named_parameters() if p.untyped_storage().nbytes() > 0]
    return {"written": written, "whole": whole}


def test_no_rank_builds_the_whole_model(tmp_path):
    """Each rank draws only its rows of every weight from the seed (the rows one process holds there: the losses
    above equal one process's); nothing writes a whole weight, and after the set-up every weight is released.
    FSDP's set-up, for comparison, writes each rank's shards; a whole materialisation writes every element."""
    overrides = UNTIED + ["parallel.dp_shard=2", *SHARDED]
    for got in shared_pool(2).run(_drawn, str(tmp_path), overrides):
        assert got["whole"] == []
        assert len(got["written"]) == 2 * 9 + 3  # every weight of the two blocks, embedding, norm, head
        for name, (wrote, elements) in got["written"].items():
            assert elements / 2 <= wrote <= elements / 2 + 64, name  # its rows, one rank's half (+ odd rows)


def test_init_from_loads_whole_then_keeps_the_rows(single, tmp_path):
    """With train.init_from the model is materialised whole to load it, then the optimizer keeps its rows: the
    same losses as one process started from the same checkpoint."""
    _run(str(tmp_path / "src"), UNTIED, 2, 2)
    source = f"train.init_from={tmp_path / 'src' / 'run'}"
    one = _run(str(tmp_path / "one"), UNTIED + [source], 2)
    for got in shared_pool(2).run(_run, str(tmp_path / "two"), UNTIED + [source, "parallel.dp_shard=2", *SHARDED], 2):
        _close(got["losses"], one["losses"])
    assert one["losses"][0] < single["losses"][0] - 0.05  # it started from the trained weights


def test_resume_is_exact_and_loads_into_fsdp(single, tmp_path):
    layout = UNTIED + ["parallel.dp_shard=2", *SHARDED]
    pool = shared_pool(2)
    full = pool.run(_run, str(tmp_path / "full"), layout, 4)
    pool.run(_run, str(tmp_path / "cut"), layout, 2, 2)
    resumed = pool.run(_run, str(tmp_path / "cut"), layout, 4, 0, True)
    assert resumed[0]["losses"] == full[0]["losses"][2:]  # bit for bit
    as_fsdp = pool.run(_run, str(tmp_path / "cut"), UNTIED + ["parallel.dp_shard=2"], 4, 0, True)
    _close(as_fsdp[0]["losses"], full[0]["losses"][2:])


@pytest.mark.parametrize("layout", [["parallel.cp=2"], ["parallel.dp_shard=2", "recompute.mode=full"]],
                         ids=["cp2", "dp2-full-recompute"])
def test_composes_with_context_parallelism_and_recomputation(single, layout, tmp_path):
    for got in shared_pool(2).run(_run, str(tmp_path), UNTIED + layout + SHARDED, 2):
        _close(got["losses"], single["losses"][:2])
        _close(got["norms"], single["norms"][:2])


def test_moe_layers(tmp_path):
    """Routed experts (ep 1) are block weights like any other: stacked [E, ...] parameters, so an expert that gets
    no token in a micro-batch still has its (zero) slice in a gradient every rank reduces. Two steps equal to one
    process."""
    model = MOE + UNTIED
    one = _run(str(tmp_path / "one"), model, 2)
    for got in shared_pool(2).run(_run, str(tmp_path / "two"), model + ["parallel.dp_shard=2", *SHARDED], 2):
        _close(got["losses"], one["losses"])
        _close(got["norms"], one["norms"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_loss_writes_the_head_gradient_into_each_micro_batchs_buffer(tied, tmp_path):
    """train.loss_chunk (loom/parallel/headgrad.py): every micro-batch's buffer is fresh, so each (two per rank:
    gradient accumulation) writes its chunks' head-gradient products straight into it; none keeps an fp32
    accumulator or a `.grad`. Tied (the tiny model's embedding and head): backward leaves the head's part in the tied
    weight's rows for the embedding's, which autograd delivers at its end, and only then are they reduced. The same
    losses and norms as one process and as the unfused path (the chunked loss's own fp32 accumulator, autograd's
    16-bit `.grad`)."""
    model = ["train.loss_chunk=16"] if tied else CHUNKED
    one = _run(str(tmp_path / "one"), model, 2)
    layout = model + ["parallel.dp_shard=2", *SHARDED]
    pool = shared_pool(2)
    fused = pool.run(_run, str(tmp_path / "fused"), layout, 2)
    plain = pool.run(_run, str(tmp_path / "plain"), layout + ["parallel.distopt_fused_wgrad=false"], 2)
    for got, ref in zip(fused, plain):
        assert got["head"] == (4, 0) and ref["head"] is None  # 2 steps x 2 micro-batches, all fused
        assert got["grads_kept"] == 0
        for run in (got, ref):
            _close(run["losses"], one["losses"])
            _close(run["norms"], one["norms"])
        _close(got["norms"], ref["norms"], rel=1e-6)


@pytest.mark.parametrize("experts", [2, 8], ids=["one-expert-per-rank", "four-per-rank"])
def test_expert_parallelism(experts, tmp_path):
    """ep=2 over dp_shard=4: each ep rank's routed experts (DTensors) are gathered with their block over its 2
    expert-data-parallel ranks, the rest over all 4. With 2 experts a rank holds one, split along its hidden
    dimension (not padded to a whole expert per rank); with 8, four split by rows. Two steps equal one process,
    and the checkpoint resumes in one process and in FSDP with ep."""
    moe = ["model.moe.experts=" + str(experts), "model.moe.top_k=2", "model.moe.ffn_hidden=32"] + UNTIED
    one = _run(str(tmp_path / "one"), moe, 3)
    layout = moe + ["parallel.dp_shard=4", "parallel.ep=2", *SHARDED]
    pool = shared_pool(4)
    for got in pool.run(_run, str(tmp_path / "ep"), layout, 2, 2):
        _close(got["losses"], one["losses"][:2])
        _close(got["norms"], one["norms"][:2])
    resumed = _run(str(tmp_path / "ep"), moe, 3, 0, True)
    _close(resumed["losses"], one["losses"][2:])
    as_fsdp = pool.run(_run, str(tmp_path / "ep"), moe + ["parallel.dp_shard=4", "parallel.ep=2"], 3, 0, True)
    _close(as_fsdp[0]["losses"], one["losses"][2:])
    # every rank's master rows: a quarter of the dense weights and half of its ep rank's experts, none padded
    held = pool.run(_held, str(tmp_path / "held"), layout)
    experts_total = 2 * 3 * experts * 64 * 32  # two layers' w1, w2, w3 [E, 64, 32]
    share = (held[0]["params"] - experts_total) / 4 + experts_total / 2 / 2
    assert all(share <= h["rows"] <= share + 400 for h in held), ([h["rows"] for h in held], share)
    assert all(h["released_bytes"] == {0} and h["gathered"] == [] for h in held)


def test_tied_embeddings(tmp_path):
    """The tiny model ties its embedding and head: the shared weight is gathered from the model's start to its
    backward and its gradient (both uses summed) reduced once; equal to one process."""
    one = _run(str(tmp_path / "one"), [], 2)
    for got in shared_pool(2).run(_run, str(tmp_path / "two"), ["parallel.dp_shard=2", *SHARDED], 2):
        _close(got["losses"], one["losses"])
        _close(got["norms"], one["norms"])


def test_compiled_blocks_with_sharded_weights(single, tmp_path):
    for got in shared_pool(2).run(_run_compiled, str(tmp_path), UNTIED + ["parallel.dp_shard=2", *SHARDED]):
        assert got["compiled_blocks"] == 2
        _close(got["losses"], single["losses"][:2], rel=1e-4)
        _close(got["norms"], single["norms"][:2], rel=1e-4)


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.distopt_shard_weights=true", "parallel.dp_shard=2", "parallel.distributed_optimizer=false"],
     "distributed_optimizer"),
    (SHARDED + ["parallel.dp_shard=2", "parallel.tp=2"] + UNTIED, "parallel.tp=2"),
    (SHARDED + ["parallel.dp_shard=2", "parallel.pp=2"] + UNTIED, "parallel.pp=2"),
])
def test_layouts_it_does_not_run_are_refused(overrides, needle):
    from loom.config import load_config
    from loom.errors import UserError

    with pytest.raises(UserError, match="distopt_shard_weights") as err:
        load_config("tiny", MODEL + overrides)
    assert needle in str(err.value)


def test_recipes_that_run_the_model_twice_per_backward_are_refused():
    from loom.config import load_config
    from loom.rules import recipe_problem

    cfg = load_config("tiny", MODEL + UNTIED + SHARDED + ["parallel.dp_shard=2"])
    assert "loom dpo" in recipe_problem("dpo", cfg) and recipe_problem("sft", cfg) is None


def test_loom_memory_and_the_planner_price_its_state_alike():
    """Bytes per rank of `dp_style=zero3` as the planner writes it (parallel.distopt_shard_weights=true): `loom
    memory`'s count and the planner's formula agree: fp32 master rows (no compute-dtype copy), fp32 gradient rows
    and moments, everything split over dp x cp: FSDP's bytes."""
    from loom.config import load_config
    from loom.memory import state_bytes
    from loom.planner.hardware import load_gpu
    from loom.planner.memory import memory
    from loom.planner.report import to_loom_config
    from loom.planner.workload import Estimate, Layout, Workload

    w = Workload(model=load_config("tiny", UNTIED).model, seq_len=256, global_batch=32, gpus=4, gpu=load_gpu("h100"))
    lay = Layout(dp=2, cp=2, dp_style="zero3", micro_batch=2)
    cfg = to_loom_config(Estimate(lay, 0.0, {}, {}, True, 0.0, 0.0, 0.0), w, "tiny")
    assert cfg.parallel.distributed_optimizer and cfg.parallel.distopt_shard_weights
    counted, priced = state_bytes(cfg), memory(w, lay)
    rows = counted["params_total"] / 4
    for ours, theirs, expect in (("params_bytes", "params", 4 * rows), ("grads_bytes", "grads", 4 * rows),
                                 ("optimizer_bytes", "optimizer", 8 * rows)):
        assert counted[ours] == pytest.approx(priced[theirs], rel=1e-6) == pytest.approx(expect, rel=1e-6), ours


def test_the_planner_counts_no_whole_model_at_start_up():
    """zero3 draws its rows at start-up (test_no_rank_builds_the_whole_model): the planner prices no whole-model
    peak for it, so 70B on 64 H100s fits; the distributed optimizer with whole weights still materialises the
    model in fp32 on every rank first, and is priced at least that."""
    from loom.config import load_config
    from loom.planner.hardware import load_gpu
    from loom.planner.memory import memory
    from loom.planner.params import model_sizes
    from loom.planner.workload import GIB, Layout, Workload

    w = Workload(model=load_config("llama3-70b").model, seq_len=8192, global_batch=128, gpus=64, gpu=load_gpu("h100"))
    zero3 = memory(w, Layout(dp=16, cp=4, dp_style="zero3", recompute="full"))
    assert zero3["total"] <= w.gpu.memory_gib * GIB and "startup" not in zero3
    distopt = memory(w, Layout(dp=16, cp=4, dp_style="distopt", recompute="full"))
    assert distopt["total"] >= 4 * model_sizes(w)["total"]


def _buffer_peak(tmp, overrides):
    """One step; the most bytes the optimizer's buffers held at once (gathered weights, fp32 gradient buffers,
    reductions in flight with their outputs), sampled after every gather and gradient-buffer allocation, and
    the parameters' sizes."""
    from pathlib import Path

    from loom.config import load_config
    from loom.parallel import zero
    from loom.train.trainer import Trainer

    trainer = Trainer(load_config("tiny", MODEL + ["train.steps=1", *overrides]), Path(tmp) / "run", quiet=True)
    opt, peak = trainer.optimizer, [0]

    def live() -> int:
        total = 0
        for b in opt.buckets:
            total += b.nbytes if b.state != zero._FREE else 0
            total += b.grad.untyped_storage().nbytes() if b.grad is not None else 0
            if b.pending is not None:
                total += sum(t.untyped_storage().nbytes() for t in b.pending[1:])
        return total

    def sampled(name):
        method = getattr(opt, name)

        def run(*args):
            out = method(*args)
            peak[0] = max(peak[0], live())
            return out
        setattr(opt, name, run)

    sampled("_gather_bucket")
    sampled("_grad_buffer")
    trainer.train_step()
    return peak[0], {s.name: s.param.numel() for b in opt.buckets for s in b.slots}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_planner_prices_the_buffers_a_step_holds_at_its_peak(tied, tmp_path):
    """`loom.planner.memory.zero3_buffer_bytes` against the peak a step holds, 3 layers on 2 ranks (fp32: e = 4).
    Untied, with the chunked loss writing the head's gradient into its buffer and a head larger than a layer
    (vocabulary 1020): the peak is at the last block's first gradient, the head's reduction still in flight
    beside two gathered blocks. Tied: at the last block's second weight gradient (a weight's fp32 buffer lives until
    the next one's is made), the first weight's reduction in flight and the second's buffer beside the two gathered
    blocks less the first weight, and the tied weight's fp32 rows holding the head's part of its gradient (the weight
    itself released as backward starts). Holding a whole block's gradients, as before, costs more."""
    from loom.planner.memory import zero3_buffer_bytes

    overrides = ["model.layers=3", "train.loss_chunk=16", *SHARDED, "parallel.dp_shard=2",
                 "model.tie_embeddings=" + str(tied).lower(), "model.vocab_size=1020"]
    peak, sizes = shared_pool(2).run(_buffer_peak, str(tmp_path), overrides)[0]
    layer = sum(v for k, v in sizes.items() if k.startswith("layers.0."))
    largest = max(v for k, v in sizes.items() if k.startswith("layers.0."))
    head = sizes["tok_embeddings.weight"]
    priced = zero3_buffer_bytes(layer, head, largest, 4, 2, tied)
    assert peak == pytest.approx(priced, rel=0.002)  # (the rows' padding to equal parts)


@pytest.mark.parametrize("ep", [1, 2], ids=["ep1", "ep2"])
def test_the_planner_prices_an_moe_steps_peak_with_the_experts_reduced_over_their_edp_ranks(ep, tmp_path):
    """An MoE model (3 layers, 2 ranks, fp32), its routed experts the largest weights: the planner's zero3 buffers
    (`loom.planner.memory.memory`) against the peak a step holds. Under ep the experts' rows are split over the
    expert-data-parallel ranks (dp x cp / ep; here 1), so an expert weight's reduce-scatter output is 1/edp of it,
    not 1/(dp x cp): with ep=2 the peak (the first expert weight's reduction beside the second's buffer) is 4.7%
    above a price that splits it over both ranks."""
    from loom.config import load_config
    from loom.planner.hardware import load_gpu
    from loom.planner.memory import memory
    from loom.planner.workload import Layout, Workload
    from test_distopt import MOE

    model = ["model.layers=3", "train.loss_chunk=16", "model.tie_embeddings=false", *MOE]
    overrides = [*model, *SHARDED, "parallel.dp_shard=2", f"parallel.ep={ep}"]
    peak, _ = shared_pool(2).run(_buffer_peak, str(tmp_path), overrides)[0]
    cfg = load_config("tiny", MODEL + model)
    w = Workload(model=cfg.model, seq_len=32, global_batch=8, gpus=2, gpu=load_gpu("h100"), precision="fp32",
                 loss_chunk=16)
    priced = memory(w, Layout(dp=2, ep=ep, dp_style="zero3", micro_batch=2))["buffers"] - 4 * 40e6  # (dp's buckets)
    assert peak == pytest.approx(priced, rel=0.002)


def test_the_planner_counts_no_copy_of_an_untied_head_gradient_the_chunked_loss_writes_in():
    """On a GPU the chunked loss writes the untied head's gradient into its fp32 buffer (loom/parallel/headgrad.py,
    tested above): zero3's copies lose the head's 16-bit gradient read and fp32 write per micro-batch (e + 4
    bytes per element), and nothing else moves."""
    from loom.config import load_config
    from loom.planner.hardware import load_gpu
    from loom.planner.kernels import hbm_time
    from loom.planner.steptime import step_time
    from loom.planner.workload import Layout, Workload

    model = load_config("llama3-70b").model
    lay = Layout(dp=16, cp=4, dp_style="zero3", recompute="full")
    terms = {chunk: step_time(Workload(model=model, seq_len=8192, global_batch=128, gpus=64, gpu=load_gpu("h100"),
                                       loss_chunk=chunk), lay) for chunk in (0, 8192)}
    m = 128 // 16
    saved = hbm_time(load_gpu("h100"), m * model.vocab_size * model.hidden * (2 + 4))
    assert terms[0]["distopt_copy"] - terms[8192]["distopt_copy"] == pytest.approx(saved, rel=1e-9)


def _set_up_peak(tmp, overrides):
    """The most bytes of gathered weights (the units' gather outputs) alive at once while the optimizer is set up,
    and the bytes of the whole model in the compute dtype."""
    from pathlib import Path

    from loom.config import load_config
    from loom.parallel import zero
    from loom.train.trainer import Trainer

    plain, peak = zero.ShardedDistributedOptimizer._set_up_bucket, [0]

    def tracked(self, bucket):
        plain(self, bucket)
        peak[0] = max(peak[0], sum(b.full.untyped_storage().nbytes() for b in self.buckets if hasattr(b, "full")))

    zero.ShardedDistributedOptimizer._set_up_bucket = tracked
    try:
        trainer = Trainer(load_config("tiny", MODEL + ["train.steps=1", *overrides]), Path(tmp) / "run", quiet=True)
    finally:
        zero.ShardedDistributedOptimizer._set_up_bucket = plain
    largest = max(b.nbytes for b in trainer.optimizer.buckets)
    return peak[0], largest, sum(b.nbytes for b in trainer.optimizer.buckets)


def test_the_set_up_gathers_no_whole_model(tmp_path):
    """Setting up the buffers the weights are gathered into allocates one at a time and releases it: no rank holds
    every weight's gather output at once (the whole model in the compute dtype) before the first step."""
    for peak, largest, whole in shared_pool(2).run(_set_up_peak, str(tmp_path), UNTIED + ["parallel.dp_shard=2",
                                                                                         *SHARDED]):
        assert peak <= largest < whole


def _diagnosed(tmp, overrides):
    """One step, then the report of a run stopped for diverging (which parameters are non-finite)."""
    from pathlib import Path

    from loom.config import load_config
    from loom.errors import TrainingDiverged
    from loom.train.trainer import Trainer

    trainer = Trainer(load_config("tiny", MODEL + ["train.steps=1", *overrides]), Path(tmp) / "run", quiet=True)
    trainer.train_step()
    try:
        trainer._stop_diverged(1)
    except TrainingDiverged as e:
        return str(e)


def test_a_diverged_run_reads_its_weights_gathered(tmp_path):
    """A run stopped for diverging names its non-finite parameters: with sharded weights they are released between
    steps (no storage), so they are gathered first rather than read."""
    for report in shared_pool(2).run(_diagnosed, str(tmp_path), UNTIED + ["parallel.dp_shard=2", *SHARDED]):
        assert "all parameters finite" in report


def _prefetched(tmp, overrides):
    """One step; for each block, whether its weights were already being gathered (prefetched) when its backward
    started, and how many all-gathers each unit started."""
    from pathlib import Path

    from loom.config import load_config
    from loom.parallel import zero
    from loom.train.trainer import Trainer

    trainer = Trainer(load_config("tiny", MODEL + ["train.steps=1", *overrides]), Path(tmp) / "run", quiet=True)
    opt, seen, gathers = trainer.optimizer, {}, {}
    before, gather = opt._before_backward, opt._gather_bucket

    def recording(i):
        seen.setdefault(opt.units[i].name, all(b.state != zero._FREE for b in opt.units[i].buckets))
        before(i)

    def counting(bucket):
        if bucket.state == zero._FREE:
            name = opt.units[bucket.unit].name
            gathers[name] = gathers.get(name, 0) + 1 / len(opt.units[bucket.unit].buckets)
        gather(bucket)

    opt._before_backward, opt._gather_bucket = recording, counting
    trainer.train_step()
    return seen, gathers


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_blocks_backward_finds_its_weights_prefetched(tied, tmp_path):
    """In backward each block's all-gather is started before it is needed (the last block's when the head unit's
    first gradient, the final norm's, arrives: tied or not), and no block is gathered again after its backward."""
    overrides = ["parallel.dp_shard=2", *SHARDED, "model.tie_embeddings=" + str(tied).lower(),
                 "train.micro_batch=2"]
    for seen, gathers in shared_pool(2).run(_prefetched, str(tmp_path), overrides):
        assert seen == {"layers.1": True, "layers.0": True}
        # twice per micro-batch (forward, backward), as the head unit is once
        assert round(gathers["layers.0"]) == round(gathers["layers.1"]) == 2 * round(gathers["head"])
