"""The task registry: a recipe's ``task`` section -> the task object and its data splits.

Each task module declares a :class:`~miles_core.data.spec.TaskSpec`; this module lists them and
cuts the splits every recipe uses the same way: scarce labelled ``train`` demonstrations (SFT), a
held-out ``test`` bucket (what results are reported on) and a ``val`` set disjoint from it (SFT
plateau and model selection), plus the prompts RL must never draw. See ARCHITECTURE.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from miles_core.config import ConfigError, RecipeConfig, TaskConfig
from miles_core.data import arith, code, countdown, filetask
from miles_core.data.arith import Problem
from miles_core.data.spec import TaskSpec

TASKS: dict[str, TaskSpec] = {s.name: s for s in (arith.SPEC, countdown.SPEC, code.SPEC, *filetask.SPECS)}


def spec_for(t: TaskConfig) -> TaskSpec:
    """The spec a recipe's task section means: countdown with files set is d1's Countdown."""
    spec = task_spec(t.name)
    return filetask.COUNTDOWN_FILES if t.name == "countdown" and (t.test_path or t.path) else spec


def check_reward(t: TaskConfig) -> str:
    """The reward pass@1 counts for this task (rewards/registry.py)."""
    return spec_for(t).check_reward


def task_spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ConfigError(f"task.name: unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name]


def canonical_prompt(task: str, prompt: str) -> str:
    """A user's prompt in the form ``task``'s models were trained on (what a served model applies)."""
    return task_spec(task).canonical_prompt(prompt)


@dataclass
class TaskData:
    task: Any                 # ArithTask | CountdownTask | CodeTask: sample(rng, split), split(name, n, seed, exclude)
    train: list[Problem]      # scarce labelled demonstrations (SFT)
    test: list[Problem]       # held-out, provably disjoint (hash bucket): what results are reported on
    val: list[Problem]        # also from the held-out bucket, disjoint from test: for plateau / selection
    rl_exclude: frozenset[str] = frozenset()  # prompts RL never draws (train.rl_exclude_demos: the SFT demos)

    def draw_rl(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` RL prompts from the verifier's supply: never the test bucket, never ``rl_exclude``."""
        out: list[Problem] = []
        for _ in range(n):
            for _ in range(10_000):
                p = self.task.sample(rng, split="rl")
                if self.task.canonical_prompt(p.prompt) not in self.rl_exclude:
                    break
            else:
                raise ConfigError("train.rl_exclude_demos: every RL prompt tried was an SFT demonstration; "
                                  "lower task.num_train or turn rl_exclude_demos off")
            out.append(p)
        return out


def build_task(cfg: RecipeConfig) -> TaskData:
    """The recipe's task and its train / test / val splits; bad task settings raise ConfigError."""
    spec = spec_for(cfg.task)
    try:
        task, need = spec.build(cfg.task)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    if cfg.task.completion_len < need:
        raise ConfigError(f"task.completion_len: {cfg.task.completion_len} is shorter than the longest target "
                          f"({need} tokens) for these task settings; set task.completion_len>={need}")
    try:
        return _task_data(task, cfg)
    except ValueError as e:
        raise ConfigError(f"task.num_train/num_test/num_val: {e}") from None


def _task_data(task: Any, cfg: RecipeConfig) -> TaskData:
    """train / test / val splits. val comes from the held-out bucket with the test prompts excluded
    (or, where the test split uses the whole bucket, from non-test prompts outside the SFT
    demonstrations), so choosing a checkpoint on val never looks at a problem results are reported on."""
    t = cfg.task
    test = task.split("test", t.num_test, seed=0)
    train = task.split("train", t.num_train, seed=0)
    val: list[Problem] = []
    if t.num_val:
        try:
            val = task.split("test", t.num_val, seed=1, exclude=[p.prompt for p in test])
        except ValueError:  # the held-out bucket is all test (code recipe): unlabelled non-test prompts
            val = task.split("rl", t.num_val, seed=1, exclude=[p.prompt for p in train])
    skip = frozenset(task.canonical_prompt(p.prompt) for p in train) if cfg.train.rl_exclude_demos else frozenset()
    return TaskData(task, train, test, val, skip)
