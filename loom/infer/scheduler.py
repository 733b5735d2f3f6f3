"""The engine's schedule: which request runs in which slot. Submitted requests are checked at once and wait in a
queue; each round admits them into free slots as the key/value memory can promise them room (`admit`), moves
the busy requests down into slots freed below them (`active`: a decode step then covers slots 0..busy-1), and
lets finished, cancelled or aborted requests go, their slots and key/value memory with them."""

from __future__ import annotations

from collections import deque

import torch

from loom.errors import UserError
from loom.infer.request import Request
from loom.infer.sampling import SamplingParams


class Scheduler:
    """The requests of one engine and the slots they hold. `slab`: the engine's key/value memory (`KVSlab` or
    `PagedKV`), which admits, moves and releases a request's keys and values with its slot. `decode`: token ids
    -> text, which requests with stop strings need. `seed`: where requests without their own seed get one.
    `stats`: the engine's counters ("refills", "moves" are kept here)."""

    def __init__(self, slab, max_batch: int, max_len: int, vocab: int, decode, seed: int, stats: dict):
        self.slab, self.max_batch, self.max_len, self.vocab, self.decode = slab, max_batch, max_len, vocab, decode
        self.stats = stats
        self.waiting: deque[Request] = deque()  # submitted, not yet admitted
        self.slots: list[Request | None] = [None] * max_batch  # the request holding each slot
        self.submitted = 0
        self._seeds = torch.Generator().manual_seed(seed)

    # --- admission ------------------------------------------------------------------------------------------

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
        if not self.slab.fits(self.most(prompt, p)):
            raise UserError(f"request {i} may hold {self.most(prompt, p)} positions but the engine's key/value "
                            f"pool holds {(self.slab.pool.blocks - 1) * self.slab.block_size}; raise kv_tokens "
                            "or lower max_new_tokens")

    def enqueue(self, prompt: list[int], p: SamplingParams, index: int) -> Request:
        """Queue a checked request (`check`); it is admitted by a later `admit`."""
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seeds))
        request = Request(index, list(prompt), p, seed)
        self.submitted += 1
        self.slab.expect([request.out.prompt])
        self.waiting.append(request)
        return request

    def most(self, prompt: list[int], p: SamplingParams) -> int:
        """The most key/value positions a request can hold."""
        return min(len(prompt) + p.max_new_tokens, self.max_len)

    # --- the slots ------------------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return sum(seq is not None for seq in self.slots)

    def holding(self, slots: list[int]) -> list[Request]:
        """The requests in `slots`, in that order."""
        return [self.slots[s] for s in slots]

    def admit(self) -> list[int]:
        """Waiting requests into free slots (a freed slot never waits for the others); their slots."""
        waiting, slots = self.waiting, self.slots
        free = [s for s, seq in enumerate(slots) if seq is None]
        if not (waiting and free):
            return []
        busy = len(free) < self.max_batch
        admitted = []
        for s in free[:len(waiting)]:
            seq = waiting[0]
            prompt, most = seq.out.prompt, self.most(seq.out.prompt, seq.params)
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

    def active(self) -> list[int]:
        """The busy slots, moved down first where holes lie below one (nothing waits to fill them)."""
        active = [s for s, seq in enumerate(self.slots) if seq is not None]
        if active and active[-1] >= len(active):
            self._compact()
            active = list(range(len(active)))
        return active

    def _compact(self) -> None:
        """Move the requests above the first len(busy) slots into the free slots below, keys and values
        with them: a decode step then covers slots 0..busy-1 (the slab read in place, a compiled step's
        bucket sized by the busy count, not by the highest busy slot)."""
        slots = self.slots
        busy = sum(seq is not None for seq in slots)
        holes = [s for s in range(busy) if slots[s] is None]
        movers = [s for s in range(busy, len(slots)) if slots[s] is not None]
        for dst, src in zip(holes, movers):
            self.slab.move(src, dst)
            slots[dst], slots[src] = slots[src], None
        self.stats["moves"] += len(movers)

    # --- leaving --------------------------------------------------------------------------------------------

    def finish(self, seqs: list[Request]) -> None:
        """The requests of `seqs` that finished give back their slots and key/value memory."""
        for seq in seqs:
            if seq.out.finish_reason:
                slot = self.slots.index(seq)
                # paged with a prefix cache: its whole blocks stay for later prompts (its last token was never fed)
                self.slab.keep(slot, seq.out.prompt + seq.out.tokens[:-1])
                self.slab.release(slot)
                self.slots[slot] = None
                seq.state = "done"

    def cancel(self, request: Request) -> None:
        """Drop a waiting or running request (its slot and blocks go back); one already done stays as it is."""
        if request.state == "waiting":
            self.waiting.remove(request)
            self.slab.withdraw(request.out.prompt)
        elif request.state == "running":
            slot = next(s for s, seq in enumerate(self.slots) if seq is request)
            self.slab.release(slot)
            self.slots[slot] = None
        if not request.done:
            request.state = "cancelled"

    def abort(self) -> list[Request]:
        """Cancel every waiting and running request and empty the key/value memory; returns them."""
        dropped = list(self.waiting) + [seq for seq in self.slots if seq is not None]
        for seq in dropped:
            seq.state = "cancelled"
        self.waiting.clear()
        self.slots = [None] * self.max_batch
        self.slab.reset()
        return dropped
