"""HumanEval and MBPP rows as Problems whose answer is the benchmark's own test code.

Formats, as their authors publish them:

* HumanEval (openai/human-eval ``data/HumanEval.jsonl.gz``): ``task_id``, ``prompt`` (imports,
  a signature and its docstring), ``canonical_solution``, ``test`` (``def check(candidate)``),
  ``entry_point``. The harness runs ``prompt + completion + test + check(entry_point)``.
* MBPP (google-research ``mbpp/mbpp.jsonl``; the HF "sanitized" config too): ``text`` (or
  ``prompt``), ``code``, ``task_id``, ``test_list`` (assert lines), ``test_setup_code``,
  ``challenge_test_list`` (harder asserts, scored with the hidden tests), ``test_imports`` (sanitized). Its README fixes the splits by
  task id: 11-510 test, 1-10 few-shot prompts, 511-600 validation, 601-974 train.

Prompts: HumanEval's is DARE's ("Complete the following python code:" and the prompt); MBPP's is
its paper's, the task text followed by its tests, zero-shot, for evaluation (:func:`parse_mbpp`);
RL prompts show one test and score them all (:func:`parse_mbpp_hidden`), so a policy cannot earn
the reward by hard-coding what it was shown. The answer is JSON for
``rewards/code.py``: the tests run in the sandbox's two-process harness (sandbox_tests.py), each
assert of MBPP scored apart, HumanEval's ``check`` as one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles_core.data.arith import Problem
from miles_core.data.public import RowError, need_list, need_str

MBPP_SPLITS = {"test": range(11, 511), "prompt": range(1, 11), "validation": range(511, 601),
               "train": range(601, 975)}
# Completions are hostile and these run in the trainer: every pattern matches in time linear in the
# text (possessive runs, no two quantifiers that can trade the same characters; strip in Python).
_BEGIN = re.compile(r"\[BEGIN\](.*?)(?:\[DONE\]|$)", re.DOTALL)
_ENTRY = re.compile(r"^\s*assert\s+(?:not\s+)?\(?\s*(?:set\(|math\.isclose\()?\s*([A-Za-z_]\w*)\s*\(")


def tests_answer(entry: str, tests: list[str], setup: str = "", prefix: str = "") -> str:
    """The JSON the code reward reads: run ``tests`` (after ``setup``) against ``entry``, defined by
    ``prefix`` + the completion's code."""
    return json.dumps({"kind": "tests", "entry": entry, "tests": tests, "setup": setup, "prefix": prefix})


PYTHON_INFO = frozenset({"", "python", "py", "python3", "py3", "pycon", "ipython"})


def fenced_blocks(text: str) -> list[str]:
    """The Python code blocks of a Markdown text, as models write them: a fence of three or more
    backticks, optionally indented (a list item) with its body dedented by as much, an info word
    that is empty or Python's (``python``, ``py``, ``python3``, any case; other languages are
    skipped), closed by a line of at least as many backticks and nothing else (so backticks inside
    a line, a string, never close it), or by the end of the text. CRLF and CR line ends are read as
    LF. One pass over the lines: linear in the text, whatever it holds."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        body = line.lstrip(" \t")
        i += 1
        if not body.startswith("```"):
            continue
        ticks = len(body) - len(body.lstrip("`"))
        words = body[ticks:].split()
        info = words[0].lower() if words else ""
        indent = len(line) - len(body)
        code = []
        while i < len(lines):
            end = lines[i].strip(" \t")
            i += 1
            if len(end) >= ticks and end == "`" * len(end):
                break
            row = lines[i - 1]
            code.append(row[indent:] if not row[:indent].strip(" \t") else row.lstrip(" \t"))
        if info in PYTHON_INFO and "`" not in info:
            blocks.append("\n".join(code) + "\n")
    return blocks


def extract_code(text: str, entry: str) -> str:
    """The code in a completion, by a stated rule: among its Python fenced blocks
    (:func:`fenced_blocks`), the first that defines ``entry``, else the first; with no block, an
    MBPP ``[BEGIN] ... [DONE]`` span; else the text itself (a base model continuing the prompt)."""
    blocks = fenced_blocks(text)
    if blocks:
        return next((b for b in blocks if re.search(rf"def\s+{re.escape(entry)}\s*\(", b)), blocks[0])
    m = _BEGIN.search(text)
    return m.group(1).strip() if m else text


_FUTURE = re.compile(r"^from[ \t]++__future__[ \t]++import[^\n]*+\n?", re.MULTILINE)


def program(spec: dict[str, Any], completion: str) -> str:
    """What the sandbox's program process runs: the prompt's code, then the completion's. A
    completion that writes the whole function redefines the prompt's stub; one that continues the
    prompt (HumanEval's base-model convention) supplies the body. The completion's ``from
    __future__`` imports go first, where Python requires them."""
    code = extract_code(completion, spec["entry"])
    prefix = spec.get("prefix", "")
    futures = "".join(m if m.endswith("\n") else m + "\n" for m in _FUTURE.findall(code))
    if futures:
        code = _FUTURE.sub("", code)
    if re.search(rf"^[ \t]*+def\s+{re.escape(spec['entry'])}\s*\(", code, re.MULTILINE):
        return futures + prefix + "\n" + code
    return futures + prefix + code


def parse_humaneval(row: dict) -> Problem:
    task_id, prompt = need_str(row, "task_id"), need_str(row, "prompt")
    solution, test, entry = need_str(row, "canonical_solution"), need_str(row, "test"), need_str(row, "entry_point")
    if not entry.isidentifier():
        raise RowError(f"field 'entry_point' must be a Python identifier, got {entry[:40]!r}")
    if "def check" not in test:
        raise RowError("field 'test' defines no check(candidate) function")
    answer = tests_answer(entry, [f"{test}\n\ncheck({entry})\n"], setup=prompt, prefix=prompt)
    return Problem(prompt=f"Complete the following python code:\n{prompt}", target=solution, answer=answer,
                   meta={"task": "humaneval", "task_id": task_id, "entry_point": entry})


def mbpp_split(row: dict) -> str:
    """Which MBPP split a row's task id belongs to (README), or '' when it has none."""
    tid = row.get("task_id")
    if isinstance(tid, int) and not isinstance(tid, bool):
        return next((name for name, ids in MBPP_SPLITS.items() if tid in ids), "")
    return ""


def parse_mbpp(row: dict) -> Problem:
    """An MBPP row under the benchmark's published protocol (evaluation): the prompt lists the
    three asserts it is scored on, as the MBPP paper's prompt does."""
    return _mbpp(row, hidden=False)


def parse_mbpp_hidden(row: dict) -> Problem:
    """An MBPP row for RL: the prompt shows the first assert only, and the reward scores every
    assert plus ``challenge_test_list``. Under the published protocol a lookup table of the three
    shown inputs scores 1.0, the classic reward hack of this benchmark; here it fails the hidden
    asserts."""
    return _mbpp(row, hidden=True)


PROTOCOLS = {False: "published: the prompt lists the asserts it is scored on (MBPP paper)",
             True: "hidden: the prompt shows the first assert; all asserts and challenge_test_list are scored"}


def _mbpp(row: dict, hidden: bool) -> Problem:
    text = need_str(row, "text" if "text" in row or "prompt" not in row else "prompt")
    code = need_str(row, "code")
    tests = need_list(row, "test_list", str)
    if any(not t.strip() for t in tests):
        raise RowError("field 'test_list' holds an empty test")
    challenge = need_list(row, "challenge_test_list", str) if row.get("challenge_test_list") else []
    m = _ENTRY.match(tests[0])
    if not m:
        raise RowError(f"field 'test_list': cannot find the function the first test calls ({tests[0][:50]!r})")
    setup = row.get("test_setup_code") or ""
    if not isinstance(setup, str):
        raise RowError(f"field 'test_setup_code' must be a string, got {type(setup).__name__}")
    imports = row.get("test_imports") or []
    if not isinstance(imports, list) or not all(isinstance(x, str) for x in imports):
        raise RowError("field 'test_imports' must be a list of strings")
    head = "\n".join(imports)
    if hidden:
        shown, scored = tests[:1], tests + [t for t in challenge if t.strip()]
        ask = "Your code should pass this test, and others like it"
    else:
        shown, scored, ask = tests, tests, "Your code should pass these tests"
    listed = "\n".join(shown)
    prompt = f"You are an expert Python programmer, and here is your task: {text.strip()} {ask}:\n\n{listed}\n"
    answer = tests_answer(m.group(1), scored, setup=f"{head}\n{setup}".strip() + "\n", prefix=head + "\n" if head else "")
    return Problem(prompt=prompt, target=code.replace("\r\n", "\n"), answer=answer,
                   meta={"task": "mbpp", "task_id": row.get("task_id"), "entry_point": m.group(1),
                         "protocol": PROTOCOLS[hidden], "shown_tests": len(shown)})
