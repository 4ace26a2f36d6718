"""The procedural code task: a solvable, enumerated function space, disjoint held-out functions,
targets that really pass their tests in the sandbox, and the recipe wiring (build_task)."""

from __future__ import annotations

import random

import pytest

from miles_core.config import ConfigError, load_recipe
from miles_core.data.code import (
    CodeConfig,
    CodeTask,
    decode_answer,
    encode_answer,
    enumerate_functions,
    is_test_prompt,
    max_prompt_len,
    max_target_len,
    run_trusted,
    space_stats,
)
from miles_core.rewards.code import score_completions
from miles_core.data.registry import build_task
from miles_core.tokenizer import CharTokenizer

CFG = CodeConfig()


def test_space_is_solvable_and_large_enough_for_a_held_out_set() -> None:
    fns = enumerate_functions(CFG)
    stats = space_stats(CFG)
    assert stats.functions == len(fns) and stats.test_functions >= 200
    assert set(stats.per_family) == set(CFG.families)
    assert len({f.prompt for f in fns}) == len(fns)  # a prompt determines its function
    xs = list(range(CFG.examples)) + list(CFG.hidden_inputs)
    for f in random.Random(0).sample(fns, 200):
        for form in f.forms:  # every spelling is the same function on visible and hidden inputs
            assert run_trusted(form, xs) == f.visible + f.hidden, form


def test_splits_are_disjoint_deterministic_and_bounded() -> None:
    task = CodeTask(CFG)
    train, test = task.split("train", 300, seed=0), task.split("test", 200, seed=0)
    assert [p.prompt for p in train] == [p.prompt for p in task.split("train", 300, seed=0)]
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert all(is_test_prompt(p.prompt) for p in test) and not any(is_test_prompt(p.prompt) for p in train)
    rng = random.Random(5)
    assert not any(is_test_prompt(task.sample(rng, "rl").prompt) for _ in range(500))
    rest = task.split("train", 50, seed=1, exclude=[p.prompt for p in train])
    assert not {p.prompt for p in rest} & {p.prompt for p in train}
    with pytest.raises(ValueError, match="test"):
        task.split("test", space_stats(CFG).test_functions + 1, seed=0)
    with pytest.raises(ValueError, match="split"):
        task.sample(rng, "valid")


def test_problem_fields_and_lengths() -> None:
    task = CodeTask(CFG)
    tok = CharTokenizer()
    longest = max_target_len(CFG)
    for p in task.split("train", 200, seed=3):
        fn = task.function(p.prompt)
        assert p.target in fn.forms and len(p.target) <= longest
        assert len(p.prompt) <= max_prompt_len(CFG)
        assert tok.unk_id not in tok.encode(p.prompt + p.target)
        spec = decode_answer(p.answer)
        assert [t[0][0] for t in spec["tests"]] == list(range(CFG.examples)) + list(CFG.hidden_inputs)
        assert p.prompt == ",".join(str(t[1]) for t in spec["tests"][:CFG.examples])
    with pytest.raises(ValueError, match="function space"):
        task.function("1,2,3")


def test_every_spelling_passes_in_the_sandbox_and_wrong_ones_do_not() -> None:
    task = CodeTask(CFG)
    probs = task.split("test", 12, seed=0)
    comps, answers = [], []
    for p in probs:
        for form in task.function(p.prompt).forms:
            comps.append(form)
            answers.append(p.answer)
    comps.append("x+1000")
    answers.append(probs[0].answer)
    scores = score_completions(comps, answers)
    assert all(s.score == 1.0 for s in scores[:-1]), [s for s in scores if s.score < 1]
    assert scores[-1].score == 0.0


@pytest.mark.parametrize("bad, match", [({"examples": 2}, "examples"), ({"families": ("fft",)}, "families"),
                                        ({"b_max": -1}, "b_max"), ({"hidden_inputs": (1,)}, "hidden_inputs")])
def test_config_errors_name_the_field(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CodeConfig(**bad)


@pytest.mark.parametrize("bad", ["", "[1]", '{"tests": []}', '{"tests": [[1, 2]]}', '{"tests": [[[1], 2]], "entry": "1x"}'])
def test_malformed_answers_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="code answer"):
        decode_answer(bad)


def test_answer_round_trip() -> None:
    tests = [[[0], 1], [[5], -3]]
    assert decode_answer(encode_answer(tests)) == {"entry": "f", "params": "x", "tests": tests}


def test_recipe_builds_the_code_task() -> None:
    cfg = load_recipe("code")
    data = build_task(cfg)
    assert isinstance(data.task, CodeTask)
    assert len(data.test) == cfg.task.num_test >= 200 and len(data.train) == cfg.task.num_train
    assert cfg.train.reward in ("code_tests", "code_pass")  # both run the completion against its tests in the sandbox
    with pytest.raises(ConfigError, match="completion_len"):
        build_task(load_recipe("code", ["task.completion_len=8"]))
    with pytest.raises(ConfigError, match="num_examples"):
        load_recipe("code", ["task.num_examples=2"])
    with pytest.raises(ConfigError, match="num_test"):
        build_task(load_recipe("code", ["task.num_test=5000"]))


def test_rl_prompts_can_exclude_the_sft_demonstrations() -> None:
    small = ["task.const_max=6", "task.num_train=60", "task.num_test=20", "task.num_val=10"]
    demos = {p.prompt for p in build_task(load_recipe("code", small)).train}
    plain = build_task(load_recipe("code", small + ["train.rl_exclude_demos=false"]))  # the recipe turns it on
    drawn = {p.prompt for p in plain.draw_rl(random.Random(0), 400)}
    assert drawn & demos                       # the small space makes collisions certain without the flag
    strict = build_task(load_recipe("code", small + ["train.rl_exclude_demos=true"]))
    drawn = {p.prompt for p in strict.draw_rl(random.Random(0), 400)}
    assert drawn and not drawn & demos and not any(plain.task.function(p).prompt in demos for p in drawn)
    every = build_task(load_recipe("code", ["task.const_max=0", "task.num_train=10", "task.num_test=1",
                                            "task.num_val=0", "train.rl_exclude_demos=true"]))
    assert len(every.task.pools[False]) == 10  # all non-test functions are demonstrations: nothing left for RL
    with pytest.raises(ConfigError, match="train.rl_exclude_demos"):
        every.draw_rl(random.Random(0), 1)


def test_code_pass_gives_no_partial_credit() -> None:
    from miles_core.rewards.registry import get_reward

    task = CodeTask(CodeConfig(b_max=5))
    fn = next(f for f in task.pools[False] if f.forms[0] == "min(x,3)+2")
    ans = [task.make_problem(fn, random.Random(0)).answer] * 4
    comps = ["2+min(3,x)", "x+2", "x+(", ""]  # right; right on x <= 3 only; syntax error; empty
    frac = get_reward("code_tests")([fn.prompt] * 4, comps, answer=ans)
    # x+2 agrees with min(x,3)+2 on x = 0..3 and on the hidden -7, -3, -1: 7 of the 15 tests
    assert frac == [1.0, 7 / 15, 0.0, 0.0]
    assert get_reward("code_pass")([fn.prompt] * 4, comps, answer=ans) == [1.0, 0.0, 0.0, 0.0]
