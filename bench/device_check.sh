#!/usr/bin/env bash
# The device check: everything loom needs from a GPU, in one run of about 9 minutes, into one folder.
#
#   bench/device_check.sh OUT_DIR [--smoke [--rehearse]] [--tar FILE] [--only STEP,STEP,...]
#
# --only: run just these measurement steps (setup_wheels and versions always run; the others are recorded as
# skipped). On a fresh machine every step's process compiles from a cold cache, so all the steps together
# need about 15 minutes, more than one call: pick the steps an issue needs (bench/DEVICE.md).
#
# On a GPU machine (the one call, bench/DEVICE.md):
#   bench/device_check.sh /tmp/check --tar $OUT/device_check.tar.gz        with carry: [".whl"]
# On this CPU (tests/test_device_check.py runs it; tiny shapes, a few steps, well under a minute):
#   bench/device_check.sh /tmp/check --smoke
# A rehearsal of the GPU run's setup on this CPU (Python 3.12, torch 2.11, bench/fetch_wheels.sh run first):
# the carried wheels installed as there, each training row in its own process with its torchtitan:
#   PYTHON=/path/to/python3.12 bench/device_check.sh /tmp/check --smoke --rehearse
#
# OUT_DIR gets one file per step, written as the step runs (the training JSONs are rewritten after every
# row): versions.json, smi_static.csv + smi_query.txt, smi.csv (SM and memory clock, power, temperature,
# use, memory, every second through the whole run), gpu_tests.log, gpu_train_1b.json, gpu_train_packed_1b.json, gpu_train_eager_1b.json,
# gpu_train_3b.json, gpu_train_7b.json, gpu_train_fp8_7b.json, gpu_train_{7b,fp8_7b,fp8_7b_tw}_auto.json,
# profile.json, generate_gpu.json,
# generate_gpu_paged.json, rl_gpu.json, each step's NAME.log, steps.jsonl (one line per step: status
# ok/failed/timeout/skipped, exit code, seconds, timeout) and log.txt (the run's own log).
# --tar FILE: a tar.gz of OUT_DIR rewritten after every step and every 30 s (the device tool brings back at
# most 8 files; this is one). A step past its timeout is killed with its processes; the next one starts.
#
# Steps and timeouts on the GPU (seconds; sum 1775 with setup, more than one 10-minute call: choose with
# --only). Sized from the second H200 run of 2026-11-26 (bench/results/device_check_h200_2026-11-26_b/), where
# the earlier, tighter timeouts cut off every step but two: on a fresh machine each process imports torch,
# builds its model and compiles from a cold cache (about 40 s for a 1B loom row, over 60 s for a 7B one)
# with the GPU idle; bench/DEVICE.md has the table and the sets that fit one call.
#   setup_wheels  20  install the carried wheel groups (below); then smi_static.csv, the smi.csv sampler
#   versions      15  versions.json: commit ($LOOM_COMMIT or git), torch, CUDA, Python, GPU, packages
#   gpu_tests     90  pytest -m gpu -rs (the tests marked gpu, collected from the files that mark them)
#   train_1b     200  gpu_train.py, Llama-3.2-1B shape, seq 4096, 2 + 5 steps: loom (loss_chunk 0 and 8192),
#                     transformers+liger, torchtitan-0.3.0 (100 s a row at most). Plain transformers and
#                     torchtitan-0.2.2 are left out on the GPU (the smoke keeps them): both measured on the
#                     first H200 run; the current anchor is torchtitan 0.3.0.
#   packed_1b     60  loom at the 1B shape on packed rows (documents of 512-1536 tokens, doc_ids + positions:
#                     FlexAttention's block mask inside the compiled blocks), against train_1b's plain row
#   eager_1b      90  loom at the 1B shape with train.compile=false (loss_chunk 0): the eager layer loom runs
#                     wherever tp, pp or cp > 1, priced by the planner at its measured elementwise rate (issue 38)
#   train_3b     150  the 3B shape, seq 8192, full recompute, 2 + 3 steps, rows loom (both losses),
#                     torchtitan-0.3.0
#   moe          150  loom on Qwen3-30B-A3B cut to 4 layers (128 experts of 768, top 8; 3.1B parameters), seq 4096,
#                     loss_chunk 8192, grouped GEMM (bf16, Hopper): tokens/s and MFU of the active FLOPs (issue 40)
#   train_7b     120  the Llama 2 7B shape (NeMo's published figure), seq 4096, 8192 tokens a step, full
#                     recompute, loss_chunk 8192, 2 + 3 steps, loom only (fits an H200's memory, not an H100's)
#   fp8_7b       120  the same with train.fp8=rowwise (torchao): the shape where fp8 should pay (issue 39)
#   train_7b_auto 120 the 7B shape as `loom plan` lays it out on one H200 (issue 39 item 5): micro-batches of 1
#                     (two a step) and recompute.mode=auto (per layer, the cheapest recomputation that fits
#                     the GPU's free memory) instead of full recomputation of micro-batches of 2
#   fp8_7b_auto  120  the same with train.fp8=rowwise
#   fp8_7b_tw    120  the same with train.fp8=tensorwise (torchao's per-tensor scales, torchtitan's default)
#   profile       60  python3 -m loom.cli plan --profile-hardware (30 s on the first H200 run, to a crash)
#   generate     120  generate_gpu.py --kv slab --batches 1,64 --new 32 --repeats 2 (+ --profile): the engine's
#                     default keys and values, each batch's top kernels by device time
#   generate_paged 150 the same on paged keys and values at batches 1, 64, 256 (Triton split-KV reads), no transformers
#   rl           150  rl_gpu.py: loom rl, GRPO, 1B shape, 8 prompts of 128 tokens x 8 completions of up to 512,
#                     1 + 2 steps, each step's phases (its start, the engine's graphs for every bucket up to
#                     batch 64 and 641 keys included, took more than 45 s on the second H200 run)
#   serve        120  serve_load.py: loom serve (FastAPI + uvicorn, carried as wheels) on the 1B shape with random
#                     weights, 32 concurrent streaming clients x 2 requests of 64 tokens: throughput, time to
#                     first token and inter-token latency percentiles, the server's decode batching
#
# Wheels carried (bench/device_wheels.txt, fetched by bench/fetch_wheels.sh into .whl/<group>/, 10.2 MiB):
#   .whl/common -> /tmp/site-common (on PYTHONPATH for every step): torchao 0.17.0, liger-kernel 0.8.5,
#     torchdata 0.11.0, datasets 4.7.0, dill 0.4.0, multiprocess 0.70.18, tyro 1.0.17, docstring-parser
#     0.18.0, typeguard 4.6.1, tomli 2.5.0, spmd-types 0.2.3, torch-checkpointing 0.1.1, and for loom serve
#     fastapi 0.165.0, starlette 1.10.0, uvicorn 0.54.0, pydantic 2.14.4, pydantic-core 2.50.5, annotated-types
#     0.8.0, typing-inspection 0.4.5, opentelemetry-api 1.45.2
#   .whl/torchtitan-0.3.0 -> /tmp/site-torchtitan-0.3.0: torchtitan 0.3.0 (its rows only)
#   .whl/torchtitan-0.2.2 -> /tmp/site-torchtitan-0.2.2: torchtitan 0.2.2 (its rows only)
# A torchtitan whose wheel is not carried gets an error row; every other step still runs.
set -u -o pipefail

DIR=
SMOKE=0
REHEARSE=0
TAR=
ONLY=
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --rehearse) REHEARSE=1 ;;
    --tar) TAR=$2; shift ;;
    --only) ONLY=",$2,"; shift ;;
    -h|--help) awk 'NR > 1 && /^set -u/ {exit} NR > 1' "$0"; exit 0 ;;
    -*) echo "device_check.sh: unknown option $1" >&2; exit 2 ;;
    *) [ -z "$DIR" ] || { echo "device_check.sh: one OUT_DIR only" >&2; exit 2; }; DIR=$1 ;;
  esac
  shift
done
[ -n "$DIR" ] || { echo "usage: bench/device_check.sh OUT_DIR [--smoke] [--tar FILE]" >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
[ -z "$TAR" ] || TAR=$(cd "$(dirname "$TAR")" && pwd)/$(basename "$TAR")
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
START=$(date +%s)
LOG=$DIR/log.txt
: > "$DIR/steps.jsonl"

say() { echo "== $(date +%T) [+$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

pack() {  # a tar.gz of DIR, replaced atomically, so a cut-off run leaves the last complete one
  [ -n "$TAR" ] || return 0
  local tmp="$TAR.$BASHPID.tmp"
  tar -czf "$tmp" -C "$(dirname "$DIR")" "$(basename "$DIR")" 2>/dev/null
  [ $? -le 1 ] && mv -f "$tmp" "$TAR"  # 1: a file changed while read (smi.csv grows): the tar is still whole
  rm -f "$tmp"
}

record() {  # record NAME STATUS RC SECONDS LIMIT [NOTE]
  printf '{"step": "%s", "status": "%s", "rc": %s, "seconds": %s, "timeout_s": %s, "note": "%s"}\n' \
    "$1" "$2" "$3" "$4" "$5" "${6:-}" >> "$DIR/steps.jsonl"
}

# run_step NAME LIMIT CMD...: output to DIR/NAME.log, its summary lines (JSON rows, pytest's tally, wrote ...)
# to stdout and log.txt; status ok / failed / timeout in steps.jsonl; then the tar.
run_step() {
  local name=$1 limit=$2; shift 2
  local t0 rc status
  case $name in setup_wheels|versions) ;; *)  # --only: the measurement steps named, setup always
    if [ -n "$ONLY" ] && [[ $ONLY != *",$name,"* ]]; then skip_step "$name" "not in --only"; return 0; fi ;;
  esac
  say "$name (timeout ${limit}s): $*"
  t0=$(date +%s)
  timeout -k 3 "$limit" "$@" 2>&1 | tee "$DIR/$name.log" \
    | { grep --line-buffered -E '^\{|^(SKIPPED|FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?)|^wrote|^[A-Za-z]*Error' \
        | cut -c1-400 | tee -a "$LOG" || true; }
  rc=${PIPESTATUS[0]}
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  record "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$limit"
  say "$name: $status (exit $rc, $(( $(date +%s) - t0 )) s)"
  pack
}

skip_step() {  # skip_step NAME REASON
  say "$1: skipped ($2)"
  record "$1" skipped null 0 0 "$2"
}

SMI_PID=
PACK_PID=
finish() {
  [ -z "$SMI_PID" ] || kill "$SMI_PID" 2>/dev/null
  [ -z "$PACK_PID" ] || kill "$PACK_PID" 2>/dev/null
  wait 2>/dev/null
  say "done"
  pack
}
trap finish EXIT

# --- setup: wheels, versions, the static GPU facts, the sampler ---------------------------------------------
say "device check into $DIR ($([ $SMOKE = 1 ] && echo smoke on CPU || echo GPU)$([ $REHEARSE = 1 ] && echo ", rehearsal"))"
SITE=/tmp/site
TT_ARGS=()
if [ $SMOKE = 1 ] && [ $REHEARSE = 0 ]; then
  skip_step setup_wheels "--smoke: the carried wheels are for the GPU machine's Python 3.12"
elif [ -d .whl/common ]; then
  # one folder per group: torchtitan 0.3.0 and 0.2.2 cannot share one
  run_step setup_wheels 20 bash -c 'for g in .whl/*/; do g=$(basename "$g"); echo "$g"; \
    "$0" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1-$g" .whl/"$g"/*.whl \
    || exit 1; done' "$PY" "$SITE"
  export PYTHONPATH=$SITE-common${PYTHONPATH:+:$PYTHONPATH}
  for tt in torchtitan-0.3.0 torchtitan-0.2.2; do
    [ -d "$SITE-$tt/torchtitan" ] && TT_ARGS+=(--pythonpath "$tt=$SITE-$tt")
  done
else
  skip_step setup_wheels "no .whl/common here (bench/fetch_wheels.sh fetches the wheels)"
fi
say "torchtitan folders: ${TT_ARGS[*]:-none (their rows will say so)}"

if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit,power.max_limit,driver_version,memory.total,pcie.link.gen.max \
    --format=csv > "$DIR/smi_static.csv" 2>&1
  nvidia-smi -q > "$DIR/smi_query.txt" 2>&1
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used \
    --format=csv -l 1 > "$DIR/smi.csv" 2>&1 &
  SMI_PID=$!
else
  echo "nvidia-smi: not found on this machine" > "$DIR/smi_static.csv"
  echo "nvidia-smi: not found on this machine" > "$DIR/smi.csv"
fi
if [ -n "$TAR" ]; then
  ( while sleep 30; do pack; done ) > /dev/null 2>&1 &  # holds no pipe of the caller's open
  PACK_PID=$!
fi

LOOM_COMMIT=${LOOM_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export LOOM_COMMIT
VERSIONS_S=15; [ $SMOKE = 1 ] && VERSIONS_S=120
run_step versions $VERSIONS_S "$PY" - "$DIR/versions.json" ${TT_ARGS[@]+"${TT_ARGS[@]}"} <<'EOF'
import json, os, platform, subprocess, sys
from importlib.metadata import PackageNotFoundError, version

def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

import torch
out = {"commit": os.environ.get("LOOM_COMMIT", "unknown"), "python": platform.python_version(),
       "platform": platform.platform(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
       "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
       if torch.cuda.is_available() else None,
       "pythonpath": os.environ.get("PYTHONPATH")}
for name in ("transformers", "torchao", "liger-kernel", "triton", "numpy", "datasets", "torchdata", "tyro",
             "spmd-types"):
    out[name] = v(name)
args = sys.argv[2:]
for flag, spec in zip(args[::2], args[1::2]):  # --pythonpath torchtitan-X=DIR: that folder's torchtitan
    fw, path = spec.split("=", 1)
    probe = "from importlib.metadata import version; print(version('torchtitan'))"
    env = dict(os.environ, PYTHONPATH=path + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    out[fw] = r.stdout.strip() or r.stderr.strip()[-300:]
out.setdefault("torchtitan (default path)", v("torchtitan"))
try:
    out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
except OSError:
    out["nvidia_smi"] = None
open(sys.argv[1], "w").write(json.dumps(out, indent=1) + "\n")
print(json.dumps(out))
EOF

# --- the measurements --------------------------------------------------------------------------------------
FW=loom,transformers+liger,torchtitan-0.3.0,torchtitan-0.2.2,transformers
if [ $SMOKE = 1 ]; then
  skip_step gpu_tests "--smoke: the tests marked gpu need a CUDA device"
  TRAIN=(bench/gpu_train.py --smoke --in-process)
  [ $REHEARSE = 1 ] && TRAIN=(bench/gpu_train.py --smoke --row-timeout 300)
  # ceilings only (a loaded 2-core machine is slow to import torch); tiny work, a minute or less in all
  X=1; [ $REHEARSE = 1 ] && X=2  # a process per row, torch's CUDA build to import: slower than the smoke
  run_step train_1b $((240 * X)) "$PY" "${TRAIN[@]}" --frameworks $FW ${TT_ARGS[@]+"${TT_ARGS[@]}"} --out "$DIR/gpu_train_1b.json"
  run_step packed_1b $((120 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --loss-chunk 0 --doc-len 12 \
    --out "$DIR/gpu_train_packed_1b.json"
  skip_step eager_1b "--smoke: train_1b's loom rows already run eager on the CPU (loom compiles on a GPU only)"
  run_step train_3b $((240 * X)) "$PY" "${TRAIN[@]}" --frameworks $FW ${TT_ARGS[@]+"${TT_ARGS[@]}"} --recompute full \
    --out "$DIR/gpu_train_3b.json"
  run_step moe $((120 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --models tiny-moe --loss-chunk 16 \
    --out "$DIR/gpu_train_moe.json"
  # the 7B rows at the tiny shape (their 7B shape is checked on the meta device by tests/test_bench_gpu_train.py)
  run_step train_7b $((120 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --recompute full --loss-chunk 16 \
    --out "$DIR/gpu_train_7b.json"
  run_step fp8_7b $((120 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --recompute full --fp8 rowwise --loss-chunk 16 \
    --out "$DIR/gpu_train_fp8_7b.json"
  for step in train_7b_auto fp8_7b_auto fp8_7b_tw; do
    skip_step $step "--smoke: tests/test_bench_gpu_train.py runs --recompute auto --micro-batch 1 on the tiny shape"
  done
  # loom plan --profile-hardware has no mode short enough for a smoke run (--quick: about 40 s of CPU on
  # 2 cores): started, then cut off by its timeout, which is also what this run checks of a step that overruns.
  run_step profile 5 "$PY" -m loom.cli plan --profile-hardware "$DIR/profile.json" --quick
  run_step generate $((240 * X)) "$PY" bench/generate_gpu.py --smoke --kv slab --out "$DIR/generate_gpu.json"
  skip_step generate_paged "--smoke: tests/test_bench_generate_gpu.py runs generate_gpu.py --smoke on paged keys"
  run_step rl $((120 * X)) "$PY" bench/rl_gpu.py --smoke --out "$DIR/rl_gpu.json"
  skip_step serve "--smoke: tests/test_bench_serve_load.py runs serve_load.py --smoke"
else
  # only the files that mark tests gpu: collecting the whole folder took most of the step's 90 s on an H200
  GPU_TEST_FILES=$(grep -l "mark\.gpu" tests/test_*.py)
  run_step gpu_tests 90 "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider --continue-on-collection-errors $GPU_TEST_FILES
  TRAIN=(bench/gpu_train.py --row-timeout 100 --kernels 15)  # + each row's top kernels of one profiled step
  run_step train_1b 200 "$PY" "${TRAIN[@]}" --models llama3.2-1b --seqs 4096 --steps 5 --warmup 2 \
    --frameworks loom,transformers+liger,torchtitan-0.3.0 ${TT_ARGS[@]+"${TT_ARGS[@]}"} --out "$DIR/gpu_train_1b.json"
  # packed rows (SFT packing, data.document_mask): documents of 512-1536 tokens; compare with train_1b's plain row
  run_step packed_1b 60 "$PY" "${TRAIN[@]}" --models llama3.2-1b --seqs 4096 --steps 5 --warmup 2 --frameworks loom \
    --loss-chunk 0 --doc-len 1024 --out "$DIR/gpu_train_packed_1b.json"
  # train_1b's plain loom row without torch.compile: the eager layer of every loom layout with tp, pp or cp > 1
  run_step eager_1b 90 "$PY" "${TRAIN[@]}" --models llama3.2-1b --seqs 4096 --steps 5 --warmup 2 --frameworks loom \
    --loss-chunk 0 --no-compile --out "$DIR/gpu_train_eager_1b.json"
  run_step train_3b 150 "$PY" "${TRAIN[@]}" --models llama3.2-3b --seqs 8192 --steps 3 --warmup 2 \
    --frameworks loom,torchtitan-0.3.0 ${TT_ARGS[@]+"${TT_ARGS[@]}"} --out "$DIR/gpu_train_3b.json"
  # MoE (issue 40): Qwen3-30B-A3B cut to 4 layers, grouped GEMM on Hopper in bf16; beside train_1b's dense rows
  run_step moe 150 "$PY" "${TRAIN[@]}" --models qwen3-30b-a3b-4l --seqs 4096 --steps 5 --warmup 2 --frameworks loom \
    --loss-chunk 8192 --out "$DIR/gpu_train_moe.json"
  # Llama 2 7B shape (issue 39; NeMo's figure): loom only, full recompute, the memory-light loss, bf16 then fp8
  TRAIN7=(bench/gpu_train.py --row-timeout 118 --kernels 15 --models llama2-7b --seqs 4096 --tokens-per-step 8192 --steps 3
          --warmup 2 --frameworks loom --recompute full --loss-chunk 8192)
  run_step train_7b 120 "$PY" "${TRAIN7[@]}" --out "$DIR/gpu_train_7b.json"
  run_step fp8_7b 120 "$PY" "${TRAIN7[@]}" --fp8 rowwise --out "$DIR/gpu_train_fp8_7b.json"
  # the same 8192 tokens a step as loom plan lays them out on one H200 (issue 39 item 5): two micro-batches of 1,
  # recompute.mode=auto instead of full recomputation (loom memory: 25 of 32 layers kept whole at micro-batch 1)
  TRAIN7A=(bench/gpu_train.py --row-timeout 118 --kernels 15 --models llama2-7b --seqs 4096 --tokens-per-step 8192
           --steps 3 --warmup 2 --frameworks loom --recompute auto --micro-batch 1 --loss-chunk 8192)
  run_step train_7b_auto 120 "$PY" "${TRAIN7A[@]}" --out "$DIR/gpu_train_7b_auto.json"
  run_step fp8_7b_auto 120 "$PY" "${TRAIN7A[@]}" --fp8 rowwise --out "$DIR/gpu_train_fp8_7b_auto.json"
  run_step fp8_7b_tw 120 "$PY" "${TRAIN7A[@]}" --fp8 tensorwise --out "$DIR/gpu_train_fp8_7b_tw_auto.json"
  run_step profile 60 "$PY" -m loom.cli plan --profile-hardware "$DIR/profile.json"
  PROFILE=()
  [ -f "$DIR/profile.json" ] && PROFILE=(--profile "$DIR/profile.json")
  # the engine's default keys and values (the slab), then paged blocks at batch 64 (issue 37)
  run_step generate 120 "$PY" bench/generate_gpu.py --kv slab --batches 1,64 --new 32 --repeats 2 \
    ${PROFILE[@]+"${PROFILE[@]}"} --out "$DIR/generate_gpu.json"
  run_step generate_paged 150 "$PY" bench/generate_gpu.py --kv paged --batches 1,64,256 --new 32 --repeats 2 --no-hf \
    --out "$DIR/generate_gpu_paged.json"
  run_step rl 150 "$PY" bench/rl_gpu.py --warmup 1 --steps 2 --timeout 140 --out "$DIR/rl_gpu.json"
  # loom serve under 32 concurrent streaming clients, the 1B shape with random weights (issue 41)
  run_step serve 120 "$PY" bench/serve_load.py --shape llama3.2-1b --clients 32 --rounds 2 --max-tokens 64 \
    --out "$DIR/serve_load.json"
fi
exit 0
