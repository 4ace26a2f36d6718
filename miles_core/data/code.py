"""Procedural code synthesis: write a Python expression for an integer function given by examples.

Prompt: the outputs ``f(0), f(1), ..., f(n-1)`` of an unknown function, e.g. ``-9,-7,-5,-3,-1,1``
(the inputs are always ``x = 0..n-1``, so only the outputs need to be shown). Completion: the
body of ``def f(x): return ...`` as one Python expression, e.g. ``x*2-9``. The reward executes it
in the sandbox (:mod:`miles_core.rewards.sandbox`) against the examples plus hidden inputs
(negative and large x) that the prompt never shows, so the program must be the function itself.

A function is a shape (``x``, ``2x``, ``3x``, ``-x``, ``x%m``, ``x//m``, ``x*x``, ``min(x,t)``)
plus a constant b in [-b_max, b_max]: small enough for a tiny model trained on CPU in minutes,
large enough (about 1100 functions) for a held-out set of over 200 unseen functions. Each has
several equivalent spellings (``x*2-9``, ``2*x-9``, ``-9+x+x`` ...). SFT demonstrations use a
randomly chosen spelling, as human-written code would; the execution reward accepts any of them.
The space is enumerated once: functions whose examples cannot tell them apart but whose hidden
tests differ are dropped (every task is solvable), and the held-out bucket is a hash of the
prompt text, which here identifies the function, so test functions are disjoint from the train
and RL functions for every seed and size.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Sequence

from miles_core.config import TaskConfig
from miles_core.data.arith import Problem
from miles_core.data.spec import TaskSpec, in_test_bucket

SPLITS = ("train", "test", "rl")
FAMILIES = ("linear", "mod", "div", "square", "min")
HIDDEN_INPUTS = (-7, -3, -1, 6, 7, 9, 12, 17, 24)
ENTRY, PARAMS = "f", "x"
_SAFE_BUILTINS = {"abs": abs, "max": max, "min": min}
_CHECK_XS = tuple(range(-30, 31))


@dataclass(frozen=True)
class CodeConfig:
    """``examples``: visible outputs f(0..examples-1); ``b_max``: additive constants in [-b_max, b_max]."""

    examples: int = 6
    families: tuple[str, ...] = FAMILIES
    b_max: int = 49
    hidden_inputs: tuple[int, ...] = HIDDEN_INPUTS

    def __post_init__(self) -> None:
        if not 3 <= self.examples <= 10:
            raise ValueError(f"CodeConfig.examples: need 3 <= examples <= 10, got {self.examples}")
        bad = sorted(set(self.families) - set(FAMILIES))
        if bad or not self.families:
            raise ValueError(f"CodeConfig.families: unknown {bad or 'empty'}; allowed: {', '.join(FAMILIES)}")
        if not 0 <= self.b_max <= 99:
            raise ValueError(f"CodeConfig.b_max: need 0 <= b_max <= 99, got {self.b_max}")
        if not self.hidden_inputs or set(self.hidden_inputs) & set(range(self.examples)):
            raise ValueError("CodeConfig.hidden_inputs: must be non-empty and disjoint from the visible x = 0..examples-1")


@dataclass(frozen=True)
class CodeFunction:
    """One function: its family, equivalent spellings (``forms[0]`` canonical) and its values."""

    family: str
    forms: tuple[str, ...]
    visible: tuple[int, ...]   # f(0..examples-1): the prompt
    hidden: tuple[int, ...]    # f(hidden_inputs): never shown

    @property
    def prompt(self) -> str:
        return ",".join(str(v) for v in self.visible)


def run_trusted(expr: str, xs: Sequence[int]) -> tuple[int, ...]:
    """Values of one of *this module's own* generated expressions. Never call it on model output:
    completions run only in the sandbox (miles_core.rewards.sandbox)."""
    fn = eval(f"lambda x: {expr}", {"__builtins__": _SAFE_BUILTINS})  # noqa: S307 - generated text only
    return tuple(fn(x) for x in xs)


def _with_const(terms: Sequence[str], b: int) -> list[str]:
    """Spellings of ``term + b`` for each spelling of ``term``: ``t+b``, ``t-b``, ``b+t``, ``b-t``."""
    if b == 0:
        return list(terms)
    out = [f"{t}{b:+d}" for t in terms]
    out += [f"{b}{t}" if t.startswith("-") else f"{b}+{t}" for t in terms]
    return out


def _family_terms(family: str) -> Iterable[list[str]]:
    """Every shape of a family (the function without its additive constant): its term spellings."""
    if family == "linear":
        yield ["x"]
        yield ["x*2", "2*x", "x+x"]
        yield ["x*3", "3*x"]
        yield ["-x"]
    elif family in ("mod", "div"):
        op = "%" if family == "mod" else "//"
        for m in (2, 3):
            yield [f"x{op}{m}"]
    elif family == "square":
        yield ["x*x", "x**2"]
    elif family == "min":
        for t in (2, 3):
            yield [f"min(x,{t})", f"min({t},x)"]


@lru_cache(maxsize=8)
def enumerate_functions(cfg: CodeConfig) -> tuple[CodeFunction, ...]:
    """The whole (deduplicated, unambiguous) function space of ``cfg``, in a fixed order.

    Spellings of one function are checked to agree on x in [-30, 30]; a generator bug that made
    two "equivalent" forms differ raises here instead of mislabelling demonstrations.
    """
    xs_vis, xs_hid = tuple(range(cfg.examples)), tuple(cfg.hidden_inputs)
    by_behaviour: dict[tuple, CodeFunction] = {}
    for fam in cfg.families:
        for terms in _family_terms(fam):
            for b in range(-cfg.b_max, cfg.b_max + 1):
                forms = _with_const(terms, b)
                ref = run_trusted(forms[0], _CHECK_XS)
                for f in forms[1:]:
                    if run_trusted(f, _CHECK_XS) != ref:
                        raise AssertionError(f"code task: {f!r} is not equivalent to {forms[0]!r}")
                fn = CodeFunction(fam, tuple(forms), run_trusted(forms[0], xs_vis), run_trusted(forms[0], xs_hid))
                key = (fn.visible, fn.hidden)
                if key in by_behaviour:  # same function reached from two families: merge spellings
                    old = by_behaviour[key]
                    merged = old.forms + tuple(f for f in fn.forms if f not in old.forms)
                    by_behaviour[key] = CodeFunction(old.family, merged, old.visible, old.hidden)
                else:
                    by_behaviour[key] = fn
    hidden_by_prompt: dict[tuple, set] = {}
    for fn in by_behaviour.values():
        hidden_by_prompt.setdefault(fn.visible, set()).add(fn.hidden)
    return tuple(fn for fn in by_behaviour.values() if len(hidden_by_prompt[fn.visible]) == 1)


def canonical_prompt(prompt: str) -> str:
    """``"1, 3, 5"`` -> ``"1,3,5"``: the form prompts are generated, bucketed and looked up in."""
    return "".join(prompt.split())


def is_test_prompt(prompt: str) -> bool:
    """True when the prompt (and so its function) is in the held-out test bucket."""
    return in_test_bucket(canonical_prompt(prompt))


def make_tests(fn: CodeFunction, cfg: CodeConfig) -> list[list[Any]]:
    """``[[args, expected], ...]``: the visible examples and the hidden inputs."""
    xs = list(range(cfg.examples)) + list(cfg.hidden_inputs)
    return [[[x], y] for x, y in zip(xs, fn.visible + fn.hidden)]


def split_answer(answer: str, examples: int) -> tuple[str, str]:
    """A problem's ``answer`` (its :func:`make_tests`, encoded) as two answers of the same form:
    its visible examples (x = 0..examples-1, what the prompt shows) and its hidden inputs. Scored
    apart, they tell a program that only fits the prompt from one that is the function. Raises ValueError when the
    first ``examples`` tests are not x = 0..examples-1 or nothing hidden is left (a wrong count)."""
    spec = decode_answer(answer)
    tests = spec["tests"]
    if not 0 < examples < len(tests) or [t[0] for t in tests[:examples]] != [[x] for x in range(examples)]:
        raise ValueError(f"split_answer: the first {examples} of {len(tests)} tests are not the visible x = 0..{examples - 1}")
    return (encode_answer(tests[:examples], spec["entry"], spec["params"]),
            encode_answer(tests[examples:], spec["entry"], spec["params"]))


def encode_answer(tests: list[list[Any]], entry: str = ENTRY, params: str = PARAMS) -> str:
    """The ``Problem.answer`` string: what the ``code_tests`` reward needs, as JSON."""
    return json.dumps({"entry": entry, "params": params, "tests": tests}, separators=(",", ":"))


def decode_answer(answer: str) -> dict[str, Any]:
    """Inverse of :func:`encode_answer`; raises ValueError naming what is wrong."""
    try:
        spec = json.loads(answer)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"code answer: not JSON ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("tests"), list) or not spec["tests"]:
        raise ValueError("code answer: need an object with a non-empty 'tests' list")
    for i, t in enumerate(spec["tests"]):
        if not (isinstance(t, list) and len(t) == 2 and isinstance(t[0], list)):
            raise ValueError(f"code answer: tests[{i}] must be [args_list, expected]")
    entry, params = spec.get("entry", ENTRY), spec.get("params", PARAMS)
    if not (isinstance(entry, str) and entry.isidentifier() and isinstance(params, str)):
        raise ValueError("code answer: 'entry' must be an identifier and 'params' a string")
    return {"entry": entry, "params": params, "tests": spec["tests"]}


class CodeTask:
    """Sampler and splits for the code task (same interface as ``ArithTask``)."""

    canonical_prompt = staticmethod(canonical_prompt)

    def __init__(self, cfg: CodeConfig | None = None) -> None:
        self.cfg = cfg or CodeConfig()
        fns = enumerate_functions(self.cfg)
        self.pools: dict[bool, tuple[CodeFunction, ...]] = {
            True: tuple(f for f in fns if is_test_prompt(f.prompt)),
            False: tuple(f for f in fns if not is_test_prompt(f.prompt)),
        }
        self._by_prompt = {f.prompt: f for f in fns}

    def make_problem(self, fn: CodeFunction, rng: random.Random, split: str | None = None) -> Problem:
        """A problem for ``fn``; the SFT target is one of its spellings, drawn with ``rng``."""
        meta: dict[str, Any] = {"task": "code", "family": fn.family, "canonical": fn.forms[0],
                                "test_bucket": is_test_prompt(fn.prompt)}
        if split is not None:
            meta["split"] = split
        return Problem(prompt=fn.prompt, target=rng.choice(fn.forms),
                       answer=encode_answer(make_tests(fn, self.cfg)), meta=meta)

    def function(self, prompt: str) -> CodeFunction:
        try:
            return self._by_prompt[canonical_prompt(prompt)]
        except KeyError:
            raise ValueError(f"CodeTask: {prompt!r} is not a prompt of this task's function space") from None

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        """One problem from ``split``'s bucket (train/rl never yield a test-bucket function)."""
        if split not in SPLITS:
            raise ValueError(f"CodeTask: unknown split {split!r}; allowed: {SPLITS}")
        return self.make_problem(rng.choice(self.pools[split == "test"]), rng, split)

    def split(self, name: str, n: int, seed: int, exclude: Iterable[str] = ()) -> list[Problem]:
        """``n`` problems with distinct functions from split ``name``, deterministic in (name, seed, cfg).

        Raises ValueError when the bucket has fewer than ``n`` functions left after ``exclude``.
        """
        if name not in SPLITS:
            raise ValueError(f"CodeTask.split: unknown split {name!r}; allowed: {SPLITS}")
        if n < 0:
            raise ValueError(f"CodeTask.split: n must be >= 0, got {n}")
        skip = {canonical_prompt(p) for p in exclude}
        pool = [f for f in self.pools[name == "test"] if f.prompt not in skip]
        if n > len(pool):
            raise ValueError(f"CodeTask.split: asked for {n} {name!r} problems but the bucket holds only "
                             f"{len(pool)} distinct functions for {self.cfg}; ask for fewer or widen b_max")
        rng = random.Random(f"miles-code:{name}:{seed}")
        return [self.make_problem(fn, rng, name) for fn in rng.sample(pool, n)]


def max_target_len(cfg: CodeConfig) -> int:
    """Longest spelling of any function (exact: the space is enumerated)."""
    return max(len(f) for fn in enumerate_functions(cfg) for f in fn.forms)


def max_prompt_len(cfg: CodeConfig) -> int:
    return max(len(fn.prompt) for fn in enumerate_functions(cfg))


@dataclass
class SpaceStats:
    functions: int
    test_functions: int
    per_family: dict[str, int] = field(default_factory=dict)


def space_stats(cfg: CodeConfig) -> SpaceStats:
    """Size of the function space and of its held-out bucket (to check a split request fits)."""
    fns = enumerate_functions(cfg)
    fam: dict[str, int] = {}
    for f in fns:
        fam[f.family] = fam.get(f.family, 0) + 1
    return SpaceStats(len(fns), sum(is_test_prompt(f.prompt) for f in fns), fam)


def _from_recipe(t: TaskConfig) -> tuple[CodeTask, int]:
    cfg = CodeConfig(examples=t.num_examples, b_max=t.const_max)
    return CodeTask(cfg), max_target_len(cfg)


SPEC = TaskSpec("code", _from_recipe, canonical_prompt, check_reward="code_tests")  # pass@1: every hidden test passes
