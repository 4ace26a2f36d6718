"""The field's benchmarks as tasks: problems from files (``task.path`` for SFT demonstrations and
RL prompts, ``task.test_path`` for evaluation), never downloaded at run time.

Why the splits come from two files and are de-duplicated: results are reported on a benchmark's
test file, and RL must never see one of its problems. Every train row whose prompt (hashed after
whitespace normalisation, :func:`prompt_key`) is also a test prompt is dropped and counted
(``FileTask.overlap``); :meth:`FileTask.split` keeps file order for the test split, so "the first
500" means what it means in the authors' evaluations. MBPP's single file is cut by its README's
task-id ranges (data/codesets.py). Bad rows are skipped and counted (data/public.py).
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable, Iterable

from miles_core.config import ConfigError, TaskConfig
from miles_core.data import codesets, d1sets, mathsets
from miles_core.data.arith import Problem
from miles_core.data.public import DataFileError, LoadReport, load_file
from miles_core.data.spec import TaskSpec

Parse = Callable[[dict], Problem]
Keep = Callable[[str, dict], bool]  # (split, raw row) -> does the row belong to that split's file part


def prompt_key(prompt: str) -> str:
    """Hash of a prompt with whitespace normalised: equal keys mean the same problem."""
    return hashlib.sha256(" ".join(prompt.split()).encode()).hexdigest()


class FileTask:
    """Problems from a train file and a test file (module docstring)."""

    def __init__(self, name: str, parse: Parse, train_uri: str, test_uri: str, keep: Keep | None = None,
                 parse_train: Parse | None = None) -> None:
        """``parse_train``: how train rows (SFT and RL prompts) become problems when that differs
        from evaluation's ``parse`` (MBPP's hidden tests); de-duplication always compares the
        prompts ``parse`` makes, so a test problem is found in the train file either way."""
        self.name = name
        self.test_report = self._load(test_uri, parse, keep, "test", "task.test_path")
        self.train_report = self._load(train_uri, parse_train or parse, keep, "train", "task.path",
                                       parse) if train_uri else None
        test_keys = {prompt_key(p.prompt) for p in self.test_report.problems}
        train = self.train_report.problems if self.train_report else []
        self.train = [p for p in train if p.meta.pop("dedup_key") not in test_keys]
        self.overlap = len(train) - len(self.train)  # train rows dropped because they are test problems
        self.test = self.test_report.problems

    @staticmethod
    def _load(uri: str, parse: Parse, keep: Keep | None, split: str, field: str,
              key_parse: Parse | None = None) -> LoadReport:
        def parse_kept(row: dict) -> Problem:
            p = parse(row)
            p.meta["in_split"] = keep is None or keep(split, row)
            if key_parse is not None:  # the prompt evaluation would show, for de-duplication
                p.meta["dedup_key"] = prompt_key((key_parse(row) if key_parse is not parse else p).prompt)
            return p
        try:
            report = load_file(uri, parse_kept)
        except DataFileError as e:
            raise ConfigError(f"{field}: {e}") from None
        report.problems = [p for p in report.problems if p.meta.pop("in_split")]
        if not report.problems:
            raise ConfigError(f"{field}: {uri} holds no rows of the {split} split")
        return report

    def canonical_prompt(self, prompt: str) -> str:
        return prompt.strip()

    def sample(self, rng: random.Random, split: str = "rl") -> Problem:
        """One RL (or train) prompt; the test file is never sampled."""
        if split == "test":
            return rng.choice(self.test)
        if not self.train:
            raise ConfigError(f"task.path: the {self.name} task has no training file (or every row was a "
                              "test problem); set task.path to the train split for SFT and RL")
        return rng.choice(self.train)

    def split(self, name: str, n: int, seed: int, exclude: Iterable[str] = ()) -> list[Problem]:
        """Up to ``n`` problems of ``name`` ("test": the test file; "train": rows with an SFT target;
        "rl": any train row), minus ``exclude``; file order for seed 0, else shuffled by seed."""
        skip = {self.canonical_prompt(p) for p in exclude}
        pool = {"test": self.test, "train": [p for p in self.train if p.target],
                "rl": self.train}.get(name)
        if pool is None:
            raise ValueError(f"FileTask.split: unknown split {name!r}; allowed: test, train, rl")
        pool = [p for p in pool if self.canonical_prompt(p.prompt) not in skip]
        if seed:
            pool = pool[:]
            random.Random(f"miles-{self.name}:{name}:{seed}").shuffle(pool)
        if n and not pool and name == "test":  # the registry then takes val from RL prompts instead
            raise ValueError(f"the {self.name} test split has no problems left")
        return pool[:n]

    def summary(self) -> dict:
        return {"test": self.test_report.summary(),
                "train": self.train_report.summary() if self.train_report else None, "train_test_overlap": self.overlap}


def _mbpp_keep(split: str, row: dict) -> bool:
    part = codesets.mbpp_split(row)
    return part in ("test", "") if split == "test" else part not in ("test", "prompt")


def _build(name: str, parse: Parse, keep: Keep | None = None,
           parse_train: Parse | None = None) -> Callable[[TaskConfig], tuple[FileTask, int]]:
    def build(t: TaskConfig) -> tuple[FileTask, int]:
        if not t.test_path:
            raise ConfigError(f"task.test_path: the {name} task reads its problems from files; set task.test_path "
                              f"(and task.path for SFT/RL), e.g. --set task.test_path=data/{name}/test.jsonl")
        return FileTask(name, parse, t.path, t.test_path, keep, parse_train), 1
    return build


def file_spec(name: str, parse: Parse, check_reward: str, keep: Keep | None = None,
              parse_train: Parse | None = None) -> TaskSpec:
    return TaskSpec(name, _build(name, parse, keep, parse_train), lambda p: p.strip(), check_reward)


SPECS = (file_spec("gsm8k", mathsets.parse_gsm8k, "math_verify"),
         file_spec("math", mathsets.parse_math, "math_verify"),
         file_spec("math500", mathsets.parse_math, "math_verify"),
         file_spec("sudoku", d1sets.parse_sudoku, "sudoku"),
         file_spec("humaneval", codesets.parse_humaneval, "code_pass"),
         file_spec("mbpp", codesets.parse_mbpp, "code_pass", _mbpp_keep, codesets.parse_mbpp_hidden))
COUNTDOWN_FILES = file_spec("countdown", d1sets.parse_countdown, "countdown_d1")  # task.test_path set
PARSERS: dict[str, Parse] = {s.name: p for s, p in zip(SPECS, (mathsets.parse_gsm8k, mathsets.parse_math,
                                                                mathsets.parse_math, d1sets.parse_sudoku,
                                                                codesets.parse_humaneval, codesets.parse_mbpp))}
PARSERS["countdown"] = d1sets.parse_countdown
