"""Reward parsing on tricky strings; malformed input never raises."""

from __future__ import annotations

import random

import pytest

from miles_core.rewards import (
    REWARDS,
    answers_match,
    combined_reward,
    extract_answer,
    format_reward,
    get_reward,
    math_exact_reward,
    normalize_number,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", "1/2"),
        (r"\boxed{\dfrac{3}{4}} and then junk 99", "3/4"),
        (r"\boxed{1} then \boxed{{2}}", "2"),  # last box, nested braces
        (r"\boxed{\text{5}}", "5"),
        ("work...\n#### 1,234", "1234"),
        ("#### $5.00", "5"),
        ("#### 72 dollars", "72"),
        ("-0", "0"),
        ("3-9=-6", "-6"),
        ("8*6=48;47+48=95;95-13=82", "82"),
        ("8*6=48;47+48=95;95-13=82;;garbage!!", "82"),
        ("x = 4 so y = -6 \u2705", "-6"),
        ("The answer is 5.", "5"),
        ("I think 7 apples, total 12", "12"),  # last number
        ("\u22127", "-7"),  # unicode minus
        ("\u00e9\u2211 42 \u2713", "42"),
        ("about 12%", "12"),
        (".5", "0.5"),
        ("5-3", "3"),  # no '=': the '-' is an operator, not a sign
        ("", None),
        ("no digits here", None),
        (r"\boxed{", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "s,expected",
    [
        ("1,234", "1234"),
        ("$5.00", "5"),
        ("+5", "5"),
        ("-0", "0"),
        ("-0.0", "0"),
        ("5.0", "5"),
        ("5.", "5"),
        ("2.50", "2.5"),
        ("12%", "12"),
        ("3/4", "3/4"),
        ("6/8", "3/4"),
        (" 7 ", "7"),
        ("1/0", None),
        ("abc", None),
        ("", None),
        ("1.2.3", None),
    ],
)
def test_normalize_number(s: str, expected: str | None) -> None:
    assert normalize_number(s) == expected


def test_answers_match() -> None:
    assert answers_match("3/4", "0.75")
    assert answers_match("0.5", "1/2")
    assert answers_match("5", "5.0000001")  # within 1e-6
    assert not answers_match("5", "5.001")
    assert answers_match("x^2", " x^2 ")  # non-numeric: normalised text
    assert not answers_match(None, "5")
    assert not answers_match("", "")


def test_math_exact_reward_contract() -> None:
    comps = [r"\boxed{42}", "junk", "", "8*6=48;47+48=95;95-13=82", "#### 1,234", "anything"]
    refs = ["#### 42", "1", "3", "82", "1234", None]
    out = math_exact_reward(["p"] * len(comps), comps, answer=refs, extra=[0] * len(comps))
    assert out == [1.0, 0.0, 0.0, 1.0, 1.0, None]
    # GSM8K-style reference with a worked solution; TRL conversational completion.
    ref = "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72"
    conv = [[{"role": "assistant", "content": "So 48+24=72"}]]
    assert math_exact_reward(["q"], conv, answer=[ref]) == [1.0]


def test_math_exact_reward_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="answer"):
        math_exact_reward(["p"], ["1", "2"], answer=["1"])


def test_format_reward() -> None:
    comps = [
        "8*6=48;47+48=95;95-13=82",
        "3-9=-6;-6+4=-2",
        "the answer\n#### 5",
        r"\boxed{7}",
        r"\boxed{}",
        "8*6=48;47+48",
        "8*6=48 ;47+48=95",
        "1.5+2=3.5",
        "",
        None,
    ]
    assert format_reward([""] * len(comps), comps) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_registry_and_combined() -> None:
    assert get_reward("math_exact") is math_exact_reward
    assert set(REWARDS) >= {"math_exact", "format", "reasoning_gym"}
    with pytest.raises(ValueError, match="allowed"):
        get_reward("nope")
    comb = combined_reward({"math_exact": 1.0, "format": 0.1})
    out = comb(["p"] * 3, ["8*6=48", "8*6=49", "48"], answer=["48", "48", None])
    assert out[0] == pytest.approx(1.1) and out[1] == pytest.approx(0.1) and out[2] is None
    spec = get_reward("math_exact:1.0, format:0.1")
    assert spec(["p"], ["8*6=48"], answer=["48"]) == [pytest.approx(1.1)]


def test_random_garbage_never_raises() -> None:
    rng = random.Random(0)
    alphabet = "0123456789+-*/=.,;$%#{}\\ boxedfrac\n\u2212\u00e9\u4e2d\U0001f600()[]^_eE"
    fns = [get_reward(n) for n in ("math_exact", "format")]
    comps: list = [None, 5, 3.2, ["x"], [{"content": None}], b"bytes", "\\boxed{" * 50, "{" * 500 + "1"]
    for _ in range(1500):
        comps.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))))
    refs = [rng.choice(["42", "#### 7", "1/2", "-3", "x"]) for _ in comps]
    for fn in fns:
        out = fn([""] * len(comps), comps, answer=refs)
        assert len(out) == len(comps)
        assert all(v in (0.0, 1.0) for v in out)
    for c in comps:
        r = extract_answer(c)  # type: ignore[arg-type]
        assert r is None or isinstance(r, str)


def test_arith_steps_process_reward_counts_correct_prefix():
    from miles_core.rewards.verifiers import arith_steps_reward

    prompts = ["47+8*6-13"] * 5 + ["not an expression"]
    comps = ["8*6=48;47+48=95;95-13=82", "8*6=48;47+48=95;95-13=81", "8*6=48;1+1=2;95-13=82", "", "1+1=2;8*6=48"]
    comps.append("1")
    assert arith_steps_reward(prompts, comps) == [1.0, 2 / 3, 1 / 3, 0.0, 0.0, None]


def test_arith_digits_reward_gives_place_value_credit_on_the_last_result_only():
    from miles_core.rewards.registry import get_reward
    from miles_core.rewards.verifiers import arith_digits_reward

    p = ["7+5+6"] * 6 + ["6-3*4"] * 2 + ["not an expression"]
    comps = ["7+5=12;12+6=18",   # right: 1
             "7+5=12;12+6=16",   # tens digit right: 1/2
             "7+5=12;12+6=8",    # right-aligned " 8" vs "18": the units digit is right: 1/2
             "7+5=13;13+6=19",   # an earlier step wrong: 0
             "7+5=12;12-6=18",   # last step's left side is not the reference one: 0
             "7+5=12;12+6=",     # no result: 0
             "3*4=12;6-12=-6",   # right, with a sign: 1
             "3*4=12;6-12=6",    # sign missing: 1/2
             "1"]
    assert arith_digits_reward(p, comps) == [1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0, 0.5, None]
    combo = get_reward("math_exact:1.0,arith_digits:0.5")
    assert combo(p[:2], comps[:2], answer=["18", "18"]) == [1.5, 0.25]


def test_nonempty_reward_makes_an_empty_completion_worse_than_a_wrong_one() -> None:
    nonempty = get_reward("nonempty")
    assert nonempty(["p"] * 4, ["", "  \n", "7", [{"role": "assistant", "content": " 1"}]]) == [0.0, 0.0, 1.0, 1.0]
    shaped = get_reward("math_exact:1.0,nonempty:0.5")
    assert shaped(["p"] * 3, ["48", "49", ""], answer=["48"] * 3) == [1.5, 0.5, 0.0]


def test_a_trl_reward_registers_by_name_and_is_called_as_trl_calls_it() -> None:
    """TRL's ``think_format_reward(completions, **kwargs)`` (trl/rewards/format_rewards.py), written
    as TRL writes it: registered by name, it scores the completions, not the prompts (a positional
    call would hand it the prompts), alone, in a weighted combination and through a training batch;
    a taken name, a name with the combination's separators and a non-callable are refused."""
    import re

    from miles_core.algo.rl import score_rewards
    from miles_core.rewards.registry import get_reward, register_reward, unregister_reward

    class Batch:  # what score_rewards reads of a recorded batch
        def __init__(self, prompts: list[str], completions: list[str], meta: list[dict]) -> None:
            self.prompts, self.completions, self.meta, self.reward = prompts, completions, meta, None

        def __len__(self) -> int:
            return len(self.completions)

    @register_reward("think_format_test")
    def think_format_reward(completions: list[str], **kwargs) -> list[float]:
        pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
        return [1.0 if re.match(pattern, c, re.DOTALL) else 0.0 for c in completions]

    try:
        prompts, comps = ["<think>a</think>x", "q"], ["no think", "<think>ok</think>42"]
        assert get_reward("think_format_test")(prompts=prompts, completions=comps) == [0.0, 1.0]
        both = get_reward("think_format_test:1.0,nonempty:0.5")
        assert both(prompts, comps, answer=["1", "2"]) == [0.5, 1.5]
        batch = Batch(prompts, comps, [{"answer": "1"}, {"answer": "2"}])
        assert score_rewards(batch, get_reward("think_format_test")).reward.tolist() == [0.0, 1.0]
        with pytest.raises(ValueError, match="'think_format_test' is already registered"):
            register_reward("think_format_test", think_format_reward)
        with pytest.raises(ValueError, match="'a:b' is not a reward name"):
            register_reward("a:b", think_format_reward)
        with pytest.raises(TypeError, match="is not callable"):
            register_reward("not_callable", 3)  # type: ignore[arg-type]
    finally:
        unregister_reward("think_format_test")
    with pytest.raises(ValueError, match="unknown reward 'think_format_test'"):
        get_reward("think_format_test")
