"""Counting what a training step synchronises with the host (tests/test_host_syncs.py).

`count_step_syncs(cfg, recipe)` trains `cfg` in this process (or this rank) with every way loom's own code can
read a device value on the host patched to count its call: `Tensor.item`, `.tolist`, `.cpu`, `.numpy`,
`float()`/`int()`/`bool()` of a tensor, `torch.cuda.synchronize`, `torch.cuda.Event.synchronize` and
`.elapsed_time` — the calls `torch.cuda.set_sync_debug_mode` flags on a GPU, counted on CPU by their caller:
only calls made from loom's training code count (not torch's internals, which keep their scalars on the host
on a GPU too; not the data readers, whose tensors are host data). It also counts the collectives loom's code
issues (`torch.distributed.all_reduce` and friends) and the training loop's writes to the process group's
key-value store (the hang beacon's background poster, loom/train/hang.py, is not the loop).
Evaluation and checkpoint saves are left out: the counts are of the steps themselves.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from pathlib import Path

import torch

LOOM = str(Path(__file__).resolve().parent.parent / "loom")
HOST_DATA = (f"{LOOM}/data/", f"{LOOM}/post/sft_data.py", f"{LOOM}/post/pref_data.py")
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_gather_object", "broadcast_object_list", "barrier")


class Counts:
    def __init__(self):
        self.on = False
        self.calls = collections.Counter()  # (kind, "file:line") -> calls

    def caller_is_loom(self) -> str | None:
        frame = sys._getframe(2)  # the caller of the patched function (torch's own calls do not count)
        name = frame.f_code.co_filename
        if name.startswith(LOOM) and not name.startswith(HOST_DATA):
            return f"{name[len(LOOM) - 4:]}:{frame.f_lineno}"
        return None

    def wrap(self, owner, attr: str, kind: str, main_thread_only: bool = False) -> None:
        original = getattr(owner, attr)

        def counted(*args, **kwargs):
            if self.on and (not main_thread_only or threading.current_thread() is threading.main_thread()) \
                    and (where := self.caller_is_loom()):
                self.calls[(kind, where)] += 1
            return original(*args, **kwargs)

        self._undo.append((owner, attr, original))
        setattr(owner, attr, counted)

    @contextlib.contextmanager
    def patched(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self._undo = []
        for attr in READS:
            self.wrap(torch.Tensor, attr, "host read")
        self.wrap(torch.cuda, "synchronize", "host read")
        self.wrap(torch.cuda.Event, "synchronize", "host read")
        self.wrap(torch.cuda.Event, "elapsed_time", "host read")
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self.wrap(dist, name, "collective")
        store = distributed_c10d._get_default_store() if dist.is_initialized() else None
        if store is not None:
            self.wrap(type(store), "set", "store write", main_thread_only=True)  # not the beacon's poster
        try:
            yield self
        finally:
            for owner, attr, original in reversed(self._undo):
                setattr(owner, attr, original)

    def per_step(self, steps: int) -> dict[str, float]:
        out = collections.Counter()
        for (kind, _), n in self.calls.items():
            out[kind] += n
        return {k: v / steps for k, v in out.items()}


def count_step_syncs(cfg, run_dir, recipe=None) -> tuple[dict[str, float], dict]:
    """Train `cfg` (no checkpoints) and count per step; ({kind: calls per step}, {(kind, where): calls})."""
    from loom.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir, quiet=True, recipe=recipe)
    counts = Counts()
    evaluate, save = trainer.evaluate, trainer.save

    def paused(fn):
        def call(*args, **kwargs):
            counts.on = False
            try:
                return fn(*args, **kwargs)
            finally:
                counts.on = True
        return call

    trainer.evaluate, trainer.save = paused(evaluate), paused(save)
    with counts.patched():
        counts.on = True
        trainer.fit()
        counts.on = False
    return counts.per_step(cfg.train.steps), dict(counts.calls)
