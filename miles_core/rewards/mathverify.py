"""The ``math_verify`` reward: GSM8K and MATH answers compared with Hugging Face's math-verify.

Two steps, each done by what is good at it:

1. **Which part of the completion is the answer** is decided here (:func:`final_answer_span`):
   the last ``\\boxed{}``, else the last ``<answer>...</answer>``, else "the answer is X", else
   GSM8K's ``#### X``, else the last number. math-verify alone, given the whole completion, takes
   every boxed expression it finds (``\\boxed{1} ... \\boxed{2}`` parses as the set {1, 2}) and
   can pick up a number from the reasoning; the last box is the convention of MATH's own grader
   and d1's MATH500 eval, so the two differ on purpose there (benchmarks/eval/tasks.py counts how often).
2. **Whether that answer equals the gold one** is math-verify's job: ``\\frac`` vs ``\\dfrac`` vs
   0.5, ``\\sqrt{8}`` vs ``2\\sqrt{2}``, intervals, sets, tuples, units, percentages, thousands
   separators, ``x = 3`` vs 3. The span is wrapped in ``$...$`` (math-verify only reads LaTeX
   inside a math environment).

The hand-written parser (data/answers.py) remains only where math-verify returns nothing for a
side: plain-text answers ("Evelyn", "\\text{(C)}") and malformed LaTeX. math-verify's own timeouts
use ``signal.alarm``, which raises in any thread but the main one (Prefect runs tasks in worker
threads), so they are off and :func:`_tame` refuses inputs that could make sympy run long (very
long spans, towers of powers, factorials) before math-verify sees them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Sequence

from miles_core.data.answers import HASH_RE, answers_match, extract_answer, reference_answer
from miles_core.rewards.puzzles import last_answer_tag
from miles_core.rewards.text import completion_text

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.\s|\.$|$|\n)", re.IGNORECASE)
_TOWER = re.compile(r"\^\s*\{[^}]*\^|\^\s*\(?[\w.]+\)?\s*\^")  # a power inside an exponent
_BIG_POWER = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*-?\d{4,}")           # an exponent of 1000 or more
_FACTORIAL = re.compile(r"(?:\d{3,}|[)}])\s*!")                          # 100! or (n+1)!
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer_span(text: str) -> str | None:
    """The part of a completion that states its final answer (module docstring), or None."""
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = _last_outer_boxed(text)
    if boxed is not None and boxed.strip():
        return _BOX.sub("{", boxed).strip()  # a box inside the answer is only emphasis
    tag = last_answer_tag(text)
    if tag:
        return tag
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip()
    hashes = HASH_RE.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _last_outer_boxed(text: str) -> str | None:
    """Content of the box that closes last (the outermost one when boxes nest:
    ``\\boxed{\\frac{\\boxed{3}}{4}}`` answers 3/4, not 3)."""
    best: tuple[int, int] | None = None
    for m in list(_BOX.finditer(text))[-16:]:  # bounded, like data.answers.last_boxed
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0 and (best is None or i > best[1]):
            best = (m.end(), i)
    return text[best[0]:best[1] - 1] if best else None


def _tame(s: str, max_len: int = 300) -> bool:
    """Small enough for sympy without a timeout: short, no power towers, no factorials, no huge literals."""
    return (len(s) <= max_len and not _FACTORIAL.search(s) and not re.search(r"\d{40}", s)
            and not _TOWER.search(s) and not _BIG_POWER.search(s))


def _mv():
    import logging

    import math_verify  # imported on use: it pulls in sympy and antlr (about a second)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": on purpose, see above
    return math_verify


@lru_cache(maxsize=8192)
def _parse_math(span: str) -> tuple:
    """math-verify's parse of one answer written as LaTeX (``$`` added; empty when it finds nothing)."""
    s = span.strip().strip("$").strip()
    if not s or not _tame(s):
        return ()
    return tuple(_mv().parse(f"${s}$", parsing_timeout=None))


def _verify(gold: tuple, pred: tuple) -> bool:
    try:
        return bool(_mv().verify(list(gold), list(pred), timeout_seconds=None))
    except Exception:  # noqa: BLE001 - sympy can raise on odd input; a reward must not
        return False


def check_answer(text: str, gold: str) -> bool:
    """Is the final answer of ``text`` equal to ``gold`` (a MATH answer string or a GSM8K number)?"""
    span = final_answer_span(text)
    if span is None or not isinstance(gold, str) or not gold.strip():
        return False
    g, p = _parse_math(gold), _parse_math(span)
    if g and p:
        return _verify(g, p)
    return answers_match(extract_answer(f"\\boxed{{{span}}}"), reference_answer(gold))  # plain text answers


def math_verify_alone(text: str, gold: str) -> bool:
    """math-verify's verdict on the whole completion, with its default extraction (the comparison
    benchmarks/eval/tasks.py reports; not a reward)."""
    if not _tame(gold) or not _tame(text, 5000):
        return False
    mv = _mv()
    try:
        return bool(mv.verify(mv.parse(f"${gold.strip().strip('$')}$", parsing_timeout=None),
                              mv.parse(text, parsing_timeout=None), timeout_seconds=None))
    except Exception:  # noqa: BLE001
        return False


def math_verify_reward(prompts: Sequence[str], completions: Sequence[Any], answer: Sequence[Any],
                       **_: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the gold answer (math-verify), else 0; None
    when there is no gold answer."""
    if len(answer) != len(completions):
        raise ValueError(f"math_verify reward: answer has {len(answer)} items but there are "
                         f"{len(completions)} completions")
    out: list[float | None] = []
    for comp, gold in zip(completions, answer):
        if gold is None or (isinstance(gold, str) and not gold.strip()):
            out.append(None)
            continue
        try:
            out.append(1.0 if check_answer(completion_text(comp), str(gold)) else 0.0)
        except Exception:  # noqa: BLE001 - a reward must never crash a rollout batch
            out.append(0.0)
    return out
