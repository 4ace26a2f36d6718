"""GSM8K, MATH and MATH-500 rows as Problems, with d1's zero-shot prompt.

Formats, as their authors publish them:

* GSM8K (openai/grade-school-math, ``train.jsonl`` / ``test.jsonl``): ``question`` and ``answer``,
  the worked solution ending in ``#### <final answer>``.
* MATH (hendrycks/math, one JSON per problem, or the JSONL/Parquet mirrors): ``problem``,
  ``solution`` (answer in its last ``\\boxed{}``), ``level`` ("Level 3"), ``type``.
* MATH-500 (HuggingFaceH4/MATH-500, ``test.jsonl``): ``problem``, ``solution``, ``answer``,
  ``subject``, ``level`` (int), ``unique_id``. ``answer`` wins over the solution's box.

The prompt is d1's evaluation prompt (dllm-reasoning/d1 ``eval/gsm8k.py``, ``eval/math500.py``):
the system text and the problem as one user turn, no few-shot examples, ``<reasoning>`` prefilled
after the chat template (:data:`PREFILL`). SFT targets are written in the format the prompt asks
for, so supervised and RL training see one format. Answers are checked by the ``math_verify``
reward (rewards/mathverify.py).
"""

from __future__ import annotations

from miles_core.data.answers import HASH_RE, last_boxed
from miles_core.data.arith import Problem
from miles_core.data.public import RowError, need_str
from miles_core.tokenizer import PROMPT_PREFILL

# d1 eval/gsm8k.py GSM_SYSTEM_PROMPT (MATH500_SYSTEM_PROMPT is the same text; its stray '"' is dropped).
SYSTEM_PROMPT = ("You are a math expert. You will be given a question to solve. Solve it step by step. "
                 "Wrap the final answer in a \\boxed{}. \nRespond in the following format:\n<reasoning>\n"
                 "Your reasoning here\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>")
PREFILL = PROMPT_PREFILL["gsm8k"]  # d1 eval.py: add_reasoning=True, "prefill for all models"


def format_prompt(question: str) -> str:
    """The user turn d1 evaluates with: the system text, a blank line, the problem."""
    return SYSTEM_PROMPT + "\n\n" + question.strip()


def format_target(reasoning: str, answer: str) -> str:
    """An SFT demonstration in the prompt's format (the prefilled ``<reasoning>`` is the prompt's)."""
    return f"\n{reasoning.strip()}\n</reasoning>\n<answer>\n\\boxed{{{answer}}}\n</answer>"


def parse_gsm8k(row: dict) -> Problem:
    question, answer = need_str(row, "question"), need_str(row, "answer")
    finals = HASH_RE.findall(answer)
    if not finals or not finals[-1].strip():
        raise RowError("field 'answer' has no '#### <final answer>' marker")
    final = finals[-1].strip().replace(",", "")
    reasoning = answer[:answer.rindex("####")]
    return Problem(prompt=format_prompt(question), target=format_target(reasoning, final), answer=final,
                   meta={"task": "gsm8k", "question": question})


def parse_math(row: dict) -> Problem:
    """A MATH or MATH-500 row; the gold answer is ``answer`` when present, else the solution's last box."""
    problem = need_str(row, "problem")
    solution = row.get("solution") if isinstance(row.get("solution"), str) else ""
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise RowError(f"field 'answer' must be a string, got {type(answer).__name__}")
    gold = (answer or "").strip() or (last_boxed(solution) or "").strip()
    if not gold:
        if "answer" in row:
            raise RowError("field 'answer' is empty and 'solution' has no \\boxed{} answer")
        raise RowError("missing field 'answer' and field 'solution' has no \\boxed{} answer")
    level = row.get("level")
    meta = {"task": "math", "question": problem, "level": level,
            "subject": row.get("subject", row.get("type")), "unique_id": row.get("unique_id")}
    target = format_target(solution or gold, gold)
    return Problem(prompt=format_prompt(problem), target=target, answer=gold, meta=meta)
