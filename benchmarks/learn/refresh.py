"""Does in-flight policy refresh learn as well as refreshing once per rollout?

Three arms per seed, from one SFT checkpoint, on the same number of sampled completions (the
asynchronous benchmark's run: arith, 150 batches of 16 x 8, one sampler beside a learner that
samples when no batch waits, S = 5; benchmarks/learn/async_vs_sync.py explains each setting):
  sync:      rollout -> reward -> update in one process (the synchronous run);
  rollout:   asynchronous, a rollout keeps the adapter it started with (async_rl.refresh_every=0);
  in-flight: asynchronous, the sampler swaps in each newer adapter at the next denoising step
             (async_rl.refresh_every=1, asyncrl/refresh.py).
The seed is the run's (``train.seed``: its prompts and noise); the SFT checkpoint and the held-out
problems are the same for every seed. Each final adapter is evaluated with the recipe's pinned
eval settings; the arms are compared by a paired sign test over (seed, problem) pairs. Each
asynchronous arm reports its steps' mean age at the update that used them (versions between the
adapter that took the step and the one updated), the rows older than S not drawn, the adapter
swaps made mid-rollout and the batches dropped.

Run: python -m benchmarks.refresh [--seeds 0 1 2] [--smoke]. Writes benchmarks/results/refresh.json.
(--smoke: one seed, a 3-step SFT, 3 batches of 2 x 4 completions, 8 eval problems.)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync import DEFAULT_OVERRIDES, SMOKE_OVERRIDES, sync_process
from benchmarks.harness import bench_args, evaluate_adapter, paired, sft_checkpoint, table, usable_cpus, workdir, write_result

ARMS = {"rollout": 0, "in-flight": 1}  # asynchronous arms: async_rl.refresh_every


def async_arm(cfg: Any, base: str, work: Path) -> dict[str, Any]:
    """One asynchronous run of ``cfg`` (local samplers and learner, fresh store under ``work``) ->
    its seconds, adapter folder and what its updates saw of step ages."""
    from miles_core.asyncrl.launch import prepare_run, run_local
    from miles_core.storage.run import RunStore

    run_uri = str(work / "run")
    prepare_run(run_uri, cfg, base)
    t0 = time.perf_counter()
    summary = run_local(run_uri, cfg.async_rl.num_samplers, work / "logs", timeout=3600)
    seconds = time.perf_counter() - t0
    rs = RunStore(run_uri)
    rs.adapters.fetch(summary["version"], work / "adapter")
    history = rs.read_json("learner", "history.json")["history"]
    updates = [h for h in history if "step_age" in h]
    return {"seconds": seconds, "adapter": str(work / "adapter"), "updates": len(history),
            "step_age_mean": sum(h["step_age"] for h in updates) / max(len(updates), 1),
            "stale_rows": sum(h.get("stale_rows", 0.0) for h in history),
            "rows": sum(h.get("rows", 0.0) for h in history),
            "refreshes": summary["refreshes"], "dropped": summary["dropped"],
            "max_staleness_seen": summary["max_staleness_seen"]}


def one_seed(seed: int, overrides: list[str], base: str, work: Path) -> dict[str, Any]:
    """The three arms of ``seed`` -> each arm's pass@1, its problems' correctness and its run's figures."""
    from miles_core.config import load_recipe

    out: dict[str, Any] = {}
    cfg = load_recipe("arith", [*overrides, f"train.seed={seed}"])
    seconds = sync_process(cfg, base, usable_cpus(), work / "sync")
    p1, correct = evaluate_adapter(cfg, base, work / "sync")
    out["sync"] = {"seconds": seconds, "pass1": p1, "correct": correct}
    for arm, every in ARMS.items():
        cfg = load_recipe("arith", [*overrides, f"train.seed={seed}", f"async_rl.refresh_every={every}"])
        r = async_arm(cfg, base, work / arm)
        p1, correct = evaluate_adapter(cfg, base, r["adapter"])
        out[arm] = {**r, "pass1": p1, "correct": correct}
        print(f"seed {seed} {arm}: pass@1 {p1:.3f}, {r['seconds']:.0f}s, step age {r['step_age_mean']:.2f}, "
              f"{r['refreshes']} swaps mid-rollout, {r['stale_rows']:.0f} stale rows", flush=True)
    print(f"seed {seed} sync: pass@1 {out['sync']['pass1']:.3f}, {out['sync']['seconds']:.0f}s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0, 1, 2), checkpoint=True, workdir=True)
    args = ap.parse_args(argv)
    import torch

    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    seeds = args.seeds[:1] if args.smoke else args.seeds
    overrides = DEFAULT_OVERRIDES + (SMOKE_OVERRIDES if args.smoke else []) + args.set
    cfg = load_recipe("arith", overrides)
    work = workdir(args, "refresh")
    torch.set_num_threads(usable_cpus())
    sft = sft_checkpoint(cfg, cfg.sft.seed, work, args.checkpoint, build_task(cfg), validate=False, progress=True)
    per_seed = {s: one_seed(s, overrides, sft["path"], work / f"seed{s}") for s in seeds}
    arms = ["sync", *ARMS]
    pooled = {a: [c for s in seeds for c in per_seed[s][a]["correct"]] for a in arms}
    mean = lambda arm, key: sum(per_seed[s][arm][key] for s in seeds) / len(seeds)  # noqa: E731
    tests = {"in-flight vs rollout": paired(pooled["in-flight"], pooled["rollout"]),
             "in-flight vs sync": paired(pooled["in-flight"], pooled["sync"]),
             "rollout vs sync": paired(pooled["rollout"], pooled["sync"])}
    rows = [[a, f"{mean(a, 'pass1'):.3f}", " ".join(f"{per_seed[s][a]['pass1']:.3f}" for s in seeds),
             f"{mean(a, 'seconds'):.0f}",
             "-" if a == "sync" else f"{mean(a, 'step_age_mean'):.2f}",
             "-" if a == "sync" else f"{mean(a, 'refreshes'):.0f}",
             "-" if a == "sync" else f"{mean(a, 'stale_rows'):.0f}",
             "-" if a == "sync" else f"{mean(a, 'dropped'):.0f}"] for a in arms]
    print(table(rows, ["arm", "pass@1", "per seed", "seconds", "step age", "swaps", "stale rows", "dropped"]))
    print(table([[k, f"{v['gain']:+.3f}", v["wins"], v["losses"], f"{v['p']:.3f}"] for k, v in tests.items()],
                ["paired over (seed, problem)", "gain", "wins", "losses", "p"]))
    payload = {"seeds": list(seeds), "overrides": overrides, "arms": arms, "tests": tests,
               "per_seed": {str(s): {a: {k: v for k, v in r.items() if k != "correct"} for a, r in per_seed[s].items()}
                            for s in seeds},
               "pass1": {a: mean(a, "pass1") for a in arms},
               "step_age_mean": {a: mean(a, "step_age_mean") for a in ARMS},
               "refreshes": {a: mean(a, "refreshes") for a in ARMS},
               "sft_checkpoint": {k: v for k, v in sft.items() if k != "curve"}, "smoke": args.smoke}
    # what it exists to measure: every arm trained and was timed, the in-flight arm's updates saw ages
    positive = [f"per_seed.*.{a}.seconds" for a in arms] + [f"per_seed.*.{a}.updates" for a in ARMS]
    present = ["pass1.sync", "pass1.rollout", "pass1.in-flight", "tests", "step_age_mean.in-flight"]
    print(f"wrote {write_result('refresh', payload, args.out, positive=positive, present=present)}")


if __name__ == "__main__":
    main()
