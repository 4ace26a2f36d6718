"""The math checker the GSM8K and MATH rewards use (math-verify on the span our extraction picks)
against math-verify alone and against the hand-written parser, on the cases that break graders."""

from __future__ import annotations

import threading

import pytest

from miles_core.rewards.math import math_exact_reward
from miles_core.rewards.mathverify import (_tame, check_answer, final_answer_span, math_verify_alone,
                                           math_verify_reward)

# (completion, gold, ours, math-verify alone, hand parser)
CASES = [
    ("so \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", True, True, True),
    ("so \\boxed{0.5}", "\\frac{1}{2}", True, True, True),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True, True, False),          # the hand parser has no algebra
    ("\\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}", True, True, False),
    ("\\boxed{(1, 2]}", "(1,2]", True, True, True),
    ("\\boxed{[1, 2)}", "(1,2]", False, False, False),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True, True, True),
    ("\\boxed{(2, 1)}", "(1,2)", False, False, False),                # tuples are ordered
    ("\\boxed{5 \\text{ cm}}", "5", True, True, False),
    ("\\boxed{25\\%}", "25", True, True, True),
    ("\\boxed{1,234}", "1234", True, True, True),
    ("\\boxed{1{,}000{,}000}", "1000000", True, True, True),
    ("\\boxed{\\boxed{7}}", "7", True, True, True),                   # nested
    ("\\boxed{\\frac{\\boxed{3}}{4}}", "\\frac{3}{4}", True, False, False),  # the outer box is the answer
    ("The answer is 72.", "72", True, True, True),
    ("Natalia sold 72 clips.\n#### 72", "72", True, True, True),
    ("first \\boxed{1}, finally \\boxed{2}", "2", True, False, True),  # last box: MATH's convention
    ("first \\boxed{1}, finally \\boxed{2}", "1", False, False, False),
    ("<answer>\n\\boxed{4}\n</answer>", "4", True, True, True),
    ("<reasoning>3 apples</reasoning><answer>42</answer>", "42", True, False, True),  # alone: takes the 3
    ("\\boxed{x = 3}", "3", True, True, False),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", True, True, True),
    ("\\boxed{-6}", "-6", True, True, True),
    ("\\boxed{6}", "-6", False, False, False),
]


@pytest.mark.parametrize("text,gold,ours,alone,hand", CASES)
def test_checkers_on_tricky_answers(text: str, gold: str, ours: bool, alone: bool, hand: bool) -> None:
    assert check_answer(text, gold) is ours
    assert math_verify_alone(text, gold) is alone
    assert math_exact_reward([""], [text], answer=[gold]) == [float(hand)]


def test_span_priority() -> None:
    assert final_answer_span("a \\boxed{1} b <answer>2</answer>") == "1"
    assert final_answer_span("<answer>2</answer> and 7") == "2"
    assert final_answer_span("so the answer is: 9 apples") == "9 apples"
    assert final_answer_span("x=4, y=5") == "5"
    assert final_answer_span("nothing") is None


def test_inputs_that_could_hang_sympy_are_refused_fast() -> None:
    for s in ("9^{9^{9^{9}}}", "2^{100000}", "10**99999", "(10^{10})!", "1" * 60):
        assert not _tame(s), s
        assert check_answer(f"\\boxed{{{s}}}", "1") is False
    assert _tame("x^2 + 2x + 1") and _tame("5!")


def test_reward_runs_in_worker_threads() -> None:
    """math-verify's own timeouts use signal.alarm, which raises outside the main thread (Prefect
    runs tasks in threads); the reward must give the same scores there."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(math_verify_reward(
        ["", "", ""], ["\\boxed{\\dfrac12}", "\\boxed{3}", "none"], answer=["0.5", "4", None])))
    t.start()
    t.join()
    assert got == [[1.0, 0.0, None]]
