"""What a task module declares so the rest of Miles can use it without knowing it.

A task is one module (``data/arith.py``, ``data/countdown.py``, ``data/code.py``) that ends with a
``SPEC``: its recipe name, how the recipe's ``task`` section builds it (and how long its longest
target is, so a too-short ``task.completion_len`` fails before training), how a user's prompt
is normalised into the form it trains on (what a served model applies), and the reward that
checks an answer for pass@1. ``data/registry.py`` lists the specs; a new task is one module, one
line there and a recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from miles_core.config import TaskConfig


@dataclass(frozen=True)
class TaskSpec:
    name: str                                        # task.name in a recipe
    build: Callable[[TaskConfig], tuple[Any, int]]   # -> (task object, longest target in tokens)
    canonical_prompt: Callable[[str], str]           # a user's prompt in the form the task trains on
    check_reward: str                                # the reward pass@1 counts (rewards/registry.py)
