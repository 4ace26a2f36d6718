"""Every reward by name: what ``train.reward`` and a task's checking reward name.

Why a registry module of its own: the rewards live in modules that say what they check (math
answers, the arithmetic and countdown verifiers, executed code, reasoning-gym's scorers); this one
only maps names to them and builds weighted combinations, so adding a reward is one module plus
one line here, or, from outside Miles, :func:`register_reward`. :func:`reward_for_recipe` also
applies the recipe's sandbox setting, so no caller can score code with a sandbox mode other than
the one its recipe asks for.

The contract is TRL's (``GRPOTrainer``'s reward functions): a reward is called with keywords,
``fn(prompts=[...], completions=[...], **columns)``, one list per dataset column (here ``answer``,
and ``isolation`` for the code rewards), and returns one float (or None: unscorable) per
completion. So a TRL reward such as ``def think_format_reward(completions, **kwargs)`` registers
and runs unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from miles_core.config import RecipeConfig
from miles_core.rewards.code import code_pass_reward, code_tests_reward
from miles_core.rewards.math import RewardFn, format_reward, math_exact_reward, nonempty_reward
from miles_core.rewards.mathverify import math_verify_reward
from miles_core.rewards.puzzles import countdown_d1_reward, sudoku_reward
from miles_core.rewards.reasoning_gym import reasoning_gym_reward
from miles_core.rewards.verifiers import arith_digits_reward, arith_steps_reward, countdown_reward

# the built-in rewards; register_reward adds others (``train.reward`` and combinations name either)
REWARDS: dict[str, RewardFn] = {
    "math_exact": math_exact_reward,
    "countdown": countdown_reward,
    "code_tests": code_tests_reward,
    "code_pass": code_pass_reward,
    "arith_steps": arith_steps_reward,
    "arith_digits": arith_digits_reward,
    "format": format_reward,
    "nonempty": nonempty_reward,
    "reasoning_gym": reasoning_gym_reward,
    "math_verify": math_verify_reward,
    "countdown_d1": countdown_d1_reward,
    "sudoku": sudoku_reward,
}


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")  # no ':' or ',': the combination grammar's separators


def register_reward(name: str, fn: RewardFn | None = None) -> Any:
    """Register ``fn`` under ``name`` for ``train.reward`` (and ``"name:weight,..."`` combinations);
    as a decorator when ``fn`` is omitted (``@register_reward("think_format")``). A taken name, a
    name the combination grammar cannot hold, or a non-callable is refused naming it."""
    def add(f: RewardFn) -> RewardFn:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"register_reward: {name!r} is not a reward name (letters, digits, '_', '.', '-'; "
                             "no ':' or ',', which separate a combination's parts)")
        if not callable(f):
            raise TypeError(f"register_reward({name!r}): {f!r} is not callable")
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered ({getattr(REWARDS[name], '__name__', REWARDS[name])})")
        REWARDS[name] = f
        return f
    return add if fn is None else add(fn)


def unregister_reward(name: str) -> None:
    """Remove a reward :func:`register_reward` added (tests clean up with this)."""
    REWARDS.pop(name, None)


def call_reward(fn: Callable[..., Sequence[float | None]], prompts: Sequence[str], completions: Sequence[Any],
                **columns: Any) -> list[float | None]:
    """``fn`` called as TRL calls a reward: keywords only, one list per column. A list comes back
    as it is (a reward's own list type keeps what it carries: the code rewards' ``stats``)."""
    out = fn(prompts=prompts, completions=completions, **columns)
    return out if isinstance(out, list) else list(out)


def combined_reward(weights: dict[str, float]) -> RewardFn:
    """Weighted sum of registered rewards, e.g. ``{"math_exact": 1.0, "format": 0.1}``.

    A sample is None when any component with non-zero weight is None (unscorable stays unscorable).
    """
    if not weights:
        raise ValueError("combined_reward: weights must name at least one reward")
    fns = {name: (get_reward(name), float(w)) for name, w in weights.items()}

    def fn(prompts: Sequence[str], completions: Sequence[Any], **meta: Any) -> list[float | None]:
        total: list[float | None] = [0.0] * len(completions)
        for name, (f, w) in fns.items():
            vals = call_reward(f, prompts, completions, **meta)
            for i, v in enumerate(vals):
                if w == 0.0:
                    continue
                cur = total[i]
                total[i] = None if (v is None or cur is None) else cur + w * float(v)
        return total

    fn.__name__ = "combined_" + "_".join(f"{k}{v:g}" for k, v in weights.items())
    return fn


def get_reward(name: str) -> RewardFn:
    """Reward by name. Also accepts a weighted spec ``"math_exact:1.0,format:0.1"`` (config-friendly)."""
    if not isinstance(name, str):
        raise TypeError(f"get_reward: name must be a str, got {type(name).__name__}")
    key = name.strip()
    if key in REWARDS:
        return REWARDS[key]
    if ":" in key:
        weights: dict[str, float] = {}
        for part in key.split(","):
            n, _, w = part.partition(":")
            try:
                weights[n.strip()] = float(w)
            except ValueError:
                raise ValueError(f"get_reward: bad weight in {part!r} (spec {name!r}); use 'name:weight,...'") from None
        return combined_reward(weights)
    raise ValueError(f"unknown reward {name!r}; allowed: {sorted(REWARDS)} or a 'name:weight,...' combination")


class RecipeReward:
    """A reward bound to its recipe's ``sandbox.isolation``: every call passes it to the reward as
    ``isolation`` (the code rewards run their completions there; the others ignore it). A value,
    not process state: a picklable object whose ``__name__`` is the reward's."""

    def __init__(self, fn: RewardFn, isolation: str) -> None:
        self.fn, self.isolation = fn, isolation
        self.__name__ = getattr(fn, "__name__", "reward")

    def __call__(self, prompts: Sequence[str], completions: Sequence[Any], **meta: Any) -> list[float | None]:
        return call_reward(self.fn, prompts, completions, **{"isolation": self.isolation, **meta})


def reward_for_recipe(cfg: RecipeConfig, name: str | None = None) -> RewardFn:
    """The reward ``name`` (default ``train.reward``), its code run under the recipe's ``sandbox.isolation``."""
    return RecipeReward(get_reward(cfg.train.reward if name is None else name), cfg.sandbox.isolation)
