"""Rule-based math rewards with a TRL-style contract (answer parsing: miles_core/data/answers.py).

Every reward function has the signature ``fn(prompts, completions, **meta) -> list[float | None]``
where ``meta`` holds per-sample lists (``answer=[...]``). Policies in RL produce arbitrary text,
so malformed completions score 0.0 and never raise: one exception inside a reward would kill a
whole rollout batch. ``None`` is reserved for "cannot be scored" (the reference itself is missing)
so that the learner can drop the row instead of treating it as a wrong answer.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from miles_core.data.answers import HASH_RE, answers_match, extract_answer, last_boxed, reference_answer
from miles_core.rewards.text import completion_text

RewardFn = Callable[..., list]

# One worked step of the arithmetic task: "a op b=c" with integers (see miles_core.data.arith).
_STEP = r"-?\d+[+\-*]-?\d+=-?\d+"
_WORKED_RE = re.compile(rf"\s*{_STEP}(?:;{_STEP})*;?\s*")


def _check_lengths(completions: Sequence[Any], **lists: Sequence[Any] | None) -> None:
    for name, vals in lists.items():
        if vals is not None and len(vals) != len(completions):
            raise ValueError(f"reward: {name} has {len(vals)} items but there are {len(completions)} completions")


def math_exact_reward(
    prompts: Sequence[str], completions: Sequence[Any], answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference answer, else 0.0 (None if no reference)."""
    _check_lengths(completions, answer=answer)
    out: list[float | None] = []
    for comp, ref in zip(completions, answer):
        r = reference_answer(ref)
        if r is None:
            out.append(None)
            continue
        try:
            out.append(1.0 if answers_match(extract_answer(completion_text(comp)), r) else 0.0)
        except Exception:  # noqa: BLE001
            out.append(0.0)
    return out


def is_worked_solution(text: str) -> bool:
    """True for the arithmetic task format ``a op b=c;a op b=c;...`` (integers only)."""
    return isinstance(text, str) and len(text) < 100_000 and _WORKED_RE.fullmatch(text) is not None


def nonempty_reward(prompts: Sequence[str], completions: Sequence[Any], **_: Any) -> list[float | None]:
    """1.0 for a completion with any non-whitespace text, else 0. Added with a small weight (e.g.
    ``code_tests:1.0,nonempty:0.5``) it makes saying nothing worse than a wrong attempt, so a policy
    drifting towards empty completions gets a gradient against it inside every group that has one
    (the collapse guard, algo/guard.py, handles the sudden case)."""
    return [1.0 if completion_text(c).strip() else 0.0 for c in completions]


def format_reward(prompts: Sequence[str], completions: Sequence[Any], **_: Any) -> list[float | None]:
    """1.0 for a well-formed worked solution or an explicit ``#### X`` / non-empty ``\\boxed{}`` answer."""
    out: list[float | None] = []
    for comp in completions:
        try:
            t = completion_text(comp)
            ok = is_worked_solution(t)
            if not ok and "####" in t:
                m = HASH_RE.findall(t)
                ok = bool(m and m[-1].strip())
            if not ok and "\\boxed" in t:
                b = last_boxed(t)
                ok = bool(b and b.strip())
            out.append(1.0 if ok else 0.0)
        except Exception:  # noqa: BLE001
            out.append(0.0)
    return out
