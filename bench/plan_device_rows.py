"""`loom plan`'s predictions for the device check's loom training rows, written before they are measured.

    python bench/plan_device_rows.py --profile bench/results/h200-2026-11-26/profile.json \
        --out bench/results/plan_device_rows_h200.json

Issue 38 asks that the planner predict loom's runs at shapes it has not seen measured. This prices each loom row
that `bench/device_check.sh` trains (the shapes, sequence lengths, micro-batches, recomputation, losses and
precisions of `bench/gpu_train.py` as the device check calls it) from a hardware profile of the GPU kind the
rows will run on, one process, loom's replicate style, as `loom plan --validate` prices loom's measured runs;
memory as the planner's total less its reserve (what `torch.cuda.max_memory_allocated` is compared with). When
the rows are measured, their error against these numbers is the planner's error on shapes it did not see.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loom.provenance import write_stamped  # noqa: E402

# (row name, gpu_train.py shape, sequence, micro-batch, recompute, loss_chunk, precision[, micro-batches a
# step[, compile]]): the device check's loom rows (bench/device_check.sh, GPU branch); compile "auto" is what
# loom's GPU path runs (compiled blocks at one process), "off" gpu_train.py's --no-compile
ROWS = [
    ("train_1b loom plain", "llama3.2-1b", 4096, 4, "none", 0, "bf16"),
    # issue 38: the eager layer every loom layout with tp, pp or cp > 1 runs, at the 1B shape (eager_1b)
    ("eager_1b loom", "llama3.2-1b", 4096, 4, "none", 0, "bf16", 1, "off"),
    ("train_1b loom chunked", "llama3.2-1b", 4096, 4, "none", 8192, "bf16"),
    ("train_3b loom plain", "llama3.2-3b", 8192, 2, "full", 0, "bf16"),
    ("train_3b loom chunked", "llama3.2-3b", 8192, 2, "full", 8192, "bf16"),
    ("train_7b loom", "llama2-7b", 4096, 2, "full", 8192, "bf16"),
    ("fp8_7b loom", "llama2-7b", 4096, 2, "full", 8192, "fp8"),
    ("moe loom", "qwen3-30b-a3b-4l", 4096, 4, "none", 8192, "bf16"),
    # issue 39 item 5: the 7B rows at micro-batch 1 (two a step), recompute.mode=auto, which on an H200 recomputes
    # the first 7 of 32 layers in full (`loom memory --config llama2-7b --train.seq_len=4096 --train.micro_batch=1
    # --train.global_batch=2 --recompute.mode=auto --recompute.memory_gib=139.8`: 25 none, 7 full)
    ("train_7b_auto loom", "llama2-7b", 4096, 1, "full:7", 8192, "bf16", 2),
    ("fp8_7b_auto loom", "llama2-7b", 4096, 1, "full:7", 8192, "fp8", 2),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a `loom plan --profile-hardware` JSON of the GPU kind")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from gpu_train import model_config

    from loom.planner.hardware import load_gpu
    from loom.planner.steptime import evaluate
    from loom.planner.workload import Layout, Workload

    gpu = load_gpu(args.profile)
    rows = []
    for name, shape, seq, mbs, recompute, chunk, precision, *rest in ROWS:
        micro, compile = (list(rest) + [1, "auto"][len(rest):])[:2]
        steps_mbs = mbs * micro  # sequences a step
        w = Workload(model_config(shape, seq), seq, steps_mbs, 1, gpu, precision=precision, loss_chunk=chunk,
                     compile=compile)
        mode, _, layers = recompute.partition(":")  # "full:7": the first 7 layers in full (auto's plan), else all
        best = evaluate(w, Layout(micro_batch=mbs, recompute=mode, recompute_layers=int(layers or 0),
                                  dp_style="replicate"))
        memory = (best.memory["total"] - best.memory["reserve"]) / 2**30
        rows.append({"row": name, "shape": shape, "seq": seq, "micro_batch": mbs, "recompute": recompute,
                     "loss_chunk": chunk, "precision": precision, "compile": compile,
                     "predicted_step_s": round(best.step_time_s, 4),
                     "sequences_per_step": steps_mbs,
                     "predicted_tokens_per_s": round(seq * steps_mbs / best.step_time_s, 1),
                     "predicted_peak_gib": round(memory, 2), "fits": bool(best.fits),
                     "time_s": {k: round(v, 4) for k, v in best.time_terms.items() if v}})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "time_s"}), flush=True)
    write_stamped(args.out, {"profile": args.profile, "rows": rows},
                  "python bench/plan_device_rows.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
