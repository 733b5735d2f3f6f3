"""The generation engine (loom/infer/engine.py): greedy output equals transformers' `generate` per prompt
under continuous batching, log-probs equal the training forward's, refit equals a fresh engine without
reallocating the slab, per-request seeds do not depend on the batch, sampling follows its distribution,
tensor parallelism gives the tp=1 tokens, and `loom generate --input/--output` writes the contract records."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

import loom
from conftest import randomize_hf_weights
from distributed import shared_pool
from engine_ranks import generate_tp
from loom.cli import main
from loom.errors import UserError
from loom.infer.engine import Engine
from loom.infer.runner import Runner, pick
from loom.infer.sampling import SamplingParams, sample
from loom.infer.step import CompiledDecode

transformers = pytest.importorskip("transformers")

VOCAB = 300


def hf_model(kind: str, seed: int = 0):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=160, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
    elif kind == "qwen2":  # q/k/v biases, tied embeddings
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=False)
    else:  # qwen3: per-head q/k norms, head_dim decoupled from hidden / heads
        config = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return randomize_hf_weights(transformers.AutoModelForCausalLM.from_config(config))


def save_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, its directory); the directories also hold a word-level tokenizer."""
    out = {}
    for kind in ("llama", "qwen2", "qwen3"):
        model = hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        save_tokenizer(path)
        out[kind] = (model, path)
    return out


def ragged_prompts(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 21, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (length,), generator=g).tolist() for length in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_generate_under_continuous_batching(models, kind):
    hf, path = models[kind]
    prompts = ragged_prompts()
    new = [3 + (7 * i) % 11 for i in range(16)]  # different lengths: slots free at different steps
    engine = Engine(loom.load_model(path), max_batch=5, max_len=48)
    done = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in new])
    # 16 requests through 5 slots: slots were refilled while other sequences were still decoding, and in the
    # tail requests were moved down into freed slots (keys and values with them).
    assert engine.stats["refills"] >= 11 and engine.stats["prefill_steps"] > 1 and engine.stats["moves"] > 0
    assert [d.finish_reason for d in done] == ["length"] * 16 and [len(d.tokens) for d in done] == new
    # transformers' greedy search: the whole batch left-padded with its attention mask (one call), and two
    # prompts alone; a greedy continuation is a prefix of any longer one.
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=max(new), do_sample=False, eos_token_id=None,
                           pad_token_id=0)[:, width:]
        for i in (prompts.index(min(prompts, key=len)), prompts.index(max(prompts, key=len))):
            alone = hf.generate(torch.tensor([prompts[i]]), max_new_tokens=max(new), do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompts[i]):]
            assert torch.equal(alone, want[i])
    for n, got, ref in zip(new, done, want.tolist()):
        assert got.tokens == ref[:n]


def test_prefill_packs_ragged_prompts_without_padding(models):
    """The linear layers of a prefill see the admitted prompts end to end (no padding rows); each request
    continues as it would alone."""
    _, path = models["qwen2"]
    model = loom.load_model(path)
    seen = []
    engine = Engine(model, max_batch=6, max_len=40)
    # The prefill runs on the model, decode steps on the engine's packed twin (the same module on a CPU
    # without the packed kernel): hook both.
    for m in {model, engine.runner.decoder}:
        m.layers["0"].attention.wq.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    prompts = ragged_prompts(6, seed=4)
    assert len(set(map(len, prompts))) > 2
    done = engine.generate(prompts, SamplingParams(max_new_tokens=3))
    assert seen == [(1, sum(map(len, prompts)), 64), (6, 1, 64), (6, 1, 64)]
    for prompt, got in zip(prompts, done):
        alone = Engine(model, max_batch=1, max_len=40).generate([prompt], SamplingParams(max_new_tokens=3))[0]
        assert alone.tokens == got.tokens
        assert max(abs(a - b) for a, b in zip(alone.logprobs, got.logprobs)) < 1e-5


def assert_equal_then_refit(engine, eager, got, prompts, params, tmp_path, device="cpu", tol=1e-5):
    """`got` (the engine's) equals the eager engine's tokens and log-probs (within `tol`); after a refit to
    other weights the engine gives a fresh eager engine's tokens on them, which differ from before."""
    assert [d.tokens for d in got] == [d.tokens for d in eager]
    assert max(abs(a - b) for x, y in zip(got, eager) for a, b in zip(x.logprobs, y.logprobs)) < tol
    path_b = tmp_path / "llama-new"
    hf_model("llama", seed=11).save_pretrained(path_b)
    new_model = loom.load_model(path_b, device=device)
    engine.refit(new_model)
    after = engine.generate(prompts, params)
    fresh = Engine(new_model, max_batch=engine.max_batch, max_len=engine.max_len).generate(prompts, params)
    assert [d.tokens for d in after] == [d.tokens for d in fresh] != [d.tokens for d in got]


def test_compiled_decode_equals_eager_and_follows_a_refit(models, tmp_path, monkeypatch):
    """compile=True: decode steps run through torch.compile in batch and key-length buckets, with idle slots
    padded in; tokens and log-probs equal the eager engine's, a handful of graphs serve every step, and a
    refit reaches the compiled graphs (they read the parameters in place)."""
    from torch._dynamo.utils import counters

    _, path = models["llama"]
    prompts = ragged_prompts(10, seed=5)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=2 + (5 * i) % 13, seed=i)
              for i in range(10)]
    eager = Engine(loom.load_model(path), max_batch=4, max_len=48).generate(prompts, params)
    monkeypatch.setattr(CompiledDecode, "KEY_BLOCK", 24)  # key-length buckets 24 and 48
    counters.clear()
    engine = Engine(loom.load_model(path), max_batch=4, max_len=48, compile=True)  # compiles every bucket now
    warm = counters["stats"]["unique_graphs"]
    # 3 batch x 2 key buckets, but batch and keys are dynamic: fewer graphs than buckets
    assert warm <= 2 and engine.stats["warmup_s"] > 0  # batch 1, and every other bucket
    sizes = []
    real = CompiledDecode.__call__
    monkeypatch.setattr(CompiledDecode, "__call__", lambda self, tokens, *rest: sizes.append(tokens.shape[0])
                        or real(self, tokens, *rest))
    got = engine.generate(prompts, params)
    assert engine.stats["compiled_steps"] == engine.stats["decode_steps"] == len(sizes) > 10
    assert counters["stats"]["unique_graphs"] == warm  # nothing compiled mid-generation
    # Each step's bucket is sized by its busy requests (moved down into freed slots), not the highest slot.
    assert engine.stats["moves"] > 0 and {1, 2, 4} <= set(sizes)
    assert_equal_then_refit(engine, eager, got, prompts, params, tmp_path)


def test_compiled_step_with_the_head_inside_equals_eager(models, monkeypatch):
    """The GPU's compiled step (`Runner._head_in_step`, forced on here with the CPU's packed twin off) computes
    the head, its argmax and log-sum-exp inside the step: no head runs after a decode step, and greedy and
    sampled tokens and log-probs equal the eager engine's (fp32, 1e-5)."""
    _, path = models["llama"]
    prompts = ragged_prompts(6, seed=3)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=6, seed=i) for i in range(6)]
    eager = Engine(loom.load_model(path), max_batch=4, max_len=48, cpu_kernel=False).generate(prompts, params)
    monkeypatch.setattr(Runner, "_head_in_step", lambda self: True)
    engine = Engine(loom.load_model(path), max_batch=4, max_len=48, compile=True, cpu_kernel=False)
    assert engine.runner.compiled.head_in_step
    heads, steps = [], []
    real_head, real_step = Runner._head_logits, CompiledDecode.__call__
    monkeypatch.setattr(Runner, "_head_logits", lambda self, h: heads.append(h.shape[0]) or real_head(self, h))
    monkeypatch.setattr(CompiledDecode, "__call__",
                        lambda self, *a: steps.append(out := real_step(self, *a)) or out)
    got = engine.generate(prompts, params)
    assert engine.stats["compiled_steps"] == len(steps) > 5
    assert len(heads) == engine.stats["prefill_steps"]  # the head ran after prefills only, never after a step
    assert [t.dtype for t in steps[-1]] == [torch.float32, torch.long, torch.float32]
    assert [d.tokens for d in got] == [d.tokens for d in eager]
    assert max(abs(a - b) for x, y in zip(got, eager) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5


def test_bf16_logits_from_the_step_pick_as_their_fp32_copy():
    """A GPU step returns the head's bf16 logits with fp32 argmax and log-sum-exp (`reduce_logits`); the pick
    (greedy and sampled tokens, their log-probs, the most likely tokens) upcasts what it reads, exactly: the
    same as picking from the logits' fp32 copy. The greedy tokens are the sampler's own copy (a CUDA graph's
    output is overwritten by its next replay)."""
    from loom.infer.sampling import Sampler, reduce_logits

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 97, generator=g) * 4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=10 * (i % 3), top_p=0.9, seed=i)
              for i in range(5)]
    picks = []
    for x in (logits, logits.float()):
        head = reduce_logits(x)
        assert head[0].dtype == x.dtype and head[2].dtype == torch.float32
        gens = [torch.Generator().manual_seed(i) for i in range(5)]
        sampler = Sampler(params, gens, 1, 97, "cpu")
        picks.append(pick(head, sampler, 0, top=3))
        assert picks[-1][0].data_ptr() != head[1].data_ptr()
    for a, b in zip(*picks):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
def test_fused_qkv_equals_three_products_and_follows_a_refit(models, kind):
    """fuse_qkv=True (the GPU's default, forced here): each layer's wq/wk/wv weights become views of one tensor
    and a decode step multiplies by it once (the three projections are never called); tokens and log-probs equal
    an unfused engine's (fp32, 1e-5); the parameters keep their identity; a refit writes the fused tensor (the
    engine then equals a fresh one on the new weights); and with gradients on the model trains through wq."""
    _, path = models[kind]
    prompts = ragged_prompts(5, seed=7)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=5, seed=i) for i in range(5)]
    want = Engine(loom.load_model(path), max_batch=4, max_len=48, cpu_kernel=False).generate(prompts, params)
    model = loom.load_model(path)
    before = [id(p) for p in model.parameters()]
    engine = Engine(model, max_batch=4, max_len=48, cpu_kernel=False, fuse_qkv=True)
    att = next(iter(model.layers.values())).attention
    assert engine.stats["fused_qkv_layers"] == len(model.layers) and [id(p) for p in model.parameters()] == before
    assert att.wq.weight.untyped_storage().data_ptr() == att.fused_qkv.untyped_storage().data_ptr()
    assert (att.fused_qkv_bias is not None) == (kind == "qwen2")
    calls = []
    for m in (att.wq, att.wk, att.wv):
        m.register_forward_hook(lambda *a: calls.append(1))
    got = engine.generate(prompts, params)
    assert not calls  # one fused product, never the three projections
    assert [d.tokens for d in got] == [d.tokens for d in want]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5
    other = loom.load_model(path)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    engine.refit(other)
    fresh = Engine(other, max_batch=4, max_len=48, cpu_kernel=False).generate(prompts, params)
    assert [d.tokens for d in engine.generate(prompts, params)] == [d.tokens for d in fresh]
    if kind == "llama":  # a compiled step traces the fused product (the tensor a static input, as parameters)
        compiled = Engine(model, max_batch=2, max_len=48, cpu_kernel=False, fuse_qkv=True, compile=True)
        assert compiled.stats["fused_qkv_layers"] == len(model.layers)
        again = compiled.generate(prompts, params)
        assert [d.tokens for d in again] == [d.tokens for d in fresh] and not calls
    model.train()
    model(torch.tensor([prompts[0]])).float().sum().backward()  # gradients on: the three products, as trained
    assert att.wq.weight.grad is not None and calls
    model.double()  # storage moved off the fused tensor: a refit refuses rather than leave steps on stale weights
    with pytest.raises(RuntimeError, match="moved off the tensor the engine fused"):
        engine.refit(other)


def test_logprobs_equal_training_forward(models):
    """Log-probs of sampled (not only argmax) tokens equal the training forward's per-token -cross-entropy."""
    _, path = models["qwen3"]
    model = loom.load_model(path)
    prompts = ragged_prompts(10, seed=1)
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=i) for i in range(10)]
    done = Engine(model, max_batch=4, max_len=40).generate(prompts, params)
    model.train()  # the training forward: the trainer's own attention path, no slab
    worst = 0.0
    for prompt, got in zip(prompts, done):
        seq = torch.tensor([prompt + got.tokens])
        logits = model(seq[:, :-1])[0, len(prompt) - 1:]
        want = -F.cross_entropy(logits.float(), seq[0, len(prompt):], reduction="none")
        worst = max(worst, (want - torch.tensor(got.logprobs)).abs().max().item())
        # at temperature 1 with every token allowed, the sampling distribution is the model's
        assert torch.allclose(torch.tensor(got.sampling_logprobs), torch.tensor(got.logprobs), atol=1e-5)
    assert worst < 1e-5
    assert min(lp for got in done for lp in got.logprobs) < -2  # not only near-certain tokens


def test_refit_equals_fresh_engine_and_keeps_the_slab(models, caplog, tmp_path):
    _, path_a = models["llama"]
    path_b = tmp_path / "llama-new"
    hf_model("llama", seed=7).save_pretrained(path_b)
    prompts = ragged_prompts(6, seed=2)
    params = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=10, seed=3)
    engine = Engine(loom.load_model(path_a), max_batch=4, max_len=40)
    before = [d.tokens for d in engine.generate(prompts, params)]
    ptrs = engine.slab.data_ptrs()
    new_model = loom.load_model(path_b)
    with caplog.at_level(logging.INFO, logger="loom.infer.engine"):
        seconds = engine.refit(new_model.state_dict())
    assert engine.slab.data_ptrs() == ptrs
    assert any("refit:" in r.getMessage() for r in caplog.records) and seconds == engine.last_refit_s > 0
    after = engine.generate(prompts, params)
    fresh = Engine(new_model, max_batch=4, max_len=40).generate(prompts, params)
    assert [d.tokens for d in after] == [d.tokens for d in fresh] != before
    assert [d.logprobs for d in after] == [d.logprobs for d in fresh]
    with pytest.raises(UserError, match="lack"):
        engine.refit({k: v for k, v in new_model.state_dict().items() if not k.startswith("layers.1.")})


def test_seed_gives_the_same_sample_alone_or_in_any_batch(models):
    _, path = models["llama"]
    model = loom.load_model(path)
    prompts = ragged_prompts(8, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=100 + i) for i in range(8)]
    batched = Engine(model, max_batch=3, max_len=40).generate(prompts, params)
    alone = Engine(model, max_batch=1, max_len=40)
    for i in (0, 5, 7):
        assert alone.generate([prompts[i]], params[i])[0].tokens == batched[i].tokens
    other = alone.generate([prompts[5]], SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=1))
    assert other[0].tokens != batched[5].tokens


def test_stop_tokens_and_context_end(models):
    _, path = models["llama"]
    engine = Engine(loom.load_model(path), max_batch=2, max_len=20)
    prompt = ragged_prompts(1, seed=4)[0][:8]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=6))[0].tokens
    stop = free[3]
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,)))[0]
    first = free.index(stop)
    assert cut.tokens == free[:first + 1] and cut.finish_reason == "stop"
    full = engine.generate([prompt], SamplingParams(max_new_tokens=50))[0]
    assert len(prompt) + len(full.tokens) == 20 and full.finish_reason == "context"
    with pytest.raises(UserError, match="1 to 19"):
        engine.generate([list(range(20))])


def test_decode_windows_read_back_once_and_track_stops_on_the_device(models, monkeypatch):
    """sync_every=8: decode steps run back to back, sampling and stop matching on the device, and the host
    reads a window back once (counted here by patching every tensor-to-Python conversion). The tokens and
    log-probs equal those of an engine that reads back after every step, with stop tokens that land inside
    windows, greedy and sampled requests, and slots refilled from a queue."""
    _, path = models["llama"]
    model = loom.load_model(path)
    prompts = ragged_prompts(12, seed=9)
    free = Engine(model, max_batch=4, max_len=48, sync_every=1).generate(prompts, SamplingParams(max_new_tokens=20))
    # each request stops at a token of its own free run: ends at different steps, inside windows
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.9, top_p=0.95, max_new_tokens=6 + (5 * i) % 15,
                             stop_token_ids=(free[i].tokens[2 + (3 * i) % 9], 7), seed=i) for i in range(12)]
    reads = {"n": 0}
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    runs = {}
    for every in (1, 8):
        engine = Engine(model, max_batch=4, max_len=48, sync_every=every)
        reads["n"] = 0
        runs[every] = (engine.generate(prompts, params), dict(engine.stats), reads["n"])
    monkeypatch.undo()
    (step, stats1, reads1), (window, stats8, reads8) = runs[1], runs[8]
    assert [d.tokens for d in window] == [d.tokens for d in step]
    assert [d.finish_reason for d in window] == [d.finish_reason for d in step]
    assert {d.finish_reason for d in window} == {"stop", "length"}
    assert max(abs(a - b) for x, y in zip(window, step) for a, b in zip(x.logprobs + x.sampling_logprobs,
                                                                        y.logprobs + y.sampling_logprobs)) < 1e-5
    assert stats1["windows"] == stats1["decode_steps"] and stats1["discarded_tokens"] == 0
    assert stats8["decode_steps"] >= 3 * stats8["windows"]
    assert stats8["discarded_tokens"] > 0  # requests that stopped inside a window decoded on until its end
    # host reads: a few per prefill (packing) and one per window, none per decode step
    assert reads8 <= 2 * stats8["prefill_steps"] + stats8["windows"] < stats8["decode_steps"]
    assert reads1 >= stats1["decode_steps"]


def test_sampling_distribution_follows_temperature_top_k_top_p():
    """The log-probability reported for each draw is that of the intended distribution, computed here
    independently; and the draws themselves follow it (1500 draws per case, within 5 standard deviations)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 2
    cases = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=5, seed=2),
             SamplingParams(temperature=1.0, top_p=0.6, seed=3)]

    def reference(row, p):
        x = logits[row] / p.temperature
        if p.top_k:
            x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
        if p.top_p < 1:
            probs = x.softmax(-1)
            keep, mass = set(), 0.0
            for i in probs.argsort(descending=True).tolist():  # smallest most-likely set reaching top_p
                if mass >= p.top_p:
                    break
                keep.add(i)
                mass += probs[i].item()
            x = torch.tensor([v if i in keep else float("-inf") for i, v in enumerate(x.tolist())])
        return x.log_softmax(-1)

    refs = torch.stack([reference(row, p) for row, p in enumerate(cases)])
    assert (refs[1] > float("-inf")).sum() == 5 and 1 < (refs[2] > float("-inf")).sum() < 40
    draws = 1500  # each case's row repeated, each copy with its own generator: one call
    rows = [row for row in range(3) for _ in range(draws)]
    gens = [torch.Generator().manual_seed(n) for n in range(len(rows))]
    tokens, lp = sample(logits[rows], [cases[row] for row in rows], gens)
    assert (lp - refs[rows].gather(1, tokens[:, None])[:, 0]).abs().max() < 1e-5
    counts = torch.zeros(3, 40).index_put_((torch.tensor(rows), tokens), torch.ones(len(rows)), accumulate=True)
    for row in range(3):
        expected = refs[row].exp() * draws
        assert counts[row][expected == 0].sum() == 0  # nothing outside top-k / top-p
        big = expected > 50
        assert ((counts[row][big] - expected[big]).abs() < 5 * expected[big].sqrt() + 5).all()
    assert torch.equal(sample(logits, [SamplingParams()] * 3, gens)[0], logits.argmax(-1))


# --- tensor parallelism -------------------------------------------------------------------------------------


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_tensor_parallel_engine_equals_one_process(models, tmp_path, compile):
    """tp=2 (heads, MLP and vocabulary split over 2 gloo ranks), refit from the new weights held FSDP-sharded
    over the same ranks: the tokens and log-probs of one process with the new weights (the old weights give
    other tokens, so the refit did reshard them)."""
    _, path = models["qwen2"]
    new_path = tmp_path / "new"
    hf_model("qwen2", seed=5).save_pretrained(new_path)
    prompts = ragged_prompts(4, seed=6)
    params = [SamplingParams(max_new_tokens=6), SamplingParams(temperature=0.9, top_k=20, max_new_tokens=6, seed=4)] * 2
    old = [d.tokens for d in Engine(loom.load_model(path), max_batch=3, max_len=40).generate(prompts, params)]
    want = Engine(loom.load_model(new_path), max_batch=3, max_len=40).generate(prompts, params)
    assert [d.tokens for d in want] != old
    for kv_local, placements, tokens, logprobs in shared_pool(2).run(generate_tp, path, new_path, prompts, params, compile):
        assert kv_local == 1  # 2 key/value heads over 2 ranks
        assert placements == {"(Shard(dim=0),)"}  # the new weights came FSDP-sharded
        assert tokens == [d.tokens for d in want]
        assert max(abs(a - b) for got, ref in zip(logprobs, want) for a, b in zip(got, ref.logprobs)) < 1e-5


# --- loom generate --input / --output ----------------------------------------------------------------------


@pytest.mark.parametrize("flags", [[], pytest.param(["--compile"], marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_generate_file_writes_contract_records_in_order(models, tmp_path, capsys, monkeypatch, flags):
    _, path = models["llama"]
    built = []
    real = CompiledDecode.bucket
    monkeypatch.setattr(CompiledDecode, "bucket", lambda self, n: built.append(n) or real(self, n))
    prompts = [" ".join(f"w{i}" for i in p) for p in ragged_prompts(7, seed=8)]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": n}) + "\n" for n, p in enumerate(prompts)) + "\n")
    out = tmp_path / "out" / "done.jsonl"
    assert main(["generate", "--checkpoint", str(path), "--input", str(src), "--output", str(out),
                 "--max-new-tokens", "6", "--max-batch", "3", *flags]) == 0
    assert "wrote 7 completions" in capsys.readouterr().out
    assert bool(built) == bool(flags)  # decode steps went through the compiled path only with --compile
    records = [json.loads(line) for line in out.read_text().splitlines()]
    want = Engine(loom.load_model(path), max_batch=2, max_len=30).generate(
        [[int(w[1:]) for w in p.split()] for p in prompts], SamplingParams(max_new_tokens=6))
    assert [r["prompt"] for r in records] == prompts
    for r, w in zip(records, want):
        assert r["tokens"] == w.tokens and len(r["logprobs"]) == 6
        assert max(abs(a - b) for a, b in zip(r["logprobs"], w.logprobs)) < 1e-5
        assert r["completion"] == " ".join(f"w{t}" for t in w.tokens) and r["finish_reason"] == "length"


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist"),
    ('{"prompt": "w1 w2"}\n{"prompt": "w3"\n', "line 2: not valid JSON"),
    ('{"prompt": "w1"}\n\n{"text": "w3"}\n', "line 3: expected a record with a string \"prompt\""),
    ('{"prompt": "w1"}\n{"prompt": 5}\n', "line 2: expected a record"),
])
def test_generate_file_bad_input_exits_2_naming_file_and_line(models, tmp_path, capsys, content, needle):
    _, path = models["llama"]
    src = tmp_path / "in.jsonl"
    if content is not None:
        src.write_text(content)
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--checkpoint", str(path), "--input", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(src) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["in.jsonl"] if content is not None else [])


@pytest.mark.parametrize("flag", ["--sync-every", "--max-batch", "--max-new-tokens", "--n"])
def test_generate_bad_counts_exit_2_naming_the_flag(models, tmp_path, capsys, flag):
    _, path = models["llama"]
    assert main(["generate", "--checkpoint", str(path), "--prompt", "w1 w2", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}=0" in err and "must be >= 1" in err, err


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_and_follows_a_refit(models, tmp_path):
    """compile=True on a GPU: decode steps replay a CUDA graph per bucket (counted as cudaGraphLaunch calls
    by torch's profiler); fp32 tokens equal the eager engine's and log-probs agree to 1e-4 (inductor's fused
    kernels round differently); a refit copies into the captured parameters in place, so the same graphs
    give a fresh engine's tokens on the new weights."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    _, path = models["llama"]
    prompts = ragged_prompts(10, seed=5)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=2 + (5 * i) % 13, seed=i)
              for i in range(10)]
    eager = Engine(loom.load_model(path, device="cuda"), max_batch=4, max_len=48).generate(prompts, params)
    counters.clear()
    engine = Engine(loom.load_model(path, device="cuda"), max_batch=4, max_len=48, compile=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        got = engine.generate(prompts, params)
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if "cudaGraphLaunch" in e.key)
    assert launches >= engine.stats["decode_steps"] > 10
    assert counters["inductor"]["cudagraph_skips"] == 0  # no graph fell back to running without CUDA graphs
    before = engine.slab.data_ptrs()
    assert_equal_then_refit(engine, eager, got, prompts, params, tmp_path, device="cuda", tol=1e-4)
    assert engine.slab.data_ptrs() == before


def cuda_layout_sdpa(monkeypatch) -> dict:
    """Make every `F.scaled_dot_product_attention` return its values in the memory layout CUDA's efficient and
    flash kernels give: [batch, seq, heads, d] in memory, seen as [batch, heads, seq, d] (not contiguous).
    Returns a counter of the calls, so that a test can check the patched path ran."""
    calls = {"n": 0}
    original = F.scaled_dot_product_attention

    def transposed(*args, **kwargs):
        calls["n"] += 1
        out = original(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", transposed)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_engine_takes_attention_outputs_in_cuda_layout(models, monkeypatch, kind):
    """fp32 with grouped-query attention on CUDA: SDPA's output is not contiguous ([b, s, h, d] in memory), and
    `KVSlab.attend` once `.view`ed it after folding query heads ("view size is not compatible", H200 run of
    2026-11-26). Here every SDPA call returns that layout on the CPU (and the CPU decode kernels are off, as on a
    GPU): prefill and decode give the same tokens and log-probs as with SDPA's own layout."""
    _, path = models[kind]
    model = loom.load_model(path)
    assert model.cfg.kv_heads < model.cfg.heads  # grouped-query attention: the folded path
    prompts = ragged_prompts(6, seed=12)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=4 + i, seed=i) for i in range(6)]
    want = Engine(model, max_batch=3, max_len=40, cpu_kernel=False).generate(prompts, params)
    calls = cuda_layout_sdpa(monkeypatch)
    got = Engine(model, max_batch=3, max_len=40, cpu_kernel=False).generate(prompts, params)
    assert calls["n"] > 0
    assert [d.tokens for d in got] == [d.tokens for d in want]
    assert [d.logprobs for d in got] == [d.logprobs for d in want]


# --- compile: auto (on on a GPU, off on a CPU), on, off --------------------------------------------------------


def test_compile_setting_auto_is_on_for_cuda_and_off_for_cpu():
    """One function decides `auto` for `loom generate`, `loom rl` and the API; on/off (and True/False) are kept;
    anything else (the removed "frozen" too) is refused naming the valid settings."""
    from loom.infer.step import resolve_compile

    assert resolve_compile("auto", "cpu") is False
    assert resolve_compile("auto", torch.device("cuda")) is True and resolve_compile("auto", "cuda:1") is True
    for device in ("cpu", "cuda"):
        assert resolve_compile("on", device) is True and resolve_compile(True, device) is True
        assert resolve_compile("off", device) is False and resolve_compile(False, device) is False
    for setting in ("fast", "frozen"):
        with pytest.raises(UserError, match=r"give False or True, or a command's setting: auto, on or off"):
            resolve_compile(setting, "cpu")


def as_if_on(monkeypatch, device: str) -> list:
    """Engines built after this resolve their compile setting as on `device` (their tensors stay on the CPU), and
    one that compiles decodes eagerly (compiling is not what the tests below check). Returns the (setting,
    device type) of each resolution."""
    from loom.infer import engine as engine_module

    seen, real = [], engine_module.resolve_compile
    monkeypatch.setattr(engine_module, "resolve_compile",
                        lambda setting, d: seen.append((setting, torch.device(d).type)) or real(setting, device))
    monkeypatch.setattr(Runner, "_compile", lambda self, *args: None)
    return seen


@pytest.mark.parametrize("flags,device,setting,want", [
    ([], "cpu", "auto", False), ([], "cuda", "auto", True), (["--compile"], "cpu", "on", True),
    (["--compile", "off"], "cuda", "off", False), (["--compile", "on"], "cpu", "on", True)])
def test_generate_compiles_by_default_on_a_gpu_only(models, tmp_path, monkeypatch, flags, device, setting, want):
    _, path = models["llama"]
    seen = as_if_on(monkeypatch, device)
    modes = []
    monkeypatch.setattr(Engine, "generate", lambda self, *a, f=Engine.generate, **k: modes.append(self.compile_mode)
                        or f(self, *a, **k))
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "w1 w2"}\n{"prompt": "w3"}\n')
    for mode in (["--prompt", "w1 w2"], ["--input", str(src), "--output", str(tmp_path / "out.jsonl")]):
        assert main(["generate", "--checkpoint", str(path), *mode, "--max-new-tokens", "2", *flags]) == 0
    assert seen == [(setting, "cpu")] * 2 and modes == [want] * 2  # prompt mode and batch mode


def test_generate_bad_compile_setting_exits_2_naming_the_choices(models, capsys):
    _, path = models["llama"]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--checkpoint", str(path), "--prompt", "w1", "--compile", "fast"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--compile" in err and "'auto', 'on', 'off')" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA device")
def test_generate_on_cuda_without_a_gpu_exits_2(models, capsys):
    _, path = models["llama"]
    assert main(["generate", "--checkpoint", str(path), "--prompt", "w1", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "valid here: auto, cpu" in err, err


@pytest.mark.parametrize("override,device,want", [
    (None, "cpu", False), (None, "cuda", True), ("off", "cuda", False), ("on", "cpu", True), ("true", "cpu", True)])
def test_rl_engine_compiles_by_default_on_a_gpu_only(monkeypatch, override, device, want):
    from loom.config import load_config
    from loom.models.llama import build_model
    from loom.post.rl.rollouts import rollout_engine

    small = ["model.layers=1", "model.hidden=32", "model.heads=2", "model.kv_heads=1", "model.ffn_hidden=64",
             "model.vocab_size=64", "model.max_seq_len=32", "train.seq_len=16", "rl.engine_batch=4"]
    cfg = load_config("tiny-grpo", small + ([f"rl.engine_compile={override}"] if override else []))
    cfg.validate()
    assert cfg.rl.engine_compile == {None: "auto", "true": "on"}.get(override, override)
    seen = as_if_on(monkeypatch, device)
    engine = rollout_engine(cfg, build_model(cfg.model, seed=0))
    assert seen == [(cfg.rl.engine_compile, "cpu")] and engine.compile_mode is want


@pytest.mark.gpu
def test_eager_decode_windows_do_not_synchronise_on_cuda(models):
    """compile="off" on a GPU: inside a decode window nothing waits for the device (CUDA's sync debug mode raises
    on a read-back or a synchronous copy), its inputs go up without waiting, and only the postprocess's read-back
    (`emit`) after the window's run (`Runner.decode`) synchronises; fp32 GQA, greedy and sampled requests with stop
    tokens, the same tokens as the same engine without the debug mode."""
    _, path = models["llama"]
    engine = Engine(loom.load_model(path, device="cuda"), max_batch=4, max_len=48, compile="off")
    prompts = ragged_prompts(8, seed=13)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.9, max_new_tokens=3 + 2 * i,
                             stop_token_ids=(7,), seed=i) for i in range(8)]
    want = engine.generate(prompts, params)
    real_decode = engine.runner.decode

    def decode(rows, seqs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_decode(rows, seqs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    engine.runner.decode = decode
    got = engine.generate(prompts, params)
    assert engine.stats["decode_steps"] > 8
    assert [d.tokens for d in got] == [d.tokens for d in want]
