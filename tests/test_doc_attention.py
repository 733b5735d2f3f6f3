"""Document-aware attention without a dense mask (loom/models/doc_attention.py, issue 39 item 4): FlexAttention's
block-sparse mask gives exactly what the dense boolean mask gives, forward and backward, with grouped queries,
context parallelism's offset queries, and through a packed model. On a CPU FlexAttention runs eagerly (its
reference implementation); the GPU path is the same function inside a compiled block."""

import pytest
import torch

from loom.config import ModelConfig
from loom.models import doc_attention
from loom.models.llama import attention_core, build_model

pytestmark = pytest.mark.skipif(doc_attention.flex_attention is None, reason="torch without FlexAttention")


@pytest.fixture(autouse=True)
def cpu_backward(monkeypatch):
    """FlexAttention's public function refuses gradients on a CPU (its kernels are generated for GPUs); the
    operator underneath has a dense reference backward, which these tests run by lifting that check."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *a: None)


def _docs(b: int, s: int, lengths: list[list[int]]) -> torch.Tensor:
    """[b, s] document ids from each row's document lengths (the rest one padding document)."""
    out = torch.empty(b, s, dtype=torch.long)
    for r, row in enumerate(lengths):
        ids = sum(([d] * n for d, n in enumerate(row)), [])
        out[r] = torch.tensor(ids + [len(row)] * (s - len(ids)))
    return out


@pytest.mark.parametrize("hq, hkv, s_q, s_k", [(4, 4, 160, 160), (8, 2, 160, 160), (4, 2, 96, 256)])
def test_flex_equals_the_dense_mask_forward_and_backward(hq, hkv, s_q, s_k):
    """Ragged documents (one longer than a 128-position block, some of a few tokens, padding), GQA, and queries
    at the last s_q of s_k keys (a context-parallel chunk): output and the gradients of q, k, v equal the dense
    path's within 1e-5 in fp32."""
    torch.manual_seed(0)
    b, d = 2, 16
    q = torch.randn(b, hq, s_q, d, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(b, hkv, s_k, d).requires_grad_()
    v = torch.randn(b, hkv, s_k, d).requires_grad_()
    docs = _docs(b, s_k, [[3, 140, 1, 10], [s_k // 2, 7, 7, 30]])
    w = torch.randn(b, hq, s_q, d)
    got = doc_attention.flex_document_attention(q, k, v, docs)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want = attention_core(q, k, v, "sdpa", 0.0, docs)  # on a CPU: the dense mask
    wgrads = torch.autograd.grad((want * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, wg in zip(grads, wgrads):
        torch.testing.assert_close(g, wg, rtol=1e-5, atol=1e-5)
    # it can fail: plain causal attention over the packed row differs
    causal = attention_core(q, k, v, "sdpa", 0.0)
    assert (causal - want).abs().max() > 1e-2


def test_packed_model_through_flex_equals_the_dense_path(monkeypatch):
    """A packed batch through the whole model with the FlexAttention path switched on (as a compiled GPU block
    takes it) gives the dense path's loss and gradients; the flex function ran once per layer."""
    cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=97, max_seq_len=192)
    model = build_model(cfg, seed=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 192), generator=g)
    docs = _docs(2, 192, [[20, 130, 5], [64, 64, 64]])
    pos = torch.cat([torch.cat([torch.arange(n) for n in row + ([192 - sum(row)] if sum(row) < 192 else [])])[None]
                     for row in ([20, 130, 5], [64, 64, 64])])

    def run():
        model.zero_grad()
        out = model(ids, doc_ids=docs, positions=pos)
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    dense_out, dense_grads = run()
    calls = []
    flex = doc_attention.flex_document_attention
    monkeypatch.setattr(doc_attention, "wanted", lambda q, dropout: dropout == 0.0)
    monkeypatch.setattr(doc_attention, "flex_document_attention", lambda *a: calls.append(1) or flex(*a))
    flex_out, flex_grads = run()
    assert len(calls) == cfg.layers
    torch.testing.assert_close(flex_out, dense_out, rtol=1e-5, atol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_flex_is_taken_only_on_a_gpu_inside_compile_without_dropout():
    q = torch.zeros(1, 1, 4, 8)
    assert not doc_attention.wanted(q, 0.0)  # a CPU: the dense mask (eager FlexAttention is a slow reference)


@pytest.mark.gpu
def test_flex_inside_a_compiled_region_on_cuda_equals_the_dense_mask():  # pragma: no cover - GPU only
    """On a GPU, attention_core inside torch.compile takes FlexAttention (its generated kernels, forward and
    backward) and equals the eager dense-mask path in fp32 (TF32 off) within 1e-4."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 8, 2, 512, 64
    q, k, v = (torch.randn(b, h, s, d, device="cuda", requires_grad=True) for h in (hq, hkv, hkv))
    docs = _docs(b, s, [[3, 300, 1, 100], [256, 7, 7, 130]]).cuda()
    w = torch.randn(b, hq, s, d, device="cuda")
    taken = []
    flex = doc_attention.flex_document_attention

    def spy(*a):
        taken.append(1)
        return flex(*a)

    doc_attention.flex_document_attention = spy
    try:
        compiled = torch.compile(lambda q, k, v: attention_core(q, k, v, "sdpa", 0.0, docs), fullgraph=True)
        got = compiled(q, k, v)
        grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    finally:
        doc_attention.flex_document_attention = flex
    assert taken, "the compiled region did not take FlexAttention"
    want = attention_core(q, k, v, "sdpa", 0.0, docs)
    wgrads = torch.autograd.grad((want * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g, wg in zip(grads, wgrads):
        torch.testing.assert_close(g, wg, rtol=1e-4, atol=1e-4)
