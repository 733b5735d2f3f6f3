#!/usr/bin/env bash
# Download exactly the wheels in bench/device_wheels.txt into .whl/<group>/ (here, before the GPU call: the
# GPU machine reaches no registry), for the machine's Python 3.12 on x86-64, and check that each wheel's
# Requires-Dist is carried or on the machine. .whl/ is git-ignored; `carry: [".whl"]` takes it along.
#
#   bench/fetch_wheels.sh            # -> .whl/common, .whl/torchtitan-0.3.0, .whl/torchtitan-0.2.2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIST=bench/device_wheels.txt
DEST=.whl
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"

rm -rf "$DEST"
group=
while IFS= read -r line; do
  case "$line" in
    "# ["*"]"*) group=${line#\# [}; group=${group%%]*}; mkdir -p "$DEST/$group"; continue ;;
    ""|"#"*) continue ;;
  esac
  [ -n "$group" ] || { echo "$LIST: $line comes before any '# [group]' line" >&2; exit 2; }
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS -d "$DEST/$group" "$line"
done < "$LIST"

# Each wheel's needs (extras left out) must be carried or installed on the machine. The machine's packages:
# /work/.library/device/KINDS.md, "Python packages already there" (read 2026-11-17).
"$PY" - "$DEST" <<'EOF'
import re, sys, zipfile
from pathlib import Path

machine = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp""".split()
not_needed = {"wandb"}  # declared by torchtitan 0.3.0, never imported on the bench's path (checked on CPU)
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = sorted(Path(sys.argv[1]).glob("*/*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
have = carried | {norm(n) for n in machine}
missing, total = [], 0
for w in wheels:
    total += w.stat().st_size
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = line.split(":", 1)[1].strip()
            if "python_version < '3.1" in req.replace('"', "'"):
                continue  # not on Python 3.12
            name = norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
            if name not in have and name not in not_needed:
                missing.append(f"{w.name}: {req}")
    print(f"{w.parent.name:18s} {w.name}")
print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB")
if missing:
    print("needed but neither carried nor on the machine:\n  " + "\n  ".join(missing))
    sys.exit(1)
EOF
