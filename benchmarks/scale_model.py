"""Predict Miles' asynchronous efficiency from 8 to 4,096 GPUs with the discrete-event model
(benchmarks/sim.py) for the design as built, and validate the model on the emulated runs.

    python -m benchmarks.emulate && python -m benchmarks.scale_model

The design as built (miles_core/asyncrl): admission (a sampler starts slot k only while
k < (S + v + 1) B), global-batch updates of B sampler batches read in shares by D learner ranks,
samplers polling only ``adapters/LATEST`` (and ``control/STOP``) with back-off, and the split and
B that ``asyncrl/placement.py`` picks from seconds per completion.

Inputs. ``llada_8b``: LLaDA-8B's shape (64 completions x 256 tokens, 256-token prompts, d1's 128
steps, ADPO on a quarter of the steps, LoRA r=64 on every projection) costed by FLOPs at an
assumed 35% of an H200's 989 dense bf16 TFLOP/s: derived, not measured (no H200 was lent).
Named assumptions for a real deployment: S3's documented 3,500 PUT and 5,500 GET per second per
prefix (all keys on one prefix here, the worst case), 20 ms per request, 90 MB/s per connection,
40 GB/s all-reduce bus bandwidth per rank, polls backing off x2 up to 5 s (2.6% of a rollout).

Validation: every run of benchmarks/results/emulate.json (the real code on SeaweedFS with a
calibrated compute stand-in) predicted from the same stand-in costs and the store latency the run
measured: efficiency and requests per batch, predicted beside measured.

Efficiency = completions/s / (N x one GPU's synchronous completions/s), N = samplers + learner
ranks; the seed's headline was 94.6% at 4,096. Writes benchmarks/results/scale_model.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from benchmarks.harness import RESULTS, table, write_result
from benchmarks.sim import Params, simulate
from miles_core.asyncrl.placement import Placement, place
from miles_core.storage.uri import S3_CONNECTIONS

GPUS = (8, 64, 512, 4096)
H200_FLOPS, MFU = 989e12, 0.35
# one S3 connection ~90 MB/s; Miles moves large objects over S3_CONNECTIONS (storage/uri.py)
REAL_S3 = dict(store_latency_s=0.020, store_bytes_s=90e6 * S3_CONNECTIONS, link_bytes_s=40e9, link_latency_s=10e-6)
SEED_CLAIM = 0.946


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def llada_8b() -> Params:
    """LLaDA-8B shape costed by FLOPs (module docstring): derived, not measured."""
    n, prompt, gen, steps, rows = 8e9, 256, 256, 128, 0.25
    rollout = 2 * n * 64 * (prompt + gen) * steps / (H200_FLOPS * MFU)
    update = 3 * 2 * n * 64 * (prompt + gen) * steps * rows / (H200_FLOPS * MFU)
    lora = 32 * (4 * (4096 * 64 * 2) + 3 * (4096 + 12288) * 64)  # r=64 on q,k,v,o,gate,up,down
    return Params(rollout_s=rollout, update_s=update, completions_per_batch=64, adapter_bytes=2 * lora,
                  allreduce_bytes=4 * lora, batch_bytes=64 * 768 * 10, checkpoint_bytes=12 * lora, rollout_cv=0.2,
                  max_staleness=6, checkpoint_every=10, poll_s=0.05, poll_backoff=2.0, poll_max_s=5.0, learner_samples=False,
                  shared_budget=False, **REAL_S3)


def configure(base: Params, gpus: int) -> tuple[Params, Placement]:
    """``gpus`` split as placement.py splits them, with its global batch; a budget beyond the horizon."""
    c = base.completions_per_batch
    pl = place(gpus, base.rollout_s / c, base.update_s / c, base.max_staleness)
    return replace(base, samplers=pl.samplers, learner_ranks=pl.learner_ranks, batches=10**9,
                   batches_per_update=pl.batches_per_update), pl


def efficiency(p: Params, r: dict) -> float:
    """Steady-state completions/s (after the pipeline's fill) over N GPUs' synchronous ideal."""
    one_gpu = p.completions_per_batch / (p.rollout_s + p.update_s)  # one GPU, synchronous
    return r["steady_completions_per_s"] / ((p.samplers + p.learner_ranks) * one_gpu)


def emulated_params(run: dict) -> Params:
    """The model of one emulated run: its stand-in's costs, split, global batch and budget, and
    the store latency that run measured on SeaweedFS."""
    return Params(samplers=run["samplers"], learner_ranks=run["learner_ranks"], batches=run["batches"],
                  completions_per_batch=run["completions_per_batch"], rollout_s=run["measured_rollout_s"], rollout_cv=0.05,
                  update_s=run["measured_update_s"],
                  allreduce_bytes=run["allreduce_bytes"], link_bytes_s=run["link_bytes_s"], link_latency_s=2e-4,
                  adapter_bytes=run["adapter_bytes"], batch_bytes=run["batch_bytes"], checkpoint_every=1,
                  store_latency_s=run["store_latency_s"], store_bytes_s=run["store_bytes_s"],
                  put_rate=run["store_rate"], get_rate=run["store_rate"], poll_s=run["poll_s"],
                  poll_backoff=run["poll_backoff"], poll_max_s=run["poll_max_s"], max_staleness=run["max_staleness"],
                  learner_samples=False, shared_budget=False, batches_per_update=run["batches_per_update"],
                  sampler_host_s=run.get("sampler_host_s", 0.0), learner_host_s=run.get("learner_host_s", 0.0),
                  learner_start_s=run.get("learner_start_s", 0.0),
                  startup_poll_s=run["learner_start_s"] / run["startup_polls"] if run.get("startup_polls") else 0.0,
                  **({"wire": run["wire"]} if "wire" in run else {}))


def validation() -> list[dict[str, Any]]:
    """Predicted against measured for every emulated run found in results/."""
    out: list[dict[str, Any]] = []
    for run in (_load("emulate") or {}).get("runs", []):
        r = simulate(emulated_params(run))
        pred = r["after_two_updates_completions_per_s"] / run["ideal_completions_per_s"]  # as emulate.py measures
        out.append({"run": f"emulated, {run['processes']} processes", "metric": "efficiency", "predicted": pred,
                    "measured": run["efficiency"], "error": pred / run["efficiency"] - 1})
        out.append({"run": f"emulated, {run['processes']} processes", "metric": "requests per batch",
                    "predicted": r["requests_per_batch"], "measured": run["requests_per_batch"],
                    "error": r["requests_per_batch"] / run["requests_per_batch"] - 1})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=40, help="simulated rollouts per sampler (the first 8 fill the pipeline)")
    args = ap.parse_args()
    base = llada_8b()
    points, rows = [], []
    for gpus in GPUS:
        p, pl = configure(base, gpus)
        r = simulate(p, args.rollouts * p.rollout_s, warmup_s=8 * p.rollout_s)
        eff = efficiency(p, r)
        points.append({"size": "llada_8b", "gpus": gpus, "samplers": p.samplers, "learner_ranks": p.learner_ranks,
                       "batches_per_update": p.batches_per_update, "efficiency": eff,
                       "predicted_idle": {"samplers": pl.sampler_idle, "learner": pl.learner_idle}, **r})
        rows.append([gpus, f"{p.samplers}:{p.learner_ranks}", p.batches_per_update, f"{r['completions_per_s']:.1f}",
                     f"{eff:.3f}", f"{r['learner_idle_fraction']:.2f}", f"{r['sampler_idle_fraction']:.2f}",
                     f"{max(r['staleness_hist'] or {0: 0})}", r["dropped"], f"{r['requests_per_batch']:.1f}",
                     f"{sum(r['store_requests_per_s'].values()):.0f}", r["bottleneck"]])
    print(table(rows, ["GPUs", "S:D", "B", "compl/s", "eff", "L idle", "S idle", "max stale", "dropped",
                       "req/batch", "req/s", "bottleneck"]))
    val = validation()
    if val:
        print()
        print(table([[v["run"], v["metric"], f"{v['predicted']:.3f}", f"{v['measured']:.3f}", f"{100 * v['error']:+.1f}%"]
                     for v in val], ["validation run", "metric", "predicted", "measured", "error"]))
    else:
        print("\nno emulated runs in benchmarks/results/ to validate against (run python -m benchmarks.emulate)")
    at4096 = next(pt for pt in points if pt["gpus"] == 4096)
    print(f"\nefficiency at 4,096 GPUs (llada_8b): {at4096['efficiency']:.3f} (seed's claim {SEED_CLAIM})")
    path = write_result("scale_model", {
        "validation": val, "points": points,
        "bottleneck": {f"{pt['size']}/{pt['gpus']}": pt["bottleneck"] for pt in points},
        "inputs": {"llada_8b": {**base.__dict__, "source": f"FLOPs at {MFU:.0%} of {H200_FLOPS / 1e12:.0f} TFLOP/s"}},
        "seed_claim_4096": SEED_CLAIM})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
