"""bench/gpu_train.py keeps running: its --smoke mode (tiny shape, CPU) trains loom and reports numbers that
follow from the FLOP formula (the transformers rows use the same code path; left out here for time)."""

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT
from loom.config import ModelConfig
from loom.flops import train_flops_per_token


def test_gpu_train_bench_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--smoke", "--frameworks", "loom", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["torch"] and report["machine"]["device"] == "cpu"
    rows = {r["framework"]: r for r in report["runs"]}
    assert set(rows) == {"loom"}
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("traceback"))
        assert row["tokens_per_step"] == 64 and row["tokens_per_s"] > 0
        cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512, max_seq_len=32)
        noncausal = row["tokens_per_s"] * train_flops_per_token(cfg, 32) / 1e12
        assert row["tflops_noncausal"] == pytest.approx(noncausal, rel=1e-3)
        # causal attention: half of the scores and values (4 s h FLOPs per layer forward, x3 for training)
        causal = noncausal - row["tokens_per_s"] * 3 * 2 * 4 * 32 * 64 / 2 / 1e12
        assert row["tflops_causal"] == pytest.approx(causal, rel=1e-3)
        assert row["mfu_causal"] == pytest.approx(row["tflops_causal"] / 989.0, rel=1e-3)
    # random init on uniform random tokens: the loss is near ln(vocab)
    assert rows["loom"]["loss"] == pytest.approx(math.log(512), rel=0.1)
    assert "train.loss_chunk=16" in rows["loom"]["settings"]
