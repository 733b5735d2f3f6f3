"""The compiled decode step of the generation engine, and where its compile setting is decided.

`CompiledDecode` runs a decode step (slots 0..rows-1, one token each) through `torch.compile` with shapes from a
few buckets: the batch padded to the next power of two (at most max_batch) of the busy slots, and the keys a
step reads to the next multiple of `KEY_BLOCK` (`CUDA_KEY_BLOCK` on a GPU; at most max_len); the batch and key
dimensions are marked dynamic, so one or two compiled graphs serve every step. On CUDA it compiles with mode
"reduce-overhead", i.e. replays a CUDA graph per bucket; the slab's tensors are marked as static addresses and
a refit copies into the parameters in place, so the graphs stay valid.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from loom.errors import UserError
from loom.infer.kv import KVSlab
from loom.infer.sampling import reduce_logits
from loom.parallel.distributed import full_tensor

# A command's compile setting (`loom generate --compile`, `rl.engine_compile`) and what each means for `Engine`.
COMPILE_SETTINGS = {"auto": None, "on": True, "off": False, "true": True, "false": False}


def resolve_compile(setting: bool | str, device: torch.device | str) -> bool:
    """Whether `Engine` compiles its decode step for `setting` on `device`: the one place where "auto" is
    decided, for `loom generate` (prompt and batch mode), `loom rl`'s engine and the Python API alike.

    "auto" is on on a GPU, where each decode step replays a CUDA graph instead of a host dispatching every op one
    by one, and off on a CPU, where building the engine (compiling every bucket first) costs more than a whole
    short generation (bench/results/generate_cpu.json, engine_ops_cpu.json). "on"/"off" (or True/False) force
    it."""
    if isinstance(setting, bool):
        return setting
    if setting not in COMPILE_SETTINGS:
        raise UserError(f"compile={setting!r} is not valid: give False or True, or a command's setting: auto, on "
                        "or off")
    mode = COMPILE_SETTINGS[setting]
    return torch.device(device).type == "cuda" if mode is None else mode


class CompiledDecode:
    """The compiled decode step of one engine: `decoder` (the model, or its CPU twin) on `slab`. Called with
    tokens and positions [rows, 1] of slots 0..rows-1 (rows a `bucket`) and the key positions the furthest
    row reads; returns final hidden states [rows, hidden], or with `head_in_step` the head's logits (its dtype)
    with their argmax and log-sum-exp in fp32 (`reduce_logits`). Its mask is folded for the `fold` query heads of each
    key/value head (`KVSlab.attend`). On paged keys and values (`PagedKV`) each step also takes its bucket's
    rows and block columns of the window's block table (fixed shapes per bucket), and the mask spans whole blocks."""

    KEY_BLOCK = 64
    CUDA_KEY_BLOCK = 256  # fewer key-length buckets where each bucket is a recorded CUDA graph

    def __init__(self, decoder: nn.Module, slab: KVSlab, fold: int, head_in_step: bool, max_batch: int,
                 max_len: int, device: torch.device):
        self.decoder, self.slab, self.fold, self.head_in_step = decoder, slab, fold, head_in_step
        self.max_batch, self.max_len, self.device = max_batch, max_len, device
        for t in (*slab.k.values(), *slab.v.values()):
            torch._dynamo.mark_static_address(t)
        self._step = torch.compile(self._static_step, mode="reduce-overhead" if device.type == "cuda" else None)

    def _static_step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, table=None):
        if table is None:
            self.slab.bind_static(positions, mask)
        else:
            self.slab.bind_static(positions, mask, table)
        hidden = self.decoder(tokens, cache=self.slab, positions=positions, return_hidden=True)[:, 0]
        return reduce_logits(self.decoder.output(hidden)) if self.head_in_step else hidden

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, keys: int):
        span, table = self.key_bucket(keys), None
        paged = getattr(self.slab, "window_table", None) is not None  # PagedKV: the bucket's block table
        if paged:
            blocks = self.slab.blocks_for(span)
            span, table = blocks * self.slab.block_size, self.slab.window_table[:tokens.shape[0], :blocks].contiguous()
            torch._dynamo.maybe_mark_dynamic(table, 1)
        mask = (torch.arange(span, device=positions.device) <= positions[..., None]).unsqueeze(1)
        mask = mask.repeat(1, 1, self.fold, 1)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        for t in (tokens, positions, mask, table):  # one graph for every bucket (sizes 1 aside), not one per bucket
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if table is None:
            return full_tensor(self._step(tokens, positions, mask))
        return full_tensor(self._step(tokens, positions, mask, table))

    def bucket(self, n: int) -> int:
        """The batch a step of n rows runs at: the next power of two, at most max_batch."""
        size = 1
        while size < n:
            size *= 2
        return min(size, self.max_batch)

    def batch_buckets(self) -> list[int]:
        """Every batch size a compiled step runs at (`bucket` of 1..max_batch)."""
        return sorted({self.bucket(n) for n in range(1, self.max_batch + 1)})

    def key_bucket(self, n: int) -> int:
        """Key positions a compiled step reads when it needs n: the next multiple of the device's block."""
        block = self.KEY_BLOCK if self.device.type == "cpu" else self.CUDA_KEY_BLOCK
        return min(self.max_len, -(-n // block) * block)

    @torch.no_grad()
    def warmup(self) -> float:
        """Compile (and on CUDA record) the step for every batch and key-length bucket now, as a server does at
        start, instead of in the middle of a generation; returns the seconds it took. Writes only position 0 of
        idle slots: call it while no generation runs."""
        start = time.perf_counter()
        # CUDA graph trees run a bucket's first call as a warm-up and record its graph on the second.
        calls = 2 if self.device.type == "cuda" else 1
        if hasattr(self.slab, "idle_table"):  # paged: every row on the scratch block
            self.slab.idle_table()
        for keys in sorted({self.key_bucket(n) for n in range(1, self.max_len + 1)}):
            for size in self.batch_buckets():
                tokens, positions = (torch.zeros(size, 1, dtype=torch.long, device=self.device) for _ in range(2))
                for _ in range(calls):
                    self(tokens, positions, keys)
        return time.perf_counter() - start
