"""CPU generation throughput: loom's engine vs transformers' `generate`, same model, same prompts.

The model is a Llama built here with random weights (no download): hidden 384, 6 layers, 6 heads, 2 key/value
heads, MLP 1024, vocabulary 16000, untied (about 22M parameters), fp32, saved once and loaded by both. Each batch
size B (1, 16, 64) gets B ragged prompts (16 to 64 tokens) and greedy decoding of a fixed number of new
tokens with no stop token, so both produce exactly B x new tokens: tokens/s = B x new / wall time of the
whole call (prefill included). transformers runs the way a user batches it: left-padded prompts with their
attention mask, `do_sample=False`, SDPA attention. loom's engine gets max_batch = B and the prompts as they
are, three times: eager and with `compile=True` (decode steps through torch.compile, batch and key length in
buckets), each with the CPU decode path (loom/infer/cpu: packed small-batch products and decode attention),
and `compile=True` without it (`loom_compiled_aten`: F.linear and SDPA); since run 9 also eager on paged keys
and values (`loom_paged`: `Engine(paged=True)`, attention through the paged CPU kernel that reads each
request's own blocks; `loom_paged_gather`: the blocks gathered densely for the slab's decode kernel); on a
CPU with AVX-512, `--modes ...,avx2` adds eager with the packed products through the AVX2 tile (`loom_avx2`:
the A/B against the AVX-512 tile that `loom` runs there; `packed_products_avx2` beside `packed_products`).
`--modes` picks the engines beside the eager one. Results up to run 8 also measured
`compile="frozen"` (weights frozen into the compiled step), since removed. Each engine is built once per batch
size and reused across rounds, as a server or an RL loop keeps its engine; building a compiled engine and its
first generation (which compile) are timed apart and reported as `engine_build_and_first_generation_s`. Rounds
rotate which goes first; each figure is total tokens over total time, and the JSON keeps every round, the load
average before and after (the ratio is only as good as the machine was quiet), and the fraction of sequences
whose greedy tokens agree. On a shared machine wall time swings with the load, so tokens per CPU-second of
this process (`time.process_time`) are reported beside it.

One more row, "ragged": batch 16 where request i wants its own number of new tokens (8 to 64), as when
sequences stop at different points. transformers decodes the batch until its longest request is done and
the caller cuts each row; loom's engine stops each request at its own length and refills its slot. Both
count only the tokens the requests asked for.

At batch 16 the JSON's `decode_step_ms` splits out one decode step (prefill and first token taken out)
for each contestant, beside the time of the weight products alone (every linear layer in layer order on
`batch` rows, each weight read from memory once as a step reads it), through ATen's `F.linear`
(`weight_products_floor`: no engine whose products go through that GEMM library can be more than
`transformers_over_floor` times faster than transformers here) and through the packed kernel
(`packed_products`).

    .venv/bin/python bench/generate_cpu.py [--rounds 2] [--new 64] [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import loom  # noqa: E402
from loom.infer.cpu.kernels import available as cpu_kernels_available  # noqa: E402
from loom.infer.cpu.kernels import product_isa as kernel_product_isa  # noqa: E402
from loom.infer.engine import Engine  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.provenance import stamp  # noqa: E402

MAX_NEW = 64  # room the engines leave for new tokens (set from --new)
SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=1024, vocab_size=16000, max_position_embeddings=256, tie_word_embeddings=False)


def build(path: Path):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE)
    config._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # larger than the default init so the greedy choice is not a near-tie everywhere
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    hf.save_pretrained(path)
    return hf


def prompts_for(batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE["vocab_size"], (int(n),), generator=g).tolist()
            for n in torch.randint(16, 65, (batch,), generator=g)]


@torch.no_grad()
def run_hf(hf, prompts, new) -> tuple[float, float, list[list[int]]]:
    """new: one count for all, or one per prompt (the batch decodes to the largest, each row is cut)."""
    news = new if isinstance(new, list) else [new] * len(prompts)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start, cpu = time.perf_counter(), time.process_time()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news), do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start, time.process_time() - cpu, [row[:n] for row, n in zip(out[:, width:].tolist(), news)]


ENGINES: dict = {}


def product_isa(use: str | None = None) -> str | None:
    """The packed product's vector path ("avx512" / "avx2"; `use` switches it), None without the kernels."""
    return kernel_product_isa(use) if cpu_kernels_available() else None


def engine_for(model, batch: int, compile: bool | str) -> Engine:
    """One engine per batch size and mode, kept across rounds as a server or an RL loop keeps it (a compiled
    engine would otherwise recompile). Slots 0..batch-1, room for the longest prompt and completion."""
    key = (batch, compile)
    if key not in ENGINES:
        aten, paged = compile == "aten", compile in ("paged", "paged_gather")
        read = "gather" if compile == "paged_gather" else "split"
        ENGINES[key] = Engine(model, max_batch=batch, max_len=64 + MAX_NEW, compile=compile is True or aten,
                              cpu_kernel=not aten, paged=paged, paged_read=read)
    return ENGINES[key]


def run_loom(model, prompts, new, compile: bool | str = False) -> tuple[float, float, list[list[int]]]:
    """compile: False, True, "aten" (compile=True without the CPU kernels), "paged" (eager, paged keys and
    values read block by block: `split_kv_decode`), "paged_gather" (eager, paged, the blocks gathered densely
    for the CPU decode attention kernel) or "avx2" (eager, the packed products through the AVX2 tile on a CPU
    whose default is the AVX-512 one: the A/B of the two in one process)."""
    news = new if isinstance(new, list) else [new] * len(prompts)
    engine = engine_for(model, len(prompts), compile)
    isa = product_isa()
    if compile == "avx2":
        product_isa("avx2")
    try:
        start, cpu = time.perf_counter(), time.process_time()
        done = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in news])
        return time.perf_counter() - start, time.process_time() - cpu, [d.tokens for d in done]
    finally:
        product_isa(isa)


@torch.no_grad()
def gemm_floor_ms(model, batch: int, reps: int = 5, packed: bool = False) -> float:
    """Milliseconds per decode step spent in the weight products alone: every linear layer of the model on
    `batch` rows, in layer order (each weight read from memory once per step, as a decode step reads it),
    then the LM head, as the engine's CPU decode path computes them without the kernels, or with `packed`
    every product through the packed kernel. Median of `reps` passes after one warm-up."""
    from loom.infer.cpu import cpu_decode
    from loom.infer.cpu.kernels import PackedLinear

    path = cpu_decode(model, use_kernels=packed)
    linears = [m for name, m in path.decoder.named_modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear)) and name != "output"]
    features = [m.source[0].in_features if isinstance(m, PackedLinear) else m.in_features for m in linears]
    inputs = {k: torch.randn(batch, k) for k in features}
    xs = [inputs[k] for k in features]
    hidden = torch.randn(batch, model.cfg.hidden)

    def one_step():
        for m, x in zip(linears, xs):
            m(x)
        path.head_logits(hidden)  # a packed head runs through its kernel there

    one_step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def decode_steps(runners, model, batch: int, new: int, rounds: int) -> dict:
    """Milliseconds per decode step for each contestant at `batch`: (time for `new` tokens - time for 1 token)
    / (new - 1), i.e. with the prefill and the first token taken out, medians over `rounds`; beside them the
    weight products' floor (`gemm_floor_ms`) and the ratio transformers / floor, the most any engine that
    reads every weight in these products once per step could gain over transformers here."""
    prompts = prompts_for(batch, batch)
    out = {}
    for name, run in runners.items():
        per = []
        for _ in range(rounds):
            one, _, _ = run(prompts, 1)
            full, _, _ = run(prompts, new)
            per.append((full - one) / (new - 1) * 1e3)
        out[name] = round(sorted(per)[rounds // 2], 2)
    out["weight_products_floor"] = round(gemm_floor_ms(model, batch), 2)
    out["transformers_over_floor"] = round(out["transformers"] / out["weight_products_floor"], 2)
    if cpu_kernels_available():
        out["packed_products"] = round(gemm_floor_ms(model, batch, packed=True), 2)
        if product_isa() == "avx512":  # and through the AVX2 tile, as a CPU without AVX-512 runs them
            product_isa("avx2")
            try:
                out["packed_products_avx2"] = round(gemm_floor_ms(model, batch, packed=True), 2)
            finally:
                product_isa("avx512")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--modes", default="compiled,compiled_aten,paged,paged_gather",
                        help="loom engines beside the eager one (loom): compiled, compiled_aten, paged, paged_gather, "
                             "avx2 (eager with the AVX2 product tile where AVX-512 is the default)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "generate_cpu.json"))
    args = parser.parse_args()
    global MAX_NEW
    MAX_NEW = max(args.new, 64)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        hf = build(Path(tmp))
        model = loom.load_model(tmp)
    params = sum(p.numel() for p in model.parameters())
    run_hf(hf, prompts_for(2, 99), 4)  # warm both up
    run_loom(model, prompts_for(2, 99), 4)
    modes = {"loom": False, "loom_compiled": True, "loom_compiled_aten": "aten", "loom_paged": "paged",
             "loom_paged_gather": "paged_gather", "loom_avx2": "avx2"}
    modes = {name: mode for name, mode in modes.items() if name[5:] in args.modes.split(",") or name == "loom"}
    names = [*modes, "transformers"]
    runners = {name: (lambda p, n, mode=mode: run_loom(model, p, n, mode)) for name, mode in modes.items()}
    runners["transformers"] = lambda p, n: run_hf(hf, p, n)
    rows, compile_s = [], {}
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(b, b, args.new) for b in batches]
    cases.append(("ragged", 16, [8 + (56 * i) // 15 for i in range(16)]))
    for label, batch, new in cases:
        prompts = prompts_for(batch, batch)
        for mode in [m for m in (True, "aten") if m in modes.values()]:  # building a compiled engine compiles
            if (batch, mode) not in ENGINES:
                start = time.perf_counter()
                run_loom(model, prompts, MAX_NEW, mode)
                compile_s.setdefault({True: "compiled", "aten": "compiled_aten"}[mode], {})[batch] = \
                    round(time.perf_counter() - start, 1)
        seconds = {name: [] for name in names}
        cpu = {name: [] for name in names}
        agree = {}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # each goes first in turn
            outs = {}
            for name in order:
                t, c, outs[name] = runners[name](prompts, new)
                seconds[name].append(round(t, 3))
                cpu[name].append(round(c, 3))
            for name in modes:
                agree[name] = sum(a == b for a, b in zip(outs[name], outs["transformers"])) / batch
        tokens = (sum(new) if isinstance(new, list) else batch * new) * args.rounds
        row = {"batch": label, "new_tokens": new, "prompt_tokens_first_8": [len(p) for p in prompts][:8]}
        for name in names:
            row[f"{name}_tokens_per_s"] = round(tokens / sum(seconds[name]), 1)
            row[f"{name}_tokens_per_cpu_s"] = round(tokens / sum(cpu[name]), 1)
        row.update(seconds=seconds, cpu_seconds=cpu, greedy_sequences_equal=agree)
        for name in modes:
            suffix = name[4:]
            row["ratio" + suffix] = round(row[f"{name}_tokens_per_s"] / row["transformers_tokens_per_s"], 2)
            row["cpu_ratio" + suffix] = round(row[f"{name}_tokens_per_cpu_s"] / row["transformers_tokens_per_cpu_s"], 2)
        rows.append(row)
        print(f"batch {label!s:>6}: " + ", ".join(f"{n} {row[f'{n}_tokens_per_s']:7.1f} tok/s" for n in names)
              + "; ratios " + ", ".join(f"{n[5:] or 'eager'} {row['ratio' + n[4:]]:.2f} (per cpu-s "
                                        f"{row['cpu_ratio' + n[4:]]:.2f})" for n in modes)
              + f"; greedy equal {agree}", flush=True)
    steps = {b: decode_steps(runners, model, b, args.new, args.rounds) for b in (16,) if b in batches}
    for b, row in steps.items():
        print(f"decode step at batch {b} (ms): {row}", flush=True)
    import transformers

    kernels = {"available": cpu_kernels_available(), "packed_linears": ENGINES[(batches[0], False)].stats["packed_linears"],
               "decode_attention": ENGINES[(batches[0], False)].slab.decode_kernel is not None,
               "product_isa": product_isa()}
    result = {"benchmark": "generate_cpu", "model": dict(SHAPE, parameters=params), "dtype": "float32",
              "cpu_kernels": kernels,
              "rows": rows, "engine_build_and_first_generation_s": compile_s,
              "decode_step_ms": steps, "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
              "transformers": transformers.__version__,
              **stamp("python bench/generate_cpu.py " + " ".join(sys.argv[1:]))}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
