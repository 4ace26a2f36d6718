"""What step merging costs in learning: ADPO with ``adpo.step_merge`` = s for several s, side by
side from one SFT checkpoint (the arith recipe: static rollouts of K = 8 steps).

s = 1 is exact ADPO. s > 1 is TraceRL's shrinkage (arXiv:2509.06949): s consecutive steps are
scored as one state, s times fewer update forwards, the ratio against the proximal policy. Each
arm trains the same number of iterations on its own rollouts (same seed and count); the table
gives final pass@1 on the held-out problems, update FLOPs (torch.utils.flop_counter) and seconds.
One seed per arm by default: the binomial SE of pass@1 on 500 problems alone is ~2 points.
Run: python -m benchmarks.step_merge [--merges 1 2 4] [--seeds 0] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import table, write_result
from benchmarks.nsd import training_part
from miles_core.config import load_recipe
from miles_core.data.registry import build_task
from miles_core.learner.baseline import train_baseline


def _job(job: tuple) -> dict:
    """One (s, seed) training run in its own process with one torch thread."""
    s, seed, ckpt, iterations = job
    torch.set_num_threads(1)
    cfg = load_recipe("arith", [f"adpo.step_merge={s}"])
    r = training_part(cfg, build_task(cfg), Path(ckpt), cfg.sampler, iterations, seed)
    return {"s": s, "seed": seed, **r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--merges", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--iterations", type=int, default=None, help="default: the recipe's train.iterations")
    ap.add_argument("--checkpoint", default=None, help="arith SFT checkpoint (trained here when absent)")
    args = ap.parse_args()
    t_all = time.perf_counter()
    cfg = load_recipe("arith", [])
    ckpt = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="miles-merge-")) / "sft"
    if not (ckpt / "config.json").exists():
        print("training the SFT checkpoint ...", flush=True)
        train_baseline(cfg, build_task(cfg), ckpt, seed=0)
    iters = args.iterations or cfg.train.iterations
    jobs = [(s, seed, str(ckpt), iters) for s in args.merges for seed in args.seeds]
    with mp.get_context("spawn").Pool(2) as pool:  # two runs at a time, one thread each
        runs = pool.map(_job, jobs)
    rows = []
    for s in args.merges:
        mine = [r for r in runs if r["s"] == s]
        n = len(mine)
        rows.append({"s": s, "pass1": sum(r["pass1"] for r in mine) / n,
                     "update_gflop": sum(r["update_flops"] for r in mine) / n / 1e9,
                     "sample_gflop": sum(r["sample_flops"] for r in mine) / n / 1e9,
                     "seconds": sum(r["seconds"] for r in mine) / n, "per_seed": mine})
    print(table([[r["s"], r["pass1"], r["update_gflop"], r["sample_gflop"], r["seconds"]] for r in rows],
                ["s", "final pass@1", "update GFLOP", "sample GFLOP", "train s"]))
    payload = {"rows": rows, "iterations": iters, "seeds": args.seeds, "seconds": time.perf_counter() - t_all}
    print(f"wrote {write_result('step_merge', payload)} in {payload['seconds']:.0f}s")


if __name__ == "__main__":
    main()
