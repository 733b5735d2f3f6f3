"""bench/serve_load.py keeps running: its --smoke mode (a tiny random model, `loom serve` in its own process on
the CPU, 6 streaming clients x 2 rounds) writes a report whose numbers follow from what it timed, and the
server's metrics show the clients' requests decoded together."""

import pytest

from conftest import bench_smoke

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_serve_load_bench_smoke(tmp_path):
    report = bench_smoke("serve_load.py", tmp_path, timeout=300)
    assert report["requests"] == report["ok"] == 12 and report["failed"] == []
    assert report["generated_tokens"] == 12 * 8  # no stop token in a word-level vocabulary: max_tokens each
    assert report["tokens_per_s"] == pytest.approx(report["generated_tokens"] / report["wall_s"], rel=1e-3)
    for key in ("ttft_s", "itl_s"):
        p = report[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert report["ttft_s"]["count"] == 12 and report["itl_s"]["count"] > 0
    assert report["server"]["decode_steps"] > 0 and report["server"]["max_batch"] > 1  # clients batched together
    assert report["commit"] and report["machine"]["cpu"] and report["command"].startswith("python bench/serve_load.py")
