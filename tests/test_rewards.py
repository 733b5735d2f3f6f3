"""loom.rewards: the built-in verifiable rewards against hand-worked values, their weighted sums, and bad
`rl.reward` specs and failing rewards as bad input naming what is wrong."""

import pytest

from loom import rewards as R
from loom.errors import UserError

SETTINGS = R.Settings(format_pattern=r"<answer>\d+</answer>", max_tokens=10, length_buffer=4)


def no_load(spec):
    raise AssertionError(f"no callable expected, got {spec}")


def test_exact_match_and_math_against_hand_values():
    assert R.exact_match("1+1=", " 2\n", answer="2") == 1.0
    assert R.exact_match("1+1=", "2.0", answer="2") == 0.0
    math = R.combine("math", SETTINGS, no_load)
    # math-verify reads values, not strings: 1/2 = 0.5 = \frac{1}{2}; a boxed answer is the one taken
    assert math("q", "so the answer is $\\frac{1}{2}$", answer="0.5") == 1.0
    assert math("q", "We get \\boxed{0.5}.", answer="\\frac{1}{2}") == 1.0
    assert math("q", "We get \\boxed{3}.", answer="2") == 0.0
    assert math("q", "no number here", answer="2") == 0.0
    assert R.exact_match("q", "\\boxed{0.5}", answer="1/2") == 0.0  # the verifier is what tells them apart


def test_format_and_length_rewards_against_hand_values():
    fmt = R.FormatReward(SETTINGS.format_pattern)
    assert fmt("q", "  <answer>12</answer>\n") == 1.0
    assert fmt("q", "<answer>12</answer> and more") == 0.0  # the whole completion must match
    length = R.LengthReward(10, 4)  # 0 up to 6, then -(n - 6) / 4, -1 from 10 on (characters here)
    assert [length("q", "x" * n) for n in (0, 6, 7, 8, 10, 14)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    counted = R.LengthReward(10, 4, count_tokens=lambda text: len(text.split()))
    assert counted("q", "a b c d e f g h") == -0.5


def test_weighted_sum_of_terms_and_user_callables():
    calls = []

    def load(spec):
        calls.append(spec)
        return lambda prompt, completion, **f: 10.0

    assert R.parse("math:1.0, format:0.2,mod.x:f:-0.5,length") == [("math", 1.0), ("format", 0.2),
                                                                   ("mod.x:f", -0.5), ("length", 1.0)]
    reward = R.combine("exact_match:2,format:0.5,mod:f:0.25,length:1", SETTINGS, load)
    assert calls == ["mod:f"]
    completion = "<answer>42</answer>"  # 19 characters: the length term is -1
    assert reward("q", completion, answer=completion) == pytest.approx(2 * 1 + 0.5 * 1 + 0.25 * 10 - 1)
    assert reward("q", "42", answer="7") == pytest.approx(0 + 0 + 2.5 + 0)
    lone = R.combine("mod:f", SETTINGS, load)  # a lone callable is itself (its own error messages)
    assert lone("q", "c") == 10.0 and R.user_callables("math,a.b:c:2") == ["a.b:c"]


@pytest.mark.parametrize("spec, message", [
    ("mathh:1.0", "unknown reward 'mathh'"),
    ("justaname", "must be package.module:function"),
    ("math:1.0,format:x y", "not a finite number"),
    ("format:1e", "the weight '1e' of 'format' is not a finite number"),
    ("math,math:2", "named twice"),
    ("math,,format", "an empty term"),
])
def test_bad_specs_name_the_term_and_the_valid_names(spec, message):
    with pytest.raises(UserError) as e:
        R.parse(spec)
    assert message in str(e.value)
    assert "named twice" in message or "math, exact_match, format, length" in str(e.value)


def test_bad_settings_and_failing_terms():
    with pytest.raises(UserError, match="rl.format_pattern"):
        R.FormatReward("<answer>(")
    with pytest.raises(UserError, match="rl.length_buffer=0"):
        R.combine("length", R.Settings(length_buffer=0), no_load)
    reward = R.combine("exact_match:1,format:1", SETTINGS, no_load)
    with pytest.raises(R.TermError, match="term exact_match raised ValueError.*\"answer\" field.*question"):
        reward("q", "1", question="what")


def test_loom_rl_with_an_unknown_reward_exits_2_naming_the_valid_ones(tmp_path, capsys):
    from loom.cli import main

    assert main(["rl", "--config", "tiny-grpo", "--run-dir", str(tmp_path / "run"), "--rl.reward=math:1,fromat:0.2",
                 "--log.progress=none"]) == 2
    err = capsys.readouterr().err
    assert "unknown reward 'fromat'" in err and "math, exact_match, format, length" in err
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()
