"""Where a profiled region's device time went: the top kernels of a `torch.profiler` run (bench/generate_gpu.py's
decode steps, bench/gpu_train.py's training step)."""

from __future__ import annotations


def top_kernels(prof, top: int) -> dict:
    """From a finished `torch.profiler.profile` with CUDA activity: the `top` kernels by total device time (name,
    calls, total and mean microseconds, share), the sum over all kernels (`kernel_ms_total`) and how many
    distinct kernels the profiler saw (kernels replayed inside CUDA graphs as far as CUPTI reports them)."""
    from torch.autograd import DeviceType

    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) if e.device_type == DeviceType.CUDA else 0.0
        if us > 0:
            kernels.append((us, e.count, e.key))
    kernels.sort(reverse=True)
    total = sum(us for us, _, _ in kernels)
    return {"kernel_ms_total": round(total / 1e3, 3), "kernels_seen": len(kernels),
            "top_kernels": [{"name": name[:160], "calls": n, "total_us": round(us, 1), "mean_us": round(us / n, 2),
                             "share": round(us / total, 4)} for us, n, name in kernels[:top]]}
