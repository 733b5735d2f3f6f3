"""Host synchronisations per training step (issue 58): a step of `loom train` / `loom sft` reads the device once
(loss, gradient norm, statistics and the stop flags in one transfer), issues one all-reduce of numbers for the
host (plus, where the count of a loss depends on the data, the count's all-reduce before the forward, kept on
the device; under pipeline parallelism the gradient norm's over the stages), and writes nothing to the key-value
store from the loop (MoE routing statistics included). Counted by patching every host read loom's code can make (tests/host_syncs.py): on the
tree before issue 58 a step made 2 host reads in one process, 3 with a data-dependent count or pipeline stages,
and 2 store writes per rank."""

from __future__ import annotations

import pytest

from conftest import SMALL
from host_syncs import count_step_syncs

from loom.config import load_config

STEPS = 3
NO_SAVES = [f"train.steps={STEPS}", "checkpoint.save_final=false", "checkpoint.interval=0"]
SFT = ["sft.data=synthetic:200", "train.seq_len=64", "model.max_seq_len=128"]


def counts(name: str, overrides: list[str], run_dir: str) -> dict[str, float]:
    recipe = None
    if name == "tiny-sft":
        from loom.post.sft import SFT as Recipe

        recipe = Recipe()
    per_step, calls = count_step_syncs(load_config(name, SMALL + NO_SAVES + overrides), run_dir, recipe)
    # The looped expert computation reads its row counts on the host: the MoE path where torch._grouped_mm is not
    # used (CPU; the grouped path on a GPU reads nothing). That is the layer's, not the step loop's.
    loop = sum(n for (kind, where), n in calls.items() if kind == "host read" and where.startswith("loom/models/moe.py"))
    if loop:
        per_step["host read"] -= loop / STEPS
    return {"per_step": per_step, "where": sorted(f"{k} at {w}: {n}" for (k, w), n in calls.items())}


@pytest.mark.parametrize("name, overrides", [("tiny", []), ("tiny-sft", SFT)], ids=["train", "sft"])
def test_one_host_read_per_step_in_one_process(name, overrides, tmp_path):
    got = counts(name, overrides, str(tmp_path / "run"))
    assert got["per_step"] == {"host read": 1.0}, got["where"]


def _rank_counts(cases: list[tuple[str, list[str], str]]) -> list[dict]:
    return [counts(*case) for case in cases]


def test_one_host_read_and_one_reduction_per_step_on_two_ranks(tmp_path):
    """SFT under data parallelism (the supervised-token count summed on the device before the forward), a
    two-stage pipeline (the bubble folded into the step's reduction; the gradient norm summed over the stages)
    and MoE under data parallelism (the routing statistics folded into the step's reduction)."""
    from distributed import shared_pool

    cases = [("tiny-sft", SFT + ["parallel.dp_shard=2"], str(tmp_path / "sft")),
             ("tiny", ["parallel.pp=2", "model.layers=4", "model.tie_embeddings=false"], str(tmp_path / "pp")),
             ("tiny-moe", ["parallel.dp_shard=2", "model.moe.router=sigmoid_bias"], str(tmp_path / "moe"))]
    for sft, pp, moe in shared_pool(2).run(_rank_counts, cases):
        assert sft["per_step"] == {"host read": 1.0, "collective": 2.0}, sft["where"]
        assert pp["per_step"] == {"host read": 1.0, "collective": 2.0}, pp["where"]
        assert moe["per_step"] == {"host read": 1.0, "collective": 1.0}, moe["where"]


def test_the_hang_beacon_posts_its_latest_mark_at_most_once_an_interval():
    """Marks cost no store write; the background poster writes the latest at most once every post_interval, and a
    rank that stops marking (hung) has its last mark in the store within one interval."""
    import time

    from loom.train.hang import Beacon, post_interval

    class Store:  # the three calls Beacon makes, with the writes counted
        def __init__(self):
            self.data, self.writes = {}, 0

        def set(self, key, value):
            self.data[key], self.writes = value.encode(), self.writes + 1

        def check(self, keys):
            return all(k in self.data for k in keys)

        def get(self, key):
            return self.data[key]

    store = Store()
    beacon = Beacon(0.4, store=store)  # interval 0.1 s
    assert post_interval(0.4) == 0.1 and post_interval(600) == 10
    t0 = time.monotonic()
    for step in range(1, 2001):
        beacon.mark(f"step {step}: train")
    elapsed = time.monotonic() - t0
    time.sleep(0.35)  # then "hung": no more marks
    assert store.writes <= 2 + (elapsed + 0.35) / 0.1, (store.writes, elapsed)
    assert store.data["loom/beacon/0"].decode() == f"{beacon.seq}|step 2000: train"
    del beacon  # the poster ends with its beacon
