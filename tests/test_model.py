import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from loom import flops
from loom.config import ModelConfig
from loom.infer.engine import Engine
from loom.infer.sampling import SamplingParams
from loom.models.llama import build_model

LLAMA = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=160, vocab_size=97, max_seq_len=64)
GPT = dict(LLAMA, kv_heads=4, norm="layernorm", mlp="gelu", position="learned", bias=True)


def randomise(model, seed=0):
    """Random values everywhere (norm scales and biases too) so no parameter is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model


def reference_forward(model, tokens):
    """Float64 reference written independently: explicit loops over heads, complex-number RoPE."""
    cfg = model.cfg
    sd = {k: v.double() for k, v in model.state_dict().items()}
    b, s = tokens.shape
    h = sd["tok_embeddings.weight"][tokens]
    if cfg.position == "learned":
        h = h + sd["pos_embeddings.weight"][:s]

    def norm(x, prefix):
        if cfg.norm == "rmsnorm":
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * sd[prefix + ".weight"]
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + cfg.norm_eps) * sd[prefix + ".weight"] + sd[prefix + ".bias"]

    def lin(x, prefix):
        y = x @ sd[prefix + ".weight"].T
        return y + sd[prefix + ".bias"] if prefix + ".bias" in sd else y

    d = cfg.head_dim
    half = d // 2
    freqs = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    rot = torch.polar(torch.ones(s, half, dtype=torch.float64), torch.outer(torch.arange(s, dtype=torch.float64), freqs))

    def rope(x):  # pairs (i, i + d/2) as a complex number
        z = torch.complex(x[..., :half], x[..., half:]) * rot
        return torch.cat([z.real, z.imag], -1)

    for i in range(cfg.layers):
        p = f"layers.{i}."
        x = norm(h, p + "attention_norm")
        q = lin(x, p + "attention.wq").view(b, s, cfg.heads, d)
        k = lin(x, p + "attention.wk").view(b, s, cfg.kv_heads, d)
        v = lin(x, p + "attention.wv").view(b, s, cfg.kv_heads, d)
        heads = []
        for hd in range(cfg.heads):
            kv = hd // (cfg.heads // cfg.kv_heads)
            qh, kh, vh = q[:, :, hd], k[:, :, kv], v[:, :, kv]
            if cfg.position == "rope":
                qh, kh = rope(qh), rope(kh)
            scores = qh @ kh.transpose(1, 2) / math.sqrt(d)
            scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -math.inf)
            heads.append(scores.softmax(-1) @ vh)
        h = h + lin(torch.cat(heads, -1), p + "attention.wo")
        x = norm(h, p + "ffn_norm")
        if cfg.mlp == "swiglu":
            a = lin(x, p + "feed_forward.w1")
            m = a * torch.sigmoid(a) * lin(x, p + "feed_forward.w3")
        else:
            a = lin(x, p + "feed_forward.w1")
            m = 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))
        h = h + lin(m, p + "feed_forward.w2")
    return lin(norm(h, "norm"), "output")


@pytest.mark.parametrize("arch", [LLAMA, GPT, dict(LLAMA, tie_embeddings=True, kv_heads=1)])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_forward_matches_float64_reference(arch, attention):
    model = randomise(build_model(ModelConfig(**arch, attention=attention)))
    tokens = torch.randint(0, 97, (2, 11))
    got = model(tokens).double()
    want = reference_forward(model, tokens)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_causal_future_tokens_do_not_change_past_logits():
    model = randomise(build_model(ModelConfig(**LLAMA)))
    a = torch.randint(0, 97, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 97
    assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-6)
    assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:], atol=1e-3)


@pytest.mark.parametrize("arch", [LLAMA, GPT])
def test_kv_cache_decoding_matches_full_forward(arch):
    """The model decoding through a key/value cache at per-token positions (the engine's slab: rotary or
    learned positions) continues as its full forward does."""
    model = randomise(build_model(ModelConfig(**arch))).eval()
    prompts = torch.randint(0, 97, (2, 5)).tolist()
    engine = Engine(model, max_batch=2, max_len=17, cpu_kernel=False)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    out = torch.tensor([p + d.tokens for p, d in zip(prompts, done)])
    assert out.shape == (2, 17)
    # Greedy: each generated token is the argmax of the full (uncached) forward over its prefix.
    full = model(out)
    assert torch.equal(full[:, 4:-1].argmax(-1), out[:, 5:])


def test_sampling_is_seeded_and_respects_top_k():
    model = randomise(build_model(ModelConfig(**LLAMA))).eval()
    prompt = torch.randint(0, 97, (3,)).tolist()
    engine = Engine(model, max_batch=1, max_len=23, cpu_kernel=False)

    def sample(seed):
        done = engine.generate([prompt], SamplingParams(temperature=1.0, top_k=5, max_new_tokens=20, seed=seed))
        return torch.tensor([prompt + done[0].tokens])

    a, b, c = sample(1), sample(1), sample(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    logits = model(a)
    for pos in range(3, a.shape[1]):
        top5 = logits[0, pos - 1].topk(5).indices
        assert a[0, pos] in top5


@pytest.mark.parametrize("arch", [LLAMA, GPT, dict(LLAMA, kv_heads=1, tie_embeddings=True)])
def test_flop_formula_matches_flop_counter(arch):
    cfg = ModelConfig(**arch, attention="math")
    model = build_model(cfg)
    tokens = torch.randint(0, 97, (3, 24))
    with FlopCounterMode(display=False) as counter:
        loss = model(tokens).sum()
        loss.backward()
    assert counter.get_total_flops() == flops.train_flops_per_token(cfg, 24) * tokens.numel()


def test_init_is_reproducible_and_scaled():
    cfg = ModelConfig(**LLAMA)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    wo = a.layers["0"].attention.wo.weight
    wq = a.layers["0"].attention.wq.weight
    assert abs(wq.std().item() - 0.02) < 0.003
    assert abs(wo.std().item() - 0.02 / math.sqrt(2 * cfg.layers)) < 0.002
