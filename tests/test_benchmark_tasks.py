"""The field's six benchmarks as tasks, on files the tests write in each public format: rows loaded
and skipped are counted (with line and field), gold answers score 1 and corrupted ones 0,
canonical solutions pass and mutated ones fail, train and test prompts are provably disjoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.sample_files import corrupt_completion, gold_completion, write_samples
from miles_core.config import ConfigError, load_recipe
from miles_core.data.filetask import PARSERS, FileTask, prompt_key
from miles_core.data.public import DataFileError, load_file
from miles_core.data.registry import build_task, check_reward
from miles_core.eval.evaluate import eval_config
from miles_core.rewards.registry import get_reward

TASKS = ("gsm8k", "math", "math500", "countdown", "sudoku", "humaneval", "mbpp")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return write_samples(tmp_path_factory.mktemp("bench"))


def _recipe(task: str, f: dict, *extra: str):
    over = [f"task.name={task}", f"task.test_path={f['test']}", "sandbox.isolation=bwrap_shared", *extra]
    if f["train"]:
        over.append(f"task.path={f['train']}")
    return load_recipe("arith", over)


@pytest.mark.parametrize("task", TASKS)
def test_rows_loaded_and_skipped_are_counted(task: str, files: dict) -> None:
    f = files[task]
    ft = FileTask(task, PARSERS[task], str(f["train"] or ""), str(f["test"]),
                  None if task != "mbpp" else __import__("miles_core.data.filetask", fromlist=["x"])._mbpp_keep)
    rep = ft.test_report
    assert rep.skipped == f["bad"], rep.errors
    assert all(str(f["test"]) in e and ("line " in e or "item " in e) for e in rep.errors)
    assert len(rep.problems) >= 2


def test_error_messages_name_the_line_and_field(files: dict) -> None:
    rep = load_file(str(files["gsm8k"]["test"]), PARSERS["gsm8k"])
    text = "\n".join(rep.errors)
    assert "line 5: missing field 'answer'" in text
    assert "line 6: field 'answer' must be a string, got int" in text
    assert "line 7: expected a JSON object, got list" in text
    assert "line 8: not UTF-8 (byte 0xe9" in text
    assert "line 9: field 'answer' has no '#### <final answer>' marker" in text
    assert "line 10: invalid JSON" in text and "truncated" in text


def test_unusable_files_are_errors_naming_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataFileError, match="empty.jsonl: the file is empty"):
        load_file(str(empty), PARSERS["gsm8k"])
    with pytest.raises(DataFileError, match="missing.jsonl: file not found"):
        load_file(str(tmp_path / "missing.jsonl"), PARSERS["gsm8k"])
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"question": "q"}\n')
    with pytest.raises(DataFileError, match="junk.jsonl: no valid rows .1 skipped.; first problem: .*'answer'"):
        load_file(str(junk), PARSERS["gsm8k"])
    with pytest.raises(ConfigError, match="task.test_path"):
        build_task(load_recipe("arith", ["task.name=gsm8k"]))


@pytest.mark.parametrize("task", TASKS)
def test_gold_scores_one_and_corrupted_zero(task: str, files: dict) -> None:
    cfg = _recipe(task, files[task])
    data = build_task(cfg)
    probs = data.test
    reward = get_reward(check_reward(cfg.task))
    answers = [p.answer for p in probs]
    gold = reward([p.prompt for p in probs], [gold_completion(task, p) for p in probs], answer=answers)
    bad = reward([p.prompt for p in probs], [corrupt_completion(task, p) for p in probs], answer=answers)
    assert gold == [1.0] * len(probs), gold
    assert all(b is not None and b < 1.0 for b in bad), bad
    if task not in ("sudoku", "mbpp"):  # cell and per-assert fractions may be partial
        assert bad == [0.0] * len(probs)


@pytest.mark.parametrize("task", [t for t in TASKS if t != "math500" and t != "sudoku" and t != "humaneval"])
def test_train_and_test_prompts_are_disjoint(task: str, files: dict) -> None:
    data = build_task(_recipe(task, files[task]))
    train = {prompt_key(p.prompt) for p in data.task.train}
    test = {prompt_key(p.prompt) for p in data.test}
    assert train and test and not train & test
    assert not {prompt_key(p.prompt) for p in data.val} & test  # model selection never sees a test problem
    if task == "gsm8k":  # the sample train file repeats two test questions: both dropped, counted
        assert data.task.overlap == 2
    if task == "mbpp":  # one file, cut by the README's task-id ranges
        assert [p.meta["task_id"] for p in data.test] == [11, 12]
        assert [p.meta["task_id"] for p in data.task.train] == [700]


def test_presets_are_recorded_in_the_eval_config(files: dict) -> None:
    ec = eval_config(_recipe("gsm8k", files["gsm8k"], "eval.preset=d1", "task.prompt_template=chat"))
    assert (ec.completion_len, ec.steps, ec.block_size, ec.temperature, ec.remasking) == (256, 128, 32, 0.0,
                                                                                            "low_confidence")
    assert (ec.preset, ec.task, ec.prompt_prefill) == ("d1", "gsm8k", "<reasoning>")
    dare = eval_config(_recipe("sudoku", files["sudoku"], "eval.preset=dare"))
    assert (dare.completion_len, dare.steps) == (256, 256)
    assert ec.fingerprint() != eval_config(_recipe("gsm8k", files["gsm8k"], "eval.preset=d1_512")).fingerprint()
    from flows.params import EvalParams

    p = EvalParams(base_checkpoint="x", tasks="gsm8k,mbpp", data_dir="d", preset="d1", overrides=["eval.seed=3"])
    assert p.recipe_overrides() == ["eval.seed=3", "eval.preset=d1"]


@pytest.mark.parametrize("name", ["gsm8k", "math", "countdown_d1", "sudoku", "mbpp"])
def test_recipes_pair_a_train_source_with_a_test_source(name: str) -> None:
    cfg = load_recipe(name)
    assert cfg.task.path and cfg.task.test_path and cfg.task.prompt_template == "chat"
    assert cfg.eval.preset == "d1" and check_reward(cfg.task) in ("math_verify", "countdown_d1", "sudoku", "code_pass")
    assert (cfg.task.path == cfg.task.test_path) == (name == "mbpp")  # MBPP: one file, cut by task id


def test_math_reads_its_published_folder_of_one_json_per_problem(tmp_path: Path) -> None:
    import json

    from tools.sample_files import MATH_TRAIN

    for i, row in enumerate(MATH_TRAIN):
        d = tmp_path / "MATH" / "train" / row["type"].lower()
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.json").write_text(json.dumps(row))
    (tmp_path / "MATH" / "train" / "bad.json").write_text("[1]")
    rep = load_file(str(tmp_path / "MATH" / "train"), PARSERS["math"])
    assert [p.answer for p in rep.problems] == ["5", "42"] and rep.skipped == 1
    assert rep.errors == [f"{tmp_path / 'MATH' / 'train'}: bad.json: expected a JSON object, got list"]


def test_mbpp_rl_prompts_hide_the_tests_they_are_scored_on(files: dict) -> None:
    """RL on MBPP shows one assert and scores all of them (and challenge_test_list); evaluation
    keeps the paper's protocol. A lookup table of the shown input passes the published protocol
    and fails the hidden one; the reference solution passes both."""
    from miles_core.data.codesets import PROTOCOLS, parse_mbpp, parse_mbpp_hidden
    from miles_core.rewards.code import score_completions
    from miles_core.rewards.jobs import SandboxLimits
    from miles_core.rewards.pool import SandboxPool

    row = {"text": "Write a function to add two numbers.", "code": "def add(a, b):\r\n  return a + b",
           "task_id": 700, "test_setup_code": "",
           "test_list": ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert add(-1, 1) == 0"],
           "challenge_test_list": ["assert add(10**20, 1) == 10**20 + 1"]}
    shown, hidden = parse_mbpp(row), parse_mbpp_hidden(row)
    assert all(t in shown.prompt for t in row["test_list"]) and shown.meta["protocol"] == PROTOCOLS[False]
    assert "add(1, 2)" in hidden.prompt and "add(5, 5)" not in hidden.prompt and "10**20" not in hidden.prompt
    assert hidden.meta["protocol"] == PROTOCOLS[True] and hidden.meta["shown_tests"] == 1
    lookup = "def add(a, b):\n    return {(1, 2): 3, (5, 5): 10, (-1, 1): 0}[(a, b)]\n"
    one_shown = "def add(a, b):\n    return 3\n"
    gold = "def add(a, b):\n    return a + b\n"
    with SandboxPool(1, SandboxLimits(timeout_s=5.0), isolation="bwrap_shared", cache_size=0) as pool:
        got = score_completions([gold, lookup, one_shown, gold, lookup, one_shown],
                                [shown.answer] * 3 + [hidden.answer] * 3, pool=pool)
    published, secret = [s.score for s in got[:3]], [s.score for s in got[3:]]
    assert published[:2] == [1.0, 1.0]           # the classic hack wins under the published protocol
    assert secret[0] == 1.0 and secret[1] < 1.0 and secret[2] < 1.0  # and loses where the tests are hidden
    # the RL split of a built task uses the hidden protocol, the test split the published one
    data = build_task(_recipe("mbpp", files["mbpp"]))
    assert {p.meta["protocol"] for p in data.task.train} == {PROTOCOLS[True]}
    assert {p.meta["protocol"] for p in data.test} == {PROTOCOLS[False]}
