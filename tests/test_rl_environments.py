"""rl.environment (loom/post/rl/environments.py, tools.py): a multi-turn rollout is the transcript one gets by
running the turns by hand, environment tokens carry no loss, the sandboxed Python tool contains hostile code
(sleep, spin, fork, huge output, memory, crash) within its limits, and `loom rl` runs the calculator tool."""

import json
import os
import time

import pytest
import torch

from loom.cli import main
from loom.config import load_config
from loom.errors import UserError
from loom.infer.sampling import SamplingParams
from loom.models.losses import IGNORE
from loom.post.rl.environments import Turns, run_episodes
from loom.post.rl.rollouts import rows_of
from loom.post.rl.tools import Calculator, PythonTool, calculate, run_python

MODEL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
         "model.vocab_size=320", "model.max_seq_len=64"]


class Bytes:
    """A byte-level tokenizer (ids 0..255): enough for the engine and the turns, no training."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class Scripted:
    """Answers the first model turn with a fixed text (reward 0.25), ends the episode at the second (reward 1)."""

    def reset(self, record):
        self.turn = 0
        return record["prompt"]

    def step(self, completion):
        self.turn += 1
        return (" [tool says 7]\n", 0.25, False) if self.turn == 1 else ("", 1.0, True)


@pytest.fixture(scope="module")
def model():
    from loom.build import build_in_layout, tensor_parallel
    from loom.parallel.dims import MeshPlace

    cfg = load_config("tiny-grpo", MODEL)
    return build_in_layout(cfg, "cpu", tensor_parallel(MeshPlace(mesh=None)), seed=1).model


@pytest.fixture(scope="module")
def engine(model):
    from loom.infer.engine import Engine

    return Engine(model, max_batch=8, max_len=64)


def test_multi_turn_rollout_matches_the_hand_run_transcript_and_masks_environment_tokens(engine):
    tok = Bytes()
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=11)
    records = [{"prompt": "12+30="}, {"prompt": "7+5="}]
    episodes = run_episodes(engine, Scripted, records, ["r0", "r1"], [params, params], Turns(tok), 3, tok.decode)
    for record, ep in zip(records, episodes):
        prompt = tok.encode(record["prompt"])
        first = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=5, seed=11))[0]
        said = tok.encode(" [tool says 7]\n")
        second = engine.generate([prompt + first.tokens + said],
                                 SamplingParams(temperature=1.0, max_new_tokens=5, seed=11 + 1_000_003))[0]
        assert ep.prompt == prompt and ep.tokens == first.tokens + said + second.tokens
        assert ep.model_mask == [1] * len(first.tokens) + [0] * len(said) + [1] * len(second.tokens)
        assert ep.logprobs == pytest.approx(first.logprobs + [0.0] * len(said) + second.logprobs, abs=1e-5)
        assert (ep.reward, ep.turns, ep.finish_reason) == (1.25, 2, "done")
    # Training rows: loss only where the model wrote the token, its label that token, the engine's log-prob.
    rows = rows_of([e.prompt for e in episodes], episodes, 40, 0, [e.model_mask for e in episodes])
    for b, ep in enumerate(episodes):
        start = len(ep.prompt) - 1
        for k, (token, mine, logp) in enumerate(zip(ep.tokens, ep.model_mask, ep.logprobs)):
            assert rows["input_ids"][b, start + k + 1] == token  # the transcript is the row's input
            assert rows["mask"][b, start + k] == mine
            assert rows["labels"][b, start + k] == (token if mine else IGNORE)
            assert rows["rollout_logp"][b, start + k] == pytest.approx(logp if mine else 0.0, abs=1e-6)
        assert rows["mask"][b].sum() == sum(ep.model_mask) < len(ep.tokens)
    # The policy loss's gradient does not reach an environment token's logit.
    logits = torch.randn(*rows["labels"].shape, 320, requires_grad=True)
    from loom.post import losses as L
    (L.token_logprobs(logits, rows["labels"]) * rows["mask"]).sum().backward()
    said_at = [len(episodes[0].prompt) - 1 + k for k, m in enumerate(episodes[0].model_mask) if not m]
    assert logits.grad[0, said_at].abs().sum() == 0 and logits.grad[0].abs().sum() > 0


def test_paged_engine_reuses_the_earlier_turns_blocks(model, engine):
    """With paged memory (rl.engine_paged) a later turn's prompt, the transcript so far, finds the blocks of the
    earlier turns in the engine's prefix cache; the episodes are the slab engine's."""
    from loom.infer.engine import Engine

    tok, params = Bytes(), SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    records = [{"prompt": "12+30=" * 3}, {"prompt": "7+5=" * 4}]  # 18 and 16 tokens: a whole 16-token block
    paged = Engine(model, max_batch=8, max_len=64, paged=True)
    got = run_episodes(paged, Scripted, records, ["r0", "r1"], [params] * 2, Turns(tok), 3, tok.decode)
    want = run_episodes(engine, Scripted, records, ["r0", "r1"], [params] * 2, Turns(tok), 3, tok.decode)
    assert [e.tokens for e in got] == [e.tokens for e in want] and all(e.turns == 2 for e in got)
    assert paged.stats["prefix_cache_hit_tokens"] >= 32  # turn 2 of both episodes: the first block each


def test_chat_turns_close_the_models_turn_once():
    from loom.post.chat import load_template

    turns = Turns(Bytes(), load_template("chatml"))
    assert Bytes().decode(turns.reply("7", closed=True)) == "\n<|im_start|>user\n7<|im_end|>\n<|im_start|>assistant\n"
    assert Bytes().decode(turns.reply("7", closed=False)).startswith("<|im_end|>\n<|im_start|>user\n7")


def test_environment_that_breaks_its_contract_is_bad_input_naming_the_record(engine):
    class Broken(Scripted):
        def step(self, completion):
            return "text", "one", False

    with pytest.raises(UserError, match="on record 3: step\\(completion\\) must return"):
        run_episodes(engine, Broken, [{"prompt": "1+1="}], ["record 3"], [SamplingParams(max_new_tokens=2)],
                     Turns(Bytes()), 2, Bytes().decode)


def test_calculator_tool():
    assert calculate("38+45") == 83 and calculate("(2+3)*4-1") == 19 and calculate("7/2") == 3.5
    for bad in ("__import__('os')", "2**99999", "1/0", "x+1"):
        with pytest.raises((ValueError, ZeroDivisionError)):
            calculate(bad)
    calc = Calculator()
    assert calc.reset({"prompt": "38+45=", "answer": "83"}) == "38+45="
    assert calc.step("calc 38+45") == (" = 83\n", 0.0, False)
    assert calc.step("calc 1/0")[0].startswith(" = error")
    assert calc.step(" 83 ") == ("", 1.0, True) and calc.step("84") == ("", 0.0, True)


def survivors(marker: str) -> list[str]:
    """Processes whose command line holds `marker` (a tool's children left behind)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def test_hostile_code_is_contained_within_its_limits():
    t0 = time.perf_counter()
    sleeper = run_python("import time\ntime.sleep(60)", timeout_s=0.5)
    assert sleeper.reason == "timeout" and time.perf_counter() - t0 < 5
    spinner = run_python("while True:\n    pass", timeout_s=0.5)
    assert spinner.reason == "timeout"
    # a bounded fork bomb (2**6 processes were it free): no fork succeeds, nothing outlives the call
    forks = run_python("import os, time\nmade = 0\nfor _ in range(6):\n    try:\n        os.fork(); made += 1\n"
                       "    except (OSError, AttributeError) as e:\n        print('blocked', type(e).__name__)\n"
                       "        break\nprint('made', made)\ntime.sleep(0.3)  # loom-fork-probe", timeout_s=2)
    assert "blocked" in forks.output and forks.output.count("made 0") == 1, forks
    assert not survivors("loom-tool-")
    huge = run_python("while True:\n    print('x' * 1000)", timeout_s=2, max_output=500)
    assert huge.reason == "output" and len(huge.output) < 700 and "over the limit" in huge.output
    memory = run_python("x = bytearray(4 * 1024 ** 3)", timeout_s=2, memory_mb=256)
    assert memory.reason == "error" and "MemoryError" in memory.output
    crash = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", timeout_s=2)
    assert crash.reason == "crash" and "SIGSEGV" in crash.output
    bad = run_python("print((", timeout_s=2)
    assert bad.reason == "error" and "SyntaxError" in bad.output
    good = run_python("print(sum(range(10)))", timeout_s=5)
    assert good.ok and good.output == "45\n"
    # In the environment: every failure is a turn with reward 0 and the reason as the tool's text.
    tool = PythonTool()
    tool.timeout_s = 0.5
    tool.reset({"prompt": "2+2=", "answer": "4"})
    text, reward, done = tool.step("```python\nwhile True: pass\n```")
    assert (reward, done, tool.reason) == (0.0, False, "timeout") and "timed out" in text
    assert tool.step("```python\nprint(2+2)\n```")[0] == "\n```output\n4\n```\n"
    assert tool.step("4") == ("", 1.0, True)


def test_loom_rl_with_the_calculator_tool(tmp_path):
    run = ["rl", "--config", "tiny-grpo", "--run-dir", str(tmp_path / "run"), *[f"--{o}" for o in MODEL],
           "--train.seq_len=24", "--train.global_batch=16", "--train.micro_batch=16", "--train.steps=1",
           "--train.eval_interval=0", "--log.progress=none", "--log.tensorboard=false", "--rl.prompts=addition:50",
           "--rl.valid_prompts=addition:4", "--rl.reward=", "--rl.environment=loom.post.rl.tools:Calculator",
           "--rl.max_turns=2", "--rl.group_size=4", "--rl.max_new_tokens=4", "--rl.engine_batch=16",
           "--checkpoint.save_final=false"]
    assert main(run) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "loss" in r][0]
    assert 1 <= step["turns"] <= 2 and step["reward"] == step["reward_env"]
    assert main([*run[:4], str(tmp_path / "bad"), *run[5:], "--rl.environment=loom.post.rl.tools:Nope"]) == 2
