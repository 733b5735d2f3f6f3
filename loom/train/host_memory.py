"""Keep freed host memory in the process while training on the CPU.

glibc's malloc hands every freed block above 32 MiB (the logits of a micro-batch, their gradient,
the log-probabilities) straight back to the kernel, and shrinks the heap whenever its top is free.
The next step allocates the same sizes again, and the kernel faults every page back in zero-filled:
70-85 thousand page faults per step of the `tiny` model, about a tenth of its time on 2 cores.
Training allocates the same shapes every step, so keeping the memory is the better bargain for a
training process. The price: the process keeps its high-water mark until it exits, and glibc's heap
fragments a little (`tiny` on 2 cores: peak resident 1167 MiB instead of 1032, reached within ~5
steps and flat after; 0 page faults per step instead of ~80 thousand; bench/results/cpu_profile.md).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Serve large blocks from the heap and never trim it (glibc only). Returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt differs or does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
