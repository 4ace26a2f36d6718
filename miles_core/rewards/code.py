"""Execution reward for code: run each completion against its tests in the sandbox.

The contract is TRL's ``fn(prompts, completions, **meta) -> list[float | None]``; the tests of
each completion arrive in ``meta["answer"]`` as the JSON written by
:func:`miles_core.data.code.encode_answer` (rollout passes ``Problem.answer`` through). Reward =
fraction of tests passed; a crash, timeout, limit breach or policy refusal scores 0, and
:func:`score_completions` returns the reason with every score, and the reward functions return
their scores as :class:`RewardScores`: a plain list, as TRL's rewards return, with the batch's
counts per status and commonest reasons for a zero beside them (``.stats``), for a trainer to log.

:class:`miles_core.rewards.pool.SandboxPool` runs the completions inside the kernel boundary of
:mod:`miles_core.rewards.isolation`. Expected outputs never leave this process: the sandbox gets
the inputs only, and comparison happens here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from concurrent.futures import Future
from typing import Any, Sequence

from miles_core.data.code import decode_answer
from miles_core.data.codesets import program
from miles_core.rewards.jobs import ExecResult, Job
from miles_core.rewards.pool import Mode, SandboxPool, shared_pool

log = logging.getLogger("miles.rewards.code")
MAX_COMPLETION_CHARS = 20_000


@dataclasses.dataclass(frozen=True)
class Score:
    score: float      # fraction of tests passed; 0 for a crash, timeout, limit breach or refusal
    reason: str
    passed: int
    total: int
    status: str       # the run's status ("ok" when it finished), see sandbox.ExecResult


def _same(got: Any, want: Any) -> bool:
    """Strict equality of JSON values: True != 1 and 1.0 != 1 (type confusions are wrong answers)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return bool(got == want)


def score_result(res: ExecResult, expected: Sequence[Any], inputs: Sequence[Sequence[Any]] = ()) -> Score:
    """Fraction of tests whose output equals ``expected``; 0 with the run's reason if it did not finish."""
    total = len(expected)
    if res.status != "ok" or len(res.outputs) != total:
        why = res.reason if res.status != "ok" else f"reported {len(res.outputs)} outputs for {total} tests"
        return Score(0.0, why, 0, total, res.status if res.status != "ok" else "bad_result")
    ok = [res.errors[i] is None and _same(res.outputs[i], expected[i]) for i in range(total)]
    passed = sum(ok)
    if passed == total:
        return Score(1.0, f"passed {total}/{total} tests", passed, total, "ok")
    i = ok.index(False)
    call = f"f{tuple(inputs[i])}" if i < len(inputs) else f"test {i}"
    got = res.errors[i] or f"returned {json.dumps(res.outputs[i])[:60]}"
    return Score(passed / total, f"passed {passed}/{total} tests; first failure {call} {got}, "
                 f"expected {json.dumps(expected[i])[:60]}", passed, total, "ok")


def _safe_score(res: ExecResult, expected: Sequence[Any], inputs: Sequence[Sequence[Any]]) -> Score:
    """score_result, or 0 with the reason when the report defeats it: a reward never raises on
    what a completion wrote (the pool bounds reports, this is the last line)."""
    try:
        return score_result(res, expected, inputs)
    except Exception as e:  # noqa: BLE001 - hostile output must cost a score, never the trainer
        return Score(0.0, f"unscorable report ({type(e).__name__})", 0, len(expected), "bad_result")


def _prepare(completions: Sequence[Any], answers: Sequence[Any]) -> tuple[list[Job | Score | None], list[list]]:
    """Per completion: a Job to run, a Score decided without running it, or None (unscorable reference)."""
    from miles_core.rewards.text import completion_text

    if len(completions) != len(answers):
        raise ValueError(f"code reward: answer has {len(answers)} items but there are {len(completions)} completions")
    plan: list[Job | Score | None] = []
    expected: list[list] = []
    for comp, ans in zip(completions, answers):
        bench = benchmark_tests(ans)
        try:
            spec = bench or decode_answer(ans)
        except ValueError:
            plan.append(None)
            expected.append([])
            continue
        tests = spec["tests"]
        expected.append([True] * len(tests) if bench else [t[1] for t in tests])
        raw = completion_text(comp)
        text = raw.strip()
        if len(raw) > MAX_COMPLETION_CHARS:  # the cap applies before any parsing, to the raw text
            plan.append(Score(0.0, f"completion longer than {MAX_COMPLETION_CHARS} characters", 0, len(tests), "too_long"))
        elif not text:
            plan.append(Score(0.0, "empty completion", 0, len(tests), "empty"))
        elif bench:  # a benchmark's own test code (HumanEval, MBPP): the two-process harness
            plan.append(Job(program(bench, raw), [], bench["entry"], kind="tests",
                            tests=bench["tests"], setup=bench["setup"]))
        else:
            plan.append(Job(text, [t[0] for t in tests], spec["entry"], spec["params"], "auto"))
    return plan, expected


def benchmark_tests(answer: Any) -> dict | None:
    """The spec of a benchmark-tests answer (data/codesets.py tests_answer), else None."""
    if not isinstance(answer, str) or '"kind": "tests"' not in answer[:20]:
        return None
    try:
        spec = json.loads(answer)
    except ValueError:
        return None
    ok = (isinstance(spec, dict) and isinstance(spec.get("entry"), str) and spec["entry"].isidentifier()
          and isinstance(spec.get("tests"), list) and spec["tests"] and all(isinstance(t, str) for t in spec["tests"])
          and isinstance(spec.get("setup"), str) and isinstance(spec.get("prefix", ""), str))
    return spec if ok else None


def submit_scores(completions: Sequence[Any], answers: Sequence[Any], pool: SandboxPool | None = None,
                  isolation: Mode = "bwrap") -> "Future[list[Score | None]]":
    """Start scoring in the sandbox workers and return at once (the caller can keep sampling);
    ``pool``, or this process's shared pool of ``isolation``."""
    plan, expected = _prepare(completions, answers)
    run = [k for k, p in enumerate(plan) if isinstance(p, Job)]
    jobs = [plan[k] for k in run]
    # each report becomes its Score as it arrives: a batch never holds its parsed reports at once
    inner = (pool or shared_pool(isolation)).submit(
        jobs, reduce=lambda j, res: _safe_score(res, expected[run[j]], jobs[j].inputs))
    out: Future = Future()

    def finish(f: Future) -> None:
        try:
            verdicts = iter(f.result())
            out.set_result([next(verdicts) if isinstance(p, Job) else p for p in plan])
        except BaseException as e:  # noqa: BLE001 - surfaced to whoever waits on the future
            out.set_exception(e)
    inner.add_done_callback(finish)
    return out


def score_completions(completions: Sequence[Any], answers: Sequence[Any], pool: SandboxPool | None = None,
                      isolation: Mode = "bwrap") -> list[Score | None]:
    """(score, reason) for every completion; None where the reference tests are missing or malformed."""
    return submit_scores(completions, answers, pool, isolation).result()


class RewardScores(list):
    """A reward's scores, a list as every reward returns, with ``stats`` (:func:`summarize`) of the
    batch they score: returned with the scores, never kept anywhere in between calls."""

    def __init__(self, scores: Sequence[float | None], stats: dict[str, Any]) -> None:
        super().__init__(scores)
        self.stats = stats


def summarize(scores: Sequence[Score | None]) -> dict[str, Any]:
    """Counts per run status and the most common reasons for a zero score (for logs and stats)."""
    zero = Counter(s.reason for s in scores if s is not None and s.score == 0.0)
    return {"status_counts": dict(Counter(s.status if s else "unscorable" for s in scores)),
            "zero_reasons": zero.most_common(5), "mean": sum(s.score for s in scores if s) / max(len(scores), 1)}


def code_tests_reward(prompts: Sequence[str], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                      isolation: Mode = "bwrap", **_: Any) -> RewardScores:
    """Fraction of hidden tests passed (executed in the sandbox of ``isolation``: the default, a
    sandbox per run, unless the caller's recipe says otherwise); 0 with a reason on any failure
    (``.stats`` of the result)."""
    if answer is None:
        raise ValueError("code_tests reward: needs meta 'answer' (the JSON tests of each completion)")
    scores = score_completions(completions, answer, isolation=isolation)
    stats = summarize(scores)
    log.debug("code_tests: %s", stats)
    return RewardScores([None if s is None else s.score for s in scores], stats)


def code_pass_reward(prompts: Sequence[str], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                     isolation: Mode = "bwrap", **_: Any) -> RewardScores:
    """1.0 when the completion passes *every* hidden test, else 0: pass@1's own criterion. Unlike
    ``code_tests`` it gives no credit to a program that is right on some inputs only (e.g. the right
    constant with the wrong shape), which an RL policy can otherwise settle for. Reasons and stats
    as ``code_tests``."""
    fractions = code_tests_reward(prompts, completions, answer=answer, isolation=isolation)
    return RewardScores([None if v is None else float(v >= 1.0) for v in fractions], fractions.stats)
