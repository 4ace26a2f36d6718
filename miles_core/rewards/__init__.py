"""Rule-based rewards with the TRL contract ``fn(prompts=..., completions=..., **meta) -> list[float | None]``
(called with keywords, as TRL calls them).

By name: :mod:`miles_core.rewards.registry`. ``code_tests`` executes code completions in the
sandbox (rewards/code.py, pool.py, isolation.py, sandbox.py); answers are read by
miles_core/data/answers.py."""

from miles_core.data.answers import answers_match, extract_answer, normalize_number, reference_answer
from miles_core.rewards.code import Score, code_tests_reward, score_completions
from miles_core.rewards.math import format_reward, is_worked_solution, math_exact_reward
from miles_core.rewards.jobs import SandboxLimits
from miles_core.rewards.pool import SandboxPool
from miles_core.rewards.registry import REWARDS, combined_reward, get_reward, register_reward, reward_for_recipe

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
    "register_reward",
    "reward_for_recipe",
]
