"""bench/plan_device_rows.py prices the device check's loom rows as `loom plan --validate` prices loom's measured
runs: where a row is one of those runs, the two predictions are the same numbers."""

import importlib.util
import json
import sys

import pytest

from conftest import ROOT

# the profile `loom plan --validate` prices loom's measured runs from (measured_runs.json names it)
PROFILE = ROOT / json.loads((ROOT / "loom" / "planner" / "measured_runs.json").read_text())["profile"]


@pytest.mark.skipif(not PROFILE.is_file(), reason="the H200 profile is not in this checkout")
def test_device_rows_priced_as_validate_prices_measured_runs(tmp_path):
    from loom.planner.validation import measured_validation

    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("plan_device_rows", ROOT / "bench" / "plan_device_rows.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--profile", str(PROFILE), "--out", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == len(bench.ROWS) and all(r["fits"] for r in rows.values())
    validated = {r["run"]: r for r in measured_validation()}
    for row, run in (("train_1b loom plain", "h200-1b-seq4096-plain"), ("train_1b loom chunked",
                                                                         "h200-1b-seq4096-chunk8192"),
                     ("train_3b loom plain", "h200-3b-seq8192-full"), ("train_7b loom", "h200-7b-seq4096-full"),
                     ("fp8_7b loom", "h200-7b-seq4096-full-fp8")):
        assert rows[row]["predicted_step_s"] == pytest.approx(validated[run]["predicted_s"], abs=1e-4)
        assert rows[row]["predicted_peak_gib"] == pytest.approx(validated[run]["predicted_gib"], abs=0.01)
    # the eager row (train.compile=false) differs from the plain compiled one in its elementwise ops, run at the
    # profile's eager rate, and in what its blocks keep for backward; its matmuls are the same
    eager, plain = rows["eager_1b loom"], rows["train_1b loom plain"]
    assert eager["compile"] == "off" and eager["time_s"]["gemm"] == plain["time_s"]["gemm"]
    assert eager["time_s"]["elementwise"] > 3 * plain["time_s"]["elementwise"]
    # fp8 at the 7B shape is priced faster than bf16 (fewer GEMM seconds, more cast traffic)
    assert rows["fp8_7b loom"]["predicted_step_s"] < rows["train_7b loom"]["predicted_step_s"]
