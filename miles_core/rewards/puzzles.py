"""d1's Countdown and Sudoku checks (dllm-reasoning/d1 ``eval/parse_and_get_acc.py``).

* ``countdown_d1``: 1 when the final expression uses every given number exactly once, holds only
  digits, ``+ - * / ( ) .`` and spaces, and evaluates to the target within 1e-5; else 0. The
  expression is the last ``\\boxed{}``, else the last ``<answer>``; ``\\div``, ``\\times`` and
  ``\\cdot`` become operators and a trailing ``= target`` is dropped, as d1 does. d1 evaluates the
  expression with Python's ``eval``; here a small evaluator over the parsed syntax tree does it
  (numbers and the four operators only), so no model text is ever executed.
* ``sudoku``: the fraction of the puzzle's empty cells the answer fills correctly (d1's metric,
  also its training reward); the answer is the last ``<answer>``'s digits, else the last run of
  16 digits, padded or cut to 16. pass@1 counts a fully solved grid (reward 1).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any, Sequence

from miles_core.data.answers import last_boxed
from miles_core.rewards.text import completion_text

_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>`` (d1's answer tag; an unclosed last tag runs to the end)."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def _eval(node: ast.AST, depth: int = 0) -> float:
    """Value of an arithmetic syntax tree: numbers, + - * / and unary minus only."""
    if depth > 50:
        raise ValueError("expression too deep")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left, depth + 1), _eval(node.right, depth + 1))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand, depth + 1)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def countdown_expression(text: str) -> str | None:
    """The final expression of a completion, as d1 reads it."""
    eq = last_boxed(text)
    if eq is None:
        eq = last_answer_tag(text)
        if eq is not None and last_boxed(eq) is not None:
            eq = last_boxed(eq)
    if eq is None:
        return None
    eq = eq.replace(r"\div", "/").replace(r"\times", "*").replace(r"\cdot", "*")
    m = re.search(r"([0-9+\-*/() ]+)=[0-9. ]+", eq)
    return (m.group(1) if m else eq).strip()


def countdown_correct(expr: str | None, nums: Sequence[int], target: float) -> bool:
    if not expr or len(expr) > 200 or not _ALLOWED.match(expr):
        return False
    if sorted(int(n) for n in re.findall(r"\d+", expr)) != sorted(nums):
        return False
    try:
        value = _eval(ast.parse(expr, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return False
    return abs(value - float(target)) < 1e-5


def _gold(ans: Any, keys: tuple[str, ...]) -> dict | None:
    try:
        g = json.loads(ans) if isinstance(ans, str) else ans
    except ValueError:
        return None
    return g if isinstance(g, dict) and all(k in g for k in keys) else None


def countdown_d1_reward(prompts: Sequence[str], completions: Sequence[Any], answer: Sequence[Any],
                        **_: Any) -> list[float | None]:
    """1.0 for a correct Countdown expression (d1's rules, module docstring), else 0; None without gold."""
    out: list[float | None] = []
    for comp, ans in zip(completions, answer):
        g = _gold(ans, ("nums", "target"))
        out.append(None if g is None else float(countdown_correct(
            countdown_expression(completion_text(comp)), g["nums"], g["target"])))
    return out


def sudoku_grid(text: str) -> str | None:
    """The 16-character grid a completion answers with (d1's extraction, padded or cut to 16)."""
    tag = last_answer_tag(text)
    digits = "".join(c for c in tag if c.isdigit()) if tag is not None else ""
    if not digits:
        runs = re.findall(r"(?<!\d)(\d{16})(?!\d)", text)
        digits = runs[-1] if runs else ""
    if not digits:
        return None
    return (digits + "0" * 16)[:16]


def sudoku_reward(prompts: Sequence[str], completions: Sequence[Any], answer: Sequence[Any],
                  **_: Any) -> list[float | None]:
    """Fraction of empty cells filled correctly (d1); None without gold."""
    out: list[float | None] = []
    for comp, ans in zip(completions, answer):
        g = _gold(ans, ("puzzle", "solution"))
        if g is None:
            out.append(None)
            continue
        grid = sudoku_grid(completion_text(comp)) or "0" * 16
        empty = [i for i, c in enumerate(g["puzzle"]) if c == "0"]
        out.append(sum(grid[i] == g["solution"][i] for i in empty) / len(empty) if empty else 1.0)
    return out
