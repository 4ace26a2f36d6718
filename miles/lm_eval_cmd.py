"""``miles lm-eval``: a Miles policy through lm-evaluation-harness (``lm_eval.simple_evaluate``).

Why a command of ours: lm-eval's own CLI only knows the models its package lists, so ``--model
miles`` needs Miles' module imported first; this command does that, opens what users hold (a
registered ``models:/NAME@alias``, an adapter folder, a model folder), writes the local task YAMLs
for the benchmark files given with ``--data`` (miles_core/eval/lm_tasks.py), and records Miles'
settings beside lm-eval's results. From Python the same is ``import miles_core.eval.lm_harness``
then ``lm_eval.simple_evaluate(model="miles", model_args={...})``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from miles.commands import UsageError, model_source


def add_parser(sub: Any) -> None:
    p = sub.add_parser("lm-eval", help="evaluate a policy with lm-evaluation-harness (local tasks, sandboxed code)",
                       description="miles lm-eval --model SRC --data gsm8k=FILE ...: lm_eval.simple_evaluate on a "
                                   "Miles policy; SRC is models:/NAME@alias, an adapter folder or a model folder.")
    p.add_argument("--model", required=True, help="models:/NAME@alias, models:/NAME/VERSION, an adapter folder "
                                                   "(adapter_config.json) or a model folder (config.json)")
    p.add_argument("--recipe", default=None, help="the recipe the policy was trained with (name or YAML; a "
                                                  "registered model carries its own)")
    p.add_argument("--base", default=None, help="an adapter's base folder (default: its base_model_name_or_path)")
    p.add_argument("--data", action="append", default=[], metavar="TASK=FILE",
                   help="a benchmark file as a local task miles_TASK (gsm8k, math500, countdown, sudoku, "
                        "humaneval, mbpp, or problems: JSONL of prompt and answer); repeat for several")
    p.add_argument("--reward", default=None, help="the reward a --data problems=FILE (JSONL of prompt, answer) "
                                                  "is scored by, e.g. math_exact")
    p.add_argument("--tasks", default="", help="more lm-eval task names, comma-separated (with --include-path)")
    p.add_argument("--include-path", default=None, help="a folder of lm-eval task YAMLs")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--mc-num", type=int, default=64, help="Monte-Carlo draws per log-likelihood (ELBO)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the ELBO's mask draws")
    p.add_argument("--output", default=None, help="write results + Miles' settings as JSON here")
    p.add_argument("--tracking-uri", default=None, help="MLflow store of a models:/ URI")
    p.set_defaults(func=cmd_lm_eval)


def open_source(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """``pretrained``, ``adapter`` and ``recipe`` of what ``--model`` names (commands.model_source)."""
    src = model_source(args.model, args.base, args.tracking_uri, scratch)
    recipe = args.recipe or src["recipe"]
    if recipe is None:
        raise UsageError(f"--model {args.model}: a folder does not record its recipe; pass --recipe NAME_OR_YAML")
    return {"pretrained": str(src["base_dir"]), "adapter": str(src["adapter_dir"]) if src["adapter_dir"] else None,
            "recipe": recipe}


def cmd_lm_eval(args: argparse.Namespace) -> int:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UsageError("lm-eval is not installed: pip install -c constraints.txt 'miles[lm-eval]'") from None
    from miles_core.eval.lm_harness import MilesLM
    from miles_core.eval.lm_tasks import write_task_folder

    files = {}
    for item in args.data:
        task, sep, path = item.partition("=")
        if not sep:
            raise UsageError(f"--data {item!r}: write TASK=FILE, e.g. --data gsm8k=data/gsm8k/test.jsonl")
        files[task] = path
    with tempfile.TemporaryDirectory(prefix="miles-lm-eval-") as scratch:
        names = [t for t in args.tasks.split(",") if t]
        include = [args.include_path] if args.include_path else []
        if files:
            try:
                names += write_task_folder(Path(scratch) / "tasks", files, reward=args.reward)
            except (ValueError, FileNotFoundError) as e:
                raise UsageError(str(e)) from None
            include.append(str(Path(scratch) / "tasks"))
        if not names:
            raise UsageError("nothing to evaluate: give --data TASK=FILE or --tasks NAMES")
        src = open_source(args, str(Path(scratch) / "model"))
        lm = MilesLM(src["pretrained"], src["recipe"], src["adapter"], batch_size=args.batch_size,
                     mc_num=args.mc_num, seed=args.seed)
        res = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=TaskManager(include_path=include or None),
                                      limit=args.limit, num_fewshot=args.num_fewshot, log_samples=False)
    for task, metrics in res["results"].items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and not k.startswith("alias"))
        print(f"{task}: {shown}")
    if args.output:
        record = {"results": res["results"], "configs": res.get("configs", {}), "miles": lm.settings(),
                  "limit": args.limit, "num_fewshot": args.num_fewshot}
        Path(args.output).write_text(json.dumps(record, indent=1, default=str))
        print(f"wrote {args.output}")
    return 0
