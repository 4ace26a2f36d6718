"""Countdown: reach a target from given numbers, showing the worked steps.

Prompt ``3,5,7:22`` (the numbers, sorted, then the target); a completion is a chain of binary
steps, each using two values still available (a given number or an earlier result) and adding its
result, e.g. ``3*5=15;15+7=22`` or ``5*3=15;7+15=22``. It is correct when every step's arithmetic
is right, every given number is used exactly once and the last result is the target (see
:func:`check`; the ``countdown`` reward in miles_core.rewards.verifiers wraps it). The demonstrations
show one generating solution; the verifier accepts any.

Why this family (on top of ``arith``): the answer tokens depend on each other as in ``arith``
(the second step reuses the first's result), but a problem has several correct answers and the
model chooses which one to write. Supervised demonstrations teach one path per problem; a verifier
reward can credit any path the policy can execute reliably. That is where RL on verifiable rewards
has measured its largest gains (d1: Countdown 20.7 -> 42.2 for LLaDA-8B, ../shared/ANCHORS.md).

The held-out test split is a hash bucket of the canonical prompt, as for ``arith``
(:func:`miles_core.data.arith.is_test_prompt`), so train / RL prompts never include a test problem.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from miles_core.config import TaskConfig
from miles_core.data.arith import SPLITS, Problem, draw_distinct, is_test_prompt
from miles_core.data.spec import TaskSpec

_STEP_RE = re.compile(r"^(-?\d+)([+\-*])(-?\d+)=(-?\d+)$")
_PROMPT_RE = re.compile(r"^(\d+(?:,\d+)+):(\d+)$")


@dataclass(frozen=True)
class CountdownConfig:
    """``numbers`` values drawn from 1..``max_value``; intermediate and final results stay >= 0."""

    numbers: int = 3
    max_value: int = 12
    ops: str = "+-*"

    def __post_init__(self) -> None:
        if not 2 <= self.numbers <= 4:
            raise ValueError(f"CountdownConfig: numbers must be in [2, 4], got {self.numbers}")
        if not 2 <= self.max_value <= 99:
            raise ValueError(f"CountdownConfig: max_value must be in [2, 99], got {self.max_value}")
        if not self.ops or set(self.ops) - set("+-*") or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"CountdownConfig: ops must be distinct characters from '+-*', got {self.ops!r}")


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    """``"3,5,7:22"`` -> ([3, 5, 7], 22). Raises ValueError naming the prompt otherwise."""
    m = _PROMPT_RE.match("".join(str(prompt).split()))
    if not m:
        raise ValueError(f"countdown: prompt {prompt!r} is not 'n1,n2,...:target'")
    return [int(x) for x in m.group(1).split(",")], int(m.group(2))


def format_prompt(nums: Iterable[int], target: int) -> str:
    """The form the task trains on and hashes into splits: numbers sorted, then the target."""
    return ",".join(str(n) for n in sorted(nums)) + f":{target}"


def canonical_prompt(prompt: str) -> str:
    """``"7, 3,5 : 22"`` -> ``"3,5,7:22"``."""
    return format_prompt(*parse_prompt(prompt))


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def check(prompt: str, completion: str) -> tuple[bool, str]:
    """Verify a worked solution: ``(ok, reason)``. Never raises on a malformed completion.

    Values are a multiset: each step removes its two operands from what is available and adds its
    result, so "each number used once" needs no bookkeeping of which 5 is which.
    """
    nums, target = parse_prompt(prompt)
    # Steps end at ";" or a line break, and spaces inside a step are ignored: an instruct model
    # writes "3 + 10 = 13" or one step per line, the same solution as "3+10=13".
    steps = [re.sub(r"\s+", "", s) for s in re.split(r"[;\n]+", str(completion).strip())]
    if not any(steps):
        return False, "empty"
    avail = Counter(nums)
    for i, step in enumerate(steps):
        m = _STEP_RE.match(step)
        if not m:
            return False, f"step {i + 1} {step!r} is not 'a op b=c'"
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        if _apply(a, op, b) != c:
            return False, f"step {i + 1}: {a}{op}{b} is not {c}"
        avail[a] -= 1
        avail[b] -= 1
        if avail[a] < 0 or avail[b] < 0:
            return False, f"step {i + 1} uses a value that is not available"
        avail[c] += 1
    left = +avail
    if sum(left.values()) != 1:
        return False, f"{sum(left.values())} values left unused; every number must be used once"
    if next(iter(left)) != target:
        return False, f"reaches {next(iter(left))}, not {target}"
    return True, "ok"


class CountdownTask:
    """Sampler and splits, with the same interface as :class:`~miles_core.data.arith.ArithTask`."""

    canonical_prompt = staticmethod(canonical_prompt)

    def __init__(self, cfg: CountdownConfig | None = None) -> None:
        self.cfg = cfg or CountdownConfig()

    def _sample_raw(self, rng: random.Random) -> tuple[str, str] | None:
        """A random solution tree over random numbers -> (prompt, worked solution); None if a
        result went negative (rejected, so every value written stays a plain non-negative number)."""
        cfg = self.cfg
        nums = [rng.randint(1, cfg.max_value) for _ in range(cfg.numbers)]
        pool = list(nums)
        steps = []
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            a, b, op = pool[i], pool[j], rng.choice(cfg.ops)
            c = _apply(a, op, b)
            if c < 0:
                return None
            steps.append(f"{a}{op}{b}={c}")
            pool = [v for k, v in enumerate(pool) if k not in (i, j)] + [c]
        return format_prompt(nums, pool[0]), ";".join(steps)

    def make_problem(self, prompt: str, target: str, split: str | None = None) -> Problem:
        meta = {"task": "countdown", "test_bucket": is_test_prompt(prompt)}
        if split is not None:
            meta["split"] = split
        return Problem(prompt=prompt, target=target, answer=str(parse_prompt(prompt)[1]), meta=meta)

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        """One problem from ``split``'s hash bucket (train/rl never yield a test-bucket prompt)."""
        if split not in SPLITS:
            raise ValueError(f"CountdownTask: unknown split {split!r}; allowed: {SPLITS}")
        for _ in range(10_000):
            raw = self._sample_raw(rng)
            if raw is not None and is_test_prompt(raw[0]) == (split == "test"):
                return self.make_problem(raw[0], raw[1], split)
        raise RuntimeError(f"CountdownTask: could not sample a {split!r} problem for {self.cfg}")

    def split(self, name: str, n: int, seed: int, exclude: Iterable[str] = ()) -> list[Problem]:
        """``n`` distinct problems of split ``name``, deterministic in (name, seed, cfg); raises
        ValueError when the space cannot provide ``n`` distinct prompts."""
        if name not in SPLITS:
            raise ValueError(f"CountdownTask.split: unknown split {name!r}; allowed: {SPLITS}")
        rng = random.Random(f"miles-countdown:{name}:{seed}")
        return draw_distinct(lambda: self.sample(rng, name), n, set(exclude), f"CountdownTask.split: {name!r} for {self.cfg}",
                             "raise numbers/max_value")


def max_target_len(cfg: CountdownConfig) -> int:
    """Longest worked solution in characters: each step is at most 'a*b=c' with every value
    bounded by max_value ** (values combined so far); numbers-1 steps joined by ';'."""
    total, hi = 0, cfg.max_value
    for _ in range(cfg.numbers - 1):
        res = hi * cfg.max_value if "*" in cfg.ops else hi + cfg.max_value
        total += len(str(hi)) + 1 + len(str(cfg.max_value)) + 1 + len(str(res))
        hi = res
    return total + cfg.numbers - 2


def _from_recipe(t: TaskConfig) -> tuple[CountdownTask, int]:
    cfg = CountdownConfig(numbers=t.numbers, max_value=t.max_value)
    return CountdownTask(cfg), max_target_len(cfg)


SPEC = TaskSpec("countdown", _from_recipe, canonical_prompt, check_reward="countdown")  # pass@1: any valid solution
