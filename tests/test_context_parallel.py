"""Context parallelism (loom/parallel/context.py): the sharding, the attention over gathered keys/values,
positions, and what each rank holds. Whole-run equivalence with one process (cp2, cp2 x tp2 x sp,
cp2 x dp_shard2, pp2 x cp2) is in tests/test_parallel.py."""

from __future__ import annotations

import pytest
import torch

from distributed import shared_pool
from loom.config import load_config
from loom.errors import UserError
from loom.parallel.context import rank_positions, shard_batch
from loom.rules import cp_problem


def test_load_balanced_chunks_cover_every_position_once():
    seq, cp = 48, 3  # 6 chunks of 8: rank 0 holds 0 and 5, rank 1 holds 1 and 4, rank 2 holds 2 and 3
    held = [rank_positions(seq, cp, r) for r in range(cp)]
    assert held[0].tolist() == [*range(0, 8), *range(40, 48)]
    assert held[2].tolist() == [*range(16, 24), *range(24, 32)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    # Causal work per rank (keys each query sees) is equal: the point of pairing chunk i with 2cp-1-i.
    assert len({int((p + 1).sum()) for p in held}) == 1
    batch = {"input_ids": torch.arange(2 * seq).view(2, seq), "labels": torch.arange(2 * seq).view(2, seq) + 1}
    part = shard_batch(batch, seq, cp, 1)
    assert part["input_ids"].shape == (2, 16)
    assert torch.equal(part["labels"][1], batch["labels"][1, held[1]])


def _attention_rank(seq, cp, kind):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loom.models.llama import attention_core
    from loom.parallel.context import ContextParallelCore, _GatherKV

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64)  # GQA: 2 key/value heads for 4 queries
    v = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64)
    out_grad = torch.randn(2, 4, seq, 8, generator=gen, dtype=torch.float64)
    # Reference: the whole sequence in this process.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_core(*leaves, kind, 0.0)
    ref.backward(out_grad)
    # This rank's chunks.
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    idx = rank_positions(seq, cp, rank)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    _GatherKV.traffic.update(gathered_bytes=0, scattered_bytes=0)
    out = ContextParallelCore(mesh.get_group(), cp, rank)(*local, kind, 0.0)
    out.backward(out_grad[:, :, idx])
    errors = [(out - ref[:, :, idx]).abs().max().item()]
    errors += [(a.grad - b.grad[:, :, idx]).abs().max().item() for a, b in zip(local, leaves)]
    return {"errors": errors, "local_len": out.shape[2], "traffic": dict(_GatherKV.traffic)}


@pytest.mark.parametrize("kind", ["sdpa", "math"])
def test_attention_over_gathered_keys_equals_whole_sequence(kind):
    seq, cp = 24, 3
    for r in shared_pool(cp).run(_attention_rank, seq, cp, kind):
        assert r["local_len"] == seq // cp
        assert max(r["errors"]) < 1e-12, r["errors"]  # output and the gradients of q, k and v (float64)
        # K and V of the other two ranks gathered (forward), their gradients scattered back (backward).
        kv_bytes = 2 * 2 * (seq // cp) * 8 * 8  # batch x kv heads x local tokens x head size x float64
        assert r["traffic"] == {"gathered_bytes": 2 * kv_bytes * (cp - 1), "scattered_bytes": 2 * kv_bytes * (cp - 1)}


def test_positions_follow_the_rank_not_the_local_index():
    """A model given a cp rank's tokens and positions computes the whole sequence's hidden states at
    those positions, for RoPE and for learned positions (no attention exchange: one layer attends to
    itself only through the core, so compare embeddings + one projection)."""
    from loom.models.llama import build_model

    for position in ("rope", "learned"):
        cfg = load_config("tiny", ["model.layers=1", f"model.position={position}"]).model
        model = build_model(cfg, seed=0)
        seq = 32
        tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
        captured = {}
        model.layers["0"].attention.core = lambda q, k, v, *a, **kw: captured.setdefault("q", q) * 0 + q
        model(tokens)
        whole = captured.pop("q")
        idx = rank_positions(seq, 2, 1)
        part = shard_batch({"input_ids": tokens}, seq, 2, 1)  # the rank's tokens and their `positions`
        assert torch.equal(part["positions"], idx[None])
        model(part["input_ids"], positions=part["positions"])
        assert torch.allclose(captured["q"], whole[:, :, idx], atol=1e-6), position


@pytest.mark.parametrize("overrides, fragments", [
    (["parallel.cp=3", "train.seq_len=32"], ["2 x cp = 6", "valid cp sizes for this seq_len: 1, 2, 4, 8, 16"]),
    (["parallel.cp=2", "parallel.tp=4", "parallel.sp=true", "train.seq_len=36", "model.max_seq_len=64"],
     ["cp x tp = 8", "valid cp sizes"]),
    (["parallel.cp=2", "recompute.mode=budget", "recompute.budget_gib=1"], ["recompute.mode=budget"]),
])
def test_bad_context_parallel_configs_are_refused(overrides, fragments):
    with pytest.raises(UserError) as err:
        load_config("tiny", overrides)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_cp_problem_accepts_what_runs():
    assert cp_problem(2, 32) is None and cp_problem(4, 4096, tp=8, sp=True) is None
    assert cp_problem(3, 32) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_chunk_attention_on_cuda_takes_no_dense_mask(compiled):  # pragma: no cover - GPU only
    """On a GPU a context-parallel chunk (queries at the end of a longer key prefix, GQA) attends through torch's
    lower-right CausalBias: equal to the dense-mask reference (fp32 math path, TF32 off) within bf16 rounding,
    forward and backward, eager and compiled, and nothing of s_q x s_k elements is saved for backward."""
    import torch.nn.functional as F

    from loom.models.llama import attention_core

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    b, hq, hkv, s_q, s_k, d = 2, 8, 2, 256, 1024, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h, s in ((hq, s_q), (hkv, s_k), (hkv, s_k)))
    w = torch.randn(b, hq, s_q, d, device="cuda", dtype=torch.bfloat16)
    core = (lambda *a: attention_core(*a, "sdpa", 0.0))
    fn = torch.compile(core, fullgraph=True) if compiled else core
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        got = fn(q, k, v)
    grads = torch.autograd.grad((got.float() * w.float()).sum(), (q, k, v))
    assert all(n < s_q * s_k for n in saved), saved
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device="cuda").tril(diagonal=s_k - s_q)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    rk, rv = (t.repeat_interleave(hq // hkv, dim=1) for t in ref_in[1:])
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(ref_in[0], rk, rv, attn_mask=mask)
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), ref_in)
    assert (got.double() - ref).abs().max().item() < 2e-2
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max().item() < 5e-2 * max(1.0, r.abs().max().item())
