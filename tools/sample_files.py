"""Small files in each benchmark's public format, written by the tests and benchmarks.tasks (nothing
here downloads a dataset). Each holds a few hand-written problems in the authors' exact fields, plus
the malformed rows a real file can hold (missing fields, wrong types, empty answers, bytes that are
not UTF-8, a truncated last line). ``gold_completion`` writes a completion that must score 1 and
``corrupt_completion`` one that must score 0."""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import re
from pathlib import Path

from miles_core.data.arith import Problem

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "A shop sells 1,250 pens a week. How many pens does it sell in 4 weeks?",
     "answer": "1,250 * 4 = <<1250*4=5000>>5,000\n#### 5,000"},
    {"question": "Tom has $3.50 and spends $1.25. How much money does he have left?",
     "answer": "3.50 - 1.25 = <<3.50-1.25=2.25>>2.25\n#### 2.25"},
    {"question": "The temperature was 4 degrees and fell by 10 degrees. What is it now?",
     "answer": "4 - 10 = -6\n#### -6"},
]
MATH = [
    {"problem": "Compute $\\dfrac{3}{6}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}",
     "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$.", "answer": "2\\sqrt{2}",
     "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"},
    {"problem": "Solve $1 < x \\le 2$ as an interval.", "solution": "$\\boxed{(1,2]}$", "answer": "(1,2]",
     "subject": "Algebra", "level": 2, "unique_id": "test/algebra/3.json"},
    {"problem": "Convert $(0,3)$ to polar coordinates.", "solution": "$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "What percent of 200 is 50?", "solution": "$\\boxed{25\\%}$", "answer": "25\\%",
     "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/5.json"},
]
MATH_TRAIN = [  # hendrycks/math: no answer field, the answer is the solution's last box
    {"problem": "What is $2+3$?", "level": "Level 1", "type": "Prealgebra", "solution": "$2+3=\\boxed{5}$."},
    {"problem": "Compute $7 \\cdot 6$.", "level": "Level 1", "type": "Prealgebra",
     "solution": "We get $\\boxed{42}$."},
]
COUNTDOWN = [{"input": "30,100,93", "output": "23"}, {"input": "83,18,75", "output": "10"},
             {"input": "4,5,6", "output": "26"}, {"input": "2,3,4", "output": "5"}]
COUNTDOWN_TRAIN = [{"nums": [3, 7, 9], "target": 30}, {"nums": [6, 8, 2], "target": 46}]
SUDOKU = [("3102200002100320", "3142243142131324"), ("0140432014020000", "2143432114323214"),
          ("1200340021000000", "1243341221344321")]
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": "from typing import List\n\n\ndef has_close_elements(numbers: List[float], "
     "threshold: float) -> bool:\n    \"\"\" Check if in given list of numbers, are any two numbers closer to each "
     "other than\n    given threshold.\n    \"\"\"\n", "entry_point": "has_close_elements",
     "canonical_solution": "    for idx, elem in enumerate(numbers):\n        for idx2, elem2 in enumerate(numbers):\n"
     "            if idx != idx2:\n                distance = abs(elem - elem2)\n                if distance < "
     "threshold:\n                    return True\n\n    return False\n",
     "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\ndef check(candidate):\n"
     "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
     "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False\n"
     "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True\n"},
    {"task_id": "HumanEval/38", "prompt": "def encode_cyclic(s: str):\n    groups = [s[(3 * i):min((3 * i + 3), "
     "len(s))] for i in range((len(s) + 2) // 3)]\n    groups = [(group[1:] + group[0]) if len(group) == 3 else group "
     "for group in groups]\n    return \"\".join(groups)\n\n\ndef decode_cyclic(s: str):\n    \"\"\"\n    takes as "
     "input string encoded with encode_cyclic function. Returns decoded string.\n    \"\"\"\n",
     "entry_point": "decode_cyclic", "canonical_solution": "    return encode_cyclic(encode_cyclic(s))\n",
     "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    from random import Random\n    rng = Random(42)\n"
     "    import string\n    for _ in range(20):\n        str = ''.join(rng.choice(string.ascii_lowercase) for _ in "
     "range(rng.randint(10, 20)))\n        encoded_str = encode_cyclic(str)\n        assert candidate(encoded_str) "
     "== str\n"},
    {"task_id": "HumanEval/2", "prompt": "\n\ndef truncate_number(number: float) -> float:\n    \"\"\" Return the "
     "decimal part of the number.\n    >>> truncate_number(3.5)\n    0.5\n    \"\"\"\n",
     "entry_point": "truncate_number", "canonical_solution": "    return number % 1.0\n",
     "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(3.5) == 0.5\n"
     "    assert abs(candidate(1.33) - 0.33) < 1e-6\n    assert abs(candidate(123.456) - 0.456) < 1e-6\n"},
]
MBPP = [
    {"text": "Write a function to find the similar elements from the given two tuple lists.",
     "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n"
             "  return (res) ", "task_id": 2, "test_setup_code": "",
     "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                   "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)",
                   "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)"],
     "challenge_test_list": []},
    {"text": "Write a python function to identify non-prime numbers.",
     "code": "import math\r\ndef is_not_prime(n):\r\n    result = False\r\n    for i in range(2,int(math.sqrt(n)) + 1):"
             "\r\n        if n % i == 0:\r\n            result = True\r\n    return result",
     "task_id": 11, "test_setup_code": "", "test_list": ["assert is_not_prime(2) == False",
                                                         "assert is_not_prime(10) == True",
                                                         "assert is_not_prime(35) == True"],
     "challenge_test_list": []},
    {"text": "Write a function to find the n largest integers from a given list of numbers.",
     "code": "import heapq as hq\r\ndef heap_queue_largest(nums,n):\r\n  largest_nums = hq.nlargest(n, nums)\r\n"
             "  return largest_nums", "task_id": 12, "test_setup_code": "",
     "test_list": ["assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65] ",
                   "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],2)==[85, 75] "],
     "challenge_test_list": []},
    {"text": "Write a function to add two numbers.", "code": "def add_two(a, b):\r\n  return a + b",
     "task_id": 700, "test_setup_code": "", "test_list": ["assert add_two(1, 2) == 3"], "challenge_test_list": []},
]
BAD_JSONL = [b'{"question": "no answer here"}', b'{"answer": 5, "question": "typed"}', b'[1, 2, 3]',
             b'{"question": "caf\xe9", "answer": "#### 1"}']
TRUNCATED = b'{"question": "cut off", "ans'


def _jsonl(path: Path, rows: list[dict], bad: list[bytes], gz: bool = False) -> Path:
    data = b"\n".join([json.dumps(r).encode() for r in rows] + bad + [TRUNCATED])
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def write_samples(root: Path) -> dict[str, dict]:
    """Every task's sample files under ``root``: ``{task: {"test": path, "train": path|None, "bad": n}}``,
    where ``bad`` is the number of malformed rows each test file holds on purpose. Test files are
    named as ``miles eval --data-dir`` looks for them (TASK.jsonl, sudoku.csv, humaneval.jsonl.gz)."""
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    bad_math = [b'{"problem": "no answer", "solution": "none"}', b'{"problem": "", "answer": "1"}',
                b'{"problem": "typed", "answer": 3}', b'\xff\xfe not utf-8']
    out["gsm8k"] = {"test": _jsonl(root / "gsm8k.jsonl", GSM8K, BAD_JSONL + [b'{"question": "q", "answer": "no marker"}']),
                    "train": _jsonl(root / "gsm8k_train.jsonl", GSM8K[:2] + [
                        {"question": "What is 6 times 7?", "answer": "6*7=42\n#### 42"}], []), "bad": 6}
    out["math500"] = {"test": _jsonl(root / "math500.jsonl", MATH, bad_math), "train": None, "bad": 5}
    out["math"] = {"test": _jsonl(root / "math.jsonl", MATH, bad_math),
                   "train": _jsonl(root / "math_train.jsonl", MATH_TRAIN, []), "bad": 5}
    out["countdown"] = {"test": _jsonl(root / "countdown.jsonl", COUNTDOWN, [
        b'{"input": "1,x,3", "output": "4"}', b'{"input": "1,2,3"}', b'{"nums": [1, 2], "target": "big"}']),
        "train": _jsonl(root / "countdown_train.jsonl", COUNTDOWN_TRAIN, []), "bad": 4}
    sud = root / "sudoku.csv"
    with open(sud, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Puzzle", "Solution"])
        w.writerows(SUDOKU)
        w.writerows([("310220000210032", "3142243142131324"), ("3102200002100320", "3142243142131323"),
                     ("3102200002100320", "3142243142131342"), ("only one column",)])
    out["sudoku"] = {"test": sud, "train": None, "bad": 4}
    out["humaneval"] = {"test": _jsonl(root / "humaneval.jsonl.gz", HUMANEVAL, [
        b'{"task_id": "HumanEval/9", "prompt": "def f():\\n", "test": "", "entry_point": "f", "canonical_solution": "x"}',
        b'{"task_id": "HumanEval/10", "prompt": "def f():\\n", "test": "def check(c): pass", "entry_point": "not valid",'
        b' "canonical_solution": "x"}'], gz=True), "train": None, "bad": 3}
    out["mbpp"] = {"test": _jsonl(root / "mbpp.jsonl", MBPP, [
        b'{"text": "t", "code": "c", "task_id": 13, "test_list": []}',
        b'{"text": "t", "code": "c", "task_id": 14, "test_list": "assert x"}']),
        "train": root / "mbpp.jsonl", "bad": 3}
    return out


def _countdown_solution(nums: list[int], target: int) -> str | None:
    """A valid expression by brute force (left-nested, every order and operator)."""
    for perm in itertools.permutations(nums):
        for ops in itertools.product("+-*/", repeat=len(nums) - 1):
            expr = str(perm[0])
            for op, n in zip(ops, perm[1:]):
                expr = f"({expr}{op}{n})"
            try:
                if abs(eval(expr) - target) < 1e-9:  # noqa: S307 - our own digits and operators
                    return expr
            except ZeroDivisionError:
                continue
    return None


def gold_completion(task: str, p: Problem) -> str:
    """A completion that states the right answer in the format the task's prompt asks for."""
    if task in ("gsm8k", "math", "math500"):
        return f"\nThe work.\n</reasoning>\n<answer>\n\\boxed{{{p.answer}}}\n</answer>"
    if task == "countdown":
        g = json.loads(p.answer)
        return f"<reasoning>search</reasoning>\n<answer>\n\\boxed{{{_countdown_solution(g['nums'], g['target'])}}}\n</answer>"
    if task == "sudoku":
        return f"<reasoning>fill</reasoning>\n<answer>\n{json.loads(p.answer)['solution']}\n</answer>"
    return f"```python\n{p.meta.get('prompt_code', '')}{p.target}\n```" if task == "humaneval" else f"```python\n{p.target}\n```"


def corrupt_completion(task: str, p: Problem) -> str:
    """The gold completion with its answer broken (a digit changed, a cell changed, code mutated)."""
    gold = gold_completion(task, p)
    if task in ("gsm8k", "math", "math500"):
        inner = p.answer
        m = list(re.finditer(r"\d", inner))
        bad = (inner[:m[-1].start()] + str((int(m[-1].group()) + 1) % 10) + inner[m[-1].end():]) if m else inner + "x"
        return gold.replace(f"\\boxed{{{inner}}}", f"\\boxed{{{bad}}}")
    if task == "countdown":
        return gold.replace("+", "-", 1) if "+" in gold else gold.replace("*", "+", 1)
    if task == "sudoku":
        g = json.loads(p.answer)
        i = g["puzzle"].index("0")
        wrong = g["solution"][:i] + str(int(g["solution"][i]) % 4 + 1) + g["solution"][i + 1:]
        return gold.replace(g["solution"], wrong)
    return gold.replace("return ", "return None and ", 1) if "return " in gold else gold + "\nraise ValueError\n"
