"""The two-process test harness (rewards/sandbox_tests.py): a benchmark's own test code runs in a
process the completion cannot reach, so the reward hacks that work against HumanEval's usual
harness (an always-equal object, rebinding builtins or a module the asserts use, walking frames up
to ``check``, exiting early) score 0, while honest programs pass and wrong ones fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from miles_core.rewards.jobs import Job, SandboxLimits
from miles_core.rewards.pool import SandboxPool
from miles_core.rewards.sandbox_values import Opaque, _tag, _untag

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=1, memory_mb=256, tmpfs_mb=16)
SETUP = 'import math\n\ndef add(a, b):\n    """Add two numbers."""\n'
CHECK = ("def check(candidate):\n    assert candidate(1, 2) == 3\n"
         "    assert math.isclose(candidate(0.5, 0.25), 0.75)\n    assert abs(candidate(-1, 1)) < 1e-9\n"
         "check(add)\n")

HACKS = {
    "always_equal": "class E(float):\n    def __eq__(s, o): return True\n    __hash__ = float.__hash__\n"
                    "def add(a, b):\n    return E(0)\n",
    "eq_object": "class E:\n    def __eq__(s, o): return True\n    def __abs__(s): return 0\n"
                 "def add(a, b):\n    return E()\n",
    "patch_builtins": "import builtins\nbuiltins.abs = lambda x: 0\ndef add(a, b):\n    return 3\n",
    "patch_math": "import math\nmath.isclose = lambda *a, **k: True\ndef add(a, b):\n    return 3\n",
    "walk_frames": ("import sys\ndef add(a, b):\n    f = sys._getframe()\n    while f is not None:\n"
                    "        f.f_globals.get('__builtins__', {}).__dict__['abs'] = lambda x: 0\n"
                    "        f.f_globals['math'] = None\n        f = f.f_back\n    return 3\n"),
    "exit_early": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys_exit": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "spin": "def add(a, b):\n    while True:\n        pass\n",
    "fake_replies": ("import os, struct\nfor _ in range(9):\n    b = b'{\"value\":3}'\n"
                     "    os.write(3, struct.pack('>I', len(b)) + b)\ndef add(a, b):\n    return 3\n"),
    "fake_fatal": ("import os, struct\nb = b'{\"fatal\":{\"status\":\"ok\",\"reason\":\"all passed\"}}'\n"
                   "os.write(3, struct.pack('>I', len(b)) + b)\ndef add(a, b):\n    return a + b\n"),
}


@pytest.fixture(scope="module", params=("bwrap", "bwrap_shared"))
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(2, LIMITS, isolation=request.param, cache_size=0) as p:
        yield p


def _run(pool: SandboxPool, sources: list[str], tests: list[str] = [CHECK], setup: str = SETUP):  # noqa: B006
    return pool.submit([Job(s, [], "add", kind="tests", tests=tests, setup=setup) for s in sources]).result()


def test_honest_program_passes_and_wrong_one_fails(pool: SandboxPool) -> None:
    right, wrong = _run(pool, ["def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"])
    assert (right.status, right.outputs) == ("ok", [True])
    assert (wrong.status, wrong.outputs, wrong.errors) == ("ok", [False], ["assertion failed"])


def test_every_hack_scores_zero(pool: SandboxPool) -> None:
    results = dict(zip(HACKS, _run(pool, list(HACKS.values()))))
    for name, res in results.items():
        assert True not in res.outputs, (name, res)
    assert results["spin"].status == "cpu_limit"
    assert results["exit_early"].status == "exited"
    assert results["sys_exit"].status == "exited"
    assert results["always_equal"].outputs == [False]   # a float subclass arrives as its float value; its __eq__ stays behind
    assert results["walk_frames"].outputs == [False]    # its frames are its own process's


def test_snippets_score_separately_with_plain_values(pool: SandboxPool) -> None:
    src = "def add(a, b):\n    return (a, [b, {1: 2}], {3}, frozenset({4}), b'x', 1.5j, None)\n"
    tests = ["assert add(1, 2) == (1, [2, {1: 2}], {3}, frozenset({4}), b'x', 1.5j, None)",
             "assert add(1, 2) == [1]", "assert isinstance(add(1, 2), tuple)", "undefined_name"]
    (res,) = _run(pool, [src], tests, setup="")
    assert res.outputs == [True, False, True, False]
    assert res.errors == [None, "assertion failed", None, "raised NameError"]


def test_exceptions_cross_as_their_builtin_class(pool: SandboxPool) -> None:
    src = "def add(a, b):\n    if a < 0:\n        raise ValueError('negative')\n    return a + b\n"
    tests = ["try:\n    add(-1, 2)\n    assert False\nexcept ValueError:\n    pass", "assert add(1, 2) == 3"]
    (res,) = _run(pool, [src], tests, setup="")
    assert res.outputs == [True, True]


def test_definition_errors_and_missing_function(pool: SandboxPool) -> None:
    crash, missing, syntax = _run(pool, ["x = 1 / 0\n", "def other():\n    return 1\n", "def add(:\n"])
    assert crash.status == "definition_error" and "ZeroDivisionError" in crash.reason
    assert missing.status == "definition_error" and "'add'" in missing.reason
    assert syntax.status == "syntax_error"


def test_tag_round_trip_and_opaque() -> None:
    v = {"a": [1, (2.5, None)], 3: {frozenset({1}), "x"}, "b": b"\xff", "c": -2j}
    assert _untag(_tag(v)) == v
    assert type(_untag(_tag((1,)))) is tuple
    assert _tag(True) is True and _tag(2 ** 70) == 2 ** 70
    o = _untag(_tag(object()))
    assert isinstance(o, Opaque) and o != o and "object" in repr(o)


def test_bad_tests_job_is_refused() -> None:
    with SandboxPool(1, LIMITS, isolation="none", cache_size=0) as p:
        with pytest.raises(ValueError, match="kind 'tests' needs tests"):
            p.submit([Job("def add(a, b): return 1", [], "add", kind="tests", tests=[])])
