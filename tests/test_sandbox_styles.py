"""The tester judges what the task asks (rewards/sandbox_tests.py): honest programs in every style a
benchmark's tests use pass, and the hollow passes fail, in both sandbox modes.

Each honest case is checked against the benchmark's own rule first: the dataset's harness
(openai/human-eval ``execution.py``, MBPP's) runs ``program + test`` as one program, so a case is
honest exactly when that passes. The two-process harness must then agree. The hollow cases pass
that single-process rule (or would under a harness that trusts the program's objects) without a
solution; here they must fail. Runs as root in ``make test`` and as an ordinary user in
.ci/sandbox-unprivileged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from miles_core.rewards.jobs import Job, SandboxLimits
from miles_core.rewards.pool import SandboxPool

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=2, memory_mb=256, tmpfs_mb=8)

# name -> (program, entry point, test snippet)
HONEST = {
    "mutates its list argument": ("def sort_in_place(a):\n    a.sort()\n", "sort_in_place",
                                  "x = [3, 1, 2]\ny = x\nsort_in_place(x)\nassert x == [1, 2, 3] and y is x"),
    "mutates a nested dict": ("def bump(d):\n    d['n']['k'] += 1\n    d['new'] = 0\n", "bump",
                              "inner = {'k': 1}\nd = {'n': inner, 'old': 1}\nbump(d)\n"
                              "assert d == {'n': {'k': 2}, 'old': 1, 'new': 0} and d['n'] is inner"),
    "returns and mutates": ("def pop_max(xs):\n    xs.remove(max(xs))\n    return len(xs)\n", "pop_max",
                            "a = [5, 9, 1]\nassert pop_max(a) == 2 and a == [5, 1]"),
    "takes a lambda": ("def apply(f, xs):\n    return [f(x) for x in xs]\n", "apply",
                       "assert apply(lambda x: x * 2, [1, 2]) == [2, 4]"),
    "takes a key function by keyword": ("def top(xs, key):\n    return max(xs, key=key)\n", "top",
                                        "assert top(['a', 'ccc', 'bb'], key=len) == 'ccc'"),
    "a callback that raises": ("def first_ok(f, xs):\n    for x in xs:\n        try:\n            return f(x)\n"
                               "        except ValueError:\n            pass\n", "first_ok",
                               "def g(x):\n    if x < 2:\n        raise ValueError(x)\n    return x * 10\n"
                               "assert first_ok(g, [0, 1, 2]) == 20"),
    "returns a generator": ("def squares(n):\n    for i in range(n):\n        yield i * i\n", "squares",
                            "assert list(squares(4)) == [0, 1, 4, 9]\ng = squares(3)\nassert next(g) == 0 and next(g) == 1"),
    "returns a map": ("def doubled(xs):\n    return map(lambda x: 2 * x, xs)\n", "doubled",
                      "assert list(doubled([1, 2])) == [2, 4] and sum(doubled([3])) == 6"),
    "returns a Counter": ("from collections import Counter\ndef freq(s):\n    return Counter(s)\n", "freq",
                          "assert freq('aab') == {'a': 2, 'b': 1}"),
    "returns a namedtuple": ("from collections import namedtuple\nP = namedtuple('P', 'x y')\n"
                             "def pt(a):\n    return P(a, a + 1)\n", "pt", "assert pt(1) == (1, 2)"),
    "returns dict keys": ("def keys(d):\n    return d.keys()\n", "keys", "assert keys({'a': 1, 'b': 2}) == {'a', 'b'}"),
    "returns a range": ("def upto(n):\n    return range(n)\n", "upto", "assert upto(3) == range(3) and list(upto(2)) == [0, 1]"),
    "raises what the test expects": ("def safe_div(a, b):\n    if b == 0:\n        raise ZeroDivisionError('b')\n"
                                     "    return a / b\n", "safe_div",
                                     "try:\n    safe_div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    assert False\n"
                                     "assert safe_div(1, 4) == 0.25"),
    "floats within a tolerance": ("def mean(xs):\n    return sum(xs) / len(xs)\n", "mean",
                                  "import math\nassert math.isclose(mean([0.1, 0.2, 0.3]), 0.2)\n"
                                  "assert abs(mean([1, 2]) - 1.5) < 1e-9"),
}

# name -> (program, entry point, test snippet): passes or would pass without solving anything
HOLLOW = {
    "StopIteration inside the test's map": ("def ok(x):\n    raise StopIteration\n", "ok",
                                            "assert all(map(ok, [1, 2, 3]))"),
    "StopIteration ends the test's loop": ("def ok(x):\n    raise StopIteration\n", "ok",
                                           "for r in map(ok, [1]):\n    assert r == 5"),
    "an unsendable object is truthy": ("class X:\n    pass\ndef f(x):\n    return X()\n", "f", "assert f(1)"),
    "an unsendable object is falsy": ("class X:\n    pass\ndef f(x):\n    return X()\n", "f", "assert not f(1)"),
    "an unsendable object equals itself": ("class X:\n    pass\ndef f(x):\n    return X()\n", "f", "assert f(1) == f(1)"),
    "an always-equal Counter": ("from collections import Counter\nclass C(Counter):\n    def __eq__(s, o):\n"
                                "        return True\ndef freq(s):\n    return C()\n", "freq", "assert freq('ab') == {'a': 1, 'b': 1}"),
    "a generator of always-equal items": ("class E(int):\n    def __eq__(s, o):\n        return True\n"
                                          "def squares(n):\n    yield E(0)\n", "squares", "assert list(squares(1)) == [7]"),
}
WRONG = {  # the honest cases' tests against programs that get it wrong
    "mutates its list argument": "def sort_in_place(a):\n    return sorted(a)\n",
    "mutates a nested dict": "def bump(d):\n    d = dict(d)\n    d['new'] = 0\n",
    "takes a lambda": "def apply(f, xs):\n    return [f(f(x)) for x in xs]\n",
    "returns a generator": "def squares(n):\n    for i in range(n):\n        yield i\n",
    "returns a Counter": "from collections import Counter\ndef freq(s):\n    return Counter(s[1:])\n",
}


def official_rule(program: str, test: str) -> bool:
    """The dataset harness's verdict: program and test as one program in one namespace."""
    try:
        exec(compile(program + "\n" + test, "<one program>", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own fixtures
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module", params=("bwrap", "bwrap_shared"))
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(2, LIMITS, isolation=request.param, cache_size=0) as p:
        yield p


def _verdicts(pool: SandboxPool, cases: dict[str, tuple[str, str, str]]) -> dict[str, tuple[bool, str]]:
    jobs = [Job(src, [], entry, kind="tests", tests=[test], setup="") for src, entry, test in cases.values()]
    return {name: (res.status == "ok" and res.outputs == [True], f"{res.status} {res.errors} {res.reason}")
            for name, res in zip(cases, pool.submit(jobs).result())}


def test_the_fixtures_mean_what_they_say() -> None:
    """The control: the honest cases pass the benchmark's own rule, their wrong versions fail it,
    and the StopIteration and always-equal cases are hollow passes under it."""
    assert [n for n, (src, _, test) in HONEST.items() if not official_rule(src, test)] == []
    assert [n for n, src in WRONG.items() if official_rule(src, HONEST[n][2])] == []
    hollow_there = [n for n, (src, _, test) in HOLLOW.items() if official_rule(src, test)]
    assert set(hollow_there) >= {"StopIteration inside the test's map", "StopIteration ends the test's loop",
                                 "an always-equal Counter", "a generator of always-equal items",
                                 "an unsendable object is truthy"}


def test_honest_programs_in_every_style_pass(pool: SandboxPool) -> None:
    got = _verdicts(pool, HONEST)
    assert {n: why for n, (ok, why) in got.items() if not ok} == {}


def test_wrong_programs_in_those_styles_fail(pool: SandboxPool) -> None:
    got = _verdicts(pool, {n: (src, HONEST[n][1], HONEST[n][2]) for n, src in WRONG.items()})
    assert [n for n, (ok, _) in got.items() if ok] == []


def test_hollow_passes_fail(pool: SandboxPool) -> None:
    got = _verdicts(pool, HOLLOW)
    assert [n for n, (ok, _) in got.items() if ok] == []
