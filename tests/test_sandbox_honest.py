"""Honest, correct solutions score 1.0: each case below passes as a plain Python process
and failed under the harness before; here it runs through the code reward exactly as training
scores it (a benchmark-tests answer, the two-process harness, default limits), in both modes.
CI runs this file as root and as an ordinary user (.ci/sandbox-unprivileged)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from miles_core.data import codesets
from miles_core.rewards.code import score_completions
from miles_core.rewards.pool import SandboxPool

# name: (completion, test); each test calls candidate (the completion's f)
CASES = {
    "future annotations and a dataclass": (
        "from __future__ import annotations\nfrom dataclasses import dataclass, field\n\n@dataclass\nclass P:\n"
        "    x: int\n    tags: list[str] = field(default_factory=list)\n\ndef f(n: int) -> P:\n    return P(n).x\n",
        "assert candidate(3) == 3"),
    "a Fraction compared with a float": (
        "from fractions import Fraction\ndef f(n):\n    return Fraction(1, n)\n", "assert candidate(2) == 0.5"),
    "a Decimal result": (
        "from decimal import Decimal\ndef f(s):\n    return Decimal(s) * 2\n",
        "from decimal import Decimal\nassert candidate('0.1') == Decimal('0.2') and candidate('0.25') == 0.5"),
    "sets appended in place to a list argument": (
        "def f(out):\n    out.append({1, 2})\n    out.append({3})\n",
        "l = []\ncandidate(l)\nassert l == [{1, 2}, {3}]"),
    "a list nested in a tuple argument": (
        "def f(t):\n    t[0].append(1)\n    t[1]['k'] = [2]\n",
        "t = ([], {})\ncandidate(t)\nassert t == ([1], {'k': [2]})"),
    "a range argument": ("def f(r):\n    return sum(r)\n", "assert candidate(range(5)) == 10"),
    "a generator argument": ("def f(it):\n    return sum(it)\n", "assert candidate(x for x in range(4)) == 6"),
    "a class argument": ("def f(cls, s):\n    return cls(s)\n", "assert candidate(int, '5') == 5"),
    "an exception subclass and its message": (
        "class BadInput(ValueError):\n    pass\ndef f(x):\n    if x < 0:\n        raise BadInput(f'negative: {x}')\n"
        "    return x\n",
        "try:\n    candidate(-1)\n    assert False\nexcept ValueError as e:\n    assert str(e) == 'negative: -1'"),
    "an int of 13,000 bits": ("def f(n):\n    return 3 * 2 ** n\n", "assert candidate(13000) == 3 * 2 ** 13000"),
    "an infinite generator taken with islice": (
        "def f():\n    n = 2\n    while True:\n        if all(n % d for d in range(2, int(n ** 0.5) + 1)):\n"
        "            yield n\n        n += 1\n",
        "from itertools import islice\nassert list(islice(candidate(), 6)) == [2, 3, 5, 7, 11, 13]"),
    "a 1.2 MB string": ("def f(n):\n    return 'ab' * (n // 2)\n", "assert len(candidate(1_200_000)) == 1_200_000"),
    "a 150,000-item list": ("def f(n):\n    return list(range(n))\n", "assert candidate(150_000)[-1] == 149_999"),
    "a dict result with tuple keys": (
        "def f(n):\n    return {(i, i + 1): [i] for i in range(n)}\n", "assert candidate(2) == {(0, 1): [0], (1, 2): [1]}"),
    "a property test of 25,000 calls": ("def f(x):\n    return x + 1\n",
                                        "for i in range(25_000):\n    assert candidate(i) == i + 1"),
    "stdlib that imports lazily from C": (
        "import datetime, time\ndef f(s):\n    return datetime.datetime.strptime(s, '%Y-%m-%d').day + "
        "time.strptime('7', '%H').tm_hour\n", "assert candidate('2024-03-05') == 12"),
    "codecs": ("import codecs\ndef f(s):\n    return codecs.encode(s, 'rot13') + s.encode('utf-16-le').decode("
               "'utf-16-le') + s.encode('cp1252').decode('cp1252')\n", "assert candidate('é') == 'é' * 3"),
    "an optional numpy": ("try:\n    import numpy as np\nexcept ImportError:\n    np = None\n"
                          "def f(xs):\n    return sum(xs) if np is None else int(np.sum(xs))\n",
                          "assert candidate([1, 2]) == 3"),
    "pure stdlib modules": (
        "import base64, zlib, pickle, csv, difflib, queue, io, unittest, heapq, string\n"
        "def f(x):\n    q = queue.Queue()\n    q.put(x)\n    b = base64.b64decode(base64.b64encode(zlib.compress(pickle.dumps(q.get()))))\n"
        "    rows = list(csv.reader(io.StringIO('a,b')))\n"
        "    return [pickle.loads(zlib.decompress(b)), rows, difflib.SequenceMatcher(None, 'ab', 'ac').ratio()]\n",
        "assert candidate(4) == [4, [['a', 'b']], 0.5]"),
}
FENCES = {  # how models write code blocks; each must run the block that defines f
    "python3 info word": "```python3\ndef f(x):\n    return x + 1\n```",
    "CRLF line ends": "Here it is:\r\n```python\r\ndef f(x):\r\n    return x + 1\r\n```\r\n",
    "indented in a list item": "1. The function:\n   ```py\n   def f(x):\n       return x + 1\n   ```\n2. Done.",
    "backticks inside a string": "```python\ndef f(x):\n    fence = '```'\n    return x + len(fence) - 2\n```",
    "a shell block first": "```bash\npython f.py\n```\n\n```Python\ndef f(x):\n    return x + 1\n```",
}


@pytest.fixture(scope="module", params=("bwrap_shared", "bwrap"))
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(2, isolation=request.param, cache_size=0) as p:
        yield p


def _score(pool: SandboxPool, completion: str, test: str) -> object:
    answer = codesets.tests_answer("f", [test], setup="", prefix="")
    return score_completions([completion], [answer], pool=pool)[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_honest_solution_scores_one(pool: SandboxPool, name: str) -> None:
    completion, test = CASES[name]
    got = _score(pool, completion, test)
    assert got.score == 1.0, (name, got)


@pytest.mark.parametrize("name", sorted(FENCES))
def test_code_blocks_as_models_write_them(pool: SandboxPool, name: str) -> None:
    got = _score(pool, FENCES[name], "assert candidate(1) == 2")
    assert got.score == 1.0, (name, got)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_passes_as_a_plain_python_process(name: str) -> None:
    """The corpus itself is right: completion + test as one plain program, in a fresh interpreter."""
    completion, test = CASES[name]
    src = completion + "\ncandidate = f\n" + test + "\n"
    res = subprocess.run([sys.executable, "-I", "-c", src], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, (name, res.stderr[-500:])
