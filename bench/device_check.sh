#!/usr/bin/env bash
# The device check: every GPU target loom has, in one call of at most 540 s, into one folder.
#
#   bench/device_check.sh OUT_DIR [--smoke [--rehearse]] [--tar FILE] [--only STEP,STEP,...] [--budget S]
#
# The standing check (bench/DEVICE.md): a session lent a GPU runs this first, whatever its issue. Its steps
# run in the order of what they are worth (the rows whose targets are open or never measured first,
# `python bench/ledger.py status`), loom's rows of one shape share one process (one torch import, one CUDA
# context, the compiled blocks' kernels reused), and the whole call keeps to --budget seconds (540 on a GPU;
# 0 = none, the smoke's default): a step gets what is left of the budget at most, and a step that would start
# with under 20 s left is recorded as skipped ("budget"). Every finished row is kept when a step is cut off.
#
# Compile caches travel (loom/compile_cache.py): the call loads bench/compile_cache/<gpu>/ (committed from the
# previous call on that GPU kind) into every process before it compiles, and each process saves what it
# compiled or loaded into OUT_DIR/compile_cache/; `python bench/ledger.py ingest OUT_DIR` adopts that folder as
# the next call's cache. A cache made with another torch, Triton, CUDA or GPU is refused with a note.
#
# --only: run just these measurement steps (setup_wheels, versions and predict always run; the others are
# recorded as skipped).
#
# On a GPU machine (the one call, bench/DEVICE.md):
#   bench/device_check.sh /tmp/check --tar $OUT/device_check.tar.gz        with carry: [".whl"]
# On this CPU (tests/test_device_check.py runs it; tiny shapes, a few steps):
#   bench/device_check.sh /tmp/check --smoke
# A rehearsal of the GPU run's setup on this CPU (Python 3.12, torch 2.11, bench/fetch_wheels.sh run first):
#   PYTHON=/path/to/python3.12 bench/device_check.sh /tmp/check --smoke --rehearse
#
# OUT_DIR gets: versions.json (commit, versions, GPU, the compile cache's state), predictions.json (loom plan's
# prices for the loom rows, made before they run), smi_static.csv + smi_query.txt, smi.csv (clocks, power,
# temperature, use, memory every second), one results JSON per step (rewritten after every row), each step's
# NAME.log, steps.jsonl (one line per step: status ok/failed/timeout/skipped, exit code, seconds, timeout),
# log.txt, call.json (the call's seconds, budget, whether every standing step finished, the cache's state) and
# compile_cache/. --tar FILE: a tar.gz of OUT_DIR without compile_cache/, rewritten after every step and every
# 30 s; the cache goes into FILE's sibling *_cache.tar at the end (a large cache cannot cost the results).
#
# The standing steps, in order (GPU timeouts in seconds; each also capped by what is left of the budget):
#   setup_wheels   20  install the carried wheel groups (below); smi_static.csv, the smi.csv sampler
#   versions       15  versions.json
#   predict        30  bench/plan_device_rows.py from the committed profile of this GPU kind -> predictions.json
#   train_1b      150  gpu_train.py, Llama-3.2-1B shape, seq 4096, loom in one process: train_1b (loss_chunk 0
#                      and 8192), eager_1b (train.compile=false: the eager layer of loom's tp/pp/cp layouts),
#                      packed_1b (documents of 512-1536 tokens, FlexAttention's block mask); 2 + 5 steps each
#   titan_1b      110  torchtitan 0.3.0 at the same shape (its own process and folder of wheels)
#   train_7b_auto 240  Llama 2 7B shape, 8192 tokens a step as loom plan lays it out on one H200 (micro-batches
#                      of 1, recompute.mode=auto), loom in one process: bf16, fp8 rowwise, fp8 tensorwise;
#                      2 + 3 steps each (H200 only: one H100 does not hold 7B's fp32 states)
#   generate_paged 100 generate_gpu.py on paged keys and values, batches 1, 64, 256, no transformers
#   generate       80  the same on the slab at batches 1, 64 (+ transformers, + the profile's predictions), and
#                      batch 1 with prompt-lookup speculative decoding against plain (--speculative 4)
#   rl            120  rl_gpu.py: loom rl, GRPO, 1B shape, 8 prompts of 128 tokens x 8 completions of 512, 1 + 2 steps
#   rl_async      120  the same with rl.mode=async: one generation process beside the trainer on the GPU (issue 56)
#   profile        60  python3 -m loom.cli plan --profile-hardware (its own attention probe)
#   train_3b      120  3B shape, seq 8192, full recompute, loom (both losses) in one process, 2 + 3 steps
#   titan_3b      110  torchtitan 0.3.0 at the 3B shape
#   moe           100  loom on Qwen3-30B-A3B cut to 4 layers (128 experts of 768, top 8), seq 4096, grouped GEMM
#   block_tp      120  block_gpu.py: a tp rank's block (70B tp 8, 8B tp 4) eager and compiled, priced first
#   serve         100  serve_load.py: loom serve, 1B shape, 32 concurrent streaming clients x 2 requests of 64 tokens
#   host_syncs     60  host_syncs_gpu.py: device-host synchronisations per training step under CUDA's sync debug mode
#   gpu_tests      90  pytest -m gpu over the files that mark tests gpu
#   train_7b      200  the 7B shape at micro-batch 2 with full recompute (measured 2026-11-26): bf16, fp8 rowwise
#   liger_1b      100  transformers + Liger at the 1B shape (measured 2026-11-26)
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
ARGS=("$@")

DIR=
SMOKE=0
REHEARSE=0
TAR=
ONLY=
BUDGET=
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --rehearse) REHEARSE=1 ;;
    --tar) TAR=$2; shift ;;
    --only) ONLY=",$2,"; shift ;;
    --budget) BUDGET=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^set -u/ {exit} NR > 1' "$0"; exit 0 ;;
    -*) echo "device_check.sh: unknown option $1" >&2; exit 2 ;;
    *) [ -z "$DIR" ] || { echo "device_check.sh: one OUT_DIR only" >&2; exit 2; }; DIR=$1 ;;
  esac
  shift
done
[ -n "$DIR" ] || { echo "usage: bench/device_check.sh OUT_DIR [--smoke] [--tar FILE] [--only STEPS] [--budget S]" >&2; exit 2; }
[ -n "$BUDGET" ] || { [ $SMOKE = 1 ] && BUDGET=0 || BUDGET=540; }
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "device_check.sh: --budget takes whole seconds (0: none), not $BUDGET" >&2; exit 2; }

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
  tar -czf "$tmp" --exclude="$(basename "$DIR")/compile_cache" -C "$(dirname "$DIR")" "$(basename "$DIR")" 2>/dev/null
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
  local t0 rc status left
  case $name in setup_wheels|versions|predict) ;; *)  # --only: the measurement steps named, setup always
    if [ -n "$ONLY" ] && [[ $ONLY != *",$name,"* ]]; then skip_step "$name" "not in --only"; return 0; fi ;;
  esac
  if [ "$BUDGET" -gt 0 ] && [[ ! $name =~ ^(setup_wheels|versions|predict)$ ]]; then  # the budget left, less 10 s to pack
    left=$(( START + BUDGET - 10 - $(date +%s) ))
    if [ $left -lt 20 ]; then skip_step "$name" "budget: ${left} s left of the call's ${BUDGET} s"; return 0; fi
    [ $left -lt "$limit" ] && limit=$left
  fi
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
  summary
  say "done"
  pack
  if [ -n "$TAR" ] && [ -d "$DIR/compile_cache" ]; then
    tar -cf "${TAR%.tar.gz}_cache.tar" -C "$DIR" compile_cache 2>/dev/null
  fi
}

summary() {  # call.json: the call's seconds, whether every standing step finished, the compile cache's state
  "$PY" - "$DIR" "$BUDGET" "$(( $(date +%s) - START ))" "$ONLY" "$0 ${ARGS[*]}" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
folder, budget, seconds, only, command = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
steps = [json.loads(x) for x in (folder / "steps.jsonl").read_text().splitlines() if x.strip()]
versions = json.loads((folder / "versions.json").read_text()) if (folder / "versions.json").is_file() else {}
design = lambda s: s["status"] == "skipped" and s["note"].startswith(("n/a", "--smoke"))  # skips by design
complete = not only and all(s["status"] == "ok" or design(s) for s in steps if s["step"] != "setup_wheels")
call = {"seconds": seconds, "budget_s": budget, "complete": complete, "cache": versions.get("compile_cache"),
        "command": command, "steps": {s["step"]: s["status"] for s in steps},
        "ok": sum(s["status"] == "ok" for s in steps)}
(folder / "call.json").write_text(json.dumps(call, indent=1) + "\n")
print(f"call: {seconds} s of a {budget or 'unlimited'} s budget, {call['ok']} steps ok, "
      f"{'every standing step finished' if complete else 'not every standing step finished'}; cache: {call['cache']}")
PYEOF
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
# the compile cache this GPU kind's last call left (bench/compile_cache/<gpu>/), and where this call's goes
GPU_NAME=cpu
command -v nvidia-smi > /dev/null && GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
GPU_SLUG=$(echo "${GPU_NAME:-cpu}" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
CACHE_IN=$ROOT/bench/compile_cache/$GPU_SLUG
[ -f "$CACHE_IN/manifest.json" ] && export LOOM_COMPILE_CACHE_LOAD=$CACHE_IN
export LOOM_COMPILE_CACHE_SAVE=$DIR/compile_cache
say "compile cache: ${LOOM_COMPILE_CACHE_LOAD:-none for $GPU_SLUG (a cold call)} -> $LOOM_COMPILE_CACHE_SAVE"
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
cache = os.environ.get("LOOM_COMPILE_CACHE_LOAD")  # what the steps will load: its key checked, nothing loaded here
if cache:
    sys.path.insert(0, os.getcwd())
    from loom import compile_cache
    manifest = compile_cache.read_manifest(cache) or {}
    differ = compile_cache.key_mismatch(manifest.get("key", {}), compile_cache.current_key())
    out["compile_cache"] = (f"refused: {cache} was made for another machine ({'; '.join(differ)})" if differ else
                            f"warm: {cache}, {len(manifest.get('entries', {}))} blobs compiled at {manifest.get('commit')}")
else:
    out["compile_cache"] = "cold: no committed cache for this GPU kind"
try:
    out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
except OSError:
    out["nvidia_smi"] = None
open(sys.argv[1], "w").write(json.dumps(out, indent=1) + "\n")
print(json.dumps(out))
EOF

# --- the measurements, in the order of what they are worth ---------------------------------------------------
PROFILE_FOR=bench/results/h200-2026-11-26/profile.json  # the committed profile of each GPU kind (H200 only so far)
case $GPU_SLUG in *h200*|cpu) ;; *) PROFILE_FOR= ;; esac
if [ -n "$PROFILE_FOR" ]; then
  run_step predict 30 "$PY" bench/plan_device_rows.py --profile "$PROFILE_FOR" --out "$DIR/predictions.json"
else
  skip_step predict "n/a: no committed hardware profile for $GPU_NAME (the profile step makes one)"
fi
TT030=torchtitan-0.3.0
if [ $SMOKE = 1 ]; then
  # the same steps on the CPU at tiny shapes (2 + 1 steps); loom's rows of a shape in one process, as on the GPU
  TRAIN=(bench/gpu_train.py --smoke --in-process)
  [ $REHEARSE = 1 ] && TRAIN=(bench/gpu_train.py --smoke --row-timeout 300)
  X=1; [ $REHEARSE = 1 ] && X=2  # ceilings only: a loaded 2-core machine is slow to import torch
  run_step train_1b $((240 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --variant train_1b:loss_chunk=0,16 \
    --variant eager_1b:loss_chunk=0:compile=false --variant packed_1b:loss_chunk=0:doc_len=12 --out "$DIR/gpu_train_1b.json"
  # every peer framework's row (the smoke has no torchtitan and no CUDA for Liger: error rows, then the next)
  run_step titan_1b $((240 * X)) "$PY" "${TRAIN[@]}" --frameworks $TT030,torchtitan-0.2.2,transformers+liger,transformers \
    ${TT_ARGS[@]+"${TT_ARGS[@]}"} --variant train_1b: --out "$DIR/gpu_train_titan_1b.json"
  run_step train_7b_auto $((240 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --loss-chunk 16 --recompute auto \
    --micro-batch 1 --variant train_7b_auto: --variant fp8_7b_auto:fp8=rowwise --out "$DIR/gpu_train_7b_auto.json"
  skip_step generate_paged "--smoke: tests/test_bench_generate_gpu.py runs generate_gpu.py --smoke on paged keys"
  run_step generate $((240 * X)) "$PY" bench/generate_gpu.py --smoke --kv slab --speculative 4 --out "$DIR/generate_gpu.json"
  run_step rl $((120 * X)) "$PY" bench/rl_gpu.py --smoke --out "$DIR/rl_gpu.json"
  skip_step rl_async "--smoke: tests/test_bench_rl_gpu.py runs rl_gpu.py --smoke --mode async (make test-all)"
  # loom plan --profile-hardware has no mode short enough for a smoke run (--quick: about 40 s of CPU on
  # 2 cores): started, then cut off by its timeout, which is also what this run checks of a step that overruns.
  run_step profile 2 "$PY" -m loom.cli plan --profile-hardware "$DIR/profile.json" --quick
  run_step train_3b $((240 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --recompute full --variant train_3b:loss_chunk=0,16 \
    --out "$DIR/gpu_train_3b.json"
  skip_step titan_3b "--smoke: titan_1b's smoke runs the same rows"
  run_step moe $((120 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --models tiny-moe --loss-chunk 16 --variant moe: \
    --out "$DIR/gpu_train_moe.json"
  skip_step block_tp "--smoke: tests/test_bench_block_gpu.py runs block_gpu.py --smoke"
  skip_step serve "--smoke: tests/test_bench_serve_load.py runs serve_load.py --smoke"
  skip_step host_syncs "--smoke: tests/test_host_syncs.py counts the same synchronisations on the CPU"
  skip_step gpu_tests "--smoke: the tests marked gpu need a CUDA device"
  run_step train_7b $((120 * X)) "$PY" "${TRAIN[@]}" --frameworks loom --recompute full --loss-chunk 16 \
    --variant train_7b: --variant fp8_7b:fp8=rowwise --out "$DIR/gpu_train_7b.json"
  skip_step liger_1b "--smoke: titan_1b's smoke runs transformers+liger"
else
  TRAIN=(bench/gpu_train.py --kernels 15 --in-process)  # loom's rows, each with its top kernels of one profiled step
  PEER=(bench/gpu_train.py --kernels 15 --row-timeout 100)  # a peer's row in its own process
  run_step train_1b 150 "$PY" "${TRAIN[@]}" --models llama3.2-1b --seqs 4096 --steps 5 --warmup 2 --frameworks loom \
    --variant train_1b:loss_chunk=0,8192 --variant eager_1b:loss_chunk=0:compile=false \
    --variant packed_1b:loss_chunk=0:doc_len=1024 --out "$DIR/gpu_train_1b.json"
  run_step titan_1b 110 "$PY" "${PEER[@]}" --models llama3.2-1b --seqs 4096 --steps 5 --warmup 2 --frameworks $TT030 \
    ${TT_ARGS[@]+"${TT_ARGS[@]}"} --variant train_1b: --out "$DIR/gpu_train_titan_1b.json"
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  SEVEN=(--models llama2-7b --seqs 4096 --tokens-per-step 8192 --steps 3 --warmup 2 --frameworks loom --loss-chunk 8192)
  if [ "${MEM:-0}" -ge 130000 ]; then  # an H200's 141 GB; one H100's 80 GB does not hold 7B's fp32 states and moments
    run_step train_7b_auto 240 "$PY" "${TRAIN[@]}" "${SEVEN[@]}" --recompute auto --micro-batch 1 \
      --variant train_7b_auto: --variant fp8_7b_auto:fp8=rowwise --variant fp8_7b_tw:fp8=tensorwise \
      --out "$DIR/gpu_train_7b_auto.json"
  else
    skip_step train_7b_auto "n/a: ${MEM:-?} MiB of GPU memory; the 7B rows need an H200"
  fi
  run_step generate_paged 100 "$PY" bench/generate_gpu.py --kv paged --batches 1,64,256 --new 32 --repeats 2 --no-hf \
    --out "$DIR/generate_gpu_paged.json"
  PROFILE=()
  [ -n "$PROFILE_FOR" ] && PROFILE=(--profile "$PROFILE_FOR")
  run_step generate 80 "$PY" bench/generate_gpu.py --kv slab --batches 1,64 --new 32 --repeats 2 --speculative 4 \
    ${PROFILE[@]+"${PROFILE[@]}"} --out "$DIR/generate_gpu.json"
  run_step rl 120 "$PY" bench/rl_gpu.py --warmup 1 --steps 2 --timeout 115 --out "$DIR/rl_gpu.json"
  # issue 56: the same steps with rl.mode=async (a generation process beside the trainer, on the same GPU)
  run_step rl_async 120 "$PY" bench/rl_gpu.py --mode async --warmup 1 --steps 2 --timeout 115 \
    --out "$DIR/rl_gpu_async.json"
  run_step profile 60 "$PY" -m loom.cli plan --profile-hardware "$DIR/profile.json"
  run_step train_3b 120 "$PY" "${TRAIN[@]}" --models llama3.2-3b --seqs 8192 --steps 3 --warmup 2 --frameworks loom \
    --variant train_3b:loss_chunk=0,8192 --out "$DIR/gpu_train_3b.json"
  run_step titan_3b 110 "$PY" "${PEER[@]}" --models llama3.2-3b --seqs 8192 --steps 3 --warmup 2 --frameworks $TT030 \
    ${TT_ARGS[@]+"${TT_ARGS[@]}"} --variant train_3b: --out "$DIR/gpu_train_titan_3b.json"
  run_step moe 100 "$PY" "${TRAIN[@]}" --models qwen3-30b-a3b-4l --seqs 4096 --steps 5 --warmup 2 --frameworks loom \
    --loss-chunk 8192 --variant moe: --out "$DIR/gpu_train_moe.json"
  # issue 52: a tensor-parallel rank's block eager and compiled, priced from this call's profile first
  BLOCK_GPU=(--gpu h200)
  [ -s "$DIR/profile.json" ] && BLOCK_GPU=(--profile "$DIR/profile.json")
  run_step block_tp 120 "$PY" bench/block_gpu.py "${BLOCK_GPU[@]}" --shapes llama3-70b-tp8,llama3-8b-tp4 \
    --out "$DIR/block_gpu.json"
  run_step serve 100 "$PY" bench/serve_load.py --shape llama3.2-1b --clients 32 --rounds 2 --max-tokens 64 \
    --out "$DIR/serve_load.json"
  run_step host_syncs 60 "$PY" bench/host_syncs_gpu.py --out "$DIR/host_syncs_gpu.json"
  # only the files that mark tests gpu: collecting the whole folder took most of the step's 90 s on an H200
  GPU_TEST_FILES=$(grep -l "mark\.gpu" tests/test_*.py)
  run_step gpu_tests 90 "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider --continue-on-collection-errors $GPU_TEST_FILES
  if [ "${MEM:-0}" -ge 130000 ]; then
    run_step train_7b 200 "$PY" "${TRAIN[@]}" "${SEVEN[@]}" --recompute full --variant train_7b: \
      --variant fp8_7b:fp8=rowwise --out "$DIR/gpu_train_7b.json"
  else
    skip_step train_7b "n/a: ${MEM:-?} MiB of GPU memory; the 7B rows need an H200"
  fi
  run_step liger_1b 100 "$PY" "${PEER[@]}" --models llama3.2-1b --seqs 4096 --steps 5 --warmup 2 \
    --frameworks transformers+liger --variant train_1b: --out "$DIR/gpu_train_liger_1b.json"
fi
exit 0
