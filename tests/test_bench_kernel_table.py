"""bench/kernel_table.py: a profiler's device-side events ranked by total time, with calls, means and shares;
host-side events are left out."""

import sys
from types import SimpleNamespace

from torch.autograd import DeviceType

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from kernel_table import top_kernels  # noqa: E402


def test_top_kernels_rank_device_time_and_leave_host_events_out():
    def event(key, device, us, count):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us, count=count)

    prof = SimpleNamespace(key_averages=lambda: [
        event("aten::mm", DeviceType.CPU, 0.0, 10),  # host side: not a kernel
        event("nvjet_gemm", DeviceType.CUDA, 600.0, 3),
        event("triton_poi_fused", DeviceType.CUDA, 300.0, 6),
        event("flash_fwd", DeviceType.CUDA, 100.0, 1),
    ])
    got = top_kernels(prof, 2)
    assert got["kernel_ms_total"] == 1.0 and got["kernels_seen"] == 3
    assert got["top_kernels"] == [
        {"name": "nvjet_gemm", "calls": 3, "total_us": 600.0, "mean_us": 200.0, "share": 0.6},
        {"name": "triton_poi_fused", "calls": 6, "total_us": 300.0, "mean_us": 50.0, "share": 0.3}]
