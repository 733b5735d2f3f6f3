"""The compile cache round trip (loom/compile_cache.py) with the CPU inductor backend: a process compiles and
saves, a fresh process with empty caches loads and hits; a cache made for another torch, or damaged, is refused
with a note and nothing is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom import compile_cache

ROOT = Path(__file__).resolve().parent.parent

# compiles one small pointwise function with inductor (a C++ kernel on the CPU), then prints the cache counters
SNIPPET = """
import json, torch
from loom import compile_cache
report = compile_cache.activate("snippet")
f = torch.compile(lambda x: torch.sin(x) * 2 + torch.cos(x), backend="inductor")
y = f(torch.arange(64, dtype=torch.float32))
assert torch.allclose(y, torch.sin(torch.arange(64.)) * 2 + torch.cos(torch.arange(64.)))
print("RESULT " + json.dumps({"hits": compile_cache.hits(), "report": report.as_dict() if report else None}))
"""


def _run(tmp: Path, env_extra: dict, inductor_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_COMPILE_CACHE")}
    # TORCHINDUCTOR_VEC_ISA_OK=1: inductor takes the CPU's vector ISA from /proc/cpuinfo instead of compiling and
    # loading a probe library per ISA into each empty cache dir (about 7 s of each process's 9 s of compiling)
    env.update(env_extra, TORCHINDUCTOR_CACHE_DIR=str(tmp / inductor_dir), PYTHONPATH=str(ROOT),
               TORCHINDUCTOR_COMPILE_THREADS="1", TORCHINDUCTOR_VEC_ISA_OK="1")
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[7:]), "stdout": out.stdout}


def test_round_trip_hits_in_a_fresh_process_and_refuses_another_machine(tmp_path):
    cache = tmp_path / "cache"
    cold = _run(tmp_path, {"LOOM_COMPILE_CACHE_SAVE": str(cache), "LOOM_COMMIT": "aaaa"}, "inductor-a")
    assert cold["hits"]["fxgraph_miss"] >= 1 and cold["hits"]["fxgraph_hit"] == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["key"] == compile_cache.current_key() and manifest["commit"] == "aaaa"
    (entry,) = manifest["entries"].values()
    assert entry["artifacts"].get("inductor", 0) >= 1 and (cache / entry["file"]).stat().st_size == entry["bytes"]

    # a fresh process, empty inductor cache dir, another commit: loads (with a note) and every graph hits
    warm = _run(tmp_path, {"LOOM_COMPILE_CACHE_LOAD": str(cache), "LOOM_COMMIT": "bbbb"}, "inductor-b")
    assert warm["report"]["artifacts"] >= 1 and len(warm["report"]["loaded"]) == 1
    assert any("compiled at commit aaaa" in n for n in warm["report"]["notes"])
    assert warm["hits"]["fxgraph_hit"] >= 1 and warm["hits"]["fxgraph_miss"] == 0

    # the same cache claiming another torch: refused with a note naming the field, nothing loaded
    manifest["key"]["torch"] = "2.0.0"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    refused = compile_cache.load(cache)
    assert refused.artifacts == 0 and refused.loaded == []
    assert any("made for another machine" in n and "torch: '2.0.0'" in n for n in refused.notes)


def test_damaged_or_missing_cache_is_ignored_with_a_note(tmp_path):
    missing = compile_cache.load(tmp_path / "nothing")
    assert missing.artifacts == 0 and "no manifest.json" in missing.notes[0]

    folder = tmp_path / "c"
    folder.mkdir()
    blob = b"not a cache blob"
    import gzip
    import hashlib

    gz = gzip.compress(blob)
    (folder / "x.bin.gz").write_bytes(gz + b"tampered")
    (folder / "manifest.json").write_text(json.dumps({
        "format": compile_cache.FORMAT, "key": compile_cache.current_key(), "commit": None,
        "entries": {"x": {"file": "x.bin.gz", "bytes": len(gz), "sha256": hashlib.sha256(gz).hexdigest()}}}))
    damaged = compile_cache.load(folder)
    assert damaged.loaded == [] and any("does not match its checksum" in n for n in damaged.notes)

    (folder / "manifest.json").write_text("{")
    assert "unreadable" in compile_cache.load(folder).notes[0]
    (folder / "manifest.json").write_text(json.dumps({"format": 99}))
    assert "format 99" in compile_cache.load(folder).notes[0]


@pytest.mark.parametrize("field", compile_cache.KEY_FIELDS)
def test_every_key_field_is_compared(field):
    key = compile_cache.current_key()
    other = {**key, field: "something else"}
    assert compile_cache.key_mismatch(other, key) == [f"{field}: 'something else' != {key[field]!r}"]
    assert compile_cache.key_mismatch(key, key) == []
