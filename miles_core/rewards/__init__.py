"""Rule-based rewards with the TRL contract ``fn(prompts, completions, **meta) -> list[float | None]``.

``code_tests`` executes code completions in the sandbox (rewards/code.py, pool.py, isolation.py, sandbox.py)."""

from miles_core.rewards.code import Score, code_tests_reward, score_completions
from miles_core.rewards.math import (
    REWARDS,
    answers_match,
    combined_reward,
    extract_answer,
    format_reward,
    get_reward,
    is_worked_solution,
    math_exact_reward,
    normalize_number,
    reference_answer,
)
from miles_core.rewards.pool import SandboxLimits, SandboxPool

__all__ = [
    "REWARDS",
    "SandboxLimits",
    "SandboxPool",
    "Score",
    "code_tests_reward",
    "score_completions",
    "answers_match",
    "combined_reward",
    "extract_answer",
    "format_reward",
    "get_reward",
    "is_worked_solution",
    "math_exact_reward",
    "normalize_number",
    "reference_answer",
]
