"""Predict Miles' asynchronous efficiency from 8 to 4,096 GPUs with the discrete-event model
(benchmarks/scale/sim.py), every cost that grows with the cluster charged, and validate it out of
sample on the emulated runs.

Run: python -m benchmarks.host_costs && python -m benchmarks.emulate && python -m benchmarks.scale_model [--smoke]

The design as built (miles_core/asyncrl): admission (a sampler starts slot k only while
k < (S + v + 1) B), updates on the recipe's global batch of B sampler batches, each learner rank
reading, building and scoring only its share, single trajectories (learner/shares.py; the busiest
rank's share and the slowest rank set the pace), samplers polling ``adapters/LATEST`` with
back-off, and the split of ``asyncrl/placement.py`` for that global batch.

Inputs. ``llada_8b``: the gsm8k recipe at LLaDA-8B's shape (16 prompts x 6 completions of 256
tokens, 256-token prompts, 128 steps, ADPO on a quarter of the steps, 4 minibatches, LoRA r=64 on
every projection) costed by FLOPs at an assumed 35% of an H200's 989 dense bf16 TFLOP/s:
derived, not measured (no H200 was lent). Charged from measurements on this machine class
(benchmarks/speed/host_costs.py, required): each rank's host work per update as a function of its share
and B, rank 0's publish and checkpoint, a sampler's adapter load and Parquet write. Stated
assumptions: rollout times lognormal (CV 0.3) with a heavy tail (2% of rollouts take 3x), each
rank's optimizer-step time varying 1% from step to step (the slowest of D sets each step's pace)
and each GPU persistently slower or faster by a 5% spread (same-model GPUs in large clusters
differ by several percent: Sinha et al., SC22), the rows dealt by the ranks' measured speeds
(``async_rl.deal = "speed"``; 1%, 2%, 5% and 8% spreads, dealt evenly or by speed, printed
beside), 60 s of rendezvous and loading
before version 0 and the 16 GB base read by every process from the store, S3's documented
3,500 PUT and 5,500 GET per second per prefix (all keys on one prefix), 20 ms per request,
90 MB/s per connection, 40 GB/s all-reduce bus bandwidth per rank, polls backing off x2 to 5 s.

Curves. *Weak* scaling: the global batch grows with the cluster, 32 completions per GPU up to a
cap of 131,072 (the optimiser changes with the cluster: fewer, larger updates); the same capped
at 16,384 completions (a GRPO/DAPO-sized batch: from 512 GPUs on, a fixed batch); *strong*
scaling: a fixed global batch of 4,608 completions (48 sampler batches). Each point gives the
steady efficiency (after the pipeline fills), the efficiency over a whole run of ``--hours``
(start-up and fill included, the steady rate extrapolated beyond the simulated window), each the
mean of ``--seeds`` simulations with their range, and its first bottleneck.
Efficiency = completions/s / (N x one GPU's synchronous completions/s).

Validation. The emulated runs (benchmarks/scale/emulate.py): the model's inputs that this 2-core machine
changes with the process count (measured rollout and update seconds, host seconds, start-up)
are fitted on the 4- and 16-process runs only, linearly in the process count, and the 64-process
run is predicted from the fit: out of sample, error with its sign. The straggler runs (a slow rank,
a spread, a rollout tail; benchmarks/scale/model_fit.py::straggler_configs) are predicted by
``--predict`` before they run (the file is committed), then checked against them. ``--runs-from
docs/results/records`` validates against the committed runs instead of benchmarks/results.
Writes benchmarks/results/scale_model.json.

``--smoke``: the same curves at 8 and 64 GPUs, sensitivity at 64, short horizons, two seeds; its
host costs computed in this process at host_costs' smoke sizes (no results file is read, so
nothing is validated). Seconds; not a figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, add_smoke, table, write_result
from benchmarks.host_costs import LORA_PARAMS, SMOKE_LORA, SMOKE_POINTS, host_seconds, measure, one
from benchmarks.model_fit import (PREDICTIONS, REFRESH_PREDICTIONS, TRAJECTORY_PREDICTIONS, checked, deal_unit,
                                  is_plain, predict, refresh_configs, straggler_configs, trajectory_configs, validation)
from benchmarks.sim import Params, simulate
from benchmarks.update_pace import largest_share, shares
from miles_core.asyncrl.placement import Placement, admitting_batch, place
from miles_core.storage.uri import S3_CONNECTIONS

GPUS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
H200_FLOPS, MFU = 989e12, 0.35
# one S3 connection ~90 MB/s; Miles moves large objects over S3_CONNECTIONS (storage/uri.py)
REAL_S3 = dict(store_latency_s=0.020, store_bytes_s=90e6 * S3_CONNECTIONS, link_bytes_s=40e9, link_latency_s=10e-6)
WEAK_PER_GPU, WEAK_CAP = 32, 131_072   # completions per update per GPU, and the cap
CAPPED = 16_384                        # the weak curve again, its global batch capped at a GRPO/DAPO size
ROUND_DOWN = 0.1                       # weak: placement may lower the batch 10% so the ranks' shares are equal
# what each stated assumption costs at 4,096 GPUs (weak): the model with one input changed
VARIANTS = {"as stated": {}, "no rank spread": {"rank_cv": 0.0, "rank_spread": 0.0},
            **{f"spread {x:.0%}, {deal}": {"rank_spread": x, "deal": deal}
               for x in (0.01, 0.02, 0.05, 0.08) for deal in ("even", "speed")},
            "no heavy tail": {"rollout_tail_p": 0.0}, "a store that never queues": {"put_rate": 1e9, "get_rate": 1e9}}
STRONG_BATCH = 4_608                   # completions per update (48 sampler batches of 96)
SEED_CLAIM = 0.946
# --predict's --configs: where each set of emulated runs' predictions is written, and the runs
CONFIGS = {"stragglers": (PREDICTIONS, straggler_configs), "refresh": (REFRESH_PREDICTIONS, refresh_configs),
           "trajectories": (TRAJECTORY_PREDICTIONS, trajectory_configs)}
SMOKE = {"rollouts": 4, "seeds": 2}    # --smoke: short horizons (20 updates still), at SMOKE_GPUS
SMOKE_GPUS = (8, 64)


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def emulated_runs(folder: Path = RESULTS) -> list[dict]:
    """Every emulated run in ``folder``'s emulate*.json (``emulate --out``: the plain runs, their
    32-prompt baselines, the straggler runs; docs/results/records/ holds the ones the published
    validation rests on), smoke runs left out."""
    runs = []
    for path in sorted(Path(folder).glob("emulate*.json")):
        doc = json.loads(path.read_text())
        runs += [] if doc.get("smoke") else [{**r, "source": path.name} for r in doc.get("runs", [])]
    return runs


def update_passes(minibatches: int) -> float:
    """Forwards per scored row in an update: forward and backward (3), plus a no-grad forward for
    the proximal policy for every row outside the first minibatch (algo/update.py::proximal_logprobs;
    rows sampled by the very weights updated, whose recorded mu stands in, are few asynchronously)."""
    return 3.0 + (1.0 - 1.0 / minibatches)


def llada_8b() -> Params:
    """The gsm8k recipe at LLaDA-8B shape costed by FLOPs (module docstring): derived, not measured."""
    n, prompt, gen, steps, rows, per, minibatches = 8e9, 256, 256, 128, 0.25, 96, 4
    rollout = 2 * n * per * (prompt + gen) * steps / (H200_FLOPS * MFU)
    update = update_passes(minibatches) * 2 * n * per * (prompt + gen) * steps * rows / (H200_FLOPS * MFU)
    lora = 32 * (4 * (4096 * 64 * 2) + 3 * (4096 + 12288) * 64)  # r=64 on q,k,v,o,gate,up,down
    return Params(rollout_s=rollout, update_s=update, completions_per_batch=per, deal_unit=1, minibatches=minibatches,
                  adapter_bytes=2 * lora, allreduce_bytes=4 * lora, batch_bytes=per * 768 * 10,
                  checkpoint_bytes=12 * lora, rollout_cv=0.3, rollout_tail_p=0.02, rollout_tail_x=3.0, rank_cv=0.01,
                  rank_spread=0.05, deal="speed",
                  base_bytes=16e9, learner_start_s=60.0, max_staleness=6, checkpoint_every=10, poll_s=0.05,
                  poll_backoff=2.0, poll_max_s=5.0, learner_samples=False, shared_budget=False, **REAL_S3)


def charge_host(p: Params, costs: dict[str, Any]) -> Params:
    """``p`` with the measured host seconds (benchmarks/speed/host_costs.py) of its shape: the busiest
    rank's per update (its share, B, the batches it reads) plus rank 0's publish and checkpoint,
    and a sampler's per batch."""
    b, n, d, g = p.batches_per_update, p.completions_per_batch, p.learner_ranks, p.deal_unit
    rank = host_seconds(costs["fit"], largest_share(b, n, d, g), b, max(shares(b, n, d, g)), d)
    extra = costs["rank0_and_sampler"]
    return replace(p, learner_host_s=rank + extra["rank0_per_update_s"], sampler_host_s=extra["sampler_per_batch_s"])


def configure(base: Params, gpus: int, completions: int, costs: dict[str, Any],
              round_down: float = 0.0) -> tuple[Params, Placement]:
    """``gpus`` split as placement.py splits them for a global batch of ``completions`` (lowered by
    at most ``round_down`` so the ranks hold equal shares), host costs charged, a budget beyond
    the horizon."""
    n = base.completions_per_batch
    b = max(1, completions // n)
    pl = place(gpus, base.rollout_s / n, base.update_s / n, base.max_staleness, b, n // base.deal_unit, round_down,
               placement_cv(base))
    p = replace(base, samplers=pl.samplers, learner_ranks=pl.learner_ranks, batches=10**9,
                batches_per_update=pl.batches_per_update)
    return charge_host(p, costs), pl


def placement_cv(p: Params) -> float:
    """The spread placement is told to leave room for: the step-to-step one, and with an even deal
    the GPUs' own (the slowest GPU then sets every update's pace); dealt by speed, the update
    waits for the mean speed, so only the step-to-step spread."""
    return p.rank_cv if p.deal == "speed" else (p.rank_cv ** 2 + p.rank_spread ** 2) ** 0.5


def one_gpu(p: Params) -> float:
    """One GPU's synchronous completions/s: rollout then update of each batch, nothing overlapped."""
    return p.completions_per_batch / (p.rollout_s + p.update_s)


def efficiency(p: Params, r: dict) -> float:
    """Steady-state completions/s (after the pipeline's fill) over N GPUs' synchronous ideal."""
    return r["steady_completions_per_s"] / ((p.samplers + p.learner_ranks) * one_gpu(p))


def whole_run(p: Params, r: dict, hours: float) -> float:
    """Efficiency over a run of ``hours``: what the simulated window consumed up to its last update
    (start-up and fill included) plus the steady rate for the rest of the run, over N GPUs' ideal
    for the whole run."""
    span = hours * 3600.0
    done = (r["consumed"] * p.completions_per_batch
            + r["steady_completions_per_s"] * max(span - r["last_update_s"], 0.0))
    return done / (span * (p.samplers + p.learner_ranks) * one_gpu(p))


def simulate_seeds(p: Params, horizon: float, warm: float, seeds: int, hours: float) -> dict[str, Any]:
    """``p`` simulated with ``seeds`` seeds: the first seed's counters, steady and whole-run
    efficiency averaged over the seeds, with their range (a balanced split's efficiency moves by a
    point or two with the draws of the rollout tail)."""
    runs = [simulate(replace(p, seed=s), horizon, warmup_s=warm) for s in range(seeds)]
    steady = [efficiency(p, r) for r in runs]
    whole = [whole_run(p, r, hours) for r in runs]
    return {**runs[0], "steady": sum(steady) / seeds, "whole_run": sum(whole) / seeds,
            "steady_range": [min(steady), max(steady)], "whole_run_range": [min(whole), max(whole)]}


def simulate_point(p: Params, pl: Placement, rollouts: int, hours: float, seeds: int) -> dict[str, Any]:
    """``p`` (split ``pl``) past its fill (start-up and 8 rollouts), for ``rollouts`` rollouts or
    enough for 20 updates at least, however few samplers fill one global batch: :func:`simulate_seeds`."""
    warm = 8 * p.rollout_s + p.learner_start_s
    span = max(rollouts, 20 * p.batches_per_update // max(min(p.samplers, pl.admitted), 1))
    return simulate_seeds(p, warm + span * p.rollout_s, warm, seeds, hours)


def curve(kind: str, base: Params, costs: dict[str, Any], rollouts: int, hours: float,
          seeds: int, sizes: tuple[int, ...] = GPUS) -> list[dict[str, Any]]:
    """Weak ("weak", "weak_capped" at :data:`CAPPED`) or strong scaling over ``sizes``
    (:data:`GPUS`): per point the split, the global batch, steady and whole-run efficiency (mean
    over ``seeds``), the first bottleneck."""
    out = []
    for gpus in sizes:
        cap = {"weak": WEAK_CAP, "weak_capped": CAPPED}.get(kind)
        completions = min(WEAK_PER_GPU * gpus, cap) if cap else STRONG_BATCH
        p, pl = configure(base, gpus, completions, costs, ROUND_DOWN if cap else 0.0)
        r = simulate_point(p, pl, rollouts, hours, seeds)
        out.append({"curve": kind, "gpus": gpus, "samplers": p.samplers, "learner_ranks": p.learner_ranks,
                    "global_batch": p.batches_per_update * p.completions_per_batch,
                    "batches_per_update": p.batches_per_update, "admitted_samplers": pl.admitted,
                    "learner_host_s": p.learner_host_s,
                    "predicted_idle": {"samplers": pl.sampler_idle, "learner": pl.learner_idle},
                    **{k: v for k, v in r.items() if k != "staleness_hist"},
                    "staleness_max": max(r["staleness_hist"] or {0: 0})})
    return out


def sensitivity(base: Params, costs: dict[str, Any], rollouts: int, hours: float, seeds: int,
                gpus: int = GPUS[-1]) -> list[dict[str, Any]]:
    """Weak scaling at ``gpus`` (4,096) with one stated assumption changed at a time (:data:`VARIANTS`;
    placement is told the rank spread, so it may pick another split)."""
    out = []
    for name, change in VARIANTS.items():
        p, pl = configure(replace(base, **change), gpus, min(WEAK_PER_GPU * gpus, WEAK_CAP), costs, ROUND_DOWN)
        warm = 8 * p.rollout_s + p.learner_start_s
        r = simulate_seeds(p, warm + rollouts * p.rollout_s, warm, seeds, hours)
        out.append({"variant": name, "change": change, "samplers": p.samplers, "learner_ranks": p.learner_ranks,
                    "global_batch": p.batches_per_update * p.completions_per_batch, "steady": r["steady"],
                    "steady_range": r["steady_range"], "whole_run": r["whole_run"], "dropped": r["dropped"],
                    "bottleneck": r["bottleneck"]})
    return out


def below(points: list[dict], level: float = 0.9) -> dict[str, Any] | None:
    """The first point from which every larger size's steady efficiency is below ``level`` (a
    small size can dip below it by its integer split alone and recover at the next)."""
    for i, pt in enumerate(points):
        if all(q["steady"] < level for q in points[i:]):
            return pt
    return None


def host_costs(smoke: bool) -> tuple[dict[str, Any], str]:
    """The measured host costs and where they came from: host_costs.json (required for the
    figures), or with ``smoke`` computed here by host_costs' own functions at its smoke sizes
    (in this process: seconds, not two fresh interpreters; no earlier result is read)."""
    if not smoke:
        costs = _load("host_costs")
        if costs is None:
            raise SystemExit("benchmarks/results/host_costs.json is missing: run python -m benchmarks.host_costs "
                             "first (the model charges the measured host work)")
        return costs, str(RESULTS / "host_costs.json")
    import torch

    threads = torch.get_num_threads()  # one() runs on one thread, as in its own process
    try:
        costs = measure(SMOKE_POINTS, [], LORA_PARAMS // SMOKE_LORA, run=lambda job: one(*job))
    finally:
        torch.set_num_threads(threads)
    return costs, f"computed in this process at host_costs' smoke sizes {SMOKE_POINTS}, LoRA 1/{SMOKE_LORA}"


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--rollouts", type=int, default=24, help="simulated rollouts per sampler after the fill")
    ap.add_argument("--hours", type=float, default=24.0, help="the whole run's length")
    ap.add_argument("--seeds", type=int, default=3, help="simulations per point (efficiency averaged)")
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/NAME.json)")
    ap.add_argument("--runs-from", default=str(RESULTS), metavar="DIR",
                    help="the emulated runs to validate against: emulate*.json in DIR (docs/results/records: the "
                         "committed ones the published validation rests on)")
    ap.add_argument("--predict", default=None, metavar="FILE", nargs="?", const="",
                    help="only write the --configs runs' predictions (from the plain emulated runs in --runs-from) "
                         "to FILE (default: docs/results/records/predictions-CONFIGS.json), before those runs")
    ap.add_argument("--configs", choices=list(CONFIGS), default="stragglers",
                    help="which emulated runs --predict predicts: the straggler runs, the in-flight refresh pair, or "
                         "the straggler runs dealt single trajectories")
    args = ap.parse_args(argv)
    if args.predict is not None:
        target = args.predict or str(CONFIGS[args.configs][0])
        plain = emulated_runs(Path(args.runs_from))
        if not plain:
            raise SystemExit(f"no emulated runs in {args.runs_from}: run python -m benchmarks.emulate (and its "
                             "--prompts 32 runs, model_fit.straggler_configs) first")
        preds = predict(plain, CONFIGS[args.configs][1]())
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(target).write_text(json.dumps({"commit": commit, "calibrated_on": [4, 16], "predictions": preds},
                                           indent=1) + "\n")
        print(table([[p["processes"], p["slow_rank"], p["rank_spread"], "{}:{}".format(*p["rollout_tail"]), p["deal"],
                      p.get("global_batch", "-"), p.get("refresh", "-"), f"{p['predicted']:.3f}",
                      f"{p['predicted_step_age']:.2f}", p["predicted_dropped"], f"{p['plain_measured']:.3f}"] for p in preds],
                    ["procs", "slow rank", "spread", "tail P:X", "deal", "fixed B", "refresh", "predicted",
                     "step age", "dropped", "plain run measured"]))
        print(f"wrote {target}")
        return
    if args.smoke:
        vars(args).update(SMOKE)
    sizes = SMOKE_GPUS if args.smoke else GPUS
    costs, source = host_costs(args.smoke)
    base = llada_8b()
    curves = {kind: curve(kind, base, costs, args.rollouts, args.hours, args.seeds, sizes)
              for kind in ("weak", "weak_capped", "strong")}
    titles = {"weak": f"weak scaling ({WEAK_PER_GPU} completions per GPU, cap {WEAK_CAP:,})",
              "weak_capped": f"weak scaling capped ({WEAK_PER_GPU} completions per GPU, cap {CAPPED:,})",
              "strong": f"strong scaling (global batch {STRONG_BATCH:,})"}
    for kind, pts in curves.items():
        print(f"\n{titles[kind]}")
        print(table([[pt["gpus"], f"{pt['samplers']}:{pt['learner_ranks']}", pt["global_batch"],
                      f"{pt['learner_host_s']:.2f}", f"{pt['steady']:.3f}",
                      f"{pt['steady_range'][0]:.3f}-{pt['steady_range'][1]:.3f}", f"{pt['whole_run']:.3f}",
                      f"{pt['learner_idle_fraction']:.2f}", f"{pt['sampler_idle_fraction']:.2f}", pt["staleness_max"],
                      pt["dropped"], f"{sum(pt['store_requests_per_s'].values()):.0f}", pt["bottleneck"]] for pt in pts],
                    ["GPUs", "S:D", "global batch", "host s", "steady", "seeds' range", f"{args.hours:g} h", "L idle",
                     "S idle",
                     "max stale", "dropped", "req/s", "bottleneck"]))
    sens = sensitivity(base, costs, args.rollouts, args.hours, args.seeds, sizes[-1])
    print(f"\nweak scaling at {sizes[-1]:,} GPUs, one stated assumption changed at a time")
    print(table([[s["variant"], f"{s['samplers']}:{s['learner_ranks']}", s["global_batch"], f"{s['steady']:.3f}",
                  f"{s['steady_range'][0]:.3f}-{s['steady_range'][1]:.3f}", f"{s['whole_run']:.3f}", s["dropped"],
                  s["bottleneck"]] for s in sens],
                ["variant", "S:D", "global batch", "steady", "seeds' range", f"{args.hours:g} h", "dropped", "bottleneck"]))
    runs = [] if args.smoke else emulated_runs(Path(args.runs_from))
    val = validation([r for r in runs if is_plain(r) and r["completions_per_batch"] == 8])  # emulate's defaults
    if val:
        print()
        print(table([[v["run"], v["metric"], f"{v['predicted']:.3f}", f"{v['measured']:.3f}", f"{100 * v['error']:+.1f}%"]
                     for v in val], ["validation run", "metric", "predicted", "measured", "error"]))
    else:
        print("\nno emulated runs validated against" + (" (--smoke reads no results)" if args.smoke else
                                                          " in benchmarks/results/ (run python -m benchmarks.emulate)"))
    straggle = []
    for file in (PREDICTIONS, TRAJECTORY_PREDICTIONS):
        done = checked(json.loads(file.read_text())["predictions"], runs) if file.exists() else []
        straggle += done
        if done:
            print("\nstraggler runs, predicted before they ran (" + str(file.relative_to(file.parents[3])) + ")")
            print(table([[p["processes"], p["slow_rank"], p["rank_spread"], "{}:{}".format(*p["rollout_tail"]), p["deal"],
                          deal_unit(p), f"{p['predicted']:.3f}", f"{p['measured']:.3f}", f"{100 * p['error']:+.1f}%"]
                         for p in done],
                        ["procs", "slow rank", "spread", "tail P:X", "deal", "unit", "predicted", "measured", "error"]))
    top = curves["weak"][-1]
    drops = {kind: below(pts) for kind, pts in curves.items()}
    print(f"\nweak scaling at {top['gpus']:,} GPUs (llada_8b, global batch {top['global_batch']:,}, GPUs spread "
          f"{base.rank_spread:.0%}, dealt by {base.deal}): steady {top['steady']:.3f}, whole {args.hours:g} h run "
          f"{top['whole_run']:.3f} (seed's claim at 4,096: {SEED_CLAIM})")
    for kind, drop in drops.items():
        print(f"{titles[kind]}: " + (f"below 0.9 from {drop['gpus']} GPUs ({drop['steady']:.3f}, {drop['bottleneck']}; "
                                     f"the batch admits {drop['admitted_samplers']} samplers)" if drop
                                     else f"never below 0.9 up to {sizes[-1]:,} GPUs"))
    drop = drops["strong"]
    # every simulated point and variant must have consumed updates at a positive rate (lists: checked keyed)
    path = write_result("scale_model", {
        **curves, "validation": val, "stragglers": straggle, "sensitivity_4096": sens,
        "strong_below_0_9_at": drop["gpus"] if drop else None,
        "below_0_9_at": {kind: d["gpus"] if d else None for kind, d in drops.items()},
        "inputs": {"llada_8b": {**base.__dict__, "source": f"FLOPs at {MFU:.0%} of {H200_FLOPS / 1e12:.0f} TFLOP/s"},
                   "host_costs": costs["fit"], "rank0_and_sampler": costs["rank0_and_sampler"],
                   "host_costs_source": source, "gpus": list(sizes),
                   "weak": {"per_gpu": WEAK_PER_GPU, "cap": WEAK_CAP, "capped": CAPPED}, "strong": STRONG_BATCH,
                   "hours": args.hours,
                   "admitting_batch_4096": admitting_batch(top["samplers"], base.max_staleness)},
        "seed_claim_4096": SEED_CLAIM, "settings": vars(args), "smoke": args.smoke}, args.out,
        positive=["inputs.llada_8b.rollout_s", "inputs.llada_8b.update_s", "inputs.rank0_and_sampler.rank0_per_update_s",
                  "inputs.rank0_and_sampler.sampler_per_batch_s", "inputs.hours",
                  *(f"{k}.*.{m}" for k in curves for m in ("steady", "whole_run", "consumed", "learner_host_s",
                                                            "steady_completions_per_s")),
                  "sensitivity_4096.*.steady", "sensitivity_4096.*.whole_run"],
        present=["validation", "strong_below_0_9_at", "inputs.host_costs.const_s", "inputs.host_costs.per_trajectory_s"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
