"""Learning does not depend on how the learner is split: the arith recipe run asynchronously with
2 samplers and a learner of 1 process, then of 2 gloo ranks under torchrun, from one SFT
checkpoint with one budget of completions; pass@1 of both on the same held-out problems.

With ``async_rl.max_staleness=0`` (``--staleness``, default 0) and a global batch of both samplers'
batches, admission (slot < (S + v + 1) B) lets a sampler start its batch u only at version u and
update u consumes exactly the two batches u: every batch is sampled with the same policy version
in both arms, whatever the timing. Each arm therefore sees the same completions as long as the two
policies agree, and they differ only in the order of float sums (each rank's share of the rows,
then the all-reduce; tests/test_learner_ranks.py checks one update to float tolerance). The table
says how many stored batches are identical between the arms. With ``--staleness 4`` the arms run
fully asynchronously and their completions differ by timing too.

    python -m benchmarks.learner_ranks [--seeds 0 1] [--checkpoint DIR] [--staleness 0] [--smoke]

Seeds set ``train.seed`` (the batches' prompts and noise); the SFT checkpoint is shared. Writes
benchmarks/results/learner_ranks.json (``--smoke``: seed 0, a 3-step SFT, 2 x 2 batches of 2 x 4
completions, 8 eval problems; learner_ranks_smoke.json).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.harness import MeasuredNothing, bench_args, evaluate_adapter, finish, paired, sft_checkpoint, workdir

BATCHES_PER_SAMPLER = 75  # 2 x 75 = 150 batches: the arith recipe's train.iterations
RANKS = (1, 2)
# --smoke: both arms, real processes and torchrun, in seconds. Every update scores all its rows (a
# 3-step SFT earns no reward spread), so the 2-rank learner splits and all-reduces real work.
SMOKE_BATCHES_PER_SAMPLER = 2
SMOKE_OVERRIDES = ["sft.steps=3", "train.prompts_per_iter=2", "train.group_size=4", "eval.num_problems=8",
                   "update.skip_zero_variance=false"]


def overrides(seed: int, ranks: int, staleness: int, per: int, extra: list[str],
              batches: int = BATCHES_PER_SAMPLER) -> list[str]:
    return ["async_rl.num_samplers=2", f"async_rl.batches_per_sampler={batches}",
            "async_rl.shared_budget=false", "async_rl.learner_samples=false", f"async_rl.global_batch={2 * per}",
            "async_rl.checkpoint_every=10", f"async_rl.learner_ranks={ranks}", f"async_rl.max_staleness={staleness}",
            f"train.seed={seed}", *extra]


def arm(seed: int, ranks: int, base: str, work: Path, staleness: int, extra: list[str],
        batches: int = BATCHES_PER_SAMPLER) -> dict[str, Any]:
    """One asynchronous run (real processes, local store) -> its figures and the final adapter's evaluation."""
    from miles_core.asyncrl.launch import prepare_run, run_local
    from miles_core.config import load_recipe
    from miles_core.storage.run import RunStore

    probe = load_recipe("arith", extra)
    cfg = load_recipe("arith", overrides(seed, ranks, staleness, probe.train.prompts_per_iter * probe.train.group_size,
                                         extra, batches))
    run = str(work / f"seed{seed}" / f"ranks{ranks}")
    prepare_run(run, cfg, base)
    t0 = time.perf_counter()
    summary = run_local(run, 2, work / "logs" / f"seed{seed}-ranks{ranks}", timeout=3600, warm=True)
    seconds = time.perf_counter() - t0
    rs = RunStore(run)
    adapter = rs.adapters.fetch(summary["version"], work / f"seed{seed}" / f"adapter{ranks}")
    pass1, correct = evaluate_adapter(cfg, base, adapter)
    print(f"seed {seed}, {ranks} learner rank(s): {seconds:.0f}s, pass@1 {pass1:.3f}, "
          f"consumed {summary['consumed']}, dropped {summary['dropped']}", flush=True)
    if summary.get("learner_ranks") != ranks:  # the arm must be what it is labelled: the split it compares
        raise MeasuredNothing(f"benchmarks.learner_ranks: the {ranks}-rank arm's learner reported "
                              f"{summary.get('learner_ranks')} ranks")
    return {"seed": seed, "learner_ranks": ranks, "seconds": seconds, "pass1": pass1,
            "correct": correct, "consumed": summary["consumed"], "dropped": summary["dropped"],
            "max_staleness_seen": summary["max_staleness_seen"], "run_uri": run, "version": summary["version"]}


def identical_batches(run_a: str, run_b: str) -> tuple[int, int]:
    """(batches whose completions are token-for-token equal in both runs, batches compared)."""
    import torch

    from miles_core.storage.run import RunStore

    a, b = RunStore(run_a).trajectories, RunStore(run_b).trajectories
    common = sorted(set(a.list_batches()) & set(b.list_batches()))
    same = sum(torch.equal(a.read_batch(i).completion_ids, b.read_batch(i).completion_ids) for i in common)
    return same, len(common)


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=[0, 1], checkpoint=True, workdir=True)
    ap.add_argument("--staleness", type=int, default=0, help="async_rl.max_staleness of both arms (0: same completions)")
    args = ap.parse_args(argv)
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    if args.smoke:
        args.seeds = [0]
    extra = (SMOKE_OVERRIDES if args.smoke else []) + args.set
    batches = SMOKE_BATCHES_PER_SAMPLER if args.smoke else BATCHES_PER_SAMPLER
    work = workdir(args, "learner_ranks")
    cfg = load_recipe("arith", extra)
    sft = sft_checkpoint(cfg, cfg.sft.seed, work, args.checkpoint, build_task(cfg), validate=False, progress=True)
    base = str(sft["path"])
    runs = [arm(seed, r, base, work, args.staleness, extra, batches) for seed in args.seeds for r in RANKS]
    rows, per_seed, a_all, b_all = [], [], [], []
    for seed in args.seeds:
        one, two = (next(x for x in runs if x["seed"] == seed and x["learner_ranks"] == r) for r in RANKS)
        same, n = identical_batches(one["run_uri"], two["run_uri"])
        cmp = paired(two["correct"], one["correct"])
        per_seed.append({"seed": seed, "identical_batches": same, "batches": n, **cmp,
                         **{f"ranks{x['learner_ranks']}": {k: v for k, v in x.items() if k != "correct"} for x in (one, two)}})
        a_all += two["correct"]
        b_all += one["correct"]
        rows.append([seed, one["pass1"], two["pass1"], cmp["gain"], cmp["p"], f"{same}/{n}",
                     f"{one['seconds']:.0f}/{two['seconds']:.0f}", max(one["dropped"], two["dropped"])])
    pooled = paired(a_all, b_all)
    rows.append(["pooled", sum(b_all) / len(b_all), sum(a_all) / len(a_all), pooled["gain"], pooled["p"], "", "", ""])
    # each arm over the seeds, keyed so the checks below can name them (per_seed is a list)
    arms = {f"ranks{r}": {"consumed": sum(x["consumed"] for x in runs if x["learner_ranks"] == r),
                          "seconds": sum(x["seconds"] for x in runs if x["learner_ranks"] == r),
                          "pass1": sum(x["pass1"] for x in runs if x["learner_ranks"] == r) / len(args.seeds)}
            for r in RANKS}
    payload = {"per_seed": per_seed, "pooled": pooled, "staleness": args.staleness, "samplers": 2,
               "batches_per_sampler": batches, "overrides": extra, "arms": arms,
               "batches_compared": sum(p["batches"] for p in per_seed),
               "identical_batches": sum(p["identical_batches"] for p in per_seed),
               "within_2_points": abs(pooled["gain"]) <= 0.02, "sft_checkpoint": base, "smoke": args.smoke}
    finish("learner_ranks", payload, rows, ["seed", "pass@1 1 rank", "pass@1 2 ranks", "2 - 1", "p (sign test)",
                                            "identical batches", "seconds 1/2", "dropped"], args.out,
           positive=["arms.*.consumed", "arms.*.seconds", "batches_compared"],
           present=["arms.*.pass1", "pooled.gain", "pooled.p", "identical_batches", "within_2_points"])


if __name__ == "__main__":
    main()
