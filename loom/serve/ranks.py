"""Tensor-parallel serving (`loom serve --nproc N`): one engine shard per rank, every rank stepping in lockstep.

Rank 0 serves HTTP and runs the scheduler (loom/serve/scheduler.py) on a `Leader`, which stands in for the engine:
each `submit` and `cancel` is applied to rank 0's engine at once and recorded; each `step` (and `abort`) first
broadcasts the recorded operations and the step itself to the other ranks (a gloo group, so a GPU run's control
messages stay off NCCL), which `follow` them on their own shards in the same order. Requests take their random
streams from the engine's seed generator in submission order, so every rank draws the same tokens; the model's
collectives (the row-parallel all-reduces, the vocabulary-parallel head) keep the shards' numbers whole.

An idle leader sends a no-op every `HEARTBEAT_S` seconds so that the followers' waits never reach the group's
timeout; `close()` tells them to leave.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_S = 60.0


def control_group():
    """A gloo group over every rank, with a timeout longer than any idle wait between heartbeats."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=10 * HEARTBEAT_S))


class Leader:
    """Rank 0's engine as the scheduler sees it: the engine's own `submit`, `cancel`, `step`, `abort`, `check`,
    `waiting`, `running` and `stats`, with every state change mirrored to the followers."""

    constrains = False  # no grammar-constrained requests: the followers would sample without the mask

    def __init__(self, engine, group):
        self.engine, self.group = engine, group
        self._ops: list[tuple] = []
        self._ids: dict[int, int] = {}  # id(engine request) -> the number the followers know it by
        self._next = 0
        self._sent = time.monotonic()

    def __getattr__(self, name):  # waiting, running, stats, check, ...: the engine's
        return getattr(self.engine, name)

    def submit(self, prompt, params):
        request = self.engine.submit(prompt, params)
        self._ids[id(request)] = self._next
        self._ops.append(("submit", self._next, prompt, params))
        self._next += 1
        return request

    def cancel(self, request) -> None:
        self.engine.cancel(request)
        number = self._ids.pop(id(request), None)
        if number is not None:
            self._ops.append(("cancel", number))

    def step(self):
        self._send(("step",))
        updates = self.engine.step()
        for update in updates:
            if update.finished:
                number = self._ids.pop(id(update.request), None)
                if number is not None:
                    self._ops.append(("forget", number))
        return updates

    def abort(self):
        self._send(("abort",))
        self._ids.clear()
        return self.engine.abort()

    def heartbeat(self) -> bool:
        """For the scheduler's idle wait (called about once a second): a no-op to the followers now and then."""
        if time.monotonic() - self._sent > HEARTBEAT_S:
            self._send(("noop",))
        return True

    def close(self) -> None:
        self._send(("stop",))

    def _send(self, last: tuple) -> None:
        message, self._ops = [*self._ops, last], []
        dist.broadcast_object_list([message], src=0, group=self.group)
        self._sent = time.monotonic()


def follow(engine, group) -> None:
    """A rank other than 0: apply the leader's operations to this rank's engine shard until it says stop."""
    requests: dict[int, object] = {}
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        for op in box[0]:
            kind = op[0]
            if kind == "submit":
                requests[op[1]] = engine.submit(op[2], op[3])
            elif kind == "cancel":
                if (request := requests.pop(op[1], None)) is not None:
                    engine.cancel(request)
            elif kind == "forget":
                requests.pop(op[1], None)
            elif kind == "step":
                engine.step()
            elif kind == "abort":
                engine.abort()
                requests.clear()
            elif kind == "stop":
                return
