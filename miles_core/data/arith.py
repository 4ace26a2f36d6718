"""Procedural arithmetic task whose answer tokens depend on each other.

Prompt ``47+8*6-13``; target the worked evaluation ``8*6=48;47+48=95;95-13=82``, one binary
operation per step in precedence order (all ``*`` left to right, then ``+``/``-`` left to right).
Later steps reuse earlier results, so the order in which a diffusion model commits tokens matters:
exactly the setting where decoding order and RL over decoding trajectories can make a difference.

The held-out test split is defined by a hash of the prompt text alone, so it is disjoint from the
train and RL splits for every seed, size and config (see :func:`is_test_prompt`).
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from miles_core.config import TaskConfig
from miles_core.data.spec import TaskSpec, in_test_bucket

SPLITS = ("train", "test", "rl")
_TOKEN_RE = re.compile(r"\d+|[+\-*]")


@dataclass(frozen=True)
class ArithConfig:
    """Shape of the problems. ``mul_max_digits`` bounds operands of ``*`` so products stay short."""

    min_ops: int = 2
    max_ops: int = 3
    max_digits: int = 2
    mul_max_digits: int = 1
    ops: str = "+-*"
    allow_negative: bool = True

    def __post_init__(self) -> None:
        if not (1 <= self.min_ops <= self.max_ops):
            raise ValueError(f"ArithConfig: need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if self.max_digits < 1 or self.mul_max_digits < 1:
            raise ValueError("ArithConfig: max_digits and mul_max_digits must be >= 1")
        if not self.ops or set(self.ops) - set("+-*") or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ArithConfig: ops must be distinct characters from '+-*', got {self.ops!r}")


@dataclass
class Problem:
    """One task instance. ``answer`` is what the reward compares; ``target`` is for SFT."""

    prompt: str
    target: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


def _tokenize(prompt: str) -> tuple[list[int], list[str]]:
    if not isinstance(prompt, str):
        raise ValueError(f"solve: expected an expression string, got {type(prompt).__name__}")
    s = "".join(prompt.split())
    if not s:
        raise ValueError("solve: empty expression")
    bad = re.sub(r"[0-9+\-*]", "", s)
    if bad:
        raise ValueError(f"solve: invalid character(s) {sorted(set(bad))!r} in {prompt!r}; allowed: digits + - *")
    toks = _TOKEN_RE.findall(s)
    nums: list[int] = []
    ops: list[str] = []
    for i, t in enumerate(toks):
        want_num = i % 2 == 0
        if t.isdigit() != want_num:
            what = "a number" if want_num else "an operator"
            raise ValueError(f"solve: expected {what} at token {i} ({t!r}) in {prompt!r}")
        if want_num:
            nums.append(int(t))
        else:
            ops.append(t)
    if len(toks) % 2 == 0:
        raise ValueError(f"solve: expression {prompt!r} ends with an operator")
    if not ops:
        raise ValueError(f"solve: expression {prompt!r} has no operator (at least one is needed)")
    return nums, ops


def solve_steps(prompt: str) -> list[tuple[int, str, int, int]]:
    """Steps ``(a, op, b, c)`` of the worked evaluation, in the order the target writes them."""
    nums, ops = _tokenize(prompt)
    steps: list[tuple[int, str, int, int]] = []
    terms, signs = [nums[0]], []
    for op, n in zip(ops, nums[1:]):  # pass 1: fold '*' runs left to right
        if op == "*":
            c = terms[-1] * n
            steps.append((terms[-1], "*", n, c))
            terms[-1] = c
        else:
            signs.append(op)
            terms.append(n)
    acc = terms[0]
    for op, t in zip(signs, terms[1:]):  # pass 2: '+'/'-' left to right
        c = acc + t if op == "+" else acc - t
        steps.append((acc, op, t, c))
        acc = c
    return steps


def format_steps(steps: Iterable[tuple[int, str, int, int]]) -> str:
    return ";".join(f"{a}{op}{b}={c}" for a, op, b, c in steps)


def solve(prompt: str) -> tuple[str, str]:
    """``(target, answer)`` for an expression over non-negative integers with ``+ - *``.

    Raises ValueError naming the problem for anything outside that grammar.
    """
    steps = solve_steps(prompt)
    return format_steps(steps), str(steps[-1][3])


def canonical_prompt(prompt: str) -> str:
    """Whitespace-free form; the hash bucket is computed on this so spacing cannot leak a test item."""
    return "".join(prompt.split())


def is_test_prompt(prompt: str) -> bool:
    """True when the prompt belongs to the held-out test bucket (a pure function of its text)."""
    return in_test_bucket(canonical_prompt(prompt))


def _operand_digits(cfg: ArithConfig, ops: list[str], i: int) -> int:
    """Max digits of operand i: operands touching a '*' use min(max_digits, mul_max_digits)."""
    touches_mul = (i > 0 and ops[i - 1] == "*") or (i < len(ops) and ops[i] == "*")
    return min(cfg.max_digits, cfg.mul_max_digits) if touches_mul else cfg.max_digits


class ArithTask:
    """Sampler and splits for the arithmetic task."""

    canonical_prompt = staticmethod(canonical_prompt)  # how a served model normalises user prompts

    def __init__(self, cfg: ArithConfig | None = None) -> None:
        self.cfg = cfg or ArithConfig()

    def _sample_raw(self, rng: random.Random) -> str:
        cfg = self.cfg
        k = rng.randint(cfg.min_ops, cfg.max_ops)
        ops = [rng.choice(cfg.ops) for _ in range(k)]
        nums = [rng.randint(0, 10 ** _operand_digits(cfg, ops, i) - 1) for i in range(k + 1)]
        return str(nums[0]) + "".join(op + str(n) for op, n in zip(ops, nums[1:]))

    def make_problem(self, prompt: str, split: str | None = None) -> Problem:
        steps = solve_steps(prompt)
        prompt = canonical_prompt(prompt)
        meta = {"task": "arith", "num_ops": len(steps), "test_bucket": is_test_prompt(prompt)}
        if split is not None:
            meta["split"] = split
        return Problem(prompt=prompt, target=format_steps(steps), answer=str(steps[-1][3]), meta=meta)

    def _valid(self, prompt: str) -> bool:
        if self.cfg.allow_negative:
            return True
        return all(c >= 0 for *_, c in solve_steps(prompt))

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        """One problem from ``split``'s hash bucket (train/rl never yield a test-bucket prompt)."""
        if split not in SPLITS:
            raise ValueError(f"ArithTask: unknown split {split!r}; allowed: {SPLITS}")
        want_test = split == "test"
        for _ in range(10_000):
            p = self._sample_raw(rng)
            if is_test_prompt(p) == want_test and self._valid(p):
                return self.make_problem(p, split)
        raise RuntimeError(f"ArithTask: could not sample a {split!r} problem for {self.cfg}")

    def split(self, name: str, n: int, seed: int, exclude: Iterable[str] = ()) -> list[Problem]:
        """``n`` distinct problems of split ``name``, deterministic in (name, seed, cfg).

        The RNG is seeded with the split name too, so ``train`` and ``rl`` with one seed differ;
        pass the SFT prompts as ``exclude`` to make RL prompts strictly unseen.
        Raises ValueError when the space cannot provide ``n`` distinct prompts.
        """
        if name not in SPLITS:
            raise ValueError(f"ArithTask.split: unknown split {name!r}; allowed: {SPLITS}")
        if n < 0:
            raise ValueError(f"ArithTask.split: n must be >= 0, got {n}")
        rng = random.Random(f"miles-arith:{name}:{seed}")
        return draw_distinct(lambda: self.sample(rng, name), n, {canonical_prompt(p) for p in exclude},
                             f"ArithTask.split: {name!r} for {self.cfg}", "enlarge the config (more ops/digits)")


def draw_distinct(draw: Callable[[], Problem], n: int, exclude: set[str], what: str, hint: str) -> list[Problem]:
    """``n`` problems with distinct prompts (none in ``exclude``) from repeated ``draw()``; raises
    ValueError, naming ``what`` and how to fix it, when the space runs out of new prompts."""
    seen, out = set(exclude), []
    misses, max_misses = 0, 2000 + 20 * n
    while len(out) < n:
        prob = draw()
        if prob.prompt in seen:
            misses += 1
            if misses > max_misses:
                raise ValueError(f"{what}: only found {len(out)} distinct prompts of {n} requested; {hint} or ask for fewer")
            continue
        seen.add(prob.prompt)
        out.append(prob)
    return out


def _op_sequences(cfg: ArithConfig) -> Iterable[tuple[str, ...]]:
    for k in range(cfg.min_ops, cfg.max_ops + 1):
        yield from itertools.product(cfg.ops, repeat=k)


def _ilen(lo: int, hi: int) -> int:
    """Longest decimal text of any integer in [lo, hi]."""
    return max(len(str(lo)), len(str(hi)))


def max_prompt_len(cfg: ArithConfig) -> int:
    """Exact maximum prompt length in characters (enumerates operator sequences)."""
    best = 0
    for ops in _op_sequences(cfg):
        best = max(best, len(ops) + sum(_operand_digits(cfg, list(ops), i) for i in range(len(ops) + 1)))
    return best


def max_target_len(cfg: ArithConfig) -> int:
    """Upper bound on the worked-solution length in characters.

    Enumerates operator sequences and propagates value intervals through the steps; each step's
    length is bounded by the longest text of its operands and result. Valid for every problem the
    config can produce (tight to within a few characters, since operands vary independently).
    """
    best = 0
    for ops_t in _op_sequences(cfg):
        ops = list(ops_t)
        hi = [10 ** _operand_digits(cfg, ops, i) - 1 for i in range(len(ops) + 1)]
        length, steps = 0, 0
        terms, signs = [(0, hi[0])], []
        for i, op in enumerate(ops):
            b = (0, hi[i + 1])
            if op == "*":
                a = terms[-1]
                c = (a[0] * b[0], a[1] * b[1])  # all values are >= 0 here
                length += _ilen(*a) + 1 + _ilen(*b) + 1 + _ilen(*c)
                steps += 1
                terms[-1] = c
            else:
                signs.append(op)
                terms.append(b)
        acc = terms[0]
        for op, t in zip(signs, terms[1:]):
            c = (acc[0] + t[0], acc[1] + t[1]) if op == "+" else (acc[0] - t[1], acc[1] - t[0])
            if not cfg.allow_negative:
                c = (max(c[0], 0), max(c[1], 0))
            length += _ilen(*acc) + 1 + _ilen(*t) + 1 + _ilen(*c)
            steps += 1
            acc = c
        best = max(best, length + steps - 1)
    return best


def _from_recipe(t: TaskConfig) -> tuple[ArithTask, int]:
    cfg = ArithConfig(min_ops=t.min_ops, max_ops=t.max_ops, max_digits=t.max_digits, mul_max_digits=t.mul_max_digits)
    return ArithTask(cfg), max_target_len(cfg)


SPEC = TaskSpec("arith", _from_recipe, canonical_prompt, check_reward="math_exact")  # pass@1: the exact answer
