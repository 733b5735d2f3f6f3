"""The share of the copy bandwidth loom's eager layer gets through its elementwise bytes, from a GPU profile.

    python bench/eager_share.py --profile bench/results/h200-2026-11-26/profile.json \
        --out bench/results/eager_share_h200.json

`loom plan --profile-hardware` times loom's eager one-layer forward under torch's profiler and counts the device
time of every kernel that is not a matrix product, attention or the embedding as elementwise. Until
`profile.is_elementwise_kernel` (issue 38), that test knew GEMM kernels by "gemm" and "cutlass" in their names
only; the H200 profile of 2026-11-26 ran torch 2.11+cu130, whose cuBLAS names its Hopper GEMMs
`nvjet_sm90_*` (every bf16 product in the same machine's 7B kernel table,
`bench/results/device_check_h200_2026-11-26_e/gpu_train_7b.json`), so that profile's `elementwise_gbps` counted
the layer's products as elementwise time. This script takes them out: for each measured row it subtracts the
time the same profile's GEMM table gives the layer's products (q, k, v, o, gate, up, down and the 256-row head
at that row's token count, `kernels.gemm_time`), and reports bytes over the remainder, and that over the
profile's measured copy rate: the shares the presets carry (`hardware.EAGER_ELEMENTWISE_FRACTION`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import write_stamped  # noqa: E402

def eager_shares(profile_path: str, precision: str = "bf16") -> list[dict]:
    """Per measured row of a GPU profile's `elementwise_gbps[precision]`: the tokens it ran, its measured time,
    the products' time by the profile's GEMM table, and the elementwise rate and share of the copy rate
    without them."""
    from loom.config import ModelConfig
    from loom.planner.hardware import load_gpu
    from loom.planner.kernels import gemm_time
    from loom.planner.layertime import elementwise_bytes_per_token
    from loom.planner.profile import ELEMENTWISE_PROBE

    gpu = load_gpu(profile_path)
    cfg = ModelConfig(**ELEMENTWISE_PROBE, max_seq_len=16384)
    h, f, kv = cfg.hidden, cfg.ffn_hidden, cfg.kv_heads * cfg.head_dim
    rows = []
    for nbytes, gbps in gpu.elementwise_gbps[precision]:
        tokens = round(nbytes / (elementwise_bytes_per_token(cfg, precision) + 2 * h * 2))
        products = [(tokens, h, h), (tokens, kv, h), (tokens, kv, h), (tokens, h, h), (tokens, f, h), (tokens, f, h),
                    (tokens, h, f), (tokens, cfg.vocab_size, h)]  # q, k, v, o, gate, up, down, the head
        measured = nbytes / (gbps * 1e9)
        gemm = sum(gemm_time(gpu, precision, *p) for p in products)
        rate = nbytes / (measured - gemm) / 1e9
        rows.append({"bytes": nbytes, "tokens": tokens, "measured_gbps": gbps, "measured_ms": round(measured * 1e3, 4),
                     "products_ms": round(gemm * 1e3, 4), "elementwise_gbps": round(rate, 1),
                     "share_of_copy": round(rate / gpu.hbm_gbps, 4),
                     "share_as_measured": round(gbps / gpu.hbm_gbps, 4)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a `loom plan --profile-hardware` JSON measured on a GPU")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rows = eager_shares(args.profile)
    for row in rows:
        print(json.dumps(row))
    write_stamped(args.out, {"profile": args.profile, "rows": rows},
                  "python bench/eager_share.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
