"""A fixed, field-sized global batch from 64 to 4,096 GPUs, with and without in-flight refresh:
where each curve falls below 0.9 efficiency, and how old the learned-from steps are.

Run: python -m benchmarks.host_costs && python -m benchmarks.fixed_batch [--gpus N ...] [--batches N ...]
[--staleness S ...] [--seeds N] [--smoke]

The model is scale_model's (benchmarks/scale/sim.py at LLaDA-8B's shape, ``scale_model.llada_8b``,
with the measured host costs and placement's split for each batch), at 8,192 and 16,384
completions per update (GRPO/DAPO-sized batches) whatever the cluster. Arms: the staleness bound
S at 6 (the model's default) and 10, each without and with in-flight refresh (a rollout's steps
take the adapters published while it runs, ``async_rl.refresh_every=1``; sim.py's refresh model:
a publish reaches a refreshing sampler after half the polls' cap, discovery, plus the adapter's
fetch). Admission is the same with and without refresh (it bounds a rollout's first step:
learner/channels.py::admits), so refresh moves throughput only through the batches it keeps from
being dropped; what it changes is the steps' age: each point reports the mean age of the steps
its updates learned from (versions between the adapter that took a step and the one updated) and
the share of steps older than S (not drawn). A raised bound with refresh can hold steps younger on
average than the lower bound without it: that pair is the comparison the printed verdict makes.

``--smoke``: 8 and 64 GPUs, short horizons, one seed, host costs computed in this process. Seconds.
Writes benchmarks/results/fixed_batch.json.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from benchmarks.harness import add_smoke, table, write_result
from benchmarks.scale_model import below, configure, host_costs, llada_8b, simulate_point
from benchmarks.sim import refresh_delay

BATCHES = (8_192, 16_384)
GPUS = (64, 128, 256, 512, 1024, 2048, 4096)
STALENESS = (6, 10)  # each bound without and with refresh
SMOKE = {"rollouts": 4, "seeds": 1}


def bound_arms(staleness: list[int]) -> dict[str, tuple[int, bool]]:
    """Each bound S without and with refresh: {"S=6": (6, False), "S=6 refresh": (6, True), ...}."""
    return {f"S={s}{' refresh' if r else ''}": (s, r) for s in staleness for r in (False, True)}


def point(base: Any, costs: dict[str, Any], gpus: int, batch: int, staleness: int, refresh: bool,
          rollouts: int, hours: float, seeds: int) -> dict[str, Any]:
    """One arm at one size: placement's split for ``batch`` completions, simulated for ``seeds`` seeds."""
    arm = replace(base, max_staleness=staleness, refresh=refresh, refresh_delay_s=refresh_delay(base))
    p, pl = configure(arm, gpus, batch, costs)
    r = simulate_point(p, pl, rollouts, hours, seeds)
    return {"gpus": gpus, "batch": batch, "max_staleness": staleness, "refresh": refresh,
            "samplers": p.samplers, "learner_ranks": p.learner_ranks, "admitted_samplers": pl.admitted,
            "global_batch": p.batches_per_update * p.completions_per_batch, "steady": r["steady"],
            "steady_range": r["steady_range"], "whole_run": r["whole_run"], "step_age_mean": r["step_age_mean"],
            "stale_step_frac": r["stale_step_frac"], "dropped": r["dropped"], "consumed": r["consumed"],
            "bottleneck": r["bottleneck"]}


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--rollouts", type=int, default=24, help="simulated rollouts per sampler after the fill")
    ap.add_argument("--hours", type=float, default=24.0, help="the whole run's length")
    ap.add_argument("--seeds", type=int, default=1, help="simulations per point (efficiency averaged)")
    ap.add_argument("--gpus", type=int, nargs="+", default=list(GPUS), help="cluster sizes")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="completions per update")
    ap.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS),
                    help="staleness bounds S, each an arm without and one with refresh")
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    sizes = (8, 64) if args.smoke else tuple(args.gpus)
    named = bound_arms(args.staleness)
    costs, source = host_costs(args.smoke)
    base = llada_8b()
    curves: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for batch in args.batches:
        curves[str(batch)] = {}
        for name, (s, refresh) in named.items():
            curves[str(batch)][name] = [point(base, costs, g, batch, s, refresh, args.rollouts, args.hours, args.seeds)
                                        for g in sizes]
            print(f"{batch:,} completions, {name}: " + ", ".join(f"{pt['gpus']} {pt['steady']:.3f}"
                                                                 for pt in curves[str(batch)][name]), flush=True)
    drops = {b: {name: below(pts) for name, pts in arms.items()} for b, arms in curves.items()}
    for b, arms in curves.items():
        print(f"\nfixed global batch of {int(b):,} completions (llada_8b, GPUs spread {base.rank_spread:.0%}, "
              f"dealt by {base.deal})")
        print(table([[pt["gpus"], name, f"{pt['samplers']}:{pt['learner_ranks']}", pt["admitted_samplers"],
                      f"{pt['steady']:.3f}", f"{pt['whole_run']:.3f}", f"{pt['step_age_mean']:.2f}",
                      f"{pt['stale_step_frac']:.3f}", pt["dropped"], pt["bottleneck"]]
                     for i in range(len(sizes)) for name, pts in arms.items() for pt in [pts[i]]],
                    ["GPUs", "arm", "S:D", "admitted", "steady", f"{args.hours:g} h", "step age", "stale steps",
                     "dropped", "bottleneck"]))
        for name, drop in drops[b].items():
            print(f"  {name}: " + (f"below 0.9 from {drop['gpus']:,} GPUs ({drop['steady']:.3f})" if drop
                                   else f"never below 0.9 up to {sizes[-1]:,} GPUs"))
    at = 1024 if 1024 in sizes else sizes[-1]
    big = str(max(args.batches))
    lo, hi = f"S={min(args.staleness)}", f"S={max(args.staleness)} refresh"
    pick = lambda arm: next(pt for pt in curves[big][arm] if pt["gpus"] == at)  # noqa: E731
    low, high = pick(lo), pick(hi)
    print(f"\nat {at:,} GPUs, {int(big):,} completions: {lo} without refresh {low['steady']:.3f} (steps "
          f"{low['step_age_mean']:.2f} versions old on average), {hi} {high['steady']:.3f} ({high['step_age_mean']:.2f}): "
          + ("younger steps and more throughput" if high["step_age_mean"] <= low["step_age_mean"] else
             "more throughput, older steps"))
    path = write_result("fixed_batch", {
        "curves": curves, "below_0_9_at": {b: {n: d["gpus"] if d else None for n, d in arms.items()}
                                           for b, arms in drops.items()},
        "compared": {"gpus": at, "batch": int(big), lo: low, hi: high}, "host_costs_source": source, "gpus": list(sizes),
        "settings": vars(args), "smoke": args.smoke},
        args.out, positive=[f"curves.*.*.*.{k}" for k in ("steady", "consumed")] + [
            f"compared.{lo}.steady"],
        present=["below_0_9_at", "curves.*.*.*.stale_step_frac", "curves.*.*.*.step_age_mean"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
