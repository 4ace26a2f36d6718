"""Task-specific verifiers with the reward contract ``fn(prompts, completions, **meta)``: process
rewards for the worked arithmetic steps, and the countdown check. Registered in rewards/registry.py.
The task modules are imported on use: miles_core.data imports the reward modules."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from miles_core.rewards.text import completion_text


def _per_reference_steps(prompts: Sequence[str], completions: Sequence[Any],
                         score: Callable[[list[str], list[str]], float]) -> list[float | None]:
    """``score(reference_steps, completion_steps)`` per item; None where the prompt is not an
    arithmetic expression the verifier can solve."""
    from miles_core.data.arith import solve

    out: list[float | None] = []
    for p, c in zip(prompts, completions):
        try:
            ref = solve(p)[0].split(";")
        except ValueError:
            out.append(None)
            continue
        out.append(score(ref, [g.strip() for g in completion_text(c).strip().split(";")]))
    return out


def _correct_prefix(ref: list[str], got: list[str]) -> float:
    k = 0
    while k < len(ref) and k < len(got) and got[k] == ref[k]:
        k += 1
    return k / len(ref)


def _last_result_digits(ref: list[str], got: list[str]) -> float:
    if len(got) != len(ref) or got[:-1] != ref[:-1]:
        return 0.0
    lhs, _, want = ref[-1].rpartition("=")
    glhs, _, have = got[-1].rpartition("=")
    if glhs != lhs or not have:
        return 0.0
    n = max(len(want), len(have))
    return sum(x == y for x, y in zip(want.rjust(n), have.rjust(n))) / n


def arith_steps_reward(prompts: Sequence[str], completions: Sequence[Any], **_: Any) -> list[float | None]:
    """Process reward for the arithmetic task: the fraction of the reference worked steps that the
    completion reproduces as a correct prefix (``8*6=48;47+48=95`` scores 1/2 for ``8*6=48;47+48=94``).

    It is dense where the exact-answer reward is sparse, and it cannot be gamed by writing true
    but irrelevant equations: each step must be the one the verifier derives from the prompt.
    """
    return _per_reference_steps(prompts, completions, _correct_prefix)


def arith_digits_reward(prompts: Sequence[str], completions: Sequence[Any], **_: Any) -> list[float | None]:
    """Place-value credit on the last step's result, given every earlier step right: the fraction of
    the reference result's characters (sign included) that the completion's result matches,
    right-aligned (``...;12+6=16`` scores 1/2 against ``12+6=18``: the tens digit is right).

    Why: the SFT model gets the first step right and the last result wrong, and a policy that is
    confidently wrong on it gives G identical exact-match rewards (no signal). Digit credit tells
    apart the samples that are nearly right. It is 1 exactly when the last step is correct.
    """
    return _per_reference_steps(prompts, completions, _last_result_digits)


def countdown_reward(prompts: Sequence[str], completions: Sequence[Any], **_: Any) -> list[float | None]:
    """1.0 for a correct worked countdown solution (data.countdown.check), else 0.0; None for an
    unreadable prompt. Imported on use: miles_core.data imports this module."""
    from miles_core.data.countdown import check

    out: list[float | None] = []
    for p, c in zip(prompts, completions):
        try:
            out.append(1.0 if check(p, completion_text(c))[0] else 0.0)
        except ValueError:
            out.append(None)
    return out
