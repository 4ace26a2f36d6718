"""What step merging costs in learning: ADPO with ``estimators.adpo.step_merge`` = s for several s, side by
side from one SFT checkpoint (the arith recipe: static rollouts of K = 8 steps).

s = 1 is exact ADPO. s > 1 is TraceRL's shrinkage (arXiv:2509.06949): s consecutive steps are
scored as one state, s times fewer update forwards, the ratio against the proximal policy. Each
arm trains the same number of iterations on its own rollouts (same seed and count); the table
gives final pass@1 on the held-out problems, update FLOPs (torch.utils.flop_counter) and seconds.
One seed per arm by default: the binomial SE of pass@1 on 500 problems alone is ~2 points.
The SFT checkpoint (seed 0) is ``--checkpoint DIR``'s, trained there when absent.
``--smoke``: s = 1 and 2 from a 3-step SFT, 2 iterations, 8 problems (seconds; not a figure).
Run: python -m benchmarks.step_merge [--merges 1 2 4] [--seeds 0] [--checkpoint DIR] [--smoke]
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.harness import bench_args, finish, over_seeds, sft_checkpoint, train_arm, workdir
from miles_core.config import load_recipe

# --smoke: the same arms at tiny sizes. Every row is kept in the update (no reward spread is needed
# for a 3-step SFT policy to be updated), so each arm's update FLOPs measure a real update.
SMOKE_SET = ["sft.steps=3", "task.num_test=8", "eval.num_problems=8", "train.prompts_per_iter=4", "train.group_size=4",
             "update.skip_zero_variance=false"]
SMOKE = {"merges": [1, 2], "iterations": 2, "seeds": [0]}


def _job(job: tuple, overrides: list[str], ckpt: str, iterations: int) -> dict:
    """One (s, seed) training run (``over_seeds`` runs them two at a time, one torch thread each)."""
    s, seed = job
    cfg = load_recipe("arith", [*overrides, f"estimators.adpo.step_merge={s}", f"train.seed={seed}",  # the seed: LoRA init, prompts, noise
                                f"train.iterations={iterations}"])
    return {"s": s, "seed": seed, **train_arm(cfg, Path(ckpt))}


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0,), checkpoint=True, workdir=True)
    ap.add_argument("--merges", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iterations", type=int, default=None, help="default: the recipe's train.iterations")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE, set=SMOKE_SET + args.set)
    t_all = time.perf_counter()
    cfg = load_recipe("arith", args.set)
    sft = sft_checkpoint(cfg, 0, workdir(args, "merge"), args.checkpoint, validate=False)
    iters = args.iterations or cfg.train.iterations
    runs = over_seeds(_job, [(s, seed) for s in args.merges for seed in args.seeds], args.set, sft["path"], iters)
    rows = []
    for s in args.merges:
        mine = [r for r in runs if r["s"] == s]
        n = len(mine)
        rows.append({"s": s, "pass1": sum(r["pass1"] for r in mine) / n,
                     "update_gflop": sum(r["update_flops"] for r in mine) / n / 1e9,
                     "sample_gflop": sum(r["sample_flops"] for r in mine) / n / 1e9,
                     "seconds": sum(r["seconds"] for r in mine) / n,
                     "completions": sum(r["completions"] for r in mine) / n, "per_seed": mine})
    payload = {"rows": rows, "iterations": iters, "seeds": args.seeds,
               "seconds": time.perf_counter() - t_all, "smoke": args.smoke,
               "sft_checkpoint": {k: v for k, v in sft.items() if k != "curve"}}
    finish("step_merge", payload, [[r["s"], r["pass1"], r["update_gflop"], r["sample_gflop"], r["seconds"]] for r in rows],
           ["s", "final pass@1", "update GFLOP", "sample GFLOP", "train s"], args.out,
           positive=["rows.*.update_gflop", "rows.*.sample_gflop", "rows.*.seconds", "rows.*.completions"],
           present=["rows.*.pass1"])


if __name__ == "__main__":
    main()
