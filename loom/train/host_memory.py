"""Keep freed host memory in the process while training on the CPU.

glibc's malloc hands every freed block above 32 MiB (the logits of a micro-batch, their gradient,
the log-probabilities) straight back to the kernel, and shrinks the heap whenever its top is free.
The next step allocates the same sizes again, and the kernel faults every page back in zero-filled,
every step. Training allocates the same shapes every step, so keeping the memory is the better bargain
for a training process. The price: the process keeps its high-water mark until it exits, and glibc's
heap fragments a little (the measured faults and resident memory, before and after:
bench/results/cpu_profile.md).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_MAX = -4
_M_MMAP_THRESHOLD = -3


def _mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt differs or does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Serve large blocks from the heap and never trim it (glibc only). Returns whether it applied."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """The opposite bargain, for sharded data parallelism on the CPU: every block of `threshold` bytes or
    more is mapped on its own and handed back to the kernel when freed (a fixed threshold: glibc would
    otherwise raise it to the largest block freed so far and keep such blocks in the heap). FSDP gathers
    each block's weights and frees them right after use; with glibc's default the freed gathers stay
    resident, and a rank's resident memory grows to hold the whole model's weights once more (measured:
    +600 MB over the forward of a 256 MB model sharded 4 ways, against +7 MB with this setting)."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold))
