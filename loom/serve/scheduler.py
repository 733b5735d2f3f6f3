"""The scheduler thread: the one owner of the engine. HTTP handlers hand it work through a bounded queue and
get their tokens back on their event loop; it loops `Engine.step` while any request waits or runs, so requests
that arrive at different times share decode steps (continuous batching across HTTP requests).

    ticket = scheduler.submit(jobs, loop)     # QueueFull when the queue is at its bound (HTTP 429)
    event = await ticket.events.get()         # (choice, tokens, logprobs, top, finish_reason or None) or an error
    scheduler.cancel(ticket)                  # the client went away or timed out: slots and blocks go back
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from loom.infer.engine import Engine

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


@dataclass
class Ticket:
    """One HTTP request's engine requests (its `n` choices). Events arrive on `events` (an asyncio.Queue of
    the handler's loop): (choice, new token ids, their log-probs, their most likely tokens [(id, log-prob)],
    finish_reason or None), or an Exception when the engine failed."""

    # (prompt ids, SamplingParams[, grammar matcher or None[, LoRA adapter name or None]])
    jobs: list[tuple]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    requests: list = field(default_factory=list)  # engine Requests, once submitted by the scheduler thread
    last: list = field(default_factory=list)  # per choice: when its latest tokens arrived (None: none yet)
    cancelled: bool = False
    model: str = ""  # the model (or adapter) name the responses carry

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody listens
            pass


class Scheduler:
    """Owns `engine` on its own thread. `max_queue`: the most engine requests (choices) waiting for a slot,
    queued here or in the engine; a submit beyond it raises QueueFull."""

    def __init__(self, engine: Engine, metrics, max_queue: int = 256):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._cond = threading.Condition()
        self._inbox: deque[Ticket] = deque()
        self._cancels: deque[Ticket] = deque()
        self._queued = 0  # choices in the inbox or waiting in the engine (read by submit, under the lock)
        self._owner: dict[int, tuple[Ticket, int]] = {}  # id(engine Request) -> (ticket, choice)
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the loop on a thread of its own (`loom serve` runs it on the thread that built the engine: a
        compiled engine's CUDA graphs belong to the thread that recorded them)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="loom-serve-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, jobs: list[tuple], loop: asyncio.AbstractEventLoop) -> Ticket:
        ticket = Ticket(jobs, loop, asyncio.Queue(), last=[None] * len(jobs))
        with self._cond:
            if self._queued + len(jobs) > self.max_queue:
                raise QueueFull(f"the server's queue is full ({self._queued} requests wait, at most "
                                f"{self.max_queue}); retry later")
            self._queued += len(jobs)
            self.metrics.waiting = self._queued
            self._inbox.append(ticket)
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.cancelled:
                return
            ticket.cancelled = True
            self._cancels.append(ticket)
            self._cond.notify()

    # --- the thread -------------------------------------------------------------------------------------------

    def run(self, alive=lambda: True) -> None:
        """The loop, on this thread, until `stop()` or `alive()` turns false (checked every second while idle)."""
        engine = self.engine
        while True:
            with self._cond:
                while not (self._stop or self._inbox or self._cancels or engine.waiting or engine.running):
                    if not alive():
                        return
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    return
                inbox, cancels = list(self._inbox), list(self._cancels)
                self._inbox.clear()
                self._cancels.clear()
            for ticket in inbox:
                if ticket.cancelled:  # cancelled before the engine saw it
                    self._settle(len(ticket.jobs))
                    continue
                requests = []
                try:
                    for prompt, params, *more in ticket.jobs:  # the handler checked them (Engine.check)
                        extra = {k: v for k, v in zip(("constraint", "adapter"), more) if v is not None}
                        requests.append(engine.submit(prompt, params, **extra))
                except Exception as exc:  # noqa: BLE001 (not expected: the server keeps serving)
                    for request in requests:
                        engine.cancel(request)
                    self._settle(len(ticket.jobs))
                    ticket.put(RuntimeError(f"the engine refused the request: {exc}"))
                    continue
                ticket.requests += requests
                for choice, request in enumerate(requests):
                    self._owner[id(request)] = (ticket, choice)
            for ticket in cancels:
                for request in ticket.requests:
                    if request.state == "waiting":
                        self._settle(1)
                    engine.cancel(request)
                    self._owner.pop(id(request), None)
            if not (engine.waiting or engine.running):
                self._gauges()
                continue
            self._step()

    def _settle(self, n: int) -> None:
        """n choices left the queue (admitted or cancelled)."""
        with self._cond:
            self._queued -= n
            self.metrics.waiting = self._queued

    def _step(self) -> None:
        engine = self.engine
        waiting, stats = engine.waiting, dict(engine.stats)
        try:
            updates = engine.step()
        except Exception as exc:  # noqa: BLE001 (the server keeps serving; every request in flight fails)
            log.exception("engine step failed")
            for request in engine.abort():
                owner = self._owner.pop(id(request), None)
                if owner is not None:
                    owner[0].put(RuntimeError(f"the engine failed: {type(exc).__name__}: {exc}"))
            self._settle(waiting)
            self._gauges()
            return
        self._settle(waiting - engine.waiting)
        now = time.perf_counter()
        steps = engine.stats["decode_steps"] - stats["decode_steps"]
        rows = (engine.stats["decoded_tokens"] + engine.stats["discarded_tokens"]
                - stats["decoded_tokens"] - stats["discarded_tokens"])
        generated = 0
        with self.metrics.lock:
            m = self.metrics
            m.decode_steps += steps
            m.decode_rows += rows
            for name in ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens",  # paged engines' prefix cache
                         "spec_draft_tokens", "spec_accepted_tokens", "spec_request_steps"):  # speculative decoding
                setattr(m, name, getattr(m, name) + engine.stats.get(name, 0) - stats.get(name, 0))
            if steps:
                m.max_batch = max(m.max_batch, rows // steps)
            for update in updates:
                owner = self._owner.get(id(update.request))
                if owner is None:
                    continue
                ticket, choice = owner
                k = len(update.tokens)
                generated += k
                if k:
                    if ticket.last[choice] is None:  # the first window's tokens count for the first token only
                        m.ttft.observe(now - ticket.arrived)
                    else:
                        m.itl.observe((now - ticket.last[choice]) / k, k)
                    ticket.last[choice] = now
            m.generated_tokens += generated
        for update in updates:
            owner = self._owner.get(id(update.request))
            if owner is None:
                continue
            ticket, choice = owner
            reason = update.request.out.finish_reason if update.finished else None
            ticket.put((choice, update.tokens, update.logprobs, update.top_logprobs, reason))
            if update.finished:
                del self._owner[id(update.request)]
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.running = self.engine.running
