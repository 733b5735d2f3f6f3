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
None on a GPU), refit (`refit.copy_weights`), and here the scheduling.

Step-wise: `submit(prompt, params)` queues a request (checked at once) and returns its `Request`; each `step()`
is one round and returns an `Update` per request that gained tokens or finished; `cancel(request)` gives its
slot back. `generate` submits its prompts and steps until they finish; a server submits as requests arrive, so
requests that arrive at different times share decode steps. One thread drives an engine.

Each round (`step`) reads schedule -> run -> postprocess. Schedule: waiting prompts take free slots (a
request owns a slot from its prefill to its last token, moved down, keys and values with it, when lower slots
free up and nothing waits: `_compact`). Run: the admitted prompts prefill as one packed row (ragged prompts
end to end, so the linear layers see no padding; only attention spreads them out per slot), then every busy
slot decodes a window of up to `sync_every` tokens, back to back on the device (`_decode`). Postprocess: the
window's tokens come back in one copy (`_emit`) and a slot freed by a finished request is refilled by the next
waiting prompt (continuous batching). The model needs no engine code beyond calling `cache.attend`.

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

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.errors import UserError
from loom.infer.cpu import cpu_decode
from loom.infer.kv import KVSlab, upload
from loom.infer.paged import PagedKV
from loom.infer.refit import copy_weights
from loom.infer.fuse import check_fused
from loom.infer.fuse import fuse_qkv as fuse_qkv_layers
from loom.infer.sampling import Sampler, SamplingParams, reduce_logits
from loom.infer.step import CompiledDecode, resolve_compile
from loom.parallel.distributed import full_tensor

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """One finished request. `finish_reason`: "stop" (a stop token, the last of `tokens`, or a stop string,
    `stop_string`, which the last of `tokens` completes), "length" (max_new_tokens reached) or "context"
    (prompt + completion reached the engine's max_len)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log-softmax of the raw logits (temperature 1)
    sampling_logprobs: list[float] = field(default_factory=list)  # under the distribution sampled from
    finish_reason: str = ""
    stop_string: str = ""  # the stop string (SamplingParams.stop) that ended it, if one did
    # with SamplingParams.logprobs = N > 0: per token, the N most likely (id, log-prob at temperature 1), best first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def text(self, decode) -> str:
        """The completion's text (`decode`: ids -> str): without the stop token that ended it, cut before the
        stop string that ended it."""
        if self.stop_string:
            text = decode(self.tokens)
            return text[:text.find(self.stop_string)]
        return decode(self.tokens[:-1] if self.finish_reason == "stop" else self.tokens)


class Request:
    """A submitted request (`Engine.submit`): its prompt, sampling parameters and seed, and as it runs its
    `out` (the Completion so far). `state`: "waiting" (queued), "running" (holds a slot), "done" (finished:
    `out.finish_reason` says why) or "cancelled" (`Engine.cancel`). `index`: the caller's label (generate's
    prompt index), else the engine's running count of submitted requests."""

    def __init__(self, index: int, prompt: list[int], params: SamplingParams, seed: int):
        self.index, self.params, self.seed = index, params, seed
        self.out = Completion(prompt=list(prompt))
        self.generator = torch.Generator().manual_seed(seed)
        self.length = len(prompt)  # tokens whose keys and values are in the slot
        self.shared = False  # paged: its prompt's blocks and first-token logits come from an earlier request
        self.state = "waiting"

    @property
    def done(self) -> bool:
        return self.state in ("done", "cancelled")


@dataclass
class Update:
    """What one `Engine.step` did for one request: the tokens (and their log-probs at temperature 1) it
    appended, and whether the request finished (`request.out.finish_reason`)."""

    request: Request
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # SamplingParams.logprobs > 0


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly tensor-parallel) parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


class Engine:
    """Generates for many requests at once on one model (or one tensor-parallel shard of it).

    `max_batch`: slots, the most sequences decoded together. `max_len`: the longest prompt + completion
    (at most the model's max_seq_len). `seed`: where requests without their own seed get one.
    `sync_every`: decode steps run on the device between reads back to the host (see the module's "Host
    reads"); a request's tokens do not depend on it.

    `compile=True` runs decode steps through `CompiledDecode` (loom/infer/step.py): the batch padded to a
    bucket of the busy slots (requests are moved down into freed slots first, see `_compact`), compiled for
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

    `paged=True` keeps keys and values in blocks of `block_size` positions from a pool of `kv_tokens` positions
    (default max_batch x max_len) instead of a slab (loom/infer/paged.py): requests are admitted while the pool can
    hold their prompt + max_new_tokens, requests with the same prompt prefill it once and share its blocks, and
    decode attention reads each request's own blocks (`paged_read="split"`) or gathers them densely ("gather")."""

    def __init__(self, model: nn.Module, max_batch: int = 16, max_len: int | None = None, seed: int = 0,
                 compile: bool | str = False, sync_every: int = 8, cpu_kernel: bool = True, decode=None,
                 paged: bool = False, block_size: int = 16, kv_tokens: int | None = None, paged_read: str = "split",
                 fuse_qkv: bool | None = None):
        cfg = model.cfg
        self.decode = decode  # token ids -> text (a tokenizer's decode): needed by requests with stop strings
        max_len = cfg.max_seq_len if max_len is None else max_len
        if paged and (block_size < 1 or (kv_tokens is not None and kv_tokens < block_size)
                      or paged_read not in ("split", "gather")):
            raise UserError(f"Engine(paged=True, block_size={block_size}, kv_tokens={kv_tokens}, paged_read="
                            f"{paged_read!r}): block_size must be >= 1, kv_tokens at least one block, paged_read "
                            "'split' or 'gather'")
        if max_batch < 1 or not 2 <= max_len <= cfg.max_seq_len or sync_every < 1:
            raise UserError(f"Engine(max_batch={max_batch}, max_len={max_len}, sync_every={sync_every}): max_batch "
                            f"and sync_every must be >= 1 and max_len in [2, {cfg.max_seq_len}] (the model's "
                            "max_seq_len)")
        self.sync_every = sync_every
        self.model = model.eval()
        # Decode steps (and the prefill's head) run on `_decoder`: the model itself, or on a CPU with fp32
        # weights its twin whose linear layers multiply through the packed small-batch kernel.
        self._cpu = cpu_decode(model, cpu_kernel)  # None off a CPU
        self._decoder = model if self._cpu is None else self._cpu.decoder
        # one product for each layer's query, key and value projections (loom/infer/fuse.py): by default on a
        # GPU; never through a CPU twin, whose packed layers are the projections
        if fuse_qkv is None:
            fuse_qkv = next(model.parameters()).device.type == "cuda"
        fused = fuse_qkv_layers(model) if fuse_qkv and (self._cpu is None or not self._cpu.packed) else 0
        self.max_batch, self.max_len, self.vocab = max_batch, max_len, cfg.vocab_size
        weight = _shard(next(model.parameters()))
        attention = next(iter(model.layers.values())).attention
        kv_heads = _shard(attention.wk.weight).shape[0] // attention.head_dim  # this rank's, under TP
        # One position beyond max_len that nothing reaches: a step's keys (at most max_len) never span the
        # whole slab, so a compiled step does not specialise on "keys == slab length" (one graph fewer).
        if paged:  # blocks from a pool (loom/infer/paged.py); by default as many tokens as a slab holds
            blocks = -(-(max_batch * max_len if kv_tokens is None else kv_tokens) // block_size) + 1  # + scratch
            self.slab = PagedKV(model.layers.keys(), max_batch, kv_heads, blocks, block_size, attention.head_dim,
                                max_len, weight.dtype, weight.device, read=paged_read)
        else:
            self.slab = KVSlab(model.layers.keys(), max_batch, kv_heads, max_len + 1, attention.head_dim,
                               weight.dtype, weight.device)
        self.paged = paged
        self.slab.decode_kernel = None if self._cpu is None else self._cpu.attention
        if paged:  # the CPU kernel that reads each request's visible keys from its blocks
            self.slab.paged_kernel = None if self._cpu is None else self._cpu.paged_attention
        self.device = weight.device
        self._seeds = torch.Generator().manual_seed(seed)
        packed = 0 if self._cpu is None else len(self._cpu.packed)
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "windows": 0, "refills": 0, "decoded_tokens": 0,
                      "discarded_tokens": 0, "compiled_steps": 0, "moves": 0, "packed_linears": packed,
                      "fused_qkv_layers": fused}
        self.last_refit_s: float | None = None
        self._waiting: deque[Request] = deque()  # submitted, not yet admitted
        self._slots: list[Request | None] = [None] * max_batch  # the request holding each slot
        self._submitted = 0
        self.compile_mode = resolve_compile(compile, self.device)
        self._compiled = self._compile(attention, kv_heads) if self.compile_mode else None

    def _compile(self, attention: nn.Module, kv_heads: int) -> CompiledDecode:
        """The compiled decode step, compiled for every bucket now (`stats["warmup_s"]`). Decode attention folds
        the query heads of a key/value head into queries (`KVSlab.attend`). The step computes the head and its
        reductions itself (`_head_in_step`); else it returns hidden states and the head runs after it
        (`_head_logits`, TP's gather)."""
        heads = _shard(attention.wq.weight).shape[0] // attention.head_dim
        step = CompiledDecode(self._decoder, self.slab, heads // kv_heads, self._head_in_step(), self.max_batch,
                              self.max_len, self.device)
        self.stats["warmup_s"] = step.warmup()
        return step

    def _head_in_step(self) -> bool:
        """Whether the compiled step computes the LM head and its reductions: on a CPU when the head is packed;
        on a GPU unless the head is tensor-parallel (its logits are gathered outside the step). There the head,
        its argmax and log-sum-exp join the step's CUDA graph: the H200 kernel tables of 2026-11-26 showed them
        run eagerly after it, a cast to fp32 and five full passes over [rows, vocab] fp32 a step."""
        if self._cpu is not None:
            return self._cpu.head_in_step
        weight = getattr(self._decoder.output, "weight", None)
        return self.device.type == "cuda" and weight is not None and not isinstance(weight, DTensor)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the LM head (on a CPU as its decode path computes them)."""
        if self._cpu is not None:
            return self._cpu.head_logits(hidden)
        return full_tensor(self._decoder.output(hidden)).float()

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
        requests = [self._enqueue(prompt, p, i) for i, (prompt, p) in enumerate(zip(prompts, params))]
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
        key/value pool holds. `i` names it in the message."""
        p.check()
        if not 1 <= len(prompt) < self.max_len:
            raise UserError(f"prompt {i} has {len(prompt)} tokens; it needs 1 to {self.max_len - 1} "
                            f"(the engine's max_len={self.max_len} holds prompt and completion)")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise UserError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab})")
        if p.stop and self.decode is None:
            raise UserError(f"request {i} has stop strings {list(p.stop)} but the engine has no decode "
                            "function to read text with; build it with Engine(..., decode=tokenizer.decode)")
        if not self.slab.fits(self._most(prompt, p)):
            raise UserError(f"request {i} may hold {self._most(prompt, p)} positions but the engine's key/value "
                            f"pool holds {(self.slab.pool.blocks - 1) * self.slab.block_size}; raise kv_tokens "
                            "or lower max_new_tokens")

    def submit(self, prompt: list[int], params: SamplingParams | None = None, index: int | None = None) -> Request:
        """Queue one request (checked first: `check`); it is admitted by a later `step`. Requests submitted
        before the same step and sharing a prompt prefill it once (paged memory)."""
        params = params or SamplingParams()
        index = self._submitted if index is None else index
        self.check(prompt, params, index)
        return self._enqueue(prompt, params, index)

    def _enqueue(self, prompt: list[int], p: SamplingParams, index: int) -> Request:
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seeds))
        request = Request(index, list(prompt), p, seed)
        self._submitted += 1
        self.slab.expect([request.out.prompt])
        self._waiting.append(request)
        return request

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return sum(seq is not None for seq in self._slots)

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

        admitted = self._admit()  # schedule: free slots first
        if admitted:
            seqs = seen([self._slots[s] for s in admitted])
            self._finish(self._prefill(admitted, seqs))  # run, postprocess
        active = self._active(self._slots)  # schedule: the busy slots, compacted
        if active:
            seqs = seen([self._slots[s] for s in active])
            self._finish(self._decode(active, seqs))  # run a window, postprocess
        return [Update(seq, seq.out.tokens[n:], seq.out.logprobs[n:], seq.state == "done", seq.out.top_logprobs[n:])
                for seq, n in marks.values()]

    def cancel(self, request: Request) -> None:
        """Drop a waiting or running request (its slot and blocks go back); one already done stays as it is.
        Between steps only: the engine is not thread-safe."""
        if request.state == "waiting":
            self._waiting.remove(request)
            self.slab.withdraw(request.out.prompt)
        elif request.state == "running":
            slot = next(s for s, seq in enumerate(self._slots) if seq is request)
            self.slab.release(slot)
            self._slots[slot] = None
        if not request.done:
            request.state = "cancelled"

    def abort(self) -> list[Request]:
        """Cancel every waiting and running request and empty the key/value memory (after a step that raised);
        returns the requests cancelled."""
        dropped = list(self._waiting) + [seq for seq in self._slots if seq is not None]
        for seq in dropped:
            seq.state = "cancelled"
        self._waiting.clear()
        self._slots = [None] * self.max_batch
        self.slab.reset()
        return dropped

    def _finish(self, seqs: list[Request]) -> None:
        for seq in seqs:
            if seq.out.finish_reason:
                slot = self._slots.index(seq)
                self.slab.release(slot)
                self._slots[slot] = None
                seq.state = "done"

    def _admit(self) -> list[int]:
        """Waiting requests into free slots (a freed slot never waits for the others); their slots."""
        waiting, slots = self._waiting, self._slots
        free = [s for s, seq in enumerate(slots) if seq is None]
        if not (waiting and free):
            return []
        busy = len(free) < self.max_batch
        admitted = []
        for s in free[:len(waiting)]:
            seq = waiting[0]
            prompt, most = seq.out.prompt, self._most(seq.out.prompt, seq.params)
            how = self.slab.admit(s, prompt, most)
            if how is None and not busy and not admitted:  # nothing runs: let go of held prompts, try again
                self.slab.evict()
                how = self.slab.admit(s, prompt, most)
            if how is None:  # paged memory: the pool cannot promise it room now; it waits for blocks
                break
            waiting.popleft()
            slots[s] = seq
            seq.state = "running"
            seq.shared = how == "shared"
            admitted.append(s)
        self.stats["refills"] += len(admitted) if busy else 0
        return admitted

    def _most(self, prompt: list[int], p: SamplingParams) -> int:
        """The most key/value positions a request can hold."""
        return min(len(prompt) + p.max_new_tokens, self.max_len)

    def _active(self, slots: list) -> list[int]:
        """The busy slots, moved down first where holes lie below one (nothing waits to fill them)."""
        active = [s for s, seq in enumerate(slots) if seq is not None]
        if active and active[-1] >= len(active):
            self._compact(slots)
            active = list(range(len(active)))
        return active

    def _compact(self, slots: list) -> None:
        """Move the requests above the first len(busy) slots into the free slots below, keys and values
        with them: a decode step then covers slots 0..busy-1 (the slab read in place, a compiled step's
        bucket sized by the busy count, not by the highest busy slot)."""
        busy = sum(seq is not None for seq in slots)
        holes = [s for s in range(busy) if slots[s] is None]
        movers = [s for s in range(busy, len(slots)) if slots[s] is not None]
        for dst, src in zip(holes, movers):
            self.slab.move(src, dst)
            slots[dst], slots[src] = slots[src], None
        self.stats["moves"] += len(movers)

    def _prefill(self, rows: list[int], seqs: list[Request]) -> list[Request]:
        """The admitted prompts as one packed row (no padding through the linear layers); each request's
        first token comes from the logits at its prompt's last position."""
        fresh = [b for b, seq in enumerate(seqs) if not seq.shared]
        head = self._prefill_head([rows[b] for b in fresh], [seqs[b] for b in fresh]) if fresh else None
        if len(fresh) < len(seqs):  # paged: requests sharing a prompt take its head's outputs (PagedKV)
            made = {tuple(seqs[b].out.prompt): j for j, b in enumerate(fresh)}
            parts = []
            for seq in seqs:
                j = made.get(tuple(seq.out.prompt))
                parts.append(tuple(t[j:j + 1] for t in head) if j is not None else self.slab.head_of(seq.out.prompt))
            head = tuple(torch.cat(t) for t in zip(*parts))
        self.slab.settle()
        self._emit(seqs, [self._pick(head, self._sampler(seqs, 1), 0, self._top(seqs))], self._stop_table(seqs), 1,
                   fed=0)
        return seqs

    def _prefill_head(self, rows: list[int], seqs: list[Request]) -> tuple:
        """The packed prefill of the prompts of `seqs` into `rows` -> the head's outputs at their last positions."""
        lengths = [len(seq.out.prompt) for seq in seqs]
        total = sum(lengths)
        ends = [end - 1 for end in itertools.accumulate(lengths)]  # each prompt's last token in the row
        # the tokens and the prompts' last positions in one copy
        host = upload(torch.tensor([t for seq in seqs for t in seq.out.prompt] + ends), self.device)
        tokens, last = host[:total][None], host[total:]
        positions = self.slab.bind_packed(rows, lengths)
        self.stats["prefill_steps"] += 1
        hidden = full_tensor(self.model(tokens, cache=self.slab, positions=positions, return_hidden=True))
        head = reduce_logits(self._head_logits(hidden[0, last]))
        for j, seq in enumerate(seqs):  # paged: kept for requests with the same prompt admitted later
            self.slab.remember(seq.out.prompt, tuple(t[j:j + 1].clone() for t in head))  # the sampler writes into head
        return head

    def _decode(self, rows: list[int], seqs: list[Request]) -> list[Request]:
        """A window of decode steps for the busy slots `rows`, run back to back on the device; the host reads
        the window's tokens and log-probs back once, at its end.

        The window is `sync_every` steps, cut to the fewest steps any request still has before max_new_tokens
        or max_len: a request that ends by length or context ends on the window's last step, and its slot is
        refilled at once. Sampling (`Sampler`) and stop tracking run on the device: each step feeds the
        tokens the previous step sampled, and the first stop token of each request is found there after the
        window. A request that stops earlier keeps decoding (its slot alone, nothing it writes is read by any
        other request) until the window ends; the host keeps its tokens up to the stop.
        Positions need no read-back: every request advances one position per step.

        With `compile=True` each step runs the compiled graph of its bucket: the batch padded to the
        bucket of max(rows) + 1 (an idle slot in that range decodes token 0 at position 0 of its
        own slot, which nothing reads: a request prefills position 0 of its slot before reading it)."""
        budget = [min(s.params.max_new_tokens - len(s.out.tokens), self.max_len - len(s.out.prompt) - len(s.out.tokens))
                  for s in seqs]
        steps = max(1, min(self.sync_every, *budget))
        sampler = self._sampler(seqs, steps)
        n, eager = len(rows), self._compiled is None
        size = len(rows) if eager else self._compiled.bucket(max(rows) + 1)
        # paged: each request's blocks for the window's positions, and the window's block table
        self.slab.prepare(rows, [s.length for s in seqs], [s.length + steps for s in seqs], None if eager else size)
        # One copy to the device per window: the token, position and advance of each row of the step (a compiled
        # step's bucket rows are slots, its idle ones decode token 0 at position 0 and stay there; an eager
        # step's rows are the busy slots in order), and the slots of the busy rows.
        table = [[0] * size for _ in range(4)]
        for b, (slot, s) in enumerate(zip(rows, seqs)):
            r = b if eager else slot
            table[0][r], table[1][r], table[2][r] = s.out.tokens[-1], s.length, 1
        table[3][:n] = rows
        state = upload(torch.tensor(table), self.device)
        tokens, positions, advance = (state[i, :, None] for i in range(3))
        where = state[3, :n]
        if not eager:  # own copies: a compiled step's inputs start aligned (views into the table do not)
            tokens, positions, advance = tokens.clone(), positions.clone(), advance.clone()
        stops = self._stop_table(seqs)
        first = max(s.length for s in seqs)
        top = self._top(seqs)
        out = []
        for step in range(steps):
            keys = first + step + 1  # key positions the furthest request reads
            # no reference to the step's outputs outlives the pick: a CUDA-graph step overwrites them next replay
            picked = self._pick(self._step(rows, tokens, positions, keys, None if size == n else where), sampler,
                                step, top)
            token = picked[0]
            out.append(picked)
            if step + 1 < steps:
                if eager:  # every row is busy: the sampled tokens are the next input as they are
                    tokens = token[:, None]
                    positions += 1
                else:
                    tokens[where, 0] = token
                    positions += advance
        kept = self._emit(seqs, out, stops, steps, fed=steps)
        self.stats["decode_steps"] += steps
        self.stats["windows"] += 1
        self.stats["decoded_tokens"] += kept
        self.stats["discarded_tokens"] += len(seqs) * steps - kept  # decoded past a stop within a window
        return seqs

    def _step(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor, keys: int, where):
        """One decode step of the busy slots `rows` reading `keys` key positions -> the head's fp32 logits of
        each busy row with their argmax and log-sum-exp (`reduce_logits`). Eager: the rows are the busy slots.
        Compiled: the rows are a bucket of slots 0..size-1, `where` the busy ones among them (None: all)."""
        if self._compiled is None:
            self.slab.bind(rows, positions, keys=keys)
            hidden = full_tensor(self._decoder(tokens, cache=self.slab, positions=positions, return_hidden=True))[:, 0]
            return reduce_logits(self._head_logits(hidden))
        x = self._compiled(tokens, positions, keys)
        in_step = self._compiled.head_in_step
        if where is not None:  # idle bucket rows out (every row busy: no gather)
            x = tuple(t[where] for t in x) if in_step else x[where]
        self.stats["compiled_steps"] += 1
        # the step computed the head and its reductions itself, or returned hidden states
        return x if in_step else reduce_logits(self._head_logits(x))

    def _sampler(self, seqs: list[Request], steps: int) -> Sampler:
        return Sampler([s.params for s in seqs], [s.generator for s in seqs], steps, self.vocab, self.device)

    def _stop_table(self, seqs: list[Request]) -> torch.Tensor | None:
        """[requests, most stop tokens] on the device, padded with -1 (never a token); None if none stop."""
        width = max(len(s.params.stop_token_ids) for s in seqs)
        if not width:
            return None
        rows = [list(s.params.stop_token_ids) + [-1] * (width - len(s.params.stop_token_ids)) for s in seqs]
        return upload(torch.tensor(rows), self.device)

    def _top(self, seqs: list[Request]) -> int:
        """The most likely tokens a window returns per token: the most any of its requests asks for."""
        return min(max(s.params.logprobs for s in seqs), self.vocab)

    def _pick(self, head, sampler: Sampler, step: int, top: int = 0):
        """The head's fp32 logits [requests, vocab] with their argmax and log-sum-exp (`reduce_logits`) -> next
        token, its log-prob under the raw logits (temperature 1) and under the distribution it was sampled
        from, and with `top` > 0 the `top` most likely tokens' ids and log-probs [requests, top]; all on the
        device."""
        logits, greedy, lse = head
        token, sampled = sampler(logits, greedy, step)
        picked = (token, logits.gather(1, token[:, None])[:, 0] - lse, sampled)
        if not top:
            return picked
        values, ids = logits.topk(top, dim=1)
        return picked + (ids, values - lse[:, None])

    def _emit(self, seqs: list[Request], out: list, stops, steps: int, fed: int) -> int:
        """Append each request's tokens of a window (`out`: per step, tokens / log-probs / sampling log-probs
        of every request) up to the first that ends it; `fed`: tokens the window wrote into each slot. The
        stop tokens are matched on the device; the host reads the whole window back in one copy. Returns
        the tokens kept."""
        tokens = torch.stack([o[0] for o in out], 1)  # [requests, steps]
        columns = [tokens.double(), torch.stack([o[1] for o in out], 1).double(),
                   torch.stack([o[2] for o in out], 1).double()]
        if stops is not None:
            hit = (tokens[:, :, None] == stops[:, None, :]).any(-1)
            first = torch.where(hit.any(1), hit.int().argmax(1), steps)  # the first stop token's step, or steps
            columns.append(first.double()[:, None])
        top = out[0][3].shape[1] if len(out[0]) > 3 else 0  # the most likely tokens of each step (`_pick`)
        if top:
            # ids, then log-probs: [requests, steps * top] each
            columns += [torch.stack([o[i] for o in out], 1).double().flatten(1) for i in (3, 4)]
        base = 3 * steps + (stops is not None)
        table = torch.cat(columns, 1).tolist()  # the window's one read-back
        kept = 0
        for seq, row in zip(seqs, table):
            out, p = seq.out, seq.params
            stop_at = int(row[3 * steps]) if stops is not None else steps
            for step in range(steps):
                out.tokens.append(int(row[step]))
                out.logprobs.append(row[steps + step])
                out.sampling_logprobs.append(row[2 * steps + step])
                if p.logprobs:
                    at = base + step * top
                    out.top_logprobs.append([(int(row[at + j]), row[at + steps * top + j])
                                             for j in range(min(p.logprobs, top))])
                kept += 1
                if step == stop_at:
                    out.finish_reason = "stop"
                elif len(out.tokens) >= p.max_new_tokens:
                    out.finish_reason = "length"
                elif len(out.prompt) + len(out.tokens) >= self.max_len:
                    out.finish_reason = "context"
                if out.finish_reason:
                    break
            if p.stop:  # text stops: the host reads the completion's text (`decode`)
                kept -= self._stop_at_string(out, p.stop, len(out.tokens) - (step + 1))
            seq.length += fed
        return kept

    def _stop_at_string(self, out: Completion, stops: tuple[str, ...], start: int) -> int:
        """End `out` at its first token whose completion text contains one of `stops` (earlier windows' text
        held none, so from token `start`, this window's first); returns the tokens dropped. A stop string may
        span tokens of earlier windows."""
        if not any(s in self.decode(out.tokens) for s in stops):
            return 0
        for n in range(start + 1, len(out.tokens) + 1):
            head = self.decode(out.tokens[:n])
            hits = [(head.find(s), s) for s in stops if s in head]
            if hits:
                out.stop_string = min(hits)[1]
                dropped = len(out.tokens) - n
                del out.tokens[n:], out.logprobs[n:], out.sampling_logprobs[n:], out.top_logprobs[n:]
                out.finish_reason = "stop"
                return dropped
        return 0

    # --- weights --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def refit(self, source: nn.Module | dict) -> float:
        """Copy new weights into the engine's model in place (the slab and every buffer stay where they are);
        returns and logs the seconds it took.

        `source`: a model or a state dict with loom's parameter names, in any layout a single process can
        read: plain tensors, or DTensors (FSDP/TP shards, gathered here with `full_tensor`; every rank of
        the source's mesh must call refit together). Under tensor parallelism the engine takes its own
        shard of each full tensor. A pipeline stage holds only some layers, so its weights are refused:
        gather them first."""
        start = time.perf_counter()
        check_fused(self.model)  # the fused q/k/v tensor must still be what the parameters view
        tensors = copy_weights(self.model, source)
        if self._cpu is not None:  # the twin's packed copies of the new weights, in place
            self._cpu.repack()
        if self.device.type == "cuda":  # the copies run asynchronously: time them, not their launches
            torch.cuda.synchronize(self.device)
        self.last_refit_s = time.perf_counter() - start
        log.info("refit: %d tensors in %.3f s", tensors, self.last_refit_s)
        return self.last_refit_s
