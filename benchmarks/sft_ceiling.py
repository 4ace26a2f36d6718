"""What would more labels buy? SFT on the scarce demonstrations vs on every non-test problem.

The learning benchmark asks whether RL on fresh verifier-checked prompts teaches the model more
than its scarce labelled set did. Before reading its gain, this measures the most any method could
get from *more data* at this model size and step budget: the same recipe's SFT trained once on the
recipe's ``task.num_train`` demonstrations and once on (nearly) every labelled problem outside the
held-out bucket, same steps, same seed, both evaluated on the same held-out problems.
If the two land together, the model and its training budget (not the data) limit the task, and no
amount of fresh prompts, RL's or anyone's, can add much at this size.

Each arm runs in its own process with one torch thread (the two use the two cores).
Writes benchmarks/results/sft_ceiling.json. Run: python -m benchmarks.sft_ceiling [--set KEY=VALUE]
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.harness import bench_args, finish, over_seeds, workdir

DEFAULT_OVERRIDES = ["sft.steps=4000"]


def largest_train_split(task, start: int, exclude: list[str], cap: int = 100_000) -> list:
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


def run_arm(all_labels: bool, recipe: str, overrides: list[str], out: str) -> dict:
    from miles_core.config import load_recipe
    from miles_core.models.base import load_checkpoint
    from miles_core.data.registry import build_task
    from miles_core.eval.evaluate import run_eval
    from miles_core.learner.baseline import train_baseline

    cfg = load_recipe(recipe, overrides)
    data = build_task(cfg)
    if all_labels:  # where validation is not its own bucket (code), its prompts are kept out
        data.train = largest_train_split(data.task, cfg.task.num_train, [p.prompt for p in data.val])
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
            "curve": curve, "seconds": seconds}


def main() -> None:
    ap = bench_args(__doc__, workdir=True)
    ap.add_argument("--recipe", default="arith")
    args = ap.parse_args()
    overrides = DEFAULT_OVERRIDES + args.set
    t0 = time.perf_counter()
    scarce, full = over_seeds(run_arm, [False, True], args.recipe, overrides, str(workdir(args, "ceiling")))
    rows = [[a["num_train"], a["best_val_pass1"], a["test_pass1"], f"{a['seconds']:.0f}"] for a in (scarce, full)]
    payload = {"recipe": args.recipe, "overrides": overrides, "scarce": scarce, "all_labels": full,
               "test_gain_from_all_labels": full["test_pass1"] - scarce["test_pass1"],
               "seconds": time.perf_counter() - t0}
    print(f"all labels - scarce labels = {payload['test_gain_from_all_labels']:+.3f} test pass@1")
    finish("sft_ceiling", payload, rows, ["labelled problems", "best val pass@1", "test pass@1", "seconds"], args.out)


if __name__ == "__main__":
    main()
