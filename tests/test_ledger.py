"""bench/ledger.py: the GPU ledger is the one source of GPU figures; the READMEs' GPU tables are generated from it
and agree with it; targets read the newest figure of each row."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import ledger  # noqa: E402


def test_readmes_agree_with_the_ledger():
    assert ledger.render(check=True) == [], "run: python bench/ledger.py render"


def test_every_row_names_its_gpu_commit_versions_and_a_committed_source():
    rows = ledger.read()
    assert len(rows) >= 80
    for r in rows:
        assert r["gpu"].startswith("NVIDIA ") and r["commit"] and r["torch"], r
        assert isinstance(r["value"], (int, float)) and r["unit"], r
        assert (ROOT / r["source"]).is_file(), r["source"]
    # each figure is the number in its source file, not a copy typed by hand
    for r in rows:
        if r["figure"] == "tokens_per_s" and r["source"].split("/")[-1].startswith("gpu_train"):
            runs = json.loads((ROOT / r["source"]).read_text())["runs"]
            assert r["value"] in [x.get("tokens_per_s") for x in runs], r


def test_the_gpu_sections_quote_no_measurement_outside_the_generated_tables():
    """The README's "On a GPU" section: every GPU figure comes from the ledger's block, none is typed in prose."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## On a GPU", 1)[1].split("\n## ", 1)[0]
    begin, end = ledger.BEGIN.format("gpu"), ledger.END.format("gpu")
    prose = section.split(begin)[0] + section.split(end)[1]
    measured = re.findall(r"\d[\d,.]*\s*(?:tokens/s|ms\b|GiB|% (?:MFU|faster|slower)|×)", prose)
    assert measured == [], measured


def _row(key, figure, value, gpu="NVIDIA H200", predicted=None, unit="tokens/s"):
    return {"key": key, "figure": figure, "value": value, "unit": unit, "gpu": gpu, "commit": "abc1234",
            "torch": "2.11", "source": "x", "predicted": predicted}


def test_targets_read_the_newest_figure_and_compute_ratios_by_hand():
    rows = [
        _row("train_1b/torchtitan-0.3.0/chunked", "tokens_per_s", 60000.0),
        _row("train_1b/loom/plain", "tokens_per_s", 58000.0),
        _row("train_1b/loom/chunked", "tokens_per_s", 61000.0),
        _row("train_1b/loom/chunked", "tokens_per_s", 64000.0),  # a later call: the newest row counts
        _row("decode/paged/b1", "decode_step_ms", 1.2, unit="ms"),
        _row("decode/slab/b1", "decode_step_ms", 1.5, unit="ms"),
        _row("train_7b_auto/loom/chunked", "step_s", 0.80, predicted=0.90, unit="s"),
        _row("eager_1b/loom/plain", "step_s", 0.50, predicted=0.48, unit="s"),
        _row("decode/paged/b1", "decode_step_ms", 0.9, gpu="NVIDIA H100 80GB HBM3", unit="ms"),
    ]
    got = {(s["target"], s["gpu"]): s for s in ledger.status(rows)}
    t = got[("train_1b_vs_torchtitan", "NVIDIA H200")]
    assert t["value"] == pytest.approx(64000 / 60000) and t["state"] == "met"  # 1.067 >= 1.05
    rows.append(_row("train_1b/torchtitan-0.3.0/chunked", "tokens_per_s", 62000.0))
    t = {(s["target"], s["gpu"]): s for s in ledger.status(rows)}[("train_1b_vs_torchtitan", "NVIDIA H200")]
    assert t["value"] == pytest.approx(64000 / 62000) and t["state"] == "open"  # 1.032 < 1.05
    assert got[("decode_b1", "NVIDIA H200")]["state"] == "open" and got[("decode_b1", "NVIDIA H100 80GB HBM3")]["state"] == "met"
    assert got[("paged_vs_slab_b1", "NVIDIA H200")]["value"] == pytest.approx(1.2 / 1.5)
    assert got[("paged_vs_slab_b1", "NVIDIA H100 80GB HBM3")]["state"] == "unmeasured"
    assert got[("moe", "NVIDIA H200")]["state"] == "unmeasured"
    err = got[("plan_within_10pct", "NVIDIA H200")]  # |predicted / measured - 1|, the largest: 0.90 / 0.80
    assert err["value"] == pytest.approx(0.125) and err["state"] == "open"


def test_ingest_replaces_a_folders_rows_and_render_writes_the_blocks(tmp_path):
    folder = tmp_path / "device_check_x"
    folder.mkdir()
    (folder / "versions.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "commit": "feed123",
                                                      "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0"}))
    run = {"framework": "loom", "model": "llama3.2-1b", "row": "train_1b", "loss_kind": "chunked", "tokens_per_s": 61000.0,
           "step_s": 0.27, "mfu_causal": 0.5, "peak_memory_gib": 43.0, "settings": ["train.loss_chunk=8192"]}
    (folder / "gpu_train_1b.json").write_text(json.dumps({"machine": {}, "command": "c", "runs": [run]}))
    (folder / "predictions.json").write_text(json.dumps({"rows": [{"row": "train_1b loom chunked", "predicted_step_s": 0.3,
                                                                   "predicted_tokens_per_s": 55000.0}]}))
    path = tmp_path / "ledger.jsonl"
    rows = ledger.ingest(folder, ledger=path, adopt_cache=False)
    by = {r["figure"]: r for r in rows}
    assert by["tokens_per_s"]["key"] == "train_1b/loom/chunked" and by["tokens_per_s"]["predicted"] == 55000.0
    assert by["step_s"]["predicted"] == 0.3 and by["mfu_causal"]["predicted"] is None
    assert {r["commit"] for r in rows} == {"feed123"} and {r["gpu"] for r in rows} == {"NVIDIA H100 80GB HBM3"}
    run["tokens_per_s"] = 62000.0
    (folder / "gpu_train_1b.json").write_text(json.dumps({"machine": {}, "command": "c", "runs": [run]}))
    ledger.ingest(folder, ledger=path, adopt_cache=False)
    assert [r["value"] for r in ledger.read(path) if r["figure"] == "tokens_per_s"] == [62000.0]

    for name in ledger.BLOCKS:  # render into copies of the READMEs' blocks
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        block = ledger.BLOCKS[name][0]
        (tmp_path / name).write_text(f"before\n{ledger.BEGIN.format(block)}\nold\n{ledger.END.format(block)}\nafter\n")
    assert ledger.render(check=True, ledger=path, root=tmp_path) == list(ledger.BLOCKS)
    ledger.render(check=False, ledger=path, root=tmp_path)
    assert ledger.render(check=True, ledger=path, root=tmp_path) == []
    readme = (tmp_path / "README.md").read_text()
    assert "| the same, loom chunked loss | 62,000 |" in readme and readme.startswith("before") and "after" in readme
    assert "`train_1b/loom/chunked` | tokens_per_s | 62,000 | 55,000 | NVIDIA H100 80GB HBM3 | feed123" in \
        (tmp_path / "bench" / "README.md").read_text()


def test_status_prints_met_open_and_unmeasured(capsys):
    assert ledger.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "open  issue 54  NVIDIA H200: decode step, 1B shape, batch 1, paged ≤ 1.0 ms" in out
    assert re.search(r"\d+ met, \d+ open, \d+ unmeasured", out)


def test_a_calls_compile_cache_is_adopted_for_its_gpu_kind_unless_too_large(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "CACHES", tmp_path / "caches")
    cache = tmp_path / "compile_cache"
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")
    (cache / "gpu_train-1.bin.gz").write_bytes(b"x" * 1000)
    (cache / ".manifest.lock").write_text("")
    dest = ledger.adopt(cache, "NVIDIA H200")
    assert dest == tmp_path / "caches" / "nvidia-h200"
    assert sorted(p.name for p in dest.iterdir()) == ["gpu_train-1.bin.gz", "manifest.json"]
    monkeypatch.setattr(ledger, "CACHE_LIMIT_MIB", 0.0005)  # 524 bytes: the blob is over it
    assert ledger.adopt(cache, "NVIDIA H100 80GB HBM3") is None and not (tmp_path / "caches" / "nvidia-h100-80gb-hbm3").exists()
