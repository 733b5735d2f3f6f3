"""bench/rl_tools_demo.py (`make demo-rl-tools`): its SFT tool transcripts are exactly what the calculator
environment produces and rewards, its held-out problems are never trained on, and (slow) the script runs end to
end in --smoke mode."""

import importlib.util
import re

import pytest

from conftest import ROOT, bench_smoke

spec = importlib.util.spec_from_file_location("rl_tools_demo", ROOT / "bench" / "rl_tools_demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def test_sft_tool_transcript_is_what_the_calculator_environment_answers_and_rewards():
    from loom.post.rl.tools import Calculator

    for prompt, answer in demo.problems(50, 0, False):
        a, b = map(int, prompt.rstrip("=").split("*"))
        assert answer == str(a * b) and 100 <= a < 1000 and 10 <= b < 100
        target = demo.tool_transcript(prompt, answer)
        call, rest = target.split(demo.STOP, 1)  # the call turn ends at rl.stop, which the engine cuts from its text
        env = Calculator()
        env.reset({"prompt": demo.TOOL + prompt, "answer": answer})
        text, reward, done = env.step(call)
        assert (reward, done) == (0.0, False) and text == f" = {a * b}\n"
        # the transcript after the call turn is the tool's reply then the answer turn
        assert target == call + demo.STOP + text + answer and rest == text + answer
        assert env.step(answer)[1:] == (1.0, True)


def test_wrong_final_answer_scores_zero_and_held_out_problems_are_disjoint():
    from loom.post.rl.tools import Calculator

    env = Calculator()
    env.reset({"prompt": demo.TOOL + "123*45=", "answer": "5535"})
    assert env.step("5536")[1:] == (0.0, True)
    train = {p for p, _ in demo.problems(2000, 0, False)} | {p for p, _ in demo.problems(2000, 1, False)}
    valid = [p for p, _ in demo.problems(200, 2, True)]
    assert len(set(valid)) == 200 and not train & set(valid)
    assert all(re.fullmatch(r"\d{3}\*\d{2}=", p) for p in valid)


@pytest.mark.slow
def test_smoke_runs_end_to_end(tmp_path):
    out = bench_smoke("rl_tools_demo.py", tmp_path)
    assert out["smoke"] is True and out["rl_steps"] == 2 and out["held_out_problems"] == 16
    for stage in ("sft", "rl"):
        acc = out["held_out_accuracy"][stage]
        for key in ("no_tool", "with_tool", "tool_call_rate"):
            assert 0.0 <= acc[key] <= 1.0
        assert acc["example_tool_transcript"].startswith(demo.TOOL)
    assert out["train"] and all("reward" in r for r in out["train"])
    assert out["commit"] and out["command"].startswith("bench/rl_tools_demo.py --smoke")
