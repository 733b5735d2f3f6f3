"""Paged keys and values (loom/infer/paged.py, blocks.py, paged_attention.py): the paged engine gives the slab
engine's tokens and log-probs, shared prompts give what unshared ones do while prefilling and storing a prompt
once, the pool gets every block back, the batch is bounded by the pool's tokens, split-KV decode attention equals
a float64 reference on ragged lengths, and a decode step reads what it must read and little more."""

from __future__ import annotations

import json
import random

import pytest
import torch

import loom
from loom.errors import UserError
from loom.infer.cpu.kernels import available as cpu_kernels_available
from loom.infer.engine import Engine
from loom.infer.paged import PagedKV
from loom.infer.paged_attention import reference_decode, split_kv_decode
from loom.infer.sampling import SamplingParams
from test_engine import VOCAB, hf_model, models, ragged_prompts  # noqa: F401  (the module's model fixture)


def close(got, want, tol=1e-5):
    assert [d.tokens for d in got] == [d.tokens for d in want]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < tol
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.sampling_logprobs, y.sampling_logprobs)) < tol


def returned(engine) -> bool:
    """Every block back in the pool but those the prefix cache holds alone (each with one reference, its own),
    and none once the cache lets go of them."""
    pool, cache = engine.slab.pool, engine.slab.cache
    held = [] if cache is None else list(cache.blocks.values())
    ok = pool.promised == 0 and pool.in_use() == len(held) and all(pool.refs[b] == 1 for b in held)
    if cache is not None:
        cache.clear()
    return ok and pool.in_use() == 0


def group_prompts():
    """Ragged prompts, some repeated as GRPO groups (contiguous, as loom/post/rl submits them) and one group
    scattered; lengths on and off block boundaries."""
    p = ragged_prompts(8, seed=3)
    p[1] = p[1][:1] + list(range(1, 16))  # 16 tokens: two whole blocks of 8
    return p[:2] + [p[1]] * 3 + p[2:5] + [p[0]] * 4 + p[5:] + [p[3]]


@pytest.mark.parametrize("read,kernel", [("split", True), ("split", False), ("gather", True)],
                         ids=["split-cpu-kernel", "split-torch", "gather"])
def test_paged_engine_equals_the_slab_engine_and_shares_prompts(models, read, kernel):
    """Greedy and sampled requests, slots refilled and compacted: the paged engine gives the slab engine's
    tokens and log-probs (the slab never shares), each distinct prompt is prefilled once (the prefill's first
    layer sees each once), copies on write happen, and every block goes back to the pool."""
    _, path = models["llama"]
    model = loom.load_model(path)
    prompts = group_prompts()
    params = [SamplingParams(temperature=0.0 if i % 3 else 1.0, top_k=0 if i % 2 else 40,
                             max_new_tokens=2 + (5 * i) % 13, seed=i) for i in range(len(prompts))]
    want = Engine(model, max_batch=5, max_len=48).generate(prompts, params)
    seen = []
    model.layers["0"].attention.wq.register_forward_hook(
        lambda m, a, out: seen.append(a[0].shape[1] if engine.slab.packed is not None else 0))  # prefills only
    engine = Engine(model, max_batch=5, max_len=48, paged=True, block_size=8, paged_read=read, cpu_kernel=kernel)
    if kernel and read == "split":  # skipped only where the CPU kernels cannot build
        assert engine.slab.paged_kernel is not None or not cpu_kernels_available()
    got = engine.generate(prompts, params)
    close(got, want)
    distinct = len({tuple(p) for p in prompts})
    prefill_tokens = sum(seen)
    assert engine.slab.stats["prefilled"] == distinct and engine.slab.stats["shared"] == len(prompts) - distinct
    assert prefill_tokens == sum(len(p) for p in {tuple(p) for p in prompts})
    assert engine.slab.stats["copied_blocks"] > 0 and engine.stats["moves"] > 0
    assert returned(engine) and not engine.slab.prefixes


def test_a_group_stores_its_prompt_once(models):
    """8 samples of one 20-token prompt (blocks of 8: two whole, one partial): the prompt's whole blocks are
    held once and listed by every sample; each sample owns only its copy of the partial block and its own
    new blocks. The samples equal 8 separate prompts with the same seeds."""
    _, path = models["qwen3"]
    model = loom.load_model(path)
    prompt = ragged_prompts(1, seed=9)[0][:1] + list(range(2, 21))
    params = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=i) for i in range(8)]
    engine = Engine(model, max_batch=8, max_len=40, paged=True, block_size=8)
    held = []
    real = engine.runner.decode

    def spy(rows, seqs):
        out = real(rows, seqs)
        held.append((engine.slab.pool.in_use(), [list(engine.slab.tables[r]) for r in rows]))
        return out

    engine.runner.decode = spy
    got = engine.generate([prompt] * 8, params)
    close(got, Engine(model, max_batch=8, max_len=40).generate([prompt] * 8, params))
    in_use, tables = held[0]
    assert {tuple(t[:2]) for t in tables} == {tuple(tables[0][:2])}  # the whole blocks: one copy, shared
    assert len({t[2] for t in tables}) == 8  # the partial block: copied on write, one per sample
    assert in_use == 2 + 8  # 2 shared + 8 own (positions 20..23 fit the third block); nothing else held
    assert engine.slab.stats["prefilled"] == 1 and engine.stats["prefill_steps"] == 1


def test_batch_is_bounded_by_the_pool_not_max_batch(models):
    """A pool of 40 positions (5 blocks of 8) under max_batch=8: requests wait for blocks, never more are held
    than the pool has, and the tokens are the slab engine's. A request that can never fit is refused."""
    _, path = models["llama"]
    model = loom.load_model(path)
    prompts = ragged_prompts(10, seed=2)
    params = [SamplingParams(max_new_tokens=4 + i) for i in range(10)]
    engine = Engine(model, max_batch=8, max_len=48, paged=True, block_size=8, kv_tokens=40)
    busy = []
    real = engine.runner.decode
    engine.runner.decode = lambda rows, seqs: busy.append((len(rows), engine.slab.pool.in_use())) or real(rows, seqs)
    close(engine.generate(prompts, params), Engine(model, max_batch=8, max_len=48).generate(prompts, params))
    assert max(n for n, _ in busy) < 8 and max(b for _, b in busy) <= 5
    with pytest.raises(UserError, match="kv_tokens"):
        engine.generate([list(range(30))], SamplingParams(max_new_tokens=17))


def test_pool_returns_every_block_after_1000_random_requests():
    """1,000 requests with random prompts (drawn from a few, so they share), lengths, windows, early stops and
    moves, against a pool barely larger than one request: at every point each block's reference count is the
    number of tables and held prompts listing it, no request writes into a block another lists, and at the end
    every block is free and nothing promised."""
    rng = random.Random(0)
    slots, size = 6, 4
    kv = PagedKV([0], slots, 1, 40, size, 2, 64, torch.float32, "cpu")
    bank = [[rng.randrange(100) for _ in range(rng.randrange(1, 20))] for _ in range(12)]
    todo = [(rng.choice(bank), rng.randrange(1, 30)) for _ in range(1000)]
    kv.expect([p for p, _ in todo])
    busy: dict[int, list] = {}  # slot -> [length, end]
    done = 0

    def check():
        refs = [0] * kv.pool.blocks
        for t in kv.tables:
            for b in t:
                refs[b] += 1
        for e in kv.prefixes.values():
            for b in e.blocks:
                refs[b] += 1
        assert refs[1:] == kv.pool.refs[1:] and refs[0] == 0
        assert kv.pool.promised == sum(kv.owed) and kv.pool.available >= 0

    while todo or busy:
        for s in range(slots):
            if s not in busy and todo:
                prompt, new = todo[0]
                if kv.admit(s, prompt, min(len(prompt) + new, 64)) is None:
                    if busy:
                        break
                    kv.evict()
                    assert kv.admit(s, prompt, min(len(prompt) + new, 64)) is not None
                todo.pop(0)
                busy[s] = [len(prompt), min(len(prompt) + new, 64) - 1]
        kv.settle()
        rows = sorted(busy)
        steps = [rng.randrange(1, 5) for _ in rows]
        ends = [min(busy[s][0] + n, busy[s][1]) for s, n in zip(rows, steps)]
        kv.prepare(rows, [busy[s][0] for s in rows], ends, None)
        for s, end in zip(rows, ends):  # the blocks a request writes are its alone
            for i in range(busy[s][0] // size, kv.blocks_for(end)):
                assert kv.pool.refs[kv.tables[s][i]] == 1
            busy[s][0] = end
        check()
        for s in rows:
            if busy[s][0] >= busy[s][1] or rng.random() < 0.1:  # done, or a stop token
                kv.release(s)
                del busy[s]
                done += 1
        free = [s for s in range(slots) if s not in busy]
        if free and busy and max(busy) > free[0] and rng.random() < 0.5:  # compaction moves a request down
            src = max(busy)
            kv.move(src, free[0])
            busy[free[0]] = busy.pop(src)
        check()
    kv.settle()
    assert done == 1000 and kv.pool.in_use() == 0 and kv.pool.promised == 0 and kv.stats["shared"] > 100


@pytest.mark.parametrize("dtype,tol,kernel", [(torch.float64, 1e-12, False), (torch.float32, 1e-5, False),
                                              (torch.float32, 1e-5, True)], ids=["f64", "f32", "cpu-kernel"])
def test_split_kv_decode_equals_float64_reference_on_ragged_lengths(dtype, tol, kernel):
    """Folded query heads (3 per key/value head), lengths 1, a block, a block + 1, long and odd, scattered
    blocks, plus a reserved block with nothing visible yet: equal to the float64 definition; so is the CPU
    kernel `decode_attention_paged`, given the block table (a column past the longest) and the positions."""
    if kernel and not cpu_kernels_available():
        pytest.skip("the CPU decode kernels cannot build here")
    g = torch.Generator().manual_seed(0)
    size, lengths = 8, [1, 8, 9, 30, 57, 3]
    K, V = (torch.randn(48, 2, size, 16, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    free = (torch.randperm(47, generator=g) + 1).tolist()
    tables = []
    for n in lengths:
        tables.append(free[:-(-n // size)])
        free = free[len(tables[-1]):]
    q = torch.randn(len(lengths), 2, 3, 16, generator=g, dtype=torch.float64).to(dtype)
    row, block, start = [], [], []
    for b, t in enumerate(tables):
        for i, x in enumerate(t + ([free[0]] if b == 2 else [])):  # row 2: one more block, all ahead of it
            row.append(b), block.append(x), start.append(i * size)
    positions = torch.tensor([n - 1 for n in lengths])
    if kernel:
        width = max(map(len, tables)) + 1
        table = torch.tensor([t + [free[0]] * (width - len(t)) for t in tables])
        got = torch.ops.loom_cpu.decode_attention_paged(q, K, V, table, positions[:, None])
    else:
        got = split_kv_decode(q, K, V, torch.tensor(row), torch.tensor(block), torch.tensor(start), positions)
    want = reference_decode(q, K, V, tables, [n - 1 for n in lengths])
    assert got.dtype == dtype and (got.double() - want).abs().max().item() < tol


def count_reads(engine, fn):
    """Bytes a decode step reads from the weights and the key/value pool, counted per ATen call: a call that
    takes a parameter (or the packed copy of one) reads it whole, an embedding reads its rows, an index into
    the pool reads what it returns."""
    from torch.utils._python_dispatch import TorchDispatchMode

    weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    pools = {t.untyped_storage().data_ptr() for t in (*engine.slab.k.values(), *engine.slab.v.values())}
    counted = {"weights": 0, "kv": 0}

    def nbytes(t):
        return t.numel() * t.element_size()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func is not torch.ops.aten.index_put_.default:
                first = args[0] if args and isinstance(args[0], torch.Tensor) else None
                ptr = first.untyped_storage().data_ptr() if first is not None else None
                if func is torch.ops.aten.embedding.default:
                    counted["weights"] += nbytes(out)
                elif ptr in pools and func is torch.ops.aten.index.Tensor:
                    counted["kv"] += nbytes(out)
                else:
                    for a in args:
                        if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in weights:
                            counted["weights"] += nbytes(a)
            return out

    with Count():
        fn()
    return counted


@pytest.mark.parametrize("read,within", [("split", True), ("gather", False)])
def test_a_decode_step_reads_weights_once_and_each_requests_own_keys(models, read, within):
    """Bytes one decode step must read: every weight once (the embedding's rows of the step's tokens) plus each
    request's visible keys and values, per layer; counted from the ATen calls of a step at a ragged batch
    (prompts of 6..118 tokens), the split-KV step reads within 10% of that; gathering every request's blocks to
    the longest does not (so the count would catch a step that reads the padded batch)."""
    _, path = models["llama"]
    model = loom.load_model(path)
    lengths = [6, 40, 70, 100, 118]
    prompts = [[(7 * n + i) % VOCAB for i in range(n)] for n in lengths]
    engine = Engine(model, max_batch=5, max_len=128, paged=True, block_size=8, paged_read=read, cpu_kernel=False,
                    sync_every=1)
    steps, real = [], engine.runner._step

    def spy(rows, tokens, positions, keys, where):
        out = []
        steps.append((positions[:, 0].tolist(), count_reads(engine, lambda: out.append(real(rows, tokens, positions,
                                                                                          keys, where)))))
        return out[0]

    engine.runner._step = spy
    engine.generate(prompts, SamplingParams(max_new_tokens=3))
    positions, counted = steps[-1]
    cfg, layers = model.cfg, len(model.layers)
    params = dict(model.named_parameters())
    weight_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if "embed" not in n)
    embed = next(p for n, p in params.items() if "embed" in n)
    weight_bytes += len(lengths) * embed.shape[1] * embed.element_size()
    if cfg.tie_embeddings:
        weight_bytes += embed.numel() * embed.element_size()
    kv_row = 2 * engine.slab.kv_heads * engine.slab.head_dim * 4  # a key and a value of one position, fp32
    need_kv = sum(p + 1 for p in positions) * kv_row * layers
    need = weight_bytes + need_kv
    reads = counted["weights"] + counted["kv"]
    assert counted["weights"] == pytest.approx(weight_bytes, rel=0.02)  # each weight once, no per-step copies
    assert (reads <= 1.1 * need) == within and reads >= need


@pytest.mark.slow  # two gloo ranks: about as long as test_engine's eager tp test, beyond this file's budget
def test_tensor_parallel_paged_engine_equals_one_process(models, tmp_path):
    """tp=2 over gloo with paged keys and values (each rank's pool holds its key/value head), shared prompts
    among the requests, refit from FSDP-sharded new weights: one process's slab engine's tokens and log-probs."""
    from distributed import shared_pool
    from engine_ranks import generate_tp

    _, path = models["qwen2"]
    new_path = tmp_path / "new"
    hf_model("qwen2", seed=5).save_pretrained(new_path)
    prompts = ragged_prompts(3, seed=6)
    prompts = [prompts[0], prompts[1], prompts[1], prompts[2]]
    params = [SamplingParams(max_new_tokens=6), SamplingParams(temperature=0.9, top_k=20, max_new_tokens=6, seed=4)] * 2
    want = Engine(loom.load_model(new_path), max_batch=3, max_len=40).generate(prompts, params)
    for kv_local, _, tokens, logprobs in shared_pool(2).run(generate_tp, path, new_path, prompts, params, False, True):
        assert kv_local == 1  # 2 key/value heads over 2 ranks
        assert tokens == [d.tokens for d in want]
        assert max(abs(a - b) for got, ref in zip(logprobs, want) for a, b in zip(got, ref.logprobs)) < 1e-5


@pytest.mark.slow
def test_compiled_paged_engine_equals_the_eager_slab_engine(models, monkeypatch):
    """compile=True with paged keys and values: each step takes its bucket's block table (fixed shapes per bucket,
    idle rows on the scratch block); tokens and log-probs equal the eager slab engine's, two graphs serve every
    bucket and nothing compiles mid-generation."""
    from torch._dynamo.utils import counters

    from loom.infer.step import CompiledDecode

    _, path = models["llama"]
    model = loom.load_model(path)
    prompts = ragged_prompts(10, seed=5)
    prompts += [prompts[2]] * 3
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=2 + (5 * i) % 13, seed=i)
              for i in range(len(prompts))]
    want = Engine(model, max_batch=4, max_len=48).generate(prompts, params)
    monkeypatch.setattr(CompiledDecode, "KEY_BLOCK", 24)
    counters.clear()
    engine = Engine(model, max_batch=4, max_len=48, paged=True, block_size=8, compile=True)
    warm = counters["stats"]["unique_graphs"]
    got = engine.generate(prompts, params)
    close(got, want)
    assert warm <= 2 and counters["stats"]["unique_graphs"] == warm
    assert engine.stats["compiled_steps"] == engine.stats["decode_steps"] > 10 and engine.slab.stats["shared"] == 3
    assert returned(engine)


def test_generate_n_samples_per_record_share_the_prompt(models, tmp_path, capsys):
    """`loom generate --n 3`: three consecutive records per input record ("sample" 0..2), sample k of record n
    drawn with seed + 3n + k: the tokens and log-probs of the slab engine given each prompt three times with
    those seeds (the engine's sharing itself: the tests above). --n without batch mode is refused (exit 2)."""
    from loom.cli import main

    _, path = models["llama"]
    prompts = [" ".join(f"w{i}" for i in p) for p in ragged_prompts(2, seed=8)]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": n}) + "\n" for n, p in enumerate(prompts)))
    out = tmp_path / "done.jsonl"
    assert main(["generate", "--checkpoint", str(path), "--input", str(src), "--output", str(out), "--n", "3",
                 "--temperature", "1", "--seed", "5", "--max-new-tokens", "5"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in records] == [(n, k) for n in range(2) for k in range(3)]
    ids = [[int(w[1:]) for w in p.split()] for p in prompts for _ in range(3)]
    want = Engine(loom.load_model(path), max_batch=6, max_len=40).generate(
        ids, [SamplingParams(temperature=1.0, max_new_tokens=5, seed=5 + i) for i in range(6)])
    for r, w in zip(records, want):
        assert r["tokens"] == w.tokens and max(abs(a - b) for a, b in zip(r["logprobs"], w.logprobs)) < 1e-5
    assert len({tuple(r["tokens"]) for r in records[:3]}) > 1  # the samples differ
    assert main(["generate", "--checkpoint", str(path), "--prompt", "w1 w2", "--n", "2"]) == 2
    assert "--n=2 needs batch mode" in capsys.readouterr().err


@pytest.mark.gpu
def test_paged_engine_on_cuda_equals_the_slab_engine(models):
    """On a GPU, fp32: the paged engine, eager (split reads through `split_kv_decode`) and compiled (CUDA graphs
    per bucket over the bucket's block table), gives the eager slab engine's tokens, log-probs within 1e-4
    (inductor's kernels round differently), with shared prompts, and returns every block."""
    _, path = models["llama"]
    model = loom.load_model(path, device="cuda")
    prompts = group_prompts()
    params = [SamplingParams(temperature=0.0 if i % 3 else 1.0, max_new_tokens=2 + (5 * i) % 13, seed=i)
              for i in range(len(prompts))]
    want = Engine(model, max_batch=4, max_len=48).generate(prompts, params)
    for compile in (False, True):
        engine = Engine(model, max_batch=4, max_len=48, paged=True, compile=compile)
        close(engine.generate(prompts, params), want, tol=1e-4)
        assert engine.slab.stats["shared"] > 0 and returned(engine)
