"""The automatic prefix cache of the paged engine (loom/infer/prefix_cache.py): requests whose prompts start with
blocks an earlier request wrote skip prefilling them and give the tokens and log-probs an engine without the cache
gives (greedy and seeded sampling, fp32); a conversation's next turn finds its earlier completion's blocks; a
small pool evicts cached blocks and stays correct; every reference goes back; new weights empty the cache."""

from __future__ import annotations

import random

import pytest
import torch

from loom.config import ModelConfig
from loom.infer.blocks import BlockPool
from loom.infer.engine import Engine
from loom.infer.prefix_cache import PrefixCache
from loom.infer.sampling import SamplingParams
from loom.models.llama import Transformer

VOCAB, BLOCK = 97, 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=VOCAB, hidden=48, layers=2, heads=4, kv_heads=2, ffn_hidden=96,
                                   max_seq_len=128)).eval()


def returned(engine) -> bool:
    """Every block back but those the cache holds alone (one reference each), and none once it lets go."""
    pool, cache = engine.slab.pool, engine.slab.cache
    held = list(cache.blocks.values())
    ok = pool.promised == 0 and pool.in_use() == len(held) and all(pool.refs[b] == 1 for b in held)
    cache.clear()
    return ok and pool.in_use() == 0 and not any(pool.refs)


def same(got, want, tol=1e-5):
    assert [c.tokens for c in got] == [c.tokens for c in want]
    for a, b in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a.logprobs + a.sampling_logprobs, b.logprobs + b.sampling_logprobs)) < tol


def waves(seed=0):
    """Two waves of prompts: a shared 37-token system prompt (4 whole blocks of 8, then 5 tokens) and ragged
    questions; the second wave asks other questions and repeats one prompt of the first."""
    g = random.Random(seed)
    system = [g.randrange(VOCAB) for _ in range(37)]
    ask = [[g.randrange(VOCAB) for _ in range(g.randrange(1, 14))] for _ in range(9)]
    return [system + q for q in ask[:5]], [system + q for q in ask[5:]] + [system + ask[0]]


def params(n, offset=0):
    """Greedy and seeded sampling; every sampled request with top-k 20 (a batch's sampler sorts its rows when any
    has top-k or top-p, and a sorted row picks another token for the same uniform: same law, other draw)."""
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=20, max_new_tokens=3 + i % 7, seed=offset + i)
            for i in range(n)]


def test_cached_prefix_is_not_prefilled_and_changes_nothing(model):
    """Wave 2 finds the system prompt's 4 whole blocks (the first wave cached them) and prefills only the rest,
    counted token by token; tokens and log-probs equal an engine without the cache (test_paged_kv: which equals
    the slab engine)."""
    first, second = waves()
    cached = Engine(model, max_batch=4, max_len=96, paged=True, block_size=BLOCK)
    plain = Engine(model, max_batch=4, max_len=96, paged=True, block_size=BLOCK, prefix_cache=False)
    for wave, p in ((first, params(len(first))), (second, params(len(second), 10))):
        before = dict(cached.stats)
        got = cached.generate(wave, p)
        same(got, plain.generate(wave, p))
        hits = cached.stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        prefilled = cached.stats["prefilled_tokens"] - before["prefilled_tokens"]
        assert prefilled == sum(map(len, wave)) - hits
        assert cached.stats["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"] == sum(map(len, wave))
    # wave 1: the first request writes the system prompt's 4 blocks as the round's others are admitted (they read
    # its blocks in the same packed prefill); wave 2: every request finds them (the repeated one, its own too)
    assert plain.stats["prefix_cache_hit_tokens"] == 0
    assert hits >= len(second) * 32
    assert returned(cached)


def test_next_turn_finds_the_earlier_completion(model):
    """Turn 2's prompt is turn 1's prompt + completion + a new message: the whole blocks of turn 1's completion
    (cached when it ended; its last token never written) are found too, and the turn equals the uncached one."""
    g = random.Random(5)
    turn1 = [g.randrange(VOCAB) for _ in range(21)]
    p = SamplingParams(temperature=0.7, max_new_tokens=30, seed=3)
    engine = Engine(model, max_batch=2, max_len=96, paged=True, block_size=BLOCK)
    plain = Engine(model, max_batch=2, max_len=96, paged=True, block_size=BLOCK, prefix_cache=False)
    out1 = engine.generate([turn1], p)[0]
    turn2 = turn1 + out1.tokens + [g.randrange(VOCAB) for _ in range(6)]
    hits = engine.stats["prefix_cache_hit_tokens"]
    same(engine.generate([turn2], p), plain.generate([turn2], p))
    written = len(turn1) + len(out1.tokens) - 1  # positions turn 1 wrote
    assert engine.stats["prefix_cache_hit_tokens"] - hits == written // BLOCK * BLOCK > len(turn1)
    assert returned(engine)


def test_small_pool_evicts_least_recently_used_and_stays_correct(model):
    """A pool of 10 blocks (80 positions) and 18 requests with 3 system prompts: cached blocks are evicted to
    admit requests, least recently used first, the tokens equal the uncached engine's, and references return."""
    g = random.Random(7)
    systems = [[g.randrange(VOCAB) for _ in range(17)] for _ in range(3)]
    prompts = [systems[g.randrange(3)] + [g.randrange(VOCAB) for _ in range(g.randrange(1, 9))] for _ in range(18)]
    p = params(18)
    engine = Engine(model, max_batch=3, max_len=64, paged=True, block_size=BLOCK, kv_tokens=80)
    plain = Engine(model, max_batch=3, max_len=64, paged=True, block_size=BLOCK, kv_tokens=80, prefix_cache=False)
    got = []
    for i in range(0, 18, 3):  # a server's stream: a few at a time
        got += engine.generate(prompts[i:i + 3], p[i:i + 3])
    same(got, plain.generate(prompts, p))
    assert engine.stats["prefix_cache_evicted_blocks"] > 0 and engine.stats["prefix_cache_hit_tokens"] > 0
    assert returned(engine)


def test_lru_order_and_chain():
    """The hash chain finds a block only after the blocks before it; eviction takes the least recently used block
    only the cache holds, a chain's tail before its head."""
    pool = BlockPool(8)
    cache = PrefixCache(pool, 2)
    a = [pool.take() for _ in range(3)]
    cache.insert([1, 2, 3, 4, 5, 6], a)
    b = [pool.take() for _ in range(2)]
    cache.insert([9, 9, 3, 4], b)  # the same second block's tokens after another first block: another digest
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == a and cache.match([9, 9, 3, 4, 0]) == b
    assert cache.match([1, 2, 3, 4, 5, 6]) == a[:2] and cache.match([2, 2, 3, 4, 5]) == []
    for t in a + b:  # the requests end: only the cache holds them
        pool.drop(t)
    assert cache.evictable() == 5
    cache.match([1, 2, 3, 4, 5, 6, 7])  # `a` used last
    assert cache.evict(1) == 1 and cache.match([9, 9, 3, 4, 0]) == b[:1]  # b's tail went first
    pool.share(b[0])  # a request lists it: not evictable
    assert cache.evict(10) == 3 and cache.match([1, 2, 3, 4, 5, 6, 7]) == [] and list(cache.blocks.values()) == [b[0]]
    pool.drop(b[0])
    cache.clear()
    assert pool.in_use() == 0


def test_refit_empties_the_cache(model):
    """New weights make cached keys stale: after a refit the same prompt finds nothing and equals a fresh engine
    on the new weights."""
    g = random.Random(2)
    prompt = [g.randrange(VOCAB) for _ in range(30)]
    engine = Engine(model, max_batch=2, max_len=64, paged=True, block_size=BLOCK)
    engine.generate([prompt], SamplingParams(max_new_tokens=2))
    torch.manual_seed(1)
    other = Transformer(model.cfg).eval()
    engine.refit(other)
    hits = engine.stats["prefix_cache_hit_tokens"]
    got = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    assert engine.stats["prefix_cache_hit_tokens"] == hits
    same(got, Engine(other, max_batch=2, max_len=64).generate([prompt], SamplingParams(max_new_tokens=4)))
    engine.refit(model)  # the module's model keeps its weights for the other tests


def test_serve_reports_prefix_cache_hits(tmp_path):
    """`loom serve --kv paged`: a second chat request with the same long system message finds its blocks, counted
    by /metrics (`loom_prefix_cache_hit_tokens_total`), and answers what a server with --no-prefix-cache answers."""
    from test_serve import Server, model_dir

    from loom.cli import build_parser
    from loom.serve import load
    from loom.serve.protocol import Limits

    tiny = model_dir(tmp_path / "tiny")
    system = {"role": "system", "content": "you are a terse helper who answers in one word"}
    asks = [[system, {"role": "user", "content": q}] for q in ("hi", "name a colour")]
    answers = {}
    for cache in (True, False):
        server = Server(load(str(tiny), max_batch=2, paged=True, prefix_cache=cache, limits=Limits(max_tokens=8)))
        try:
            answers[cache] = [server.client.chat.completions.create(model="tiny", messages=m, max_tokens=6,
                                                                    temperature=0).choices[0].message.content
                              for m in asks]
            metrics = server.metrics()
        finally:
            server.close()
        hits, queried = metrics["loom_prefix_cache_hit_tokens_total"], metrics["loom_prefix_cache_queried_tokens_total"]
        assert (hits >= 16 and queried > hits) if cache else (hits == 0 and queried == 0)
    assert answers[True] == answers[False]
    assert build_parser().parse_args(["serve", "--model", "m", "--kv", "paged", "--no-prefix-cache"]).prefix_cache is False
