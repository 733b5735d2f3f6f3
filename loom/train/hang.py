"""A hung collective becomes an error that names the rank (`train.collective_timeout_s`).

The process group is created with that timeout, so a collective that waits longer raises on the
ranks that are waiting. To say *who* they were waiting for, every rank posts what it is about to do
("step 12: train", "step 12: checkpoint save", ...) to the process group's key-value store, with a
sequence number; a rank that times out reads the others' posts and names those behind it.

`mark` itself only notes the post: a background thread writes the latest one to the store at most once every
`post_interval(timeout)` seconds (a fraction of the timeout, at most 10 s) and only when it changed, so a run
of short steps costs the store one write per rank per interval, not one or more per step. A rank that stops
(hung, or waiting in a collective) has its last post in the store within one interval: long before any other
rank's collective times out.

Test hook: `LOOM_TEST_HANG=RANK:WHAT` makes rank RANK stop (sleep) instead of starting WHAT, e.g.
`1:step 3: train`; the sleeping process dies on SIGTERM, as a process stuck in Python would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref

from loom.errors import CollectiveTimeout

TIMEOUT_MARKERS = ("timed out", "timeout")
PEER_GONE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` was raised by the communication backend, judged by its type: torch's distributed
    errors (NCCL and store timeouts, broken connections), or the plain RuntimeError that gloo raises from
    its transport (its message starts with the gloo source file). Anything else, such as an OSError
    "Connection timed out" from a file system, is not a collective failure and keeps its traceback."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return type(exc) is RuntimeError and "gloo" in str(exc).split("]", 1)[0]


def post_interval(timeout_s: float) -> float:
    """How often a rank's latest post reaches the store: a quarter of the collective timeout, at most 10 s."""
    return min(10.0, timeout_s / 4)


def _poster(beacon_ref, interval: float, stop: threading.Event) -> None:
    """Write the beacon's latest post when it changed, every `interval` seconds, until the beacon is gone."""
    while not stop.wait(interval):
        beacon = beacon_ref()
        if beacon is None:
            return
        try:
            beacon.post()
        except Exception:  # the store went away (the job is ending): hang reports are best effort
            return
        del beacon


class Beacon:
    def __init__(self, timeout_s: float, store=None):
        """`store`: the key-value store to post to; the process group's by default (none on one process)."""
        import torch.distributed as dist

        self.timeout_s = timeout_s
        self.store = None
        self.rank, self.world = 0, 1
        self.seq, self.what = 0, "start"
        self.posted = 0  # the seq last written to the store
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if store is None and dist.is_available() and dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if store is not None:
            self.store = store
            self.mark("start-up")
            self.post()
            threading.Thread(target=_poster, args=(weakref.ref(self), post_interval(timeout_s), self.stop),
                             name="loom-beacon", daemon=True).start()
            weakref.finalize(self, self.stop.set)

    def mark(self, what: str) -> None:
        """Note what this rank is about to do (the store gets it within `post_interval`)."""
        if os.environ.get("LOOM_TEST_HANG") == f"{self.rank}:{what}":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3600)
        with self.lock:
            self.seq, self.what = self.seq + 1, what

    def post(self) -> None:
        """Write the latest mark to the store if it changed since the last write."""
        with self.lock:
            seq, what = self.seq, self.what
        if self.store is not None and seq != self.posted:
            self.store.set(f"loom/beacon/{self.rank}", f"{seq}|{what}")
            self.posted = seq

    def others(self) -> list[tuple[int, int, str]]:
        out = []
        for r in range(self.world):
            key = f"loom/beacon/{r}"
            if r != self.rank and self.store.check([key]):
                seq, _, what = self.store.get(key).decode().partition("|")
                out.append((r, int(seq), what))
        return out

    @contextlib.contextmanager
    def naming_hangs(self):
        """Turn a timed-out or broken collective inside the block into a CollectiveTimeout naming the ranks."""
        try:
            yield
        except Exception as exc:
            explained = self.explain(exc)
            if explained is None:
                raise
            raise explained from None

    def explain(self, exc: BaseException) -> CollectiveTimeout | None:
        """A CollectiveTimeout naming the ranks behind, if `exc` is a timed-out or broken collective."""
        if self.store is None or not is_collective_failure(exc):
            return None
        text = str(exc).lower()
        timed_out = any(m in text for m in TIMEOUT_MARKERS)
        if not (timed_out or any(m in text for m in PEER_GONE_MARKERS)):
            return None
        try:
            others = self.others()
        except Exception:  # the store lives with the launcher or rank 0, which may be gone too
            others = []
        behind = [(r, what) for r, seq, what in others if seq < self.seq]
        where = "; ".join(f"rank {r} last reported '{what}'" for r, seq, what in others) or "no other rank reachable"
        if timed_out:
            head = (f"rank {self.rank} waited more than train.collective_timeout_s={self.timeout_s:g}s in a "
                    f"collective during '{self.what}'")
        else:
            head = f"rank {self.rank} lost its connection to another rank during '{self.what}' (that rank crashed or was killed)"
        if behind:
            names = ("rank " if len(behind) == 1 else "ranks ") + ", ".join(str(r) for r, _ in behind)
            tail = (f"; {names} did not get there ({where}): hung or far slower than the others. "
                    "Look at that rank's output; raise train.collective_timeout_s if it is only slow")
        else:
            tail = f"; every rank got at least as far ({where}), so the hang is inside that step"
        return CollectiveTimeout(head + tail)
