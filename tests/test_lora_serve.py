"""Adapters per request (loom/infer/adapters.py, `loom serve --lora NAME=PATH`): requests of two PEFT adapters
and of the base, decoded in one batch on one base model, give the tokens and log-probs (fp32, 5e-5: `close`) of
each merged model served alone; `/v1/models` lists them; an unknown name gets 400 naming what is served;
bad --lora arguments exit 2."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
safetensors = pytest.importorskip("safetensors")

from loom.infer.engine import Engine  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402

PROMPTS = ["the quick brown fox", "say ok 3", "jumps over the lazy dog", "ok"]
TARGETS = {"a": ("attention.wq", "attention.wo", "mlp.w2"), "b": ("attention.wk", "attention.wv", "mlp.w1")}


def write_peft(path, base, targets, rank, seed):
    """A PEFT LoRA adapter directory on `base` with random A and B on `targets` of every layer."""
    from safetensors.torch import save_file

    from loom import load_model
    from loom.interop.hf_names import loom_to_hf_name

    model = load_model(str(base))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        if name.endswith(".weight") and name.removesuffix(".weight").split(".", 2)[-1] in targets:
            hf = loom_to_hf_name(name).removesuffix(".weight")
            tensors[f"base_model.model.{hf}.lora_A.weight"] = torch.randn(rank, p.shape[1], generator=g) * 0.3
            tensors[f"base_model.model.{hf}.lora_B.weight"] = torch.randn(p.shape[0], rank, generator=g) * 0.3
    assert tensors
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "base_model_name_or_path": str(base),
        "target_modules": sorted({k.split(".")[-3] for k in tensors})}))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from test_serve import model_dir

    root = tmp_path_factory.mktemp("lora-serve")
    base = model_dir(root / "tiny")
    return base, {"a": str(write_peft(root / "a", base, TARGETS["a"], 4, 1)),
                  "b": str(write_peft(root / "b", base, TARGETS["b"], 2, 2))}


def close(got, want) -> bool:
    """Log-probs equal to 5e-5 (fp32): the base model alone, batched 1 or 12 requests, differs by up to 1.0e-5
    on this sharp random model (the products' rounding depends on the batch); the adapters move them by > 1e-3."""
    return len(got) == len(want) and all(abs(a - b) <= 5e-5 for a, b in zip(got, want))


def merged_outputs(path, prompts, params):
    """Greedy tokens and log-probs of the merged model at `path` (a PEFT directory: `loom.load_model` merges it;
    or the base), each request alone on its own engine."""
    from loom import load_model

    engine = Engine(load_model(path), max_batch=1, max_len=96, sync_every=4)
    return [engine.generate([p], params)[0] for p in prompts]


def test_requests_of_different_adapters_batched_equal_each_merged_model(adapters):
    from test_serve import Server

    from loom.data.tokenizer import Tokenizer
    from loom.serve import load
    from loom.serve.protocol import Limits

    base, loras = adapters
    server = Server(load(str(base), max_batch=16, sync_every=4, limits=Limits(max_tokens=64, max_n=4), loras=loras))
    try:
        models = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        assert models == ["tiny", "a", "b"]
        names = ["tiny", "a", "b"]
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

        async def one(model, prompt):
            r = await client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=0)
            assert r.model == model
            return r.choices[0]

        async def run():
            jobs = [one(m, p) for p in PROMPTS for m in names]
            return await asyncio.gather(*jobs)

        before = server.metrics()
        got = asyncio.run(run())
        after = server.metrics()
        rows = after["loom_decode_rows_total"] - before["loom_decode_rows_total"]
        steps = after["loom_decode_steps_total"] - before["loom_decode_steps_total"]
        assert rows / steps > 3  # requests of the three models shared decode steps
        unknown = httpx.post(server.url + "/v1/completions", json={"model": "c", "prompt": "a", "max_tokens": 2})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "model_not_found"
        assert "'tiny', 'a', 'b'" in unknown.json()["error"]["message"]
    finally:
        server.close()
    tok = Tokenizer.from_file(base / "tokenizer.json")
    params = SamplingParams(max_new_tokens=10, stop_token_ids=server.served.stop_ids)
    ids = [tok.encode(p) for p in PROMPTS]
    want = {m: merged_outputs(str(base) if m == "tiny" else loras[m], ids, params) for m in names}
    for i, choice in enumerate(got):
        w = want[names[i % 3]][i // 3]
        assert choice.token_ids == w.tokens, (names[i % 3], PROMPTS[i // 3])
        assert close(choice.logprobs.token_logprobs, w.logprobs), (choice.logprobs.token_logprobs, w.logprobs)
    # the adapters change what the model says (else the equality above proves nothing)
    assert want["a"][0].tokens != want["tiny"][0].tokens or want["a"][0].logprobs != want["tiny"][0].logprobs
    assert all(abs(x - y) > 1e-3 for x, y in zip(want["a"][0].logprobs, want["b"][0].logprobs))


def test_an_engine_mixes_adapters_and_base_in_one_prefill_and_window(adapters):
    """Engine level: one packed prefill and decode windows holding base, a, b and a again; each request's tokens
    equal its merged model's."""
    from loom import load_model
    from loom.data.tokenizer import Tokenizer
    from loom.infer.adapters import attach_adapters

    base, loras = adapters
    tok = Tokenizer.from_file(base / "tokenizer.json")
    model = load_model(str(base))
    rows = attach_adapters(model, loras)
    engine = Engine(model, max_batch=8, max_len=96, sync_every=3, adapters=rows)
    params = SamplingParams(max_new_tokens=8)
    ids = [tok.encode(p) for p in PROMPTS]
    order = [None, "a", "b", "a"]
    requests = [engine.submit(p, params, adapter=m) for p, m in zip(ids, order)]
    while not all(r.done for r in requests):
        engine.step()
    assert engine.stats["prefill_steps"] == 1
    for r, p, m in zip(requests, ids, order):
        want = merged_outputs(str(base) if m is None else loras[m], [p], params)[0]
        assert r.out.tokens == want.tokens
        assert close(r.out.logprobs, want.logprobs), (r.out.logprobs, want.logprobs)
    with pytest.raises(Exception, match="no adapter 'c'; this engine has a, b"):
        engine.submit(ids[0], params, adapter="c")


def test_bad_lora_arguments_exit_2(adapters, tmp_path):
    from conftest import run_main

    base, loras = adapters
    for argv, message in [
        (["--lora", "a"], "must be NAME=PATH"),
        (["--lora", f"tiny={loras['a']}"], "already taken (by the base model)"),
        (["--lora", f"a={loras['a']}", "--lora", f"a={loras['b']}"], "already taken (by another --lora)"),
        (["--lora", f"a={tmp_path / 'nope'}"], "is not a directory"),
        (["--lora", f"a={loras['a']}", "--kv", "paged"], "leave out --nproc, --kv paged and --compile on"),
        (["--lora", f"a={tmp_path}"], "not a PEFT adapter directory"),
    ]:
        r = run_main("serve", "--model", str(base), "--port", "0", *argv)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
