"""Arithmetic task (solver, splits, length bounds) and the GSM8K / reasoning-gym loaders."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from miles_core.data import (
    ArithConfig,
    ArithTask,
    is_test_prompt,
    load_gsm8k_jsonl,
    max_prompt_len,
    max_target_len,
    solve,
    solve_steps,
)
from miles_core.rewards import math_exact_reward

_STEP_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)")


def _check_worked(prompt: str, target: str, answer: str) -> None:
    steps = target.split(";")
    assert len(steps) == len(re.findall(r"[+\-*]", prompt))
    for s in steps:
        m = _STEP_RE.fullmatch(s)
        assert m, s
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert {"+": a + b, "-": a - b, "*": a * b}[op] == c, s
    assert steps[-1].split("=")[1] == answer


def test_solve_examples() -> None:
    assert solve("47+8*6-13") == ("8*6=48;47+48=95;95-13=82", "82")
    assert solve("3-9+4") == ("3-9=-6;-6+4=-2", "-2")
    assert solve("2*3*4+1") == ("2*3=6;6*4=24;24+1=25", "25")
    assert solve(" 1 + 2 ") == ("1+2=3", "3")


@pytest.mark.parametrize("bad", ["", "5", "+5", "5+", "5++3", "5/3", "a+1", "-3+4", "4--3", None])
def test_solve_rejects_bad_input(bad: object) -> None:
    with pytest.raises(ValueError, match="solve"):
        solve(bad)  # type: ignore[arg-type]


def test_solve_matches_eval_on_random_prompts() -> None:
    rng = random.Random(123)
    for _ in range(1000):
        k = rng.randint(1, 6)
        nums = [rng.randint(0, 10 ** rng.randint(1, 3) - 1) for _ in range(k + 1)]
        ops = [rng.choice("+-*") for _ in range(k)]
        prompt = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:]))
        target, answer = solve(prompt)
        assert int(answer) == eval(prompt)  # noqa: S307 - digits and + - * only
        _check_worked(prompt, target, answer)
        assert math_exact_reward([prompt], [target], answer=[answer]) == [1.0]


def test_splits_disjoint_deterministic_distinct() -> None:
    task = ArithTask(ArithConfig())
    train = task.split("train", 600, seed=0)
    rl = task.split("rl", 300, seed=0)
    test = task.split("test", 300, seed=0)
    tr, rlp, te = ({p.prompt for p in s} for s in (train, rl, test))
    assert len(tr) == 600 and len(rlp) == 300 and len(te) == 300  # distinct
    assert not (te & tr) and not (te & rlp)
    assert all(is_test_prompt(p) for p in te)
    assert not any(is_test_prompt(p) for p in tr | rlp)
    assert [p.prompt for p in task.split("test", 300, seed=0)] == [p.prompt for p in test]
    assert [p.prompt for p in task.split("train", 50, seed=1)] != [p.prompt for p in train[:50]]
    assert [p.prompt for p in rl[:50]] != [p.prompt for p in train[:50]]  # name enters the seed
    fresh = task.split("rl", 200, seed=0, exclude=tr)
    assert not ({p.prompt for p in fresh} & tr)
    for p in train[:100] + test[:100]:
        _check_worked(p.prompt, p.target, p.answer)
        assert 2 <= p.meta["num_ops"] <= 3
    # Roughly 20% of prompts fall in the test bucket.
    rng = random.Random(5)
    frac = sum(is_test_prompt(task._sample_raw(rng)) for _ in range(4000)) / 4000
    assert 0.16 < frac < 0.24
    # Whitespace cannot move a prompt across buckets.
    assert is_test_prompt(" ".join(test[0].prompt)) and not is_test_prompt(" ".join(train[0].prompt))


def test_validation_split_is_held_out_and_disjoint_from_test() -> None:
    # model selection (SFT plateau) looks at val; results are reported on test: never the same problem
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    cfg = load_recipe("arith")
    data = build_task(cfg)
    test, val, train = ({p.prompt for p in s} for s in (data.test, data.val, data.train))
    assert len(val) == cfg.task.num_val == 200 and len(test) == 500
    assert not val & test and not val & train and all(is_test_prompt(p) for p in val)
    assert [p.prompt for p in build_task(load_recipe("arith", ["task.num_val=0"])).test] == [p.prompt for p in data.test]
    code = build_task(load_recipe("code"))  # val: more held-out-bucket functions (unlabelled non-test if the bucket runs out)
    cval, ctest, ctrain = ({p.prompt for p in s} for s in (code.val, code.test, code.train))
    assert len(cval) == 200 and not cval & ctest and not cval & ctrain
    from miles_core.data.code import is_test_prompt as code_is_test

    assert all(code_is_test(p) for p in cval)
    whole = build_task(load_recipe("code", ["task.const_max=49"]))  # 233 tests = the whole held-out bucket
    wval, wtest, wtrain = ({p.prompt for p in s} for s in (whole.val, whole.test, whole.train))
    assert len(wval) == 200 and not wval & wtest and not wval & wtrain and not any(code_is_test(p) for p in wval)


def test_split_errors() -> None:
    task = ArithTask(ArithConfig(min_ops=1, max_ops=1, max_digits=1, ops="+"))
    with pytest.raises(ValueError, match="distinct"):
        task.split("test", 50, seed=0)  # only 100 prompts exist, ~20 in the test bucket
    with pytest.raises(ValueError, match="allowed"):
        task.split("valid", 5, seed=0)
    with pytest.raises(ValueError):
        ArithConfig(ops="+/")
    with pytest.raises(ValueError):
        ArithConfig(min_ops=3, max_ops=2)


def test_operand_digits_and_no_negative() -> None:
    cfg = ArithConfig(min_ops=3, max_ops=4, max_digits=3, mul_max_digits=1, allow_negative=False)
    task = ArithTask(cfg)
    for p in task.split("train", 300, seed=3):
        toks = re.findall(r"\d+|[+\-*]", p.prompt)
        for i in range(0, len(toks), 2):
            near_mul = (i > 0 and toks[i - 1] == "*") or (i + 1 < len(toks) and toks[i + 1] == "*")
            assert len(toks[i]) <= (1 if near_mul else 3)
        assert all(c >= 0 for *_, c in solve_steps(p.prompt))


def _brute_lengths(cfg: ArithConfig) -> tuple[int, int]:
    mp = mt = 0
    for k in range(cfg.min_ops, cfg.max_ops + 1):
        for ops in itertools.product(cfg.ops, repeat=k):
            for nums in itertools.product(range(10**cfg.max_digits), repeat=k + 1):
                p = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:]))
                steps = solve_steps(p)
                if not cfg.allow_negative and any(c < 0 for *_, c in steps):
                    continue
                mp, mt = max(mp, len(p)), max(mt, len(solve(p)[0]))
    return mp, mt


@pytest.mark.parametrize(
    "cfg",
    [ArithConfig(1, 2, 1, 1), ArithConfig(2, 2, 1, 1, ops="-*", allow_negative=False)],
)
def test_length_bounds_exact_on_small_spaces(cfg: ArithConfig) -> None:
    assert (max_prompt_len(cfg), max_target_len(cfg)) == _brute_lengths(cfg)


@pytest.mark.parametrize("cfg", [ArithConfig(), ArithConfig(2, 5, 2, 2), ArithConfig(1, 3, 3, 1, ops="+*")])
def test_length_bounds_hold(cfg: ArithConfig) -> None:
    task, rng = ArithTask(cfg), random.Random(0)
    probs = [task.sample(rng) for _ in range(1500)]
    lp, lt = max_prompt_len(cfg), max_target_len(cfg)
    assert max(len(p.prompt) for p in probs) <= lp
    assert max(len(p.target) for p in probs) <= lt
    assert max(len(p.target) for p in probs) >= lt - 8  # the bound is not loose
    assert max_prompt_len(ArithConfig()) == 11  # "99+99+99+99" / "99-99-99-99"


# ---------------------------------------------------------------- loaders


def _write_jsonl(path: Path, rows: list[object]) -> None:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_gsm8k_loader_local_and_file_uri(tmp_path: Path) -> None:
    f = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": "Natalia sold 48 clips...", "answer": "48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72"},
        "",
        {"question": "Big?", "answer": "lots\n#### 1,234"},
        {"question": "Money?", "answer": "#### $5.00", "id": "x3"},
    ]
    _write_jsonl(f, rows)
    probs = load_gsm8k_jsonl(str(f))
    assert [p.answer for p in probs] == ["72", "1234", "5"]
    assert probs[0].target.endswith("#### 72") and probs[0].prompt.startswith("Natalia")
    assert probs[2].meta["id"] == "x3" and probs[1].meta["line"] == 3
    via_uri = load_gsm8k_jsonl(f.as_uri(), storage_options={}, limit=2)
    assert [p.answer for p in via_uri] == ["72", "1234"]
    comps = ["so 72", r"\boxed{1234}", "5"]
    assert math_exact_reward([p.prompt for p in probs], comps, answer=[p.target for p in probs]) == [1.0] * 3


@pytest.mark.parametrize(
    "bad,pattern",
    [
        ({"question": "q"}, r"line 2: .*'answer'"),
        ({"answer": "#### 1"}, r"line 2: .*'question'"),
        ({"question": "q", "answer": "no marker"}, r"line 2: .*'answer'"),
        ("{not json", r"line 2: invalid JSON"),
    ],
)
def test_gsm8k_loader_errors_name_line_and_field(tmp_path: Path, bad: object, pattern: str) -> None:
    f = tmp_path / "bad.jsonl"
    _write_jsonl(f, [{"question": "ok", "answer": "#### 1"}, bad])
    with pytest.raises(ValueError, match=pattern):
        load_gsm8k_jsonl(str(f))


def test_reasoning_gym_loader_and_scorer() -> None:
    pytest.importorskip("reasoning_gym")
    from miles_core.data import load_reasoning_gym
    from miles_core.rewards.reasoning_gym import reasoning_gym_reward
    from miles_core.rewards import get_reward

    probs = load_reasoning_gym("chain_sum", size=4, seed=7)
    again = load_reasoning_gym("chain_sum", size=4, seed=7)
    assert len(probs) == 4 and [p.prompt for p in probs] == [p.prompt for p in again]
    entries = [p.meta["entry"] for p in probs]
    names = [p.meta["dataset_name"] for p in probs]
    comps = [
        probs[0].answer,
        f"Adding up step by step, the result is <answer>{probs[1].answer}</answer>",
        f"so the total = {probs[2].answer}",
        "I don't know",
    ]
    out = reasoning_gym_reward([p.prompt for p in probs], comps, entry=entries, dataset_name=names)
    assert out == [1.0, 1.0, 1.0, 0.0]
    rg_reward = get_reward("reasoning_gym")
    junk = rg_reward([p.prompt for p in probs], [None, 3, "", "x"], entry=entries, dataset_name="chain_sum")
    assert junk == [0.0, 0.0, 0.0, 0.0]
    assert reasoning_gym_reward(["p"], ["1"], entry=[None]) == [None]
    with pytest.raises(ValueError, match="unknown dataset"):
        load_reasoning_gym("no_such_dataset", size=1, seed=0)
