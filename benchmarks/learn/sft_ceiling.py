"""What would more labels buy? SFT on the scarce demonstrations vs on every non-test problem.

The learning benchmark asks whether RL on fresh verifier-checked prompts teaches the model more
than its scarce labelled set did. Before reading its gain, this measures the most any method could
get from *more data* at this model size and step budget: the same recipe's SFT trained once on the
recipe's ``task.num_train`` demonstrations and once on (nearly) every labelled problem outside the
held-out bucket, same steps, same seed, both evaluated on the same held-out problems.
If the two land together, the model and its training budget (not the data) limit the task, and no
amount of fresh prompts, RL's or anyone's, can add much at this size.

Each arm runs in its own process with one torch thread (the two use the two cores).
``--smoke``: both arms for 3 SFT steps, the larger set capped at 2000 problems, 8 problems
evaluated (seconds; not a figure).
Writes benchmarks/results/sft_ceiling.json. Run: python -m benchmarks.sft_ceiling [--set KEY=VALUE] [--smoke]
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.harness import bench_args, finish, over_seeds, workdir

DEFAULT_OVERRIDES = ["sft.steps=4000"]
MAX_LABELS = 100_000  # the all-labels arm's cap (largest_train_split)
# --smoke: the same two arms at tiny sizes; one validation at the last step, so each arm has a curve.
# Finding the largest split by bisection is most of a smoke run's time uncapped (~30 s): 2000 caps it.
SMOKE_SET = ["sft.steps=3", "sft.eval_every=3", "task.num_val=8", "task.num_test=8", "eval.num_problems=8"]
SMOKE_MAX_LABELS = 2000


def largest_train_split(task, start: int, exclude: list[str], cap: int = MAX_LABELS) -> list:
    """The most distinct train-bucket problems the task's space can supply (doubling, then
    bisecting; at most ``cap``), none of them in ``exclude`` (the validation prompts)."""
    def fits(n: int) -> bool:
        try:
            task.split("train", n, seed=0, exclude=exclude)
            return True
        except ValueError:
            return False

    lo = start
    while lo * 2 <= cap and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, cap + 1)
    while hi - lo > 50:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return task.split("train", lo, seed=0, exclude=exclude)


def run_arm(all_labels: bool, recipe: str, overrides: list[str], out: str, cap: int = MAX_LABELS) -> dict:
    from miles_core.config import load_recipe
    from miles_core.models.base import load_checkpoint
    from miles_core.data.registry import build_task
    from miles_core.eval.evaluate import run_eval
    from miles_core.learner.baseline import train_baseline

    cfg = load_recipe(recipe, overrides)
    data = build_task(cfg)
    if all_labels:  # where validation is not its own bucket (code), its prompts are kept out
        data.train = largest_train_split(data.task, cfg.task.num_train, [p.prompt for p in data.val], cap)
    curve: list[dict] = []

    def on_eval(step: int, pass1: float, stats: dict) -> None:  # no patience: both arms get the same steps
        curve.append({"step": step, "val_pass1": pass1, "loss": stats["loss"]})
        print(f"[{len(data.train)} demos] step {step} val pass@1 {pass1:.3f} loss {stats['loss']:.3f}", flush=True)

    t0 = time.perf_counter()
    ckpt = Path(out) / ("sft-all" if all_labels else "sft-scarce")
    train_baseline(cfg, data, ckpt, on_eval=on_eval)
    seconds = time.perf_counter() - t0
    model, tok = load_checkpoint(ckpt)
    test = run_eval(model, tok, cfg, data).pass_at["pass@1"]
    return {"num_train": len(data.train), "test_pass1": test, "best_val_pass1": max(c["val_pass1"] for c in curve),
            "curve": curve, "steps": curve[-1]["step"], "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, workdir=True)
    ap.add_argument("--recipe", default="arith")
    ap.add_argument("--max-labels", type=int, default=MAX_LABELS, help="cap on the all-labels arm's problems")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(set=SMOKE_SET + args.set, max_labels=SMOKE_MAX_LABELS)
    overrides = DEFAULT_OVERRIDES + args.set
    t0 = time.perf_counter()
    scarce, full = over_seeds(run_arm, [False, True], args.recipe, overrides, str(workdir(args, "ceiling")),
                              args.max_labels)
    rows = [[a["num_train"], a["best_val_pass1"], a["test_pass1"], f"{a['seconds']:.0f}"] for a in (scarce, full)]
    payload = {"recipe": args.recipe, "overrides": overrides, "scarce": scarce, "all_labels": full,
               "test_gain_from_all_labels": full["test_pass1"] - scarce["test_pass1"],
               # the arms differ only in data: an all-labels arm no larger than the scarce one compared nothing
               "extra_labels": full["num_train"] - scarce["num_train"],
               "seconds": time.perf_counter() - t0, "smoke": args.smoke}
    print(f"all labels - scarce labels = {payload['test_gain_from_all_labels']:+.3f} test pass@1")
    finish("sft_ceiling", payload, rows, ["labelled problems", "best val pass@1", "test pass@1", "seconds"], args.out,
           positive=["extra_labels", *(f"{arm}.{k}" for arm in ("scarce", "all_labels") for k in ("num_train", "steps", "seconds"))],
           present=["test_gain_from_all_labels", "scarce.test_pass1", "all_labels.test_pass1"])


if __name__ == "__main__":
    main()
