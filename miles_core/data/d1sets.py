"""Countdown and 4x4 Sudoku in d1's files and prompts (dllm-reasoning/d1).

Files, as d1 ships or reads them:

* Countdown: d1's test file ``dataset/countdown_cd3_test.jsonl`` holds ``{"input": "30,100,93",
  "output": "23"}``; its RL data is ``Jiayi-Pan/Countdown-Tasks-3to4`` with ``nums`` (a list)
  and ``target`` (an int). Both are read.
* Sudoku: ``dataset/4x4_test_sudoku.csv`` and ``4x4_sudoku_unique_puzzles.csv``, columns
  ``Puzzle,Solution``: 16 digits read row by row, ``0`` for an empty cell. d1 reads them as strings
  so leading zeros survive; a Parquet copy with integer cells is zero-padded back.

The prompts are d1's evaluation prompts (``eval/countdown.py`` CTD_SYSTEM_PROMPT, ``eval/sudoku.py``
SUDOKU_SYSTEM_PROMPT), zero-shot. The rewards (rewards/puzzles.py) follow d1's
``eval/parse_and_get_acc.py``. The gold answer travels as JSON (numbers and target; puzzle and
solution) because the checks need both.
"""

from __future__ import annotations

import json

from miles_core.data.arith import Problem
from miles_core.data.public import RowError, need_list, need_str

COUNTDOWN_PROMPT = (
    "Using only the provided numbers, create an arithmetic expression that evaluates to exactly the provided "
    "target number. You may use the operations +, -, *, and / as needed, but each number must be used exactly "
    "once. Think step-by-step. After reasoning, provide only your final expression inside \\boxed{} tags without "
    "including an equals sign or the target number. For example: \\boxed{a + b * c}Respond in the following "
    "format:\n<reasoning>\nYour reasoning here\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>")

SUDOKU_PROMPT = """
Please solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string reading left-to-right, top-to-bottom, where '0' represents empty cells.

Rules:
- Fill empty cells with digits 1-4
- Each row must contain digits 1-4 exactly once
- Each column must contain digits 1-4 exactly once
- Each 2x2 box must contain digits 1-4 exactly once

Important: Your solution must be a COMPLETE 16-character string with only the digits 1-4, representing your final solved grid.

Respond in this exact format:
<reasoning>
Your step-by-step solving process
</reasoning>
<answer>
[16-character solution string with no spaces or separators]
</answer>
"""


def _int(v: object, name: str) -> int:
    if isinstance(v, bool):
        raise RowError(f"field {name!r} must be an integer, got bool")
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v.strip())
    raise RowError(f"field {name!r} must be an integer, got {v!r:.40}")


def parse_countdown(row: dict) -> Problem:
    """A d1 test row (``input``/``output``) or a Countdown-Tasks-3to4 row (``nums``/``target``)."""
    if "input" in row or "output" in row:
        text = need_str(row, "input")
        try:
            nums = [int(x) for x in text.split(",")]
        except ValueError:
            raise RowError(f"field 'input' must be comma-separated integers, got {text[:40]!r}") from None
        target = _int(row.get("output"), "output") if row.get("output") is not None else None
        if target is None:
            raise RowError("missing field 'output'")
    else:
        nums = need_list(row, "nums", int, min_len=2)
        if "target" not in row or row["target"] is None:
            raise RowError("missing field 'target'")
        target = _int(row["target"], "target")
    if len(nums) < 2 or any(n < 0 for n in nums):
        raise RowError(f"countdown needs at least two non-negative numbers, got {nums}")
    prompt = f"{COUNTDOWN_PROMPT}\n\nNumbers: {nums}\nTarget: {target}"
    return Problem(prompt=prompt, target="", answer=json.dumps({"nums": nums, "target": target}),
                   meta={"task": "countdown", "nums": nums, "target": target})


def _grid(v: object, name: str, digits: str) -> str:
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v).zfill(16)  # a Parquet/CSV reader that took the cell for a number dropped leading zeros
    if v is None:
        raise RowError(f"missing field {name!r}")
    if not isinstance(v, str):
        raise RowError(f"field {name!r} must be a 16-digit string, got {type(v).__name__}")
    s = v.strip()
    if len(s) != 16 or any(c not in digits for c in s):
        raise RowError(f"field {name!r} must be 16 characters from {digits!r}, got {s[:20]!r}")
    return s


def valid_solution(grid: str) -> bool:
    """Rows, columns and 2x2 boxes of a 16-digit grid each hold 1-4 exactly once."""
    cells = [[grid[4 * r + c] for c in range(4)] for r in range(4)]
    units = [set(row) for row in cells] + [{cells[r][c] for r in range(4)} for c in range(4)]
    units += [{cells[r + i][c + j] for i in (0, 1) for j in (0, 1)} for r in (0, 2) for c in (0, 2)]
    return all(u == set("1234") for u in units)


def parse_sudoku(row: dict) -> Problem:
    puzzle = _grid(row.get("Puzzle", row.get("puzzle")), "Puzzle", "01234")
    solution = _grid(row.get("Solution", row.get("solution")), "Solution", "1234")
    if any(p != "0" and p != s for p, s in zip(puzzle, solution)):
        raise RowError("field 'Solution' disagrees with a given cell of 'Puzzle'")
    if not valid_solution(solution):
        raise RowError("field 'Solution' is not a valid 4x4 Sudoku grid")
    prompt = f"{SUDOKU_PROMPT}\n\nSolve the following Sudoku puzzle: {puzzle}\n"
    target = f"\n<reasoning>\nFill each empty cell.\n</reasoning>\n<answer>\n{solution}\n</answer>"
    return Problem(prompt=prompt, target=target, answer=json.dumps({"puzzle": puzzle, "solution": solution}),
                   meta={"task": "sudoku", "puzzle": puzzle})
