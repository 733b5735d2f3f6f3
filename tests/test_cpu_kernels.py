"""The CPU decode kernels (loom/infer/cpu/kernels.py): the packed small-batch product against float64
`F.linear` and the decode attention against float64 SDPA, inside torch.compile, repacked in place, refused
cleanly where they cannot build, and in the engine: the same tokens and log-probs as the engine without
them, the model untouched."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom.infer.cpu import kernels as cpu_kernels
from loom.infer.engine import Engine
from loom.infer.sampling import SamplingParams
from loom.models.llama import Transformer
from loom.config import ModelConfig

CAN_BUILD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("c++") is not None
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="needs an AVX2 CPU and a C++ compiler")


@pytest.fixture(autouse=True)
def _two_threads():
    """At least two threads, so that the kernels split their work over threads as an engine's do (`pytest -n`
    gives each worker one thread of a 2-core machine: tests/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@needs_kernel
def test_builds_and_loads_here():
    """On an AVX2 machine with a compiler the kernel is used (a silent fallback would hide every test below)."""
    assert cpu_kernels.available(), cpu_kernels._state.get("why")
    assert hasattr(torch.ops.loom_cpu, "packed_linear")


@needs_kernel
@pytest.mark.parametrize("k", [1, 37, 384])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_equals_float64_linear(n, k):
    """Every row count (register tiles of 6 and each remainder), columns that fill panels partly, with and
    without bias, 2-D and 3-D inputs: within fp32 rounding of the float64 product, as close as ATen's."""
    assert cpu_kernels.available()
    g = torch.Generator().manual_seed(n * 1000 + k)
    for bias in (False, True):
        lin = nn.Linear(k, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g))
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        layer = cpu_kernels.PackedLinear(lin)
        for shape in [(1, k), (5, k), (6, k), (7, k), (16, k), (33, k), (2, 9, k)]:
            x = torch.randn(shape, generator=g)
            want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
            got = layer(x)
            assert got.shape == want.shape and got.dtype == torch.float32
            scale = (x.double().abs() @ lin.weight.double().abs().t()).max().item() + 1
            err = (got.double() - want).abs().max().item()
            aten = (F.linear(x, lin.weight, lin.bias).double() - want).abs().max().item()
            assert err <= 1e-6 * scale + 2 * aten, (shape, err, aten)


@needs_kernel
@pytest.mark.parametrize("d", [64, 13])
def test_decode_attention_equals_float64_sdpa(d):
    """The decode attention op against float64 SDPA with the same boolean mask: several query heads per
    key/value head, keys and values as strided views of a larger slab (the engine passes slab views), rows
    whose visible keys end at different positions, a fully visible row, and a query that sees only key 0."""
    assert cpu_kernels.available()
    g = torch.Generator().manual_seed(d)
    slots, heads, length, rows, rep, keys = 6, 2, 40, 5, 3, 32
    K = torch.randn(slots, heads, length, d, generator=g)
    V = torch.randn(slots, heads, length, d, generator=g)
    q = torch.randn(rows, heads, rep, d, generator=g) * 2
    positions = torch.tensor([[0], [5], [31], [17], [40]])  # 40 >= keys: every key visible
    mask = (torch.arange(keys) <= positions[..., None]).unsqueeze(1).repeat(1, 1, rep, 1)
    k, v = K[:rows, :, :keys], V[:rows, :, :keys]
    assert not k.is_contiguous()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    got = torch.ops.loom_cpu.decode_attention(q, k, v, mask)
    aten = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (got.double() - want).abs().max().item() < 1e-5
    assert (aten.double() - want).abs().max().item() < 1e-5
    assert torch.allclose(got[0], v[0, :, :1].expand(heads, rep, d))  # a query that sees key 0 only gets value 0


@needs_kernel
def test_inside_torch_compile_with_a_dynamic_batch():
    """The op is one opaque call in a compiled graph (its fake implementation gives the shape): compiled
    results equal the eager op's bit for bit at several batch sizes from one graph."""
    from torch._dynamo.utils import counters

    assert cpu_kernels.available()
    torch._dynamo.reset()
    counters.clear()
    lin = nn.Linear(48, 40)
    layer = cpu_kernels.PackedLinear(lin)
    fn = torch.compile(lambda x: torch.relu(layer(x)) * 2, fullgraph=True, dynamic=True)
    with torch.no_grad():  # the op has no backward: the engine calls it under no_grad
        for rows in (3, 8, 13):
            x = torch.randn(rows, 48)
            assert torch.equal(fn(x), torch.relu(layer(x)) * 2)
    assert counters["stats"]["unique_graphs"] == 1


@needs_kernel
def test_repack_writes_in_place():
    """After the source weight changes, `repack` rewrites the packed copy at the same address and the layer
    computes with the new weight."""
    assert cpu_kernels.available()
    lin = nn.Linear(20, 35, bias=False)
    layer = cpu_kernels.PackedLinear(lin)
    address = layer.packed.data_ptr()
    assert layer.packed.shape == (3, 20, 16)
    assert torch.equal(layer.packed[2, :, 3:], torch.zeros(20, 13))  # columns past N are zero
    x = torch.randn(4, 20)
    before = layer(x)
    with torch.no_grad():
        lin.weight.mul_(-2)
    assert torch.allclose(layer(x), before)  # stale until repacked
    layer.repack()
    assert layer.packed.data_ptr() == address
    assert torch.allclose(layer(x), -2 * before, atol=1e-5)


def test_unavailable_when_switched_off_or_unbuildable(monkeypatch, tmp_path, caplog):
    """LOOM_CPU_KERNELS=0, or a compiler that fails (in a fresh process): `available()` is False with the
    reason logged, the cache directory holds no half-written library, and an engine falls back to F.linear
    (no packed layers) and still generates."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("LOOM_CPU_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="loom.infer.cpu.kernels"):
        assert not cpu_kernels.available()
    assert "LOOM_CPU_KERNELS=0" in caplog.text
    model = Transformer(ModelConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, ffn_hidden=48,
                                    max_seq_len=32))
    engine = Engine(model, max_batch=2, max_len=16)
    assert engine.stats["packed_linears"] == 0 and engine.runner.decoder is model and engine.slab.decode_kernel is None

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return
    script = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from loom.config import ModelConfig
from loom.infer.cpu import kernels as cpu_kernels
from loom.infer.engine import Engine
from loom.infer.sampling import SamplingParams
from loom.models.llama import Transformer
model = Transformer(ModelConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, ffn_hidden=48, max_seq_len=32))
engine = Engine(model, max_batch=2, max_len=16)
done = engine.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=3))
print("available", cpu_kernels.available(), "packed", engine.stats["packed_linears"], [len(d.tokens) for d in done])
"""
    env = {**os.environ, "LOOM_CACHE": str(tmp_path), "CXX": "false"}  # a "compiler" that fails
    env.pop("LOOM_CPU_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "building the CPU decode kernels failed" in out.stdout
    assert "available False packed 0 [3, 3]" in out.stdout
    assert not list((tmp_path / "kernels").glob("*.so")) and not list((tmp_path / "kernels").glob("tmp*"))


@needs_kernel
def test_engine_with_the_kernel_equals_the_engine_without(tmp_path):
    """A model with biases and a tied head: the packed engine (eager and compiled) gives the tokens of the
    engine without the kernel, log-probs within 1e-5; the model keeps its own nn.Linear layers and shares
    every parameter with the twin; a refit repacks (outputs equal a fresh engine on the new weights)."""
    assert cpu_kernels.available()
    cfg = ModelConfig(vocab_size=96, hidden=48, layers=2, heads=4, kv_heads=2, ffn_hidden=80, max_seq_len=64,
                      qkv_bias=True, tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in (3, 9, 5, 12, 7)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=6 + i, seed=i) for i in range(5)]
    plain = Engine(model, max_batch=3, max_len=40, cpu_kernel=False).generate(prompts, params)
    for compile in (False, True):
        engine = Engine(model, max_batch=3, max_len=40, compile=compile)
        assert engine.stats["packed_linears"] == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the head
        assert engine.slab.decode_kernel is not None  # decode attention through the kernel too
        got = engine.generate(prompts, params)
        assert [d.tokens for d in got] == [d.tokens for d in plain]
        assert max(abs(a - b) for x, y in zip(got, plain) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5
    assert type(model.layers["0"].attention.wq) is nn.Linear and type(model.output) is nn.Linear
    shared = {id(p) for p in model.parameters()}
    assert all(id(p) in shared for p in engine.runner.decoder.parameters())  # norms, embedding: the model's own
    packed = [m for m in engine.runner.decoder.modules() if isinstance(m, cpu_kernels.PackedLinear)]
    originals = set(map(id, model.modules()))
    assert len(packed) == 15 and all(id(m.source[0]) in originals for m in packed)

    torch.manual_seed(1)
    other = Transformer(cfg)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0, 0.3)
    engine.refit(other)
    after = engine.generate(prompts, params)
    fresh = Engine(other, max_batch=3, max_len=40, cpu_kernel=False).generate(prompts, params)
    assert [d.tokens for d in after] == [d.tokens for d in fresh] != [d.tokens for d in got]


@needs_kernel
def test_the_profiler_measures_decode_products_as_the_engine_runs_them():
    """`loom plan --profile-hardware` times its decode tables through the engine's product: the packed kernel
    for CPU fp32 (equal to F.linear within rounding), F.linear (None) where the engine would not use it."""
    from loom.infer.cpu import decode_product
    from loom.planner.profile import _linear_pass

    assert cpu_kernels.available()
    make = decode_product("cpu", torch.float32)
    w, x = torch.randn(100, 64), torch.randn(16, 64)
    assert torch.allclose(make(w)(x), F.linear(x, w), atol=1e-4)
    assert decode_product("cpu", torch.bfloat16) is None
    calls = []
    _linear_pass(x, [w, w], "cpu", min_time=0.01, product=lambda w: (lambda x: calls.append(x.shape)))
    assert calls and set(calls) == {(16, 64)}


def test_the_engine_probe_times_with_the_engines_threads():
    """The probe's timer runs with the caller's thread count, the engine's, not torch's benchmark timer's
    default of one thread (which measures decode attention slower than an engine runs it)."""
    from loom.infer.probe import _seconds

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        _seconds(lambda: seen.append(torch.get_num_threads()), 0.01)
        assert seen and set(seen) == {2}
    finally:
        torch.set_num_threads(before)


def test_the_engine_probe_reads_decode_attention_caches_cold(monkeypatch):
    """Each size of the decode attention table cycles over enough layers' caches to outgrow a last-level cache
    (128 MB on a CPU), one attend call per layer, and divides by the layers: one layer's cache read again and
    again stays cached, which a decode step, reading it once between the model's weights, does not."""
    from loom.infer import probe

    calls = []
    real = probe.KVSlab.attend

    def attend(self, layer, q, k, v):
        calls.append((layer, 2 * self.k[layer].numel() * self.k[layer].element_size()))
        return real(self, layer, q, k, v)

    monkeypatch.setattr(probe.KVSlab, "attend", attend)
    monkeypatch.setattr(probe, "_seconds", lambda fn, min_time: (fn(), 2.0)[1])  # one pass, "2 s"
    table = probe.decode_attention_gbps("cpu", torch.float32)
    sizes = {}  # one layer's K and V of the batch -> the layers read, in order
    for layer, nbytes in calls:
        sizes.setdefault(nbytes, []).append(layer)
    assert [nbytes for nbytes, _ in table] == list(sizes) and len(table) == 4
    for (nbytes, gbps), layers in zip(table, sizes.values()):
        assert layers == list(range(len(layers))) and len(layers) * nbytes >= 1 << 27  # every layer once, cold
        assert gbps == pytest.approx(nbytes / (2.0 / len(layers)) / 1e9, abs=1e-3)
