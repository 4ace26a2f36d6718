"""The field's benchmarks as local lm-eval tasks, scored the way ``miles eval`` scores them.

Why generated: lm-eval reads a task from a YAML file, and a local file's path belongs in it
(``dataset_path: json`` with ``data_files``), so :func:`write_task_folder` writes one YAML per
task for the files a user holds, plus a two-line module the YAMLs' ``!function`` entries load
(lm-eval resolves them beside the YAML). ``lm_eval --include_path FOLDER --tasks miles_gsm8k``
then evaluates the same problems offline. Every piece is Miles' own, so the numbers agree by
construction: a row becomes a problem through the task's parser (data/filetask.py, rows it cannot
parse are dropped as ``miles eval`` drops them, MBPP cut to its test range), the prompt is that
problem's, and a completion scores 1 when the task's check reward (rewards/registry.py) gives 1.
Code runs in Miles' kernel sandbox through that reward, never in lm-eval's unsandboxed ``exec``.

``problems``: a JSONL of ``{"prompt", "answer"}`` rows (``"target"`` for a log-likelihood task)
scored by a named reward: how a Miles toy task (arith) is put in front of lm-eval.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from miles_core.data.arith import Problem
from miles_core.data.filetask import PARSERS, SPECS, COUNTDOWN_FILES

BENCHMARKS = ("gsm8k", "math500", "countdown", "sudoku", "humaneval", "mbpp")
CHECK = {s.name: s.check_reward for s in (*SPECS, COUNTDOWN_FILES)}  # task -> the reward pass@1 counts


def parse(task: str, doc: dict) -> Problem:
    """One row as the problem ``miles eval`` would make of it (``problems``: prompt and answer as given)."""
    if task == "problems":
        return Problem(str(doc["prompt"]), str(doc.get("target") or doc["answer"]), str(doc["answer"]))
    return PARSERS[task](doc)


def keeps(task: str, doc: dict) -> bool:
    """Whether ``miles eval`` evaluates this row: it parses, and MBPP's lies in its test range."""
    from miles_core.data import codesets

    try:
        parse(task, doc)
    except (KeyError, TypeError, ValueError):
        return False
    return task != "mbpp" or codesets.mbpp_split(doc) in ("test", "")


def bind(task: str, reward: str | None = None) -> tuple[Callable[..., Any], ...]:
    """(doc_to_text, doc_to_target, process_results) of one task, for its YAML (its rows are
    already the ones ``miles eval`` evaluates: :func:`readable_rows`)."""
    from miles_core.rewards.registry import get_reward

    name = reward or CHECK.get(task)  # a log-likelihood 'problems' task scores no completion

    def doc_to_text(doc: dict) -> str:
        return parse(task, doc).prompt

    def doc_to_target(doc: dict) -> str:
        return parse(task, doc).target

    def process_results(doc: dict, results: list[str]) -> dict[str, float]:
        if name is None:
            raise ValueError(f"lm-eval task {task!r}: no reward to score completions by")
        p = parse(task, doc)
        r = get_reward(name)([p.prompt], [results[0]], answer=[p.answer])[0]
        return {"exact_match": float(r is not None and r >= 1.0)}

    return doc_to_text, doc_to_target, process_results


def readable_rows(task: str, path: str | Path) -> list[dict]:
    """The rows of a benchmark file (any format Miles reads: JSONL, .gz, JSON, CSV, Parquet, a
    MATH folder) that ``miles eval`` evaluates, as plain JSON rows in file order: lm-eval's JSON
    loader then reads exactly those, where a malformed row (bad UTF-8, a missing field) would
    otherwise fail the whole file or be scored as a problem Miles never poses."""
    from miles_core.data.public import DataFileError, LoadReport, iter_rows

    report = LoadReport(str(path))
    rows = [row for _, row in iter_rows(str(path), report) if keeps(task, row)]
    if not rows:
        raise DataFileError(f"lm-eval task {task!r}: {path} holds no row miles eval would evaluate "
                            f"({report.skipped} skipped: {report.errors[:3]})")
    return rows


def _yaml(name: str, task: str, path: Path, kind: str) -> str:
    fn = task
    head = [f"task: {name}", "dataset_path: json",
            "dataset_kwargs:", "  data_files:", f"    test: {json.dumps(str(path))}",
            "test_split: test",
            f"doc_to_text: !function miles_lm_tasks.doc_to_text_{fn}",
            f"doc_to_target: !function miles_lm_tasks.doc_to_target_{fn}", 'target_delimiter: ""',
            'fewshot_delimiter: "\\n\\n"']
    if kind == "loglikelihood":
        body = ["output_type: loglikelihood", "metric_list:", "  - metric: perplexity",
                "    aggregation: perplexity", "    higher_is_better: false", "  - metric: acc",
                "    aggregation: mean", "    higher_is_better: true"]
    else:
        body = ["output_type: generate_until", f"process_results: !function miles_lm_tasks.process_results_{fn}",
                "generation_kwargs:", "  until: []", "  do_sample: false", "metric_list:",
                "  - metric: exact_match", "    aggregation: mean", "    higher_is_better: true"]
    return "\n".join(head + body + ["metadata:", "  version: 1.0", ""])


def write_task_folder(out: str | Path, files: dict[str, str | Path], reward: str | None = None,
                      kind: str = "generate_until", prefix: str = "miles") -> list[str]:
    """Task YAMLs in ``out`` for ``files`` ({task: local file}; a task is one of
    :data:`BENCHMARKS` or ``problems``), named ``PREFIX_TASK``; ``reward``: the ``problems``
    task's reward (the benchmarks use their own check reward); ``kind``: ``generate_until`` or
    ``loglikelihood`` (of each row's target). Returns the task names for ``--tasks``."""
    if kind not in ("generate_until", "loglikelihood"):
        raise ValueError(f"lm-eval task kind {kind!r}: 'generate_until' or 'loglikelihood'")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names, shim = [], ["# written by miles_core.eval.lm_tasks.write_task_folder: the functions the YAMLs name",
                       "from miles_core.eval.lm_tasks import bind", ""]
    for task, path in files.items():
        if task not in (*BENCHMARKS, "problems"):
            raise ValueError(f"lm-eval task {task!r}: Miles writes tasks for {', '.join(BENCHMARKS)} and 'problems'")
        if task == "problems" and not reward and kind == "generate_until":
            raise ValueError("lm-eval task 'problems': name the reward its completions are scored by")
        name = f"{prefix}_{task}"
        fn = task
        rows = readable_rows(task, path)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / f"{name}.yaml").write_text(f"# {len(rows)} rows of {path} that miles eval reads\n" +
                                          _yaml(name, task, out / f"{name}.jsonl", kind))
        shim.append(f"doc_to_text_{fn}, doc_to_target_{fn}, process_results_{fn} = "
                    f"bind({task!r}, {reward if task == 'problems' else None!r})")
        names.append(name)
    (out / "miles_lm_tasks.py").write_text("\n".join(shim) + "\n")
    return names
