"""The code benchmark's hard-coding rate (benchmarks/learn/code.py ``hardcoding``): a completion that fits
the outputs the prompt shows without being the function must be told apart, in the real sandbox,
from the function itself and from a plain wrong answer, since RL is paid for whatever the reward
cannot tell from a solution."""

from __future__ import annotations

import pytest
import torch

from benchmarks.code import code_eval, hardcoding
from miles_core.config import load_recipe
from miles_core.data.code import CodeConfig, CodeTask, decode_answer, split_answer
from miles_core.data.registry import build_task, check_reward
from miles_core.rewards.registry import reward_for_recipe

CFG = CodeConfig()


@pytest.fixture
def recipe_reward():
    """The reward code_eval scores with: the recipe's check reward, under its sandbox isolation."""
    cfg = load_recipe("code")
    return reward_for_recipe(cfg, check_reward(cfg.task))


def one_per_family(task: CodeTask) -> list:
    """A held-out problem of every family, so each shape's hidden inputs are exercised."""
    probs = task.split("test", 120, seed=0)
    by_family: dict = {}
    for p in probs:
        by_family.setdefault(p.meta["family"], p)
    assert set(by_family) == set(CFG.families)
    return list(by_family.values())


def test_split_answer_keeps_the_visible_examples_first_and_the_hidden_inputs_apart() -> None:
    task = CodeTask(CFG)
    for p in one_per_family(task):
        fn = task.function(p.prompt)
        visible, hidden = (decode_answer(a)["tests"] for a in split_answer(p.answer, CFG.examples))
        assert visible == [[[x], y] for x, y in zip(range(CFG.examples), fn.visible)]
        assert hidden == [[[x], y] for x, y in zip(CFG.hidden_inputs, fn.hidden)]
        assert p.prompt == ",".join(str(t[1]) for t in visible)  # exactly what the prompt shows
    with pytest.raises(ValueError, match="visible"):  # a count that does not match the tests is refused
        split_answer(p.answer, CFG.examples + 1)
    with pytest.raises(ValueError, match="visible"):
        split_answer(p.answer, CFG.examples + len(CFG.hidden_inputs))


def test_a_lookup_table_of_the_shown_outputs_is_hard_coded_the_function_and_a_wrong_answer_are_not(
        recipe_reward) -> None:
    task = CodeTask(CFG)
    probs = one_per_family(task)
    prompts, comps, answers, want = [], [], [], []
    for p in probs:
        fn = task.function(p.prompt)
        vs = fn.visible
        table = "[" + ",".join(map(str, vs)) + "][x]"                      # IndexError / wrong value off 0..n-1
        chain = " else ".join(f"{v} if x=={x}" for x, v in enumerate(vs[:-1])) + f" else {vs[-1]}"
        cases = [(fn.forms[-1], (True, True, False)),    # the function (any spelling): fits and generalises
                 (table, (True, False, True)),           # fits the prompt only: hard-coded
                 (chain, (True, False, True)),
                 ("x+1000", (False, False, False))]      # wrong: not even the prompt; not counted
        for comp, flags in cases:
            prompts.append(p.prompt)
            comps.append(comp)
            answers.append(p.answer)
            want.append(flags)
    got = hardcoding(prompts, comps, answers, CFG.examples, recipe_reward)
    assert list(zip(got["visible"], got["hidden"], got["hardcoded"])) == want, \
        [(c, g) for c, g, w in zip(comps, zip(got["visible"], got["hidden"], got["hardcoded"]), want) if g != w]
    assert got["visible_pass"] == pytest.approx(3 / 4) and got["hardcoded_rate"] == pytest.approx(2 / 4)
    # the full tests agree: only the function passes them all (what pass@1 counts)
    assert [s >= 1.0 for s in recipe_reward(prompts, comps, answer=answers)] == [w[1] for w in want]
    with pytest.raises(ValueError, match="hardcoding"):
        hardcoding(prompts, comps[:-1], answers, CFG.examples, recipe_reward)


def test_code_eval_is_run_eval_plus_the_hard_coding_rate_of_the_same_completions() -> None:
    """code_eval's pass@1 is run_eval's, and the hard-coding rate is of the completions run_eval
    scored (EvalResult.completions, every problem's, in the problems' order)."""
    from miles_core.eval.evaluate import run_eval
    from miles_core.models.tiny import TinyConfig, TinyDenoiser
    from miles_core.tokenizer import CharTokenizer

    cfg = load_recipe("code", ["task.num_train=16", "task.num_test=8", "task.num_val=8"])
    data = build_task(cfg)
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = TinyDenoiser(TinyConfig(tok.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48)).eval()
    ours, ref = code_eval(model, tok, cfg, data), run_eval(model, tok, cfg, data)
    assert ours["config"] == ref.config.to_dict() and ours["correct"] == [c[0] for c in ref.correct]
    assert [s["completion"] for s in ours["samples"]] == [s["completion"] for s in ref.samples[:8]]
    assert [c[0] for c in ref.completions][:len(ref.samples)] == [s["completion"] for s in ref.samples]
    assert ref.runtime == {"batch_size": cfg.eval.batch_size, "dtype": "float32", "device": "cpu",
                           "torch_threads": torch.get_num_threads()}   # recorded beside the number
    assert len(ours["hardcoded"]) == len(data.test) == 8
    assert 0.0 <= ours["hardcoded_rate"] <= ours["visible_pass"] <= 1.0
    assert not any(h and c for h, c in zip(ours["hardcoded"], ours["correct"]))  # solved is never hard-coded
