"""tests/distributed.RankPool: the process groups a task's device meshes make are destroyed after it, so a rank
that runs many layouts keeps a bounded number of threads (each gloo group holds its own)."""

import os

from distributed import shared_pool


def _mesh_task():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("tp", "dp"))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    t = torch.ones(2)
    dist.all_reduce(t, group=mesh.get_group("dp"))
    dist.all_reduce(t, group=other.get_group("cp"))
    return len(os.listdir("/proc/self/task")), t.tolist()


def test_threads_per_rank_stay_bounded_across_layouts():
    pool = shared_pool(2)
    counts = []
    for _ in range(6):
        out = pool.run(_mesh_task)
        assert [v for _, v in out] == [[4.0, 4.0]] * 2  # both sub-groups reduced over both ranks
        counts.append(max(c for c, _ in out))
    # without the release each task left three more threads per rank (measured: 9, 13, 16, ... 52 after 15)
    assert counts[-1] <= counts[1] + 1, counts
