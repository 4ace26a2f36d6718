"""What a task module declares so the rest of Miles can use it without knowing it.

A task is one module (``data/arith.py``, ``data/countdown.py``, ``data/code.py``) that ends with a
``SPEC``: its recipe name, how the recipe's ``task`` section builds it (and how long its longest
target is, so a too-short ``task.completion_len`` fails before training), how a user's prompt
is normalised into the form it trains on (what a served model applies), and the reward that
checks an answer for pass@1. ``data/registry.py`` lists the specs; a new task is one module, one
line there and a recipe.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

from miles_core.config import TaskConfig


@dataclass(frozen=True)
class TaskSpec:
    name: str                                        # task.name in a recipe
    build: Callable[[TaskConfig], tuple[Any, int]]   # -> (task object, longest target in tokens)
    canonical_prompt: Callable[[str], str]           # a user's prompt in the form the task trains on
    check_reward: str                                # the reward pass@1 counts (rewards/registry.py)


TEST_BUCKETS = 2  # sha256 % 10 < TEST_BUCKETS -> test: about 20% of all prompts


def in_test_bucket(canonical: str) -> bool:
    """Whether a prompt, in its task's canonical form, belongs to the held-out test split. A pure
    function of the text (SHA-256 into ten buckets), so every process, seed and run puts a prompt
    in the same split, and spacing cannot move a test item into training."""
    h = hashlib.sha256(canonical.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % 10 < TEST_BUCKETS
