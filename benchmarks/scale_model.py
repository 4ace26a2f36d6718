"""Predict Miles' asynchronous efficiency from 8 to 4,096 GPUs with the discrete-event model
(benchmarks/sim.py), from measured component costs, and find what saturates first.

    python -m benchmarks.components && python -m benchmarks.scale_model

Inputs. ``cpu_toy``: this machine's measured costs (benchmarks/results/components.json: rollout and
update per batch on one thread, batch and adapter bytes, store latency against the loopback S3
server). ``llada_8b``: LLaDA-8B's shape (64 completions x 256 tokens, 256-token prompts, d1's 128
steps, ADPO on a quarter of the steps, LoRA r=64 on every projection) costed by FLOPs at an
assumed 35% of an H200's 989 dense bf16 TFLOP/s: derived, not measured (no H200 was lent; its
GPU script would replace these). Named assumptions for a real deployment: S3's documented
3,500 PUT and 5,500 GET per second per partitioned prefix, 20 ms per request, 90 MB/s per
connection, and 40 GB/s all-reduce bus bandwidth per rank across nodes.

Validation: the model with this machine's measured component costs against Miles' own measured
runs (benchmarks/results/async_vs_sync.json, scaling.json), predicted beside measured.

Efficiency = completions/s / (N x one GPU's synchronous completions/s), N = samplers + learner
ranks; the seed's headline was 94.6% at 4,096. Writes benchmarks/results/scale_model.json.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

from benchmarks.harness import RESULTS, table, write_result
from benchmarks.sim import Params, simulate, update_time

GPUS = (8, 64, 512, 4096)
RATIOS = {"3:1": 4, "1:1": 2}  # samplers:learner ranks -> GPUs per learner rank
H200_FLOPS, MFU = 989e12, 0.35
GLOO_LOOPBACK = dict(link_bytes_s=1e9, link_latency_s=0.5e-3)  # named assumption, not measured
REAL_S3 = dict(store_latency_s=0.020, store_bytes_s=90e6, link_bytes_s=40e9, link_latency_s=10e-6)
SEED_CLAIM = 0.946


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def cpu_toy(components: dict | None) -> tuple[Params, str]:
    """The toy model's costs: measured here when components.json exists, else sim.Params' defaults
    (from a measured run too: benchmarks/async_vs_sync.py's docstring)."""
    if components is None:
        return Params(), "sim.Params defaults (run python -m benchmarks.components to measure)"
    c, s3 = components["compute"], components["store"]["loopback_s3"]
    return Params(rollout_s=c["rollout_s"], update_s=c["update_s"], completions_per_batch=c["completions_per_batch"],
                  adapter_bytes=c["adapter_bytes"], batch_bytes=s3["batch_bytes"], allreduce_bytes=2 * c["adapter_bytes"],
                  store_latency_s=s3["marker_check_s"]), "benchmarks/results/components.json"


def llada_8b() -> Params:
    """LLaDA-8B shape costed by FLOPs (module docstring): derived, not measured."""
    n, prompt, gen, steps, rows = 8e9, 256, 256, 128, 0.25
    rollout = 2 * n * 64 * (prompt + gen) * steps / (H200_FLOPS * MFU)
    update = 3 * 2 * n * 64 * (prompt + gen) * steps * rows / (H200_FLOPS * MFU)
    lora = 32 * (4 * (4096 * 64 * 2) + 3 * (4096 + 12288) * 64)  # r=64 on q,k,v,o,gate,up,down
    return Params(rollout_s=rollout, update_s=update, min_update_s=update / (64 * steps * rows) + 0.05,
                  completions_per_batch=64, adapter_bytes=2 * lora, allreduce_bytes=4 * lora, batch_bytes=64 * 768 * 10,
                  checkpoint_bytes=12 * lora, rollout_cv=0.2, max_pending=3, **REAL_S3)


def configure(base: Params, gpus: int, per_rank: int) -> Params:
    """``gpus`` split into samplers and learner ranks; back-pressure allows one waiting batch per
    sampler (async_rl.max_pending scaled with the run), the budget outlasts the horizon."""
    ranks = max(1, gpus // per_rank)
    samplers = gpus - ranks
    return replace(base, samplers=samplers, learner_ranks=ranks, batches=10**9, learner_samples=False,
                   max_pending=max(base.max_pending, samplers))


def horizon(p: Params, rollouts: int) -> float:
    """Simulated seconds for ``rollouts`` rollouts per sampler: a steady-state window."""
    return rollouts * p.rollout_s


def efficiency(p: Params, r: dict) -> float:
    one_gpu = p.completions_per_batch / (p.rollout_s + p.update_s)  # one GPU, synchronous
    return r["completions_per_s"] / ((p.samplers + p.learner_ranks) * one_gpu)


def validation(toy: Params) -> list[dict[str, Any]]:
    """Predicted against measured, for each of Miles' own measured runs found in results/."""
    out: list[dict[str, Any]] = []
    av = _load("async_vs_sync")
    if av:
        mc, lsu = av["machine_ceiling"], av["learner_seconds_per_update"]
        # measured: the run's own batches redone by two single-thread processes at once (async_vs_sync.py replay_floor)
        p = replace(toy, samplers=1, batches=av["completions"] // 128, rollout_s=mc["rollout_s_per_batch"],
                    update_s=mc["update_s_per_batch"], max_pending=3, max_staleness=av["staleness_bound"],
                    store_latency_s=(lsu["read_s"] + lsu["publish_s"]) / 4, learner_samples=True, shared_budget=True)
        r = simulate(p)
        out.append({"run": "async, 1 sampler + learner sampling in its bubbles (2 cores)", "metric": "compute seconds",
                    "predicted": r["seconds"], "measured": av["async_compute_s"],
                    "error": r["seconds"] / av["async_compute_s"] - 1,
                    "inputs": "machine_ceiling of the same run: its batches replayed two processes at once"})
        sync = p.batches * (mc["sync_rollout_s_per_batch"] + mc["sync_update_s_per_batch"])
        out.append({"run": "sync (2 threads)", "metric": "compute seconds", "predicted": sync,
                    "measured": mc["sync_compute_s"], "error": sync / mc["sync_compute_s"] - 1,
                    "inputs": "per-batch rollout and update of the same run (a pipeline of one stage)"})
        out.append({"run": "async over sync", "metric": "speedup", "predicted": sync / r["seconds"],
                    "measured": mc["sync_compute_s"] / av["async_compute_s"],
                    "error": (sync / r["seconds"]) / (mc["sync_compute_s"] / av["async_compute_s"]) - 1, "inputs": ""})
    sc, comp = _load("scaling"), _load("components")
    if sc and comp:
        ceiling = sc["machine_ceiling_2"]  # measured: two copies of the same work at once on this machine
        local = comp["store"]["local"]
        one = replace(toy, samplers=1, batches=40, update_s=1e-6, rollout_cv=0.05, learner_samples=False,
                      shared_budget=False, max_pending=10**6, max_staleness=10**6, store_latency_s=local["write_batch_s"] / 2)
        two = replace(one, samplers=2, batches=80, rollout_s=one.rollout_s / ceiling)
        pred = simulate(two)["completions_per_s"] / (2 * simulate(one)["completions_per_s"])
        out.append({"run": "2 sampler processes vs 1 (local store)", "metric": "efficiency", "predicted": pred,
                    "measured": sc["sampler_efficiency_2"], "error": pred / sc["sampler_efficiency_2"] - 1,
                    "inputs": "rollout and store costs of components.json, the machine ceiling of scaling.json"})
        u = 0.15  # the scaling benchmark's 1-rank update (its model, not the recipe's); only the ratio matters
        lr = replace(toy, learner_ranks=2, update_s=2 * u / ceiling, allreduce_bytes=4 * 2 * 128 * 8 * 2 * 4 * 2,
                     **GLOO_LOOPBACK)
        pred = u / update_time(lr)
        out.append({"run": "2 gloo learner ranks vs 1", "metric": "efficiency", "predicted": pred,
                    "measured": sc["learner_efficiency_2"], "error": pred / sc["learner_efficiency_2"] - 1,
                    "inputs": "the machine ceiling of scaling.json; gloo over loopback assumed 0.5 ms per ring step"})
    return out


CHANGES = {  # the design changes the model points to, each applied alone on top of Miles today
    "merge waiting batches, ranks read in parallel": lambda p: replace(p, batches_per_update=10**6),
    "staleness bound = pipeline depth": lambda p: replace(p, max_staleness=math.ceil(p.rollout_s / update_time(p)) + 2),
    "merge + depth bound": lambda p: replace(p, batches_per_update=10**6,
                                             max_staleness=math.ceil(p.rollout_s / update_time(p)) + 2),
    "object names over 64 prefixes": lambda p: replace(p, prefixes=64),
    "poll back-off x2 to 1 s": lambda p: replace(p, poll_backoff=2.0, poll_max_s=1.0),
    "push notifications, no polling": lambda p: replace(p, push=True),
    "all of the above": lambda p: replace(p, batches_per_update=10**6, prefixes=64, push=True, adapter_share=8,
                                          max_staleness=math.ceil(p.rollout_s / update_time(p)) + 2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=6, help="simulated rollouts per sampler (the window)")
    args = ap.parse_args()
    toy, toy_source = cpu_toy(_load("components"))
    sizes = {"cpu_toy": toy, "llada_8b": llada_8b()}
    points, rows = [], []
    for size, base in sizes.items():
        for ratio, per_rank in RATIOS.items():
            for gpus in GPUS:
                p = configure(base, gpus, per_rank)
                t = horizon(p, args.rollouts)
                r = simulate(p, t)
                eff = efficiency(p, r)
                changes = {}
                for name, fn in CHANGES.items():
                    q = fn(p)
                    rq = simulate(q, t)
                    changes[name] = {"efficiency": efficiency(q, rq), "bottleneck": rq["bottleneck"]}
                best = max(changes.items(), key=lambda kv: kv[1]["efficiency"])
                points.append({"size": size, "ratio": ratio, "gpus": gpus, "samplers": p.samplers,
                               "learner_ranks": p.learner_ranks, "efficiency": eff, **r, "changes": changes})
                rows.append([size, ratio, gpus, f"{r['completions_per_s']:.1f}", f"{eff:.3f}",
                             f"{r['learner_idle_fraction']:.2f}", f"{r['sampler_idle_fraction']:.2f}",
                             f"{max(r['staleness_hist'] or {0: 0})}", r["dropped"],
                             f"{sum(r['store_requests_per_s'].values()):.0f}", r["bottleneck"],
                             f"{best[0][:26]}: {best[1]['efficiency']:.3f}"])
    print(table(rows, ["model", "S:L", "GPUs", "compl/s", "eff", "L idle", "S idle", "max stale", "dropped",
                       "req/s", "bottleneck", "best change: eff"]))
    val = validation(toy)
    if val:
        print()
        print(table([[v["run"], v["metric"], f"{v['predicted']:.3f}", f"{v['measured']:.3f}", f"{100 * v['error']:+.1f}%"]
                     for v in val], ["validation run", "metric", "predicted", "measured", "error"]))
    else:
        print("\nno measured runs in benchmarks/results/ to validate against (run benchmarks.async_vs_sync, .scaling)")
    at4096 = [pt for pt in points if pt["gpus"] == 4096]
    print(f"\nefficiency at 4,096 GPUs: " + ", ".join(f"{pt['size']} {pt['ratio']} {pt['efficiency']:.3f}" for pt in at4096)
          + f" (seed's claim {SEED_CLAIM})")
    path = write_result("scale_model", {
        "validation": val, "points": points,
        "bottleneck": {f"{pt['size']}/{pt['ratio']}/{pt['gpus']}": pt["bottleneck"] for pt in points},
        "inputs": {"cpu_toy": {**toy.__dict__, "source": toy_source},
                   "llada_8b": {**sizes["llada_8b"].__dict__, "source": f"FLOPs at {MFU:.0%} of {H200_FLOPS / 1e12:.0f} TFLOP/s"}},
        "seed_claim_4096": SEED_CLAIM})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
