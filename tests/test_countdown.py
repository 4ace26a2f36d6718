"""Countdown task (miles_core/data/countdown.py): the verifier on hand-checked strings, splits
held out by hash bucket, the length bound, and the recipe wiring (reward and pass@1 check)."""

from __future__ import annotations

import random

import pytest

from miles_core.config import ConfigError, load_recipe
from miles_core.data.arith import is_test_prompt
from miles_core.data.countdown import CountdownConfig, CountdownTask, check, max_target_len, parse_prompt
from miles_core.rewards.registry import get_reward
from miles_core.data.registry import build_task, check_reward


@pytest.mark.parametrize("completion, ok, why", [
    ("3*5=15;15+7=22", True, "ok"),
    ("5*3=15;7+15=22", True, "ok"),                 # operands in any order
    ("7+15=22;3*5=15", False, "not available"),     # 15 used before it exists
    ("3*5=15;15+7=23", False, "15+7 is not 23"),    # wrong arithmetic
    ("3*5=15;15+5=20", False, "not available"),     # 5 used twice
    ("3*5=15", False, "2 values left"),             # 7 unused
    ("3+5=8;8*7=56", False, "reaches 56, not 22"),  # valid but another target
    ("3*5=15;15+7=22;", False, "is not 'a op b=c'"),
    ("", False, "empty"),
    ("3*5=15;15+7=22 garbage", False, "is not 'a op b=c'"),
    ("7-5=2;3-2=1;1+21=22", False, "not available"),
    ("3 * 5 = 15; 15 + 7 = 22", True, "ok"),        # an instruct model's spacing
    ("3*5=15\n15+7=22\n", True, "ok"),              # one step per line
    ("3 * 5 = 15;\n15 + 7 = 22", True, "ok"),
    ("3 * 5 = 15\n15 + 7 = 22\nSo the answer is 22.", False, "is not 'a op b=c'"),  # prose is not a step
    ("3 * 5 = 15\n3 * 5 = 15\n15+7=22", False, "not available"),  # a repeated line uses 3 and 5 twice
])
def test_check_on_hand_checked_completions(completion: str, ok: bool, why: str) -> None:
    got, reason = check("3,5,7:22", completion)
    assert got is ok and why in reason


def test_check_negative_intermediate_and_duplicate_numbers() -> None:
    assert check("2,2,9:5", "2-9=-7;2--7=9") == (False, "reaches 9, not 5")
    assert check("2,2,9:5", "2+2=4;9-4=5") == (True, "ok")            # the two 2s are two values
    assert check("2,2,9:13", "9+2=11;11+2=13")[0]
    assert not check("2,9:13", "9+2=11;11+2=13")[0]                    # only one 2 given


def test_reward_contract_and_bad_prompts() -> None:
    fn = get_reward("countdown")
    assert fn(["3,5,7:22"] * 3, ["3*5=15;15+7=22", "nonsense", None]) == [1.0, 0.0, 0.0]
    assert fn(["not a prompt"], ["1+1=2"]) == [None]
    with pytest.raises(ValueError, match="not 'n1,n2,...:target'"):
        parse_prompt("3,5,7=22")


def test_every_sampled_demo_verifies_fits_and_splits_are_held_out() -> None:
    for cfg in (CountdownConfig(3, 12), CountdownConfig(4, 9), CountdownConfig(2, 5, "+-")):
        task = CountdownTask(cfg)
        rng = random.Random(0)
        for split in ("train", "test", "rl"):
            for _ in range(300):
                p = task.sample(rng, split)
                assert check(p.prompt, p.target) == (True, "ok")
                assert len(p.target) <= max_target_len(cfg)
                assert is_test_prompt(p.prompt) == (split == "test") == p.meta["test_bucket"]
                nums, target = parse_prompt(p.prompt)
                assert nums == sorted(nums) and len(nums) == cfg.numbers and p.answer == str(target)


def test_recipe_splits_disjoint_and_pass1_uses_the_verifier() -> None:
    cfg = load_recipe("countdown")
    data = build_task(cfg)
    train, test, val = ({p.prompt for p in s} for s in (data.train, data.test, data.val))
    assert len(train) == 1000 and len(test) == 500 and len(val) == 200
    assert not (train & test) and not (val & test) and not (train & val)
    assert check_reward(cfg.task) == "countdown"  # procedural; with task.test_path set, d1's countdown_d1
    with pytest.raises(ConfigError, match="task.completion_len"):
        build_task(load_recipe("countdown", ["task.completion_len=12"]))
    with pytest.raises(ConfigError, match="task: CountdownConfig: numbers"):
        build_task(load_recipe("countdown", ["task.numbers=7"]))


def test_chat_question_names_the_numbers_and_target() -> None:
    """The user turn a chat prompt asks (tokenizer.py::PROMPT_QUESTION): the numbers and the target
    in words an instruct model answers with an equation, not the training notation "3,5,7:22"."""
    from miles_core.tokenizer import prompt_question

    q = prompt_question("countdown")("3,5,7:22")
    assert "22" in q and "3 and 5 and 7" in q and "3,5,7:22" not in q
    assert prompt_question("arith")("6-1-3") == "What is 6-1-3? Answer with the number."
    assert prompt_question("gsm8k")("x") == "x"
