"""CPU training keeps freed memory: a step does not fault its large buffers back in from the kernel.

Each case runs in a fresh interpreter, since the malloc setting is process-wide and cannot be undone.
"""

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    ctypes.CDLL(None).gnu_get_libc_version
    GLIBC = sys.platform.startswith("linux")
except (OSError, AttributeError):
    GLIBC = False

pytestmark = pytest.mark.skipif(not GLIBC, reason="the setting is glibc's")


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


STEP = """
import json, resource, tempfile, torch
from pathlib import Path
from loom.config import load_config
from loom.train.trainer import Trainer
# logits of 32 x 512 tokens x 512 vocabulary in fp32: 32 MiB, past glibc's largest mmap threshold
cfg = load_config("tiny", ["model.layers=1", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
                           "model.ffn_hidden=128", "model.vocab_size=512", "model.max_seq_len=512",
                           "train.seq_len=512", "train.micro_batch=32", "train.global_batch=32", "train.steps=12",
                           "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false",
                           "train.device=cpu", "train.threads=1"])
trainer = Trainer(cfg, Path(tempfile.mkdtemp()) / "run", quiet=True)
for _ in range(5):  # the heap reaches its steady size within ~5 steps
    trainer.train_step()
faults = []
for _ in range(5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    trainer.train_step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"faults_per_step": sorted(faults)[len(faults) // 2], "all": faults}))
"""


def test_cpu_training_step_does_not_fault_its_buffers_back_in():
    # Without the setting this step faults ~100k pages (the logits, their log-probabilities and
    # gradients, each freed and allocated anew every step); with it, next to none.
    # The median step: a step now and then faults a few thousand pages (the heap still settling, the
    # background data reader's own arena), never the ~100k of every step without the setting.
    r = _run(STEP)
    assert r["faults_per_step"] < 1000, r
