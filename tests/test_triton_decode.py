"""The Triton split-KV decode kernels over paged keys and values (loom/infer/triton_decode.py): equal to the float64
`reference_decode` on ragged lengths, shuffled block tables, 1..8 query heads per key/value head, more splits than
a row has blocks, bf16; in the engine (`PagedKV.attend`) they give the slab engine's tokens and log-probs; and
the op traces under torch.compile. Skipped without Triton (CPU wheels of torch do not bring it).

The kernels run on this CPU through Triton's interpreter, which must be switched on before the kernels are
defined: the checks run in one subprocess with TRITON_INTERPRET=1 (this file run as a script) and print their
numbers, which the tests assert."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

# (G, kv_heads, head_dim, block_size, splits, programs, dtype): the dot path (chunks of 64 positions, G padded to
# 16; blocks of 16, of 4 and of 24, not a power of two), the broadcast path (heads under 16: chunks of 16; blocks
# of 4, and of 32, larger than a chunk), one split (written directly), more splits than most rows' blocks, and
# `programs` cutting the splits a many-row step uses: to one (10 programs over 5 rows x 2 heads: split 0 writes
# the output, the combine kernel returns at once) or to two of four (20 programs)
CASES = [(1, 2, 16, 16, 1, 0, "float32"), (4, 3, 16, 16, 3, 0, "float32"), (8, 2, 32, 16, 8, 0, "float32"),
         (4, 2, 8, 4, 6, 0, "float32"), (4, 2, 16, 16, 4, 10, "float32"), (4, 2, 16, 16, 3, 0, "bfloat16"),
         (2, 2, 16, 24, 4, 20, "float32"), (4, 2, 16, 4, 2, 0, "float32"), (2, 1, 8, 32, 3, 0, "float32"),
         (4, 2, 16, 16, 4, 10, "bfloat16")]


def _kernel_cases() -> list[dict]:
    from loom.infer.paged_attention import reference_decode
    from loom.infer.triton_decode import paged_decode

    out = []
    for i, (G, kv, d, bs, splits, programs, dtype) in enumerate(CASES):
        g = torch.Generator().manual_seed(i)
        # position 0, the end of block 0, the start of block 1, mid-block, the longest (mid-chunk: 81 of 16)
        positions = [0, bs - 1, bs, 2 * bs + bs // 2, 5 * bs + 1]
        width = max(p // bs for p in positions) + 2  # a spare column, as PagedKV's tables have
        pool = len(positions) * width + 1
        dt = getattr(torch, dtype)
        K, V = (torch.randn(pool, kv, bs, d, generator=g).to(dt) for _ in range(2))
        table = (torch.randperm(pool - 1, generator=g) + 1)[:len(positions) * width].view(-1, width)  # shuffled
        q = torch.randn(len(positions), kv, G, d, generator=g).to(dt)
        got = paged_decode(q, K, V, table.to(torch.int32), torch.tensor(positions), splits, programs)
        want = reference_decode(q, K, V, table.tolist(), positions)
        out.append({"case": [G, kv, d, bs, splits, programs, dtype], "dtype": str(got.dtype).split(".")[1],
                    "err": (got.double() - want).abs().max().item(), "scale": want.abs().max().item()})
    return out


def _tiny(device: str = "cpu"):
    """A 2-layer model (8 query heads over 2 key/value heads of 16: G = 4) with weights large enough that
    attention is far from uniform, and greedy and sampled requests of ragged lengths (1 to 21 prompt tokens)."""
    from loom.config import ModelConfig
    from loom.infer.sampling import SamplingParams
    from loom.models.llama import build_model

    model = build_model(ModelConfig(layers=2, hidden=128, heads=8, kv_heads=2, ffn_hidden=160, vocab_size=97,
                                    max_seq_len=64), device=device, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 16, 9, 21)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=4 + i, seed=i) for i in range(4)]
    return model, prompts, params


def _engine_case() -> dict:
    """The paged engine with split reads through the kernels (set by hand: PagedKV picks them on CUDA) against
    the slab engine, fp32."""
    from loom.infer.engine import Engine
    from loom.infer.triton_decode import paged_decode

    model, prompts, params = _tiny()
    want = Engine(model, max_batch=4, max_len=40).generate(prompts, params)
    engine = Engine(model, max_batch=4, max_len=40, paged=True, block_size=16, paged_read="split", cpu_kernel=False)
    calls = []

    def counted(*args):
        calls.append(1)
        return paged_decode(*args)

    engine.slab.triton_kernel = (counted, 2, 0)
    got = engine.generate(prompts, params)
    return {"calls": len(calls), "tokens_equal": [d.tokens for d in got] == [d.tokens for d in want],
            "logprob_err": max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs))}


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_kernels_equal_the_float64_reference(interpreted):
    """Ragged rows (position 0, block boundaries, mid-block, the longest: mid-chunk), shuffled block ids,
    G = 1, 2, 4, 8, 1-3 kv heads, blocks of 4, 16, 24 and 32, 1 to 8 splits (more than most rows' blocks), one
    split used at run time (direct write) or two of four: fp32 to 1e-4; bf16 in bf16 out, loosely."""
    assert len(interpreted["kernel"]) == len(CASES)
    for row in interpreted["kernel"]:
        dtype = row["case"][-1]
        assert row["dtype"] == dtype
        tol = 1e-4 if dtype == "float32" else 3e-2 * row["scale"]
        assert row["err"] < tol, row


def test_paged_engine_through_the_kernels_equals_the_slab_engine(interpreted):
    """Every decode step's attention went through the kernels, and the tokens and log-probs are the slab
    engine's (fp32, 1e-5)."""
    engine = interpreted["engine"]
    assert engine["calls"] > 0
    assert engine["tokens_equal"]
    assert engine["logprob_err"] < 1e-5


def test_the_op_traces_under_torch_compile():
    """torch.compile traces `paged_decode` (a torch.library.triton_op) whole, with the batch and block
    columns dynamic. Off the interpreter on a CPU the op computes in torch ops: the Triton kernels themselves
    are traced only on a GPU (torch's compile path does not take interpreted kernels)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreted kernels are not traceable")
    from torch._library.triton import triton_ops_to_kernels

    from loom.infer.paged_attention import reference_decode
    from loom.infer.triton_decode import paged_decode

    kernels = {k.fn.__name__ if hasattr(k, "fn") else k.__name__ for k in triton_ops_to_kernels["loom::paged_decode"]}
    assert kernels == {"_split_kernel", "_combine_kernel"}  # what Inductor sees inside the op on a GPU
    step = torch.compile(lambda q, K, V, t, p: paged_decode(q, K, V, t, p, 4, 0), backend="aot_eager",
                         fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    K, V = (torch.randn(20, 2, 16, 16, generator=g) for _ in range(2))
    for rows, width in ((3, 4), (5, 3)):
        table = (torch.randperm(19, generator=g) + 1)[:rows * width].view(rows, width)
        positions = torch.randint(0, width * 16, (rows,), generator=g)
        q = torch.randn(rows, 2, 4, 16, generator=g)
        want = reference_decode(q, K, V, table.tolist(), positions.tolist())
        assert (step(q, K, V, table, positions).double() - want).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_cuda_kernels_equal_the_float64_reference(dtype, tol):
    """On a GPU, at the Llama-3.2-1B attention shape (8 kv heads of 64, G = 4, blocks of 16): ragged rows up
    to 600 keys, shuffled blocks, PagedKV's default splits and programs, one split, and splits cut by a
    many-row step."""
    from loom.infer.paged_attention import reference_decode
    from loom.infer.triton_decode import paged_decode, splits_for

    g = torch.Generator().manual_seed(0)
    positions = [0, 15, 16, 100, 333, 600]
    width = 600 // 16 + 2
    pool = len(positions) * width + 1
    K, V = (torch.randn(pool, 8, 16, 64, generator=g).to(dtype).cuda() for _ in range(2))
    table = (torch.randperm(pool - 1, generator=g) + 1)[:len(positions) * width].view(-1, width)
    q = torch.randn(len(positions), 8, 4, 64, generator=g).to(dtype).cuda()
    want = reference_decode(q.cpu(), K.cpu(), V.cpu(), table.tolist(), positions)
    for splits, programs in (splits_for(width, torch.device("cuda")), (1, 0), (16, 64)):
        got = paged_decode(q, K, V, table.cuda(), torch.tensor(positions).cuda(), splits, programs)
        assert got.dtype == dtype
        assert (got.double().cpu() - want).abs().max() < tol * max(1.0, want.abs().max().item()), (splits, programs)


def no_other_reads(monkeypatch):
    """Make PagedKV's other decode reads (the dense gather's mask, eager `split_kv_decode`) fail if reached."""
    import loom.infer.paged as paged

    def other(*args, **kwargs):
        raise AssertionError("a paged decode step read keys without the Triton kernels")

    monkeypatch.setattr(paged.PagedKV, "_step_mask", other)
    monkeypatch.setattr(paged, "split_kv_decode", other)


def test_compiled_paged_step_traces_the_op_on_cpu(monkeypatch):
    """A compiled paged engine on this CPU (cpu_kernel=False) given the op by hand (PagedKV picks it on CUDA
    only): its decode steps are traced again through `paged_decode` (torch ops here), with the other paged reads
    failing if reached, and give the slab engine's tokens and log-probs (fp32, 1e-5)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreted kernels are not traceable")
    from loom.infer.engine import Engine
    from loom.infer.triton_decode import paged_decode

    model, prompts, params = _tiny()
    want = Engine(model, max_batch=4, max_len=40).generate(prompts, params)
    engine = Engine(model, max_batch=4, max_len=40, paged=True, compile=True, cpu_kernel=False)
    no_other_reads(monkeypatch)
    engine.slab.triton_kernel = (paged_decode, 3, 0)  # a guard of the compiled step: it compiles again
    got = engine.generate(prompts, params)
    assert [d.tokens for d in got] == [d.tokens for d in want]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5


@pytest.mark.gpu
def test_compiled_paged_step_on_cuda_reads_through_the_kernels(monkeypatch):
    """compile=True on a GPU with paged keys and values: the CUDA-graph step reads through `paged_decode` (no
    gather fallback: the other reads fail if reached), runs with no graph skipped, and gives the slab engine's
    tokens and log-probs (fp32, 1e-4), as does the eager paged engine."""
    from torch._dynamo.utils import counters

    from loom.infer.engine import Engine

    model, prompts, params = _tiny("cuda")
    want = Engine(model, max_batch=4, max_len=40).generate(prompts, params)
    no_other_reads(monkeypatch)
    counters.clear()
    engine = Engine(model, max_batch=4, max_len=40, paged=True, compile=True)
    assert engine.slab.triton_kernel is not None
    for got in (engine.generate(prompts, params),
                Engine(model, max_batch=4, max_len=40, paged=True).generate(prompts, params)):
        assert [d.tokens for d in got] == [d.tokens for d in want]
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    assert counters["inductor"]["cudagraph_skips"] == 0


if __name__ == "__main__":  # the interpreted checks (TRITON_INTERPRET=1 set by the fixture)
    torch.set_num_threads(1)
    print(json.dumps({"kernel": _kernel_cases(), "engine": _engine_case()}))
