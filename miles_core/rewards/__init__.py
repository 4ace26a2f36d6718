"""Rule-based rewards with the TRL contract ``fn(prompts, completions, **meta) -> list[float | None]``."""

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

__all__ = [
    "REWARDS",
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
