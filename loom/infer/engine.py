"""The generation engine: a preallocated key/value slab, continuous batching, per-request sampling that
returns per-token log-probabilities, and in-place weight refit. RL drives it from Python; `loom generate`
from the command line.

    engine = Engine(model, max_batch=16, max_len=512)
    done = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, max_new_tokens=64, seed=1))
    done[0].tokens, done[0].logprobs            # generated ids; log p(token | prefix) at temperature 1
    engine.refit(trainer_model)                 # new weights, same slab

How it works. The slab holds, per layer, keys and values of shape [slots, kv_heads, max_len, head_dim],
allocated once. A request owns a slot from its prefill to its last token (moved down, keys and values
with it, when lower slots free up and nothing waits: `_compact`). Each round the engine prefills waiting
prompts into free slots (ragged prompts packed end to end into one row, so the linear
layers see no padding; only attention spreads them out per slot), then decodes a window of up to
`sync_every` tokens for every busy slot, back to back on the device (`_decode`); a slot freed by a finished
request is refilled by the next waiting prompt at the window's end (continuous batching). Row b of a forward belongs to slot `rows[b]` and its tokens sit at `positions[b]`:
rotary positions come from there, keys and values are written there, and a query at position p attends
to keys 0..p of its own slot only, so neither padding nor another slot's (or an earlier request's) stale
entries are ever seen. The model needs no engine code beyond calling `cache.attend` (loom/models/llama.py).

Sampling is per request: temperature (0 = greedy), top-k, top-p, max_new_tokens, stop tokens, seed. Each
request draws its random numbers from its own generator, one uniform per token, so what it samples does
not depend on which other requests share the batch.

Log-probabilities. `Completion.logprobs[i]` is log-softmax of the model's unmodified logits (temperature 1,
no top-k/top-p) at generated token i: the quantity a trainer's forward computes, which RL losses need.
`Completion.sampling_logprobs[i]` is the log-probability under the distribution the token was actually
drawn from (after temperature, top-k and top-p; 0.0 for greedy), for importance weights.

Tensor parallelism: pass a model sharded by `loom.parallel.tensor.apply_tensor_parallel` (every rank runs
the same engine loop on the same requests); the slab holds this rank's key/value heads and the logits are
gathered before sampling, so every rank samples the same tokens.

Host reads. Within a decode window nothing comes back to the host: sampling (`Sampler`, with every
request's uniforms drawn up front from its own generator) and stop-token matching run on the device,
positions advance by one per step without being read, and the window's tokens and log-probs come back in
one copy at its end. A window ends early when some request reaches max_new_tokens or max_len, so those
slots are refilled at once; a request that hits a stop token inside a window decodes on (in its own slot)
until the window ends and its extra tokens are dropped (`stats["discarded_tokens"]`). `sync_every=1` reads
back after every step.

GPU: nothing here is CPU-specific but the CPU decode kernels (`cpu_kernel`, which a GPU engine skips), and
`compile=True` decodes through CUDA graphs per bucket there (`loom generate` and `loom rl` compile by default on a
GPU: `resolve_compile`). An eager step's time on a GPU is the host's, dispatching op after op: per layer it does
only what differs between layers (`KVSlab`), and it uploads its inputs without waiting for the device.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import types
from collections import deque
from dataclasses import dataclass, field

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

from loom.errors import UserError
from loom.infer import cpu_kernels
from loom.models.init import canonical_name
from loom.parallel.distributed import local

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is continued. `temperature` 0 is greedy; `top_k` 0 and `top_p` 1 keep every token.
    Generation stops after `max_new_tokens`, at any of `stop_token_ids` (kept as the last token), or when
    prompt + completion fill the engine's `max_len`. `seed` None draws one from the engine's seed."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def check(self) -> None:
        bad = []
        if not self.temperature >= 0:
            bad.append(f"temperature={self.temperature} (must be >= 0; 0 is greedy)")
        if self.top_k < 0:
            bad.append(f"top_k={self.top_k} (must be >= 0; 0 keeps every token)")
        if not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p} (must be in (0, 1])")
        if self.max_new_tokens < 1:
            bad.append(f"max_new_tokens={self.max_new_tokens} (must be >= 1)")
        if bad:
            raise UserError("invalid sampling parameters: " + "; ".join(bad))


@dataclass
class Completion:
    """One finished request. `finish_reason`: "stop" (a stop token, the last of `tokens`), "length"
    (max_new_tokens reached) or "context" (prompt + completion reached the engine's max_len)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log-softmax of the raw logits (temperature 1)
    sampling_logprobs: list[float] = field(default_factory=list)  # under the distribution sampled from
    finish_reason: str = ""


class KVSlab:
    """Keys and values of every slot, allocated once: per layer [slots, kv_heads, max_len, head_dim].

    `bind` says which slot each row of the next forward is and where its tokens go; every attention layer
    then calls `attend`, which writes that layer's new keys and values and attends within each slot.

    Host work per layer. An eager decode step (a GPU engine without compile, whose time is the host's: every op
    is dispatched one by one) does everything that is the same for all layers once, in `bind`: the mask
    (additive, in the activations' dtype, folded for the query heads of each key/value head: what SDPA would
    otherwise convert from a boolean mask in every layer), and the index that writes each row's new keys and
    values. The slab's view of the bound slots is kept per layer while the batch keeps its size, and nothing in
    `attend` reads a tensor back to the host. bench/engine_ops.py counts the ops (results/engine_ops_cpu.json)."""

    # Key positions an additive mask's rows are padded to in memory: CUDA's memory-efficient attention pads a
    # mask whose rows are not aligned (a copy per layer) before it runs.
    MASK_ALIGN = 16

    def __init__(self, layer_ids, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, next(iter(self.k.values())).device
        self.rows = self.positions = self.mask = None  # rows: the slots as a tensor, when not slots 0..n-1
        self.static = False  # bound by bind_static (a compiled step)
        self.prefix = 0  # > 0: the rows are slots 0..prefix-1 in order (read the slab without copying)
        self.keys = 0  # key positions a query can see: 0..keys-1
        self.packed = None  # a packed prefill: (slot, row and position of each token), see bind_packed
        self._folded = None  # (rep, dtype, the step's mask as attention takes it for rep query heads per kv head)
        self._rows = None  # the list `rows` was made from (bind)
        self._write = None  # bind with prefix rows: each row's positions, expanded over heads and head_dim
        self._views = {}  # layer -> (K, V) of slots 0..prefix-1 (views, kept while the bound batch size stays)
        self.cpu_kernel = False  # decode attention through loom_cpu::decode_attention (fp32 CPU; the Engine sets it)

    def bind(self, rows: list[int], positions: torch.Tensor, keys: int | None = None) -> None:
        """Row b of the next forward is slot rows[b]; its tokens sit at positions[b] ([rows, seq]). `keys`:
        one past the highest position, if the caller knows it (else read back from `positions`)."""
        if self._rows != rows:  # a decode window binds the same rows every step: at most one copy
            self._rows, self.static = list(rows), False
            self.prefix = len(rows) if rows == list(range(len(rows))) else 0
            self.rows = None if self.prefix else upload(torch.tensor(rows), self.device)
        self.positions = positions if positions.device == self.device else positions.to(self.device)
        self.keys = int(positions.max()) + 1 if keys is None else keys
        self.packed = self._folded = None
        # Query at position p sees keys 0..p of its own slot: [rows, 1, seq, keys].
        self.mask = (torch.arange(self.keys, device=self.device) <= self.positions[..., None]).unsqueeze(1)
        if self.prefix:  # scatter_ index of the new keys and values: [rows, kv_heads, seq, head_dim]
            n, seq = self.positions.shape
            self._write = self.positions[:, None, :, None].expand(n, self.kv_heads, seq, self.head_dim)

    def bind_static(self, positions: torch.Tensor, mask: torch.Tensor) -> None:
        """For a compiled decode step: the rows are slots 0..rows-1 and every size comes from the tensors'
        shapes (no Python number that a compiled graph would specialise on). positions [rows, 1]; mask
        [rows, 1, q, keys], True where a query may attend (q = 1, or the query heads per key/value head
        when the CPU folds them into queries, see `attend`)."""
        self.rows, self.positions, self.mask, self.packed, self._rows = None, positions, mask, None, None
        self.static = True
        self._folded = (mask.shape[2], None, mask) if mask.shape[2] > 1 else None
        self.prefix = self.keys = -1  # sizes are taken from q and the mask

    def bind_packed(self, rows: list[int], lengths: list[int]) -> torch.Tensor:
        """The next forward is one packed row: the prompts of slots `rows` (lengths[b] tokens each, from
        position 0) laid end to end, no padding. Returns the tokens' positions [1, total] for the model's
        rotary tables. The linear layers see only real tokens; `attend` spreads queries, keys and values
        out per slot for the attention itself and packs the output back. Each token's slot, row and position
        are worked out on the host and go to the device in one copy (nothing is read back)."""
        self.rows, self._rows, self.static = upload(torch.tensor(rows), self.device), None, False
        self.prefix = len(rows) if rows == list(range(len(rows))) else 0
        self.keys = max(lengths)
        row_of = [b for b, n in enumerate(lengths) for _ in range(n)]
        table = upload(torch.tensor([[rows[b] for b in row_of], row_of,
                                     [p for n in lengths for p in range(n)]]), self.device)
        self.packed = (table[0], table[1], table[2])  # slot, row and position of each token
        self.positions = table[2][None]
        self.mask = self._folded = None
        return self.positions

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [rows, heads, seq, d], k/v [rows, kv_heads, seq, d] -> attention output [rows, heads, seq, d]."""
        if self.packed is not None:
            return self._attend_packed(layer_id, q, k, v)
        K, V = self.k[layer_id], self.v[layer_id]
        k, v = (t if t.dtype == K.dtype else t.to(K.dtype) for t in (k, v))
        if self.static:
            rows = torch.arange(q.shape[0], device=q.device)
            where = (rows[:, None], slice(None), self.positions)  # -> [rows, seq, kv_heads, d]
            K[where], V[where] = k.transpose(1, 2), v.transpose(1, 2)
            keys, values = K[:q.shape[0], :, :self.mask.shape[-1]], V[:q.shape[0], :, :self.mask.shape[-1]]
        elif self.prefix:  # slots 0..n-1: write in place, read a view
            Kn, Vn = self._slots(layer_id)
            Kn.scatter_(2, self._write, k)
            Vn.scatter_(2, self._write, v)
            keys, values = Kn[:, :, :self.keys], Vn[:, :, :self.keys]
        else:
            where = (self.rows[:, None], slice(None), self.positions)  # -> [rows, seq, kv_heads, d]
            K[where], V[where] = k.transpose(1, 2), v.transpose(1, 2)
            keys, values = self._bound(K), self._bound(V)
        rows, heads, seq, d = q.shape
        kv_heads = keys.shape[1]
        rep = heads // kv_heads
        # Grouped-query attention: SDPA with a mask and enable_gqa takes a slow path (CPU, torch 2.13: 15 ms against
        # 0.3 ms for one decode query over 150 keys; on CUDA only the math kernel takes both), and copying each
        # key/value head for its query heads costs a copy of the cache per layer and step. Instead the query heads
        # that share a key/value head become more queries of it: [rows, kv_heads, rep * seq, d] against the cache
        # as it is, each query keeping its own position's mask.
        kernel = self.cpu_kernel and q.dtype == keys.dtype == torch.float32 and q.device.type == "cpu"
        out = self._sdpa(q.reshape(rows, kv_heads, rep * seq, d), keys, values, self._step_mask(rep, q.dtype, kernel),
                         kernel)
        # reshape, not view: CUDA's attention kernels return [rows, queries, kv_heads, d] in memory (not contiguous)
        return out.reshape(rows, heads, seq, d)

    def _slots(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_id`'s keys and values of slots 0..prefix-1 (views, made again when the batch size changes)."""
        views = self._views.get(layer_id)
        if views is None or views[0].shape[0] != self.prefix:
            views = self._views[layer_id] = (self.k[layer_id][:self.prefix], self.v[layer_id][:self.prefix])
        return views

    def _step_mask(self, rep: int, dtype: torch.dtype, kernel: bool) -> torch.Tensor:
        """The bound mask as this step's attention takes it, made at the first layer and kept for the others:
        repeated for `rep` query heads per key/value head, and for SDPA in an eager step additive in `dtype` (0
        where a query may attend, -inf elsewhere: what SDPA makes of a boolean mask, once instead of per
        layer), its rows padded to `MASK_ALIGN` in memory. The CPU kernel and a compiled step take it boolean."""
        want = None if kernel or self.static else dtype
        if self._folded is not None and self._folded[:2] == (rep, want):
            return self._folded[2]
        mask = self.mask if rep == 1 else self.mask.repeat(1, 1, rep, 1)
        if want is not None:
            width = -(-mask.shape[-1] // self.MASK_ALIGN) * self.MASK_ALIGN
            bias = torch.full((*mask.shape[:-1], width), float("-inf"), dtype=want, device=mask.device)
            mask = bias[..., :mask.shape[-1]].masked_fill_(mask, 0.0)
        self._folded = (rep, want, mask)
        return mask

    def _sdpa(self, q, keys, values, mask, kernel: bool = False):
        """Masked attention of q [rows, kv_heads, queries, d] to the bound keys and values [rows, kv_heads, keys, d]:
        SDPA, or on a CPU with fp32 tensors (`kernel`) the decode kernel (loom/infer/cpu_kernels.py), which reads
        only the key and value rows some query may attend to (bench model, batch 16: 0.16 against 0.21 ms a layer)."""
        if kernel:
            return torch.ops.loom_cpu.decode_attention(q, keys, values, mask)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def _attend_packed(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, heads, total, d], k/v [1, kv_heads, total, d] of a packed prefill (`bind_packed`). Keys and
        values go straight to their slots; the queries are spread to [rows, heads, longest, d] and attend
        causally to their own slot's keys 0..p, all written by this prefill. A padding query (past its
        prompt's end) sees only its own slot too and its output is dropped when packing back."""
        K, V = self.k[layer_id], self.v[layer_id]
        slots, row_of, pos_of = self.packed
        K[slots, :, pos_of] = k[0].transpose(0, 1).to(K.dtype)  # [total, kv_heads, d]
        V[slots, :, pos_of] = v[0].transpose(0, 1).to(V.dtype)
        keys, values = self._bound(K), self._bound(V)
        heads, d = q.shape[1], q.shape[3]
        spread = q.new_zeros(len(self.rows), self.keys, heads, d)
        spread[row_of, pos_of] = q[0].transpose(0, 1)
        out = F.scaled_dot_product_attention(spread.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                             is_causal=True, enable_gqa=heads != keys.shape[1])
        return out.transpose(1, 2)[row_of, pos_of].transpose(0, 1)[None]

    def _bound(self, cache: torch.Tensor) -> torch.Tensor:
        """Key positions 0..keys-1 of the bound rows' slots: a view when they are slots 0..n-1, else a copy."""
        if self.prefix:
            return cache[:self.prefix, :, :self.keys]
        return cache[self.rows, :, :self.keys]

    def move(self, src: int, dst: int) -> None:
        """Copy slot src's keys and values of every layer into slot dst (in place: addresses stay)."""
        for cache in (self.k, self.v):
            for t in cache.values():
                t[dst].copy_(t[src])

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in (*self.k.values(), *self.v.values())]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor made on the host, on `device`. To a GPU through pinned memory without waiting for the device
    (an ordinary copy from pageable memory synchronises the stream); the caching host allocator keeps the pinned
    block until the copy is done, and the caller never writes `host` again."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class _Sequence:
    """A request while it holds a slot."""

    def __init__(self, index: int, prompt: list[int], params: SamplingParams, seed: int):
        self.index, self.params = index, params
        self.out = Completion(prompt=list(prompt))
        self.generator = torch.Generator().manual_seed(seed)
        self.length = len(prompt)  # tokens whose keys and values are in the slot


class Sampler:
    """Per-request sampling of a fixed set of requests for `steps` consecutive decode steps, entirely on the
    logits' device: the per-request settings become tensors once, and each hot (temperature > 0) request's
    uniforms for all the steps are drawn from its own generator up front (one per token, in order, so a
    request samples the same tokens however many steps a window holds) and moved in one copy. Greedy rows
    take the argmax (log-probability 0: a point mass); the others apply temperature, then top-k, then top-p
    (the smallest set of most likely tokens holding top_p of the mass), and invert the CDF at their uniform."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator], steps: int, vocab: int,
                 device):
        self.hot = [i for i, p in enumerate(params) if p.temperature > 0]
        self.sorts = False
        if not self.hot:
            return
        hot = [params[i] for i in self.hot]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in hot]
        self.sorts = min(top_k) < vocab or min(p.top_p for p in hot) < 1
        uniforms = torch.stack([torch.rand(steps, generator=generators[i]) for i in self.hot])
        # one copy to the device: row, temperature, top-k, top-p and the uniforms (float32, exact in float64)
        settings = torch.tensor([[i, p.temperature, k, p.top_p] for i, p, k in zip(self.hot, hot, top_k)],
                                dtype=torch.float64)
        table = upload(torch.cat([settings, uniforms.double()], 1), torch.device(device))
        self.idx = table[:, 0].long()
        self.temperature = table[:, 1:2].float()
        self.kth = table[:, 2:3].long() - 1
        self.top_p = table[:, 3:4].float()
        self.uniforms = table[:, 4:].float()  # [hot, steps]
        self.vocab = vocab

    def __call__(self, logits: torch.Tensor, greedy: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [rows, vocab] (fp32) and their argmax [rows] at window step `step` -> (token [rows], its
        log-probability under the distribution it was drawn from)."""
        tokens = greedy
        chosen = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        if not self.hot:
            return tokens, chosen
        x = logits[self.idx] / self.temperature
        order = None
        if self.sorts:
            x, order = x.sort(dim=-1, descending=True)
            kth = x.gather(1, self.kth)
            x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th logit stay, as in transformers
            probs = x.softmax(-1)
            x = x.masked_fill((probs.cumsum(-1) - probs > self.top_p) & (self.top_p < 1), float("-inf"))
        logp = x.log_softmax(-1)
        cdf = logp.exp().cumsum(-1)
        u = self.uniforms[:, step:step + 1]
        pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=self.vocab - 1)
        chosen[self.idx] = logp.gather(1, pick)[:, 0]
        tokens[self.idx] = pick[:, 0] if order is None else order.gather(1, pick)[:, 0]
        return tokens, chosen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of `Sampler`: logits [rows, vocab] (fp32) -> (token [rows], its log-probability under the
    distribution it was drawn from); each hot row draws one uniform from its generator."""
    return Sampler(params, generators, 1, logits.shape[-1], logits.device)(logits, logits.argmax(-1), 0)


# compile="frozen": the weights become constants of the compiled step (inductor's freezing), so that its
# CPU GEMM template (generated micro-kernels over weights packed once, chosen by timing against the ATen
# product) can run the products. The switches are inductor's global config, so they are set only while the
# step runs (where it compiles); torch.compile(options=...) does not reach freezing.
FROZEN_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}

# A command's compile setting (`loom generate --compile`, `rl.engine_compile`) and what each means for `Engine`.
COMPILE_SETTINGS = {"auto": None, "on": True, "off": False, "true": True, "false": False, "frozen": "frozen"}


def resolve_compile(setting: bool | str, device: torch.device | str) -> bool | str:
    """`Engine`'s compile mode (False, True or "frozen") for `setting` on `device`: the one place where "auto"
    is decided, for `loom generate` (prompt and batch mode), `loom rl`'s engine and the Python API alike.

    "auto" is on on a GPU: each decode step replays a CUDA graph (H200, Llama-3.2-1B shape, bf16: 1.6-4.1 ms
    a step at batch 1-256 against 40-49 ms eager, whose host dispatches every op one by one), and off on a CPU:
    compiled decode was 1.2-1.5x faster per token there, but building the engine (compiling every bucket first)
    took 3-8 s with a warm compile cache (bench/results/generate_cpu.json), more than a whole generation: `loom
    generate` of 16 prompts x 32 tokens on the tiny config took 2.5 s eager and 22 s compiled, the same tokens
    (bench/results/engine_ops_cpu.json). "on"/"off" (or True/False) force it; "frozen" is the CPU's frozen
    compile."""
    if isinstance(setting, bool):
        return setting
    if setting not in COMPILE_SETTINGS:
        raise UserError(f"compile={setting!r} is not valid: give False, True or \"frozen\", or a command's setting: "
                        "auto, on, off or frozen")
    mode = COMPILE_SETTINGS[setting]
    return torch.device(device).type == "cuda" if mode is None else mode


class Engine:
    """Generates for many requests at once on one model (or one tensor-parallel shard of it).

    `max_batch`: slots, the most sequences decoded together. `max_len`: the longest prompt + completion
    (at most the model's max_seq_len). `seed`: where requests without their own seed get one.
    `sync_every`: decode steps run on the device between reads back to the host (see the module's "Host
    reads"); a request's tokens do not depend on it.

    `compile=True` runs decode steps through `torch.compile` with shapes from a few buckets: the batch is
    padded to the next power of two (at most max_batch) of the busy slots (requests are moved down into
    freed slots first, see `_compact`), and the keys a step reads to the next multiple of `KEY_BLOCK`
    (`CUDA_KEY_BLOCK` on a GPU; at most max_len); the batch and key dimensions are marked dynamic, so one
    or two compiled graphs serve every step (on CUDA one recorded graph per bucket). On CUDA
    it compiles with mode "reduce-overhead", i.e. replays a CUDA graph per bucket; the slab's tensors are
    marked as static addresses and a refit copies into the parameters in place, so the graphs stay valid.
    Prefill (ragged, packed) stays eager. The first steps of each bucket pay for compilation. A command's
    setting is taken too: "on", "off", or "auto", which `resolve_compile` decides (on on a GPU, off on a CPU).

    `compile="frozen"` (CPU, one process) freezes the weights into the compiled step, LM head included, so
    that inductor's CPU GEMM template runs the products with micro-kernels over weights packed once, each
    chosen by timing it against the ATen product (max-autotune): one graph per batch bucket, compiled at
    construction (about a minute for a 22M-parameter model on 2 cores), a packed copy of the weights
    beside the model's, and a refit compiles afresh (its time is the compile's). With the packed kernel
    (below) the products are that kernel's in either compiled mode and frozen gains nothing over
    compile=True, which builds in seconds and refits by repacking; frozen is kept for cpu_kernel=False.

    `cpu_kernel` (CPU, fp32 weights, one process): decode steps, and the prefill's head on the prompts' last
    positions, multiply through `loom.infer.cpu_kernels` (weights packed once into 16-column panels, a register-
    tiled AVX2 product for few rows: about 2x ATen's at 16 rows on the bench machine) on a twin of the model
    that shares its parameters (`_packed_twin`; the model itself is untouched) and holds the packed copy
    (as much memory again as the linear layers); a refit repacks in place. With compile=True the head and
    its reductions then run inside the compiled step too. Where the kernel cannot run (no AVX2, no C++
    compiler, LOOM_CPU_KERNELS=0, bf16, a GPU, a tensor-parallel shard) the engine uses F.linear as before;
    `stats["packed_linears"]` counts the layers that run packed. The prefill's own products stay ATen's:
    at hundreds of rows the kernel is no faster."""

    KEY_BLOCK = 64
    CUDA_KEY_BLOCK = 256  # fewer key-length buckets where each bucket is a recorded CUDA graph

    def __init__(self, model: nn.Module, max_batch: int = 16, max_len: int | None = None, seed: int = 0,
                 compile: bool | str = False, sync_every: int = 8, cpu_kernel: bool = True):
        cfg = model.cfg
        max_len = cfg.max_seq_len if max_len is None else max_len
        if max_batch < 1 or not 2 <= max_len <= cfg.max_seq_len or sync_every < 1:
            raise UserError(f"Engine(max_batch={max_batch}, max_len={max_len}, sync_every={sync_every}): max_batch "
                            f"and sync_every must be >= 1 and max_len in [2, {cfg.max_seq_len}] (the model's "
                            "max_seq_len)")
        self.sync_every = sync_every
        self.model = model.eval()
        # Decode steps (and the prefill's head) run on `_decoder`: the model itself, or on a CPU with fp32
        # weights its twin whose linear layers multiply through the packed small-batch kernel (`_packed_twin`).
        self._decoder, self._packed = model, []
        if cpu_kernel:
            self._decoder, self._packed = _packed_twin(model)
        self.max_batch, self.max_len, self.vocab = max_batch, max_len, cfg.vocab_size
        weight = local_tensor(next(model.parameters()))
        attention = next(iter(model.layers.values())).attention
        kv_heads = local_tensor(attention.wk.weight).shape[0] // attention.head_dim  # this rank's, under TP
        # One position beyond max_len that nothing reaches: a step's keys (at most max_len) never span the
        # whole slab, so a compiled step does not specialise on "keys == slab length" (one graph fewer).
        self.slab = KVSlab(model.layers.keys(), max_batch, kv_heads, max_len + 1, attention.head_dim,
                           weight.dtype, weight.device)
        self.slab.cpu_kernel = bool(self._packed)  # the kernels built and loaded, fp32 CPU weights
        self.device = weight.device
        self._seeds = torch.Generator().manual_seed(seed)
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "windows": 0, "refills": 0, "decoded_tokens": 0,
                      "discarded_tokens": 0, "compiled_steps": 0, "moves": 0, "packed_linears": len(self._packed)}
        self.last_refit_s: float | None = None
        heads = local_tensor(attention.wq.weight).shape[0] // attention.head_dim
        # Decode attention folds the query heads of a key/value head into queries (KVSlab.attend).
        self._fold = heads // kv_heads
        self._compiled = None
        compile = resolve_compile(compile, self.device)
        self.compile_mode = compile  # the resolved setting: False, True or "frozen"
        self._frozen = compile == "frozen"
        # The compiled step computes the head and its reductions itself when frozen, or when the head is a packed
        # layer (CPU); else it returns hidden states and the head runs after it (`head_logits`, TP's gather).
        self._head_in_step = self._frozen or isinstance(self._decoder.output, cpu_kernels.PackedLinear)
        if self._frozen and (self.device.type != "cpu" or hasattr(weight, "device_mesh")):
            raise UserError("Engine(compile=\"frozen\") is the CPU path for one process (weights frozen into the "
                            "compiled step); on a GPU or under tensor parallelism use compile=True")
        if compile:
            for t in (*self.slab.k.values(), *self.slab.v.values()):
                torch._dynamo.mark_static_address(t)
            self._compiled = self._compile()
            self.warmup()

    def _compile(self):
        """The compiled decode step. Frozen: a copy of `_static_decode` with its own code object, so that its
        compiled graphs (which hold this model's weights, packed) are cached apart from every other engine's
        and a refit can start afresh."""
        if not self._frozen:
            return torch.compile(self._static_decode, mode="reduce-overhead" if self.device.type == "cuda" else None)
        fn = Engine._static_decode
        fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        # One graph per batch bucket (with key length dynamic): room for them all in dynamo's per-code limit.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self._batch_buckets()))
        return torch.compile(types.MethodType(fresh, self))

    @torch.no_grad()
    def warmup(self) -> float:
        """Compile (and on CUDA record) the decode step for every batch and key-length bucket now, as a server
        does at start, instead of in the middle of a generation; returns the seconds it took. Writes only
        position 0 of idle slots: call it while no generation runs."""
        start = time.perf_counter()
        # CUDA graph trees run a bucket's first call as a warm-up and record its graph on the second.
        calls = 2 if self.device.type == "cuda" else 1
        for keys in sorted({self._key_bucket(n) for n in range(1, self.max_len + 1)}):
            for size in self._batch_buckets():
                tokens, positions = (torch.zeros(size, 1, dtype=torch.long, device=self.device) for _ in range(2))
                for _ in range(calls):
                    self._run_compiled(tokens, positions, keys)
        self.stats["warmup_s"] = time.perf_counter() - start
        return self.stats["warmup_s"]

    def _batch_buckets(self) -> list[int]:
        """Every batch size a compiled step runs at (`_bucket` of 1..max_batch)."""
        return sorted({self._bucket(n) for n in range(1, self.max_batch + 1)})

    def _key_bucket(self, n: int) -> int:
        """Key positions a compiled step reads when it needs n: the next multiple of the device's block."""
        block = self.KEY_BLOCK if self.device.type == "cpu" else self.CUDA_KEY_BLOCK
        return min(self.max_len, -(-n // block) * block)

    def _run_compiled(self, tokens, positions, keys: int):
        """The compiled step on slots 0..rows-1 reading `keys` key positions (`_static_decode`: hidden states,
        or with the head in the step (frozen, or a packed head), the head's logits with their argmax and
        log-sum-exp); its mask is folded for the query heads of each key/value head (KVSlab.attend)."""
        mask = (torch.arange(keys, device=positions.device) <= positions[..., None]).unsqueeze(1)
        mask = mask.repeat(1, 1, self._fold, 1)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        if self._frozen:  # one graph per batch bucket: the GEMM template needs a static row count
            with inductor_config.patch(FROZEN_OPTIONS):
                return self._compiled(tokens, positions, mask)
        for t in (tokens, positions, mask):  # one graph for every bucket (sizes 1 aside), not one per bucket
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return local(self._compiled(tokens, positions, mask))

    # --- generation -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_done=None) -> list[Completion]:
        """Continue every prompt (a list of token ids); results in the order of `prompts`. `params`: one for
        all or one per prompt. `on_done(index, completion)` is called as each request finishes."""
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params)} sampling parameters; give one for all or "
                            "one per prompt")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p.check()
            if not 1 <= len(prompt) < self.max_len:
                raise UserError(f"prompt {i} has {len(prompt)} tokens; it needs 1 to {self.max_len - 1} "
                                f"(the engine's max_len={self.max_len} holds prompt and completion)")
            if min(prompt) < 0 or max(prompt) >= self.vocab:
                raise UserError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab})")
        seeds = [p.seed if p.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seeds))
                 for p in params]
        waiting = deque(range(len(prompts)))
        slots: list[_Sequence | None] = [None] * self.max_batch
        results: list[Completion | None] = [None] * len(prompts)

        def finish(seqs: list[_Sequence]) -> None:
            for seq in seqs:
                if seq.out.finish_reason:
                    results[seq.index] = seq.out
                    slots[slots.index(seq)] = None
                    if on_done is not None:
                        on_done(seq.index, seq.out)

        while waiting or any(slots):
            free = [s for s, seq in enumerate(slots) if seq is None]
            if waiting and free:  # fill free slots first: a freed slot never waits for the others
                busy = len(free) < self.max_batch
                admitted = []
                for s in free[:len(waiting)]:
                    i = waiting.popleft()
                    slots[s] = _Sequence(i, prompts[i], params[i], seeds[i])
                    admitted.append(s)
                self.stats["refills"] += len(admitted) if busy else 0
                finish(self._prefill(admitted, [slots[s] for s in admitted]))
            active = [s for s, seq in enumerate(slots) if seq is not None]
            if active and active[-1] >= len(active):  # holes below a busy slot (nothing waits to fill them)
                self._compact(slots)
                active = list(range(len(active)))
            if active:
                finish(self._decode(active, [slots[s] for s in active]))
        return results

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

    def _prefill(self, rows: list[int], seqs: list[_Sequence]) -> list[_Sequence]:
        """The admitted prompts as one packed row (no padding through the linear layers); each request's
        first token comes from the logits at its prompt's last position."""
        lengths = [len(seq.out.prompt) for seq in seqs]
        total = sum(lengths)
        ends = [end - 1 for end in itertools.accumulate(lengths)]  # each prompt's last token in the row
        # the tokens and the prompts' last positions in one copy
        host = upload(torch.tensor([t for seq in seqs for t in seq.out.prompt] + ends), self.device)
        tokens, last = host[:total][None], host[total:]
        positions = self.slab.bind_packed(rows, lengths)
        self.stats["prefill_steps"] += 1
        hidden = local(self.model(tokens, cache=self.slab, positions=positions, return_hidden=True))
        head = reduce_logits(head_logits(self._decoder.output, hidden[0, last]))
        self._emit(seqs, [self._pick(head, self._sampler(seqs, 1), 0)], self._stop_table(seqs), 1, fed=0)
        return seqs

    def _static_decode(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        """The compiled decode step: slots 0..rows-1, one token each -> final hidden states [rows, hidden] (frozen
        or with a packed head: the head's fp32 logits with their argmax and log-sum-exp, `reduce_logits`, the
        head's product and the reductions inside the step)."""
        self.slab.bind_static(positions, mask)
        hidden = self._decoder(tokens, cache=self.slab, positions=positions, return_hidden=True)[:, 0]
        return reduce_logits(self._decoder.output(hidden).float()) if self._head_in_step else hidden

    def _bucket(self, n: int) -> int:
        size = 1
        while size < n:
            size *= 2
        return min(size, self.max_batch)

    def _decode(self, rows: list[int], seqs: list[_Sequence]) -> list[_Sequence]:
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
        next power of two of max(rows) + 1 (an idle slot in that range decodes token 0 at position 0 of its
        own slot, which nothing reads: a request prefills position 0 of its slot before reading it)."""
        budget = [min(s.params.max_new_tokens - len(s.out.tokens), self.max_len - len(s.out.prompt) - len(s.out.tokens))
                  for s in seqs]
        steps = max(1, min(self.sync_every, *budget))
        sampler = self._sampler(seqs, steps)
        n, eager = len(rows), self._compiled is None
        size = len(rows) if eager else self._bucket(max(rows) + 1)
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
        out = []
        for step in range(steps):
            keys = first + step + 1  # key positions the furthest request reads
            if not eager:
                x = self._run_compiled(tokens, positions, self._key_bucket(keys))
                if size != len(rows):  # idle bucket rows out (every row busy: no gather)
                    x = tuple(t[where] for t in x) if self._head_in_step else x[where]
                # the step computed the head and its reductions itself, or returned hidden states
                head = x if self._head_in_step else reduce_logits(head_logits(self._decoder.output, x))
                self.stats["compiled_steps"] += 1
            else:
                self.slab.bind(rows, positions, keys=keys)
                hidden = local(self._decoder(tokens, cache=self.slab, positions=positions, return_hidden=True))[:, 0]
                head = reduce_logits(head_logits(self._decoder.output, hidden))
            token, logprob, sampled = self._pick(head, sampler, step)
            out.append((token, logprob, sampled))
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

    def _sampler(self, seqs: list[_Sequence], steps: int) -> Sampler:
        return Sampler([s.params for s in seqs], [s.generator for s in seqs], steps, self.vocab, self.device)

    def _stop_table(self, seqs: list[_Sequence]) -> torch.Tensor | None:
        """[requests, most stop tokens] on the device, padded with -1 (never a token); None if none stop."""
        width = max(len(s.params.stop_token_ids) for s in seqs)
        if not width:
            return None
        rows = [list(s.params.stop_token_ids) + [-1] * (width - len(s.params.stop_token_ids)) for s in seqs]
        return upload(torch.tensor(rows), self.device)

    def _pick(self, head, sampler: Sampler, step: int):
        """The head's fp32 logits [requests, vocab] with their argmax and log-sum-exp (`reduce_logits`) -> next
        token, its log-prob under the raw logits (temperature 1) and under the distribution it was sampled
        from; all on the device."""
        logits, greedy, lse = head
        token, sampled = sampler(logits, greedy, step)
        return token, logits.gather(1, token[:, None])[:, 0] - lse, sampled

    def _emit(self, seqs: list[_Sequence], out: list, stops, steps: int, fed: int) -> int:
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
        table = torch.cat(columns, 1).tolist()  # the window's one read-back
        kept = 0
        for seq, row in zip(seqs, table):
            out, p = seq.out, seq.params
            stop_at = int(row[3 * steps]) if stops is not None else steps
            for step in range(steps):
                out.tokens.append(int(row[step]))
                out.logprobs.append(row[steps + step])
                out.sampling_logprobs.append(row[2 * steps + step])
                kept += 1
                if step == stop_at:
                    out.finish_reason = "stop"
                elif len(out.tokens) >= p.max_new_tokens:
                    out.finish_reason = "length"
                elif len(out.prompt) + len(out.tokens) >= self.max_len:
                    out.finish_reason = "context"
                if out.finish_reason:
                    break
            seq.length += fed
        return kept

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
        state = source.state_dict() if isinstance(source, nn.Module) else source
        state = {canonical_name(k): v for k, v in state.items()}
        params = dict(self.model.named_parameters())  # one entry per tensor: a tied head appears once
        missing = [name for name in params if name not in state]
        if missing:
            raise UserError(f"refit: the new weights lack {len(missing)} of the engine's parameters, e.g. "
                            f"{missing[:3]}; give the whole model's state dict (a pipeline stage holds only some "
                            "layers: gather them first)")
        for name, p in params.items():
            src = local(state[name])
            if tuple(src.shape) != tuple(p.shape):
                raise UserError(f"refit: {name} has shape {tuple(src.shape)}; the engine's model has {tuple(p.shape)}")
            if hasattr(p, "device_mesh"):  # a tensor-parallel engine: this rank's shard of the full tensor
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(src.to_local())
            else:
                p.copy_(src)
        for packed in self._packed:  # the twin's packed copies of the new weights, in place
            packed.repack()
        if self._frozen:  # the compiled step holds packed copies of the old weights: compile it afresh
            self._compiled = self._compile()
            self.warmup()
        if self.device.type == "cuda":  # the copies run asynchronously: time them, not their launches
            torch.cuda.synchronize(self.device)
        self.last_refit_s = time.perf_counter() - start
        log.info("refit: %d tensors in %.3f s", len(params), self.last_refit_s)
        return self.last_refit_s


def _packed_twin(model: nn.Module) -> tuple[nn.Module, list[cpu_kernels.PackedLinear]]:
    """(twin, its packed layers): a copy of `model` that shares every parameter and buffer with it but whose
    fp32 CPU linear layers (`cpu_kernels.packable`) are `cpu_kernels.PackedLinear`s over the model's own weights,
    so that a decode step's few-row products run through the packed kernel; the twin holds a packed copy of
    those weights (as much memory again as the linear layers). The model itself is untouched: a trainer's
    forward on it stays its own. (model, []) when nothing is packable or the kernel cannot run here."""
    if not any(cpu_kernels.packable(m) for m in model.modules()):
        return model, []
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo)
    originals = dict(model.named_modules())
    packed = []
    for name, module in list(twin.named_modules()):
        if name and cpu_kernels.packable(module):
            parent, _, leaf = name.rpartition(".")
            packed.append(cpu_kernels.PackedLinear(originals[name]))
            setattr(twin.get_submodule(parent) if parent else twin, leaf, packed[-1])
    return twin, packed


def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] of the LM head. On a CPU, for the few rows of a decode step and a plain fp32
    weight, computed as (W h^T)^T: MKL's sgemm streams the tall weight far faster as the left operand
    (torch 2.13, 2-core EPYC, 16 rows through a 16000 x 384 head: 8.5 ms as `F.linear`, 4.7 ms so, the
    transposing copy included); the result equals `F.linear`'s up to the order of fp32 additions."""
    if isinstance(head, cpu_kernels.PackedLinear):
        return head(hidden)
    w = head.weight
    if (hidden.device.type == "cpu" and type(w) is nn.Parameter and w.dtype == hidden.dtype == torch.float32
            and 1 < hidden.shape[0] <= 64 and getattr(head, "bias", None) is None and type(head) is nn.Linear):
        return torch.mm(w, hidden.t()).t().contiguous()
    return local(head(hidden)).float()


def reduce_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits [rows, vocab] -> (logits, argmax [rows], log-sum-exp [rows]): what sampling and the
    log-probabilities read. Inside the frozen compiled step both reductions fuse into the step's graph (CPU,
    bench model, batch 16, vocab 16000: 11.1 ms per decode step against 12.3 ms with ATen's eager argmax and
    logsumexp after the step)."""
    return logits, logits.argmax(-1), logits.logsumexp(-1)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) parameter."""
    return t.to_local() if hasattr(t, "to_local") else t
