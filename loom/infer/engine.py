"""The generation engine: continuous batching over a preallocated key/value slab, per-request sampling that
returns per-token log-probabilities, and in-place weight refit. RL drives it from Python; `loom generate`
from the command line.

    engine = Engine(model, max_batch=16, max_len=512)
    done = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, max_new_tokens=64, seed=1))
    done[0].tokens, done[0].logprobs            # generated ids; log p(token | prefix) at temperature 1
    engine.refit(trainer_model)                 # new weights, same slab

The parts, one file each: key/value storage (`kv.KVSlab`, or with `paged=True` `paged.PagedKV`: blocks from a
pool, `blocks.BlockPool`, shared prompts, attention that reads each request's own blocks), sampling
(`sampling.Sampler`), the compiled decode step (`step.CompiledDecode`), the CPU decode path (`cpu.cpu_decode`,
None on a GPU), refit (`refit.copy_weights`); and the round's three stages: the requests (`request.Request`,
`Completion`, `Update`), their schedule (`scheduler.Scheduler`), the model's run (`runner.Runner`) and the
postprocess (`postprocess.emit`). Here: the engine that builds them and drives a round.

Step-wise: `submit(prompt, params)` queues a request (checked at once) and returns its `Request`; each `step()`
is one round and returns an `Update` per request that gained tokens or finished; `cancel(request)` gives its
slot back. `generate` submits its prompts and steps until they finish; a server submits as requests arrive, so
requests that arrive at different times share decode steps. One thread drives an engine.

Each round (`step`) reads schedule -> run -> postprocess. Schedule (`Scheduler`): waiting prompts take free
slots (a request owns a slot from its prefill to its last token, moved down, keys and values with it, when
lower slots free up and nothing waits: `Scheduler.active`). Run (`Runner`): the admitted prompts prefill as
one packed row (ragged prompts end to end, so the linear layers see no padding; only attention spreads them
out per slot), then every busy slot decodes a window of up to `sync_every` tokens, back to back on the device
(`Runner.decode`). Postprocess: the window's tokens come back in one copy (`emit`) and a slot freed by a
finished request is refilled by the next waiting prompt (continuous batching). The model needs no engine code
beyond calling `cache.attend`.

Log-probabilities. `Completion.logprobs[i]` is log-softmax of the model's unmodified logits (temperature 1,
no top-k/top-p) at generated token i: the quantity a trainer's forward computes, which RL losses need.
`Completion.sampling_logprobs[i]` is the log-probability under the distribution the token was actually
drawn from (after temperature, top-k and top-p; 0.0 for greedy), for importance weights.

Tensor parallelism: pass a model sharded by `loom.parallel.tensor.apply_tensor_parallel` (every rank runs
the same engine loop on the same requests: the same submits, in the same order, between the same steps); the
slab holds this rank's key/value heads and the logits are gathered before sampling, so every rank samples the
same tokens.

Host reads. Within a decode window nothing comes back to the host: sampling (`Sampler`, with every
request's uniforms drawn up front from its own generator) and stop-token matching run on the device,
positions advance by one per step without being read, and the window's tokens and log-probs come back in
one copy at its end. A window ends early when some request reaches max_new_tokens or max_len, so those
slots are refilled at once; a request that hits a stop token inside a window decodes on (in its own slot)
until the window ends and its extra tokens are dropped (`stats["discarded_tokens"]`). `sync_every=1` reads
back after every step. Stop strings (`SamplingParams.stop`, text) are matched on the host: a request that has
them has its completion decoded (`decode`) after each window and is cut at the token that completes one.

GPU: `compile=True` decodes through CUDA graphs per bucket (`loom generate` and `loom rl` compile by default
on a GPU: `resolve_compile`). An eager step's time on a GPU is the host's, dispatching op after op: per layer
it does only what differs between layers (`KVSlab`), and it uploads its inputs without waiting for the device.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from loom.errors import UserError
from loom.infer.cpu import cpu_decode
from loom.infer.fuse import check_fused
from loom.infer.fuse import fuse_qkv as fuse_qkv_layers
from loom.infer.kv import KVSlab
from loom.infer.paged import PagedKV
from loom.infer.postprocess import emit
from loom.infer.refit import copy_weights
from loom.infer.request import Completion, Request, Update
from loom.infer.runner import Runner, Window, shard
from loom.infer.sampling import SamplingParams
from loom.infer.scheduler import Scheduler
from loom.infer.step import resolve_compile

__all__ = ["Completion", "Engine", "Request", "SamplingParams", "Update"]

log = logging.getLogger(__name__)


class Engine:
    """Generates for many requests at once on one model (or one tensor-parallel shard of it).

    `max_batch`: slots, the most sequences decoded together. `max_len`: the longest prompt + completion
    (at most the model's max_seq_len). `seed`: where requests without their own seed get one.
    `sync_every`: decode steps run on the device between reads back to the host (see the module's "Host
    reads"); a request's tokens do not depend on it.

    `compile=True` runs decode steps through `CompiledDecode` (loom/infer/step.py): the batch padded to a
    bucket of the busy slots (requests are moved down into freed slots first: `Scheduler.active`), compiled for
    every bucket at construction. Prefill (ragged, packed) stays eager. A command's setting is taken too:
    "on", "off", or "auto", which `resolve_compile` decides (on on a GPU, off on a CPU).

    `decode` (token ids -> text): how requests with stop strings (`SamplingParams.stop`) read their text; the
    host decodes such a request's completion after each window.

    `cpu_kernel` (CPU, fp32 weights, one process): decode steps, and the prefill's head on the prompts' last
    positions, run through the CPU decode path (loom/infer/cpu: packed small-batch products on a twin of the
    model that shares its parameters, and a decode attention kernel); a refit repacks in place. Where it cannot
    run the engine uses F.linear and SDPA; `stats["packed_linears"]` counts the layers that run packed.

    `fuse_qkv` (default: on a GPU): each attention layer's query, key and value weights are laid end to end in
    one tensor that the three parameters become views of (loom/infer/fuse.py), so a decode step multiplies by
    them once; the model's parameters keep their identity and memory, and a refit writes through them.
    `stats["fused_qkv_layers"]` counts the layers fused.

    `speculative="ngram"`: speculative decoding with prompt-lookup drafts of up to `draft_tokens` tokens per request
    and step, verified in one forward (loom/infer/speculative.py): greedy output equal to non-speculative greedy,
    sampled output of the same law; `stats["spec_accepted_tokens"]`, `["spec_draft_tokens"]`,
    `["spec_request_steps"]` count what was kept.

    `paged=True` keeps keys and values in blocks of `block_size` positions from a pool of `kv_tokens` positions
    (default max_batch x max_len) instead of a slab (loom/infer/paged.py): requests are admitted while the pool can
    hold their prompt + max_new_tokens, requests with the same prompt prefill it once and share its blocks, and
    decode attention reads each request's own blocks (`paged_read="split"`) or gathers them densely ("gather").
    With `prefix_cache` (paged only; on by default) whole blocks stay after their request ends, found again by
    their tokens' hash chain: a later prompt that starts with them prefills only the rest (loom/infer/
    prefix_cache.py). `stats["prefix_cache_hit_tokens"]` / `["prefix_cache_queried_tokens"]` count prompt tokens
    found cached / looked up; `stats["prefilled_tokens"]` the tokens prefills ran. A refit empties the cache.

    Its parts: `slab` (the key/value memory), `scheduler` (the requests and the slots they hold: `Scheduler`),
    `runner` (the model's run: `Runner`, with the `decoder` decode steps run on and the `compiled` step)."""

    constrains = True  # takes grammar-constrained requests (`submit(..., constraint=...)`)

    def __init__(self, model: nn.Module, max_batch: int = 16, max_len: int | None = None, seed: int = 0,
                 compile: bool | str = False, sync_every: int = 8, cpu_kernel: bool = True, decode=None,
                 paged: bool = False, block_size: int = 16, kv_tokens: int | None = None, paged_read: str = "split",
                 fuse_qkv: bool | None = None, prefix_cache: bool = True, speculative: str | None = None,
                 draft_tokens: int = 4, adapters=None):
        cfg = model.cfg
        # LoRA adapters chosen per request (loom/infer/adapters.py, `attach_adapters` on the model first): eager
        # steps, unfused projections and a slab (paged memory shares prompts and prefixes across adapters)
        self.adapters = adapters
        if adapters is not None:
            if paged or resolve_compile(compile, next(model.parameters()).device):
                raise UserError("adapters per request (loom serve --lora) run on a slab, eagerly: give paged=False "
                                "(--kv slab) and compile off")
            fuse_qkv = False
        self.decode = decode  # token ids -> text (a tokenizer's decode): needed by requests with stop strings
        max_len = cfg.max_seq_len if max_len is None else max_len
        if paged and (block_size < 1 or (kv_tokens is not None and kv_tokens < block_size)
                      or paged_read not in ("split", "gather")):
            raise UserError(f"Engine(paged=True, block_size={block_size}, kv_tokens={kv_tokens}, paged_read="
                            f"{paged_read!r}): block_size must be >= 1, kv_tokens at least one block, paged_read "
                            "'split' or 'gather'")
        if speculative not in (None, "off", "ngram") or draft_tokens < 1:
            raise UserError(f"Engine(speculative={speculative!r}, draft_tokens={draft_tokens}): speculative must be "
                            "None, 'off' or 'ngram' (prompt-lookup drafts) and draft_tokens >= 1")
        if max_batch < 1 or not 2 <= max_len <= cfg.max_seq_len or sync_every < 1:
            raise UserError(f"Engine(max_batch={max_batch}, max_len={max_len}, sync_every={sync_every}): max_batch "
                            f"and sync_every must be >= 1 and max_len in [2, {cfg.max_seq_len}] (the model's "
                            "max_seq_len)")
        self.sync_every = sync_every
        self.model = model.eval()
        # Decode steps (and the prefill's head) run on the runner's decoder: the model itself, or on a CPU with
        # fp32 weights its twin whose linear layers multiply through the packed small-batch kernel.
        cpu = cpu_decode(model, cpu_kernel)  # None off a CPU
        # one product for each layer's query, key and value projections (loom/infer/fuse.py): by default on a
        # GPU; never through a CPU twin, whose packed layers are the projections
        if fuse_qkv is None:
            fuse_qkv = next(model.parameters()).device.type == "cuda"
        fused = fuse_qkv_layers(model) if fuse_qkv and (cpu is None or not cpu.packed) else 0
        self.max_batch, self.max_len, self.vocab = max_batch, max_len, cfg.vocab_size
        weight = shard(next(model.parameters()))
        attention = next(iter(model.layers.values())).attention
        kv_heads = shard(attention.wk.weight).shape[0] // attention.head_dim  # this rank's, under TP
        # One position beyond max_len that nothing reaches: a step's keys (at most max_len) never span the
        # whole slab, so a compiled step does not specialise on "keys == slab length" (one graph fewer).
        if paged:  # blocks from a pool (loom/infer/paged.py); by default as many tokens as a slab holds
            blocks = -(-(max_batch * max_len if kv_tokens is None else kv_tokens) // block_size) + 1  # + scratch
            self.slab = PagedKV(model.layers.keys(), max_batch, kv_heads, blocks, block_size, attention.head_dim,
                                max_len, weight.dtype, weight.device, read=paged_read, prefix_cache=prefix_cache)
        else:
            self.slab = KVSlab(model.layers.keys(), max_batch, kv_heads, max_len + 1, attention.head_dim,
                               weight.dtype, weight.device)
        self.paged = paged
        self.slab.decode_kernel = None if cpu is None else cpu.attention
        if paged:  # the CPU kernel that reads each request's visible keys from its blocks
            self.slab.paged_kernel = None if cpu is None else cpu.paged_attention
        self.device = weight.device
        packed = 0 if cpu is None else len(cpu.packed)
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "windows": 0, "refills": 0, "decoded_tokens": 0,
                      "discarded_tokens": 0, "compiled_steps": 0, "moves": 0, "packed_linears": packed,
                      "fused_qkv_layers": fused, "prefilled_tokens": 0, "prefix_cache_queried_tokens": 0,
                      "prefix_cache_hit_tokens": 0, "prefix_cache_evicted_blocks": 0}
        if paged and self.slab.cache is not None:  # the prefix cache counts into the engine's stats
            self.slab.cache.stats = self.stats
        self.last_refit_s: float | None = None
        self.scheduler = Scheduler(self.slab, max_batch, max_len, self.vocab, decode, seed, self.stats)
        self.compile_mode = resolve_compile(compile, self.device)
        self.runner = Runner(model, cpu, self.slab, max_batch, max_len, sync_every, self.compile_mode, self.stats)
        self.speculator = None  # speculative decoding (loom/infer/speculative.py): drafts verified in one forward
        if speculative == "ngram":
            from loom.infer.speculative import NgramSpeculator

            self.speculator = NgramSpeculator(self.runner, self.stats, draft_tokens, max_len, decode)
        self.runner.adapters = adapters

    # --- generation -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_done=None) -> list[Completion]:
        """Continue every prompt (a list of token ids); results in the order of `prompts`. `params`: one for
        all or one per prompt. `on_done(index, completion)` is called as each request finishes. A user of the
        step-wise API: every request is checked, then submitted, then `step` runs until they all finish
        (requests someone else submitted run along; their results stay on their `Request`)."""
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params)} sampling parameters; give one for all or "
                            "one per prompt")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self.check(prompt, p, i)
        requests = [self.scheduler.enqueue(prompt, p, i) for i, (prompt, p) in enumerate(zip(prompts, params))]
        mine, left = set(map(id, requests)), len(requests)
        try:
            while left:
                for update in self.step():
                    if update.finished and id(update.request) in mine:
                        left -= 1
                        if on_done is not None:
                            on_done(update.request.index, update.request.out)
        finally:  # cut short (an exception, Ctrl-C): this call's requests let go of their slots and blocks
            for r in requests:
                if not r.done:
                    self.cancel(r)
        return [r.out for r in requests]

    # --- the step-wise API: submit, step, cancel --------------------------------------------------------------

    def check(self, prompt: list[int], p: SamplingParams, i: int | str = "") -> None:
        """Refuse (UserError) a request the engine cannot run: its sampling parameters, a prompt empty or too
        long for max_len, ids outside the vocabulary, stop strings without `decode`, more positions than the
        key/value pool holds. `i` names it in the message. A request that only scores its prompt (max_new_tokens
        0, `prompt_logprobs`) takes no slot: its prompt may fill max_len."""
        outside = [t for t in (*p.stop_token_ids, *(t for t, _ in p.logit_bias)) if not 0 <= t < self.vocab]
        if outside:
            raise UserError(f"request {i} names token ids {outside[:5]} (stop_token_ids / logit_bias) outside the "
                            f"vocabulary [0, {self.vocab})")
        if p.max_new_tokens == 0:
            p.check()
            if not 1 <= len(prompt) <= self.max_len or min(prompt) < 0 or max(prompt) >= self.vocab:
                raise UserError(f"prompt {i} has {len(prompt)} tokens (1 to {self.max_len} can be scored) or ids "
                                f"outside the vocabulary [0, {self.vocab})")
            return
        self.scheduler.check(prompt, p, i)

    def submit(self, prompt: list[int], params: SamplingParams | None = None, index: int | None = None,
               constraint=None, adapter: str | None = None) -> Request:
        """Queue one request (checked first: `check`); it is admitted by a later `step`. Requests submitted
        before the same step and sharing a prompt prefill it once (paged memory). `constraint`: a grammar's
        matcher (`loom.infer.grammar.Grammars.matcher`) that every token of the request must satisfy. `adapter`:
        the name of the LoRA adapter it runs with (`adapters`), None for the base."""
        params = params or SamplingParams()
        if adapter is not None and self.adapters is None:
            raise UserError(f"adapter={adapter!r}, but this engine has no adapters")
        slot = None if adapter is None else self.adapters.index(adapter)
        if slot is not None and params.prompt_logprobs is not None:
            raise UserError(f"scoring the prompt (prompt_logprobs, echo) runs on the base model; adapter={adapter!r} "
                            "cannot be scored yet")
        index = self.scheduler.submitted if index is None else index
        self.check(prompt, params, index)
        request = self.scheduler.enqueue(prompt, params, index)
        request.constraint, request.adapter = constraint, slot
        return request

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return self.scheduler.running

    @torch.no_grad()
    def step(self) -> list[Update]:
        """One round: waiting requests take free slots and prefill (schedule, run, postprocess), then every busy
        slot decodes one window of up to `sync_every` tokens; finished requests leave their slots. Returns an
        `Update` per request that gained tokens or finished, in that order; [] when nothing waits or runs."""
        marks = {}

        def seen(seqs: list[Request]) -> list[Request]:
            for seq in seqs:
                marks.setdefault(id(seq), (seq, len(seq.out.tokens)))
            return seqs

        for seq in seen(self._score()):  # prompts to score (loom/infer/score.py), before any takes a slot; those
            self.scheduler.cancel(seq)  # that only score (max_new_tokens 0) are done without one
            seq.state, seq.out.finish_reason = "done", "length"
        admitted = self.scheduler.admit()  # schedule: free slots first
        if admitted:
            seqs = seen(self.scheduler.holding(admitted))
            self._postprocess(seqs, self.runner.prefill(admitted, seqs))  # run, postprocess
        active = self.scheduler.active()  # schedule: the busy slots, compacted
        if active:
            seqs = seen(self.scheduler.holding(active))
            if self.speculator is not None and self.speculator.takes(seqs):  # draft, verify, append: one forward
                self.speculator.step(active, seqs)
                self.scheduler.finish(seqs)
            else:
                self._postprocess(seqs, self.runner.decode(active, seqs))  # run a window, postprocess
        return [Update(seq, seq.out.tokens[n:], seq.out.logprobs[n:], seq.state == "done", seq.out.top_logprobs[n:])
                for seq, n in marks.values()]

    def _score(self) -> list[Request]:
        """The waiting requests that asked for their prompt's log-probs get them, in one batched forward; those
        that only score (max_new_tokens 0) are returned for the step to finish."""
        todo = [r for r in self.scheduler.waiting
                if r.params.prompt_logprobs is not None and r.out.prompt_logprobs is None]
        if todo:
            from loom.infer.score import score_prompts

            scores = score_prompts(self.model, [r.out.prompt for r in todo],
                                   [min(r.params.prompt_logprobs, self.vocab) for r in todo], self.device)
            for r, (lps, top) in zip(todo, scores):
                r.out.prompt_logprobs, r.out.prompt_top_logprobs = lps, top
            self.stats["scored_tokens"] = self.stats.get("scored_tokens", 0) + sum(len(r.out.prompt) for r in todo)
        return [r for r in todo if r.params.max_new_tokens == 0]

    def _postprocess(self, seqs: list[Request], window: Window) -> None:
        """A run's tokens onto the requests' completions (one read-back: `emit`); finished requests leave."""
        kept = emit(seqs, window, self.max_len, self.decode)
        if window.fed:  # a decode window
            self.stats["decoded_tokens"] += kept
            self.stats["discarded_tokens"] += len(seqs) * window.steps - kept  # decoded past a stop within it
        self.scheduler.finish(seqs)

    def cancel(self, request: Request) -> None:
        """Drop a waiting or running request (its slot and blocks go back); one already done stays as it is.
        Between steps only: the engine is not thread-safe."""
        self.scheduler.cancel(request)

    def abort(self) -> list[Request]:
        """Cancel every waiting and running request and empty the key/value memory (after a step that raised);
        returns the requests cancelled."""
        return self.scheduler.abort()

    # --- weights --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def refit(self, source: nn.Module | dict, local: bool = False) -> float:
        """Copy new weights into the engine's model in place (the slab and every buffer stay where they are);
        returns and logs the seconds it took.

        `source`: a model or a state dict with loom's parameter names, in any layout a single process can
        read: plain tensors, or DTensors (FSDP/TP shards, gathered here with `full_tensor`; every rank of
        the source's mesh must call refit together). Under tensor parallelism the engine takes its own
        shard of each full tensor; with `local`, `source` holds that shard already (RL's tensor-parallel generation
        ranks, which never keep the whole tensor). A pipeline stage holds only some layers, so its weights are
        refused: gather them first."""
        start = time.perf_counter()
        check_fused(self.model)  # the fused q/k/v tensor must still be what the parameters view
        tensors = copy_weights(self.model, source, local)
        if self.paged and self.slab.cache is not None:  # keys and values of the old weights: found no more
            self.slab.cache.clear()
        if self.runner.cpu is not None:  # the twin's packed copies of the new weights, in place
            self.runner.cpu.repack()
        if self.device.type == "cuda":  # the copies run asynchronously: time them, not their launches
            torch.cuda.synchronize(self.device)
        self.last_refit_s = time.perf_counter() - start
        log.info("refit: %d tensors in %.3f s", tensors, self.last_refit_s)
        return self.last_refit_s
