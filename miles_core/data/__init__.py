"""Task data: the procedural arithmetic task and loaders for GSM8K JSONL and reasoning-gym."""

from miles_core.data.arith import (
    ArithConfig,
    ArithTask,
    Problem,
    canonical_prompt,
    is_test_prompt,
    max_prompt_len,
    max_target_len,
    solve,
    solve_steps,
)
from miles_core.data.loaders import load_gsm8k_jsonl, load_reasoning_gym

__all__ = [
    "ArithConfig",
    "ArithTask",
    "Problem",
    "canonical_prompt",
    "is_test_prompt",
    "load_gsm8k_jsonl",
    "load_reasoning_gym",
    "max_prompt_len",
    "max_target_len",
    "solve",
    "solve_steps",
]
