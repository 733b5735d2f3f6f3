"""lm-evaluation-harness against `loom serve` (issue 57): its `local-completions` model runs a multiple-choice task
and a generate_until task written here (local JSONL + YAML, `include_path`; nothing downloaded). Its
loglikelihoods equal a direct fp32 forward of the same model to 1e-5, its is_greedy flags the argmax check of the
same forward, and its generations equal `loom generate`'s greedy completions."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("lm_eval")

from test_serve import CONTEXT, Server, model_dir  # noqa: E402

from loom.cli import main  # noqa: E402
from loom.serve import load  # noqa: E402
from loom.serve.protocol import Limits  # noqa: E402

pytestmark = pytest.mark.slow  # lm_eval's import (datasets, pandas, sklearn, ...) and its task machinery

MC = [{"question": "the quick brown", "choices": ["fox", "dog", "lazy"], "answer": 0},
      {"question": "jumps over the", "choices": ["lazy dog", "quick fox"], "answer": 0},
      {"question": "say ok", "choices": ["1", "2", "3", "the"], "answer": 2}]
GEN = [{"prompt": "the quick brown fox", "target": "jumps"}, {"prompt": "say ok 3", "target": "ok"}]
NEW_TOKENS = 8


def write_tasks(d, mc_path, gen_path):
    (d / "loom_mc.yaml").write_text(f"""task: loom_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc_path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (d / "loom_gen.yaml").write_text(f"""task: loom_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen_path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["<never>"]
  max_gen_toks: {NEW_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_lm_eval_local_completions_equals_loom(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    path = model_dir(tmp_path / "tiny")
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GEN))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks, tmp_path / "mc.jsonl", tmp_path / "gen.jsonl")
    server = Server(load(str(path), max_batch=8, limits=Limits(max_tokens=64)))
    try:
        lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", tokenizer=str(path),
                                 tokenizer_backend="huggingface", max_length=CONTEXT - 1, num_concurrent=2, batch_size=3,
                                 max_retries=1, max_gen_toks=NEW_TOKENS)
        out = lm_eval.simple_evaluate(model=lm, tasks=["loom_mc", "loom_gen"], task_manager=TaskManager(
            include_path=str(tasks)), log_samples=True, num_fewshot=0)
        scored = server.served.scheduler.engine.stats["scored_tokens"]
    finally:
        server.close()
    model = server.served.scheduler.engine.model
    tok = server.served.tokenizer
    samples = out["samples"]["loom_mc"]
    assert len(samples) == len(MC) and scored > 0
    checked = 0
    for sample in samples:
        for (context, continuation), ((ll, greedy),) in zip((a for a in sample["arguments"]), sample["resps"]):
            ctx = tok.encode(context)
            ids = tok.encode(context + continuation)
            with torch.no_grad():
                logp = model(torch.tensor([ids]))[0].double().log_softmax(-1)
            want = sum(logp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
            assert abs(ll - want) < 1e-5, (context, continuation)
            assert greedy == all(int(logp[i - 1].argmax()) == ids[i] for i in range(len(ctx), len(ids)))
            checked += 1
    assert checked == sum(len(r["choices"]) for r in MC)
    # generate_until: loom generate's greedy completions of the same prompts
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in GEN))
    assert main(["generate", "--checkpoint", str(path), "--input", str(tmp_path / "in.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]) == 0
    want = [json.loads(x)["completion"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    got = {s["doc"]["prompt"]: s["resps"][0][0] for s in out["samples"]["loom_gen"]}
    assert [got[r["prompt"]] for r in GEN] == want and all(want)
