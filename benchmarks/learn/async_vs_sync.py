"""Asynchronous vs synchronous ADPO on the same recipe and the same number of completions.

Both arms start from one SFT checkpoint and consume num_samplers x batches_per_sampler batches of
prompts_per_iter x G completions.
  sync:  one process, torch threads = all cores: rollout -> reward -> update, in turn;
  async: the learner and num_samplers samplers as separate processes, one torch thread each,
         talking only through the run's store (local folder by default, --s3 for the loopback
         S3 endpoint), bounded staleness S = async_rl.max_staleness, admission k < (S + v + 1) B;
         whenever no batch waits, the learner samples one of the budget itself (learner_samples).
Each arm's seconds are end to end, process start-up included. Both final adapters are evaluated
on the same held-out problems with the recipe's pinned eval config.
Writes benchmarks/results/async_vs_sync.json. Run: python -m benchmarks.async_vs_sync [--smoke]
(--smoke: the same arms, ceiling and evaluation on a 3-step SFT, 3 batches of 2 x 4 completions and
8 eval problems; writes async_vs_sync_smoke.json).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any
from unittest import mock

from benchmarks.harness import (ASYNC_OVERRIDES, bench_args, evaluate_adapter, local_run, sft_checkpoint, table, usable_cpus,
                                workdir, write_result)

# 150 batches (the arith recipe's train.iterations) of 16 x 8 completions. Measured on the quiet
# 2-core machine (single thread: a rollout 0.49 s, an update 0.16 s; sync with 2 threads: 0.31 s
# and 0.13 s, since two threads speed a rollout up 1.6x):
#   3 samplers, nice 0:  1.06x, learner idle 7.5%  (4 processes time-share 2 cores; samplers slow down)
#   2 samplers, nice 10, shared budget: 1.14x, 1.25x, idle 38-43%: a learner with a core to itself waits
#   1 sampler + the learner sampling whenever no batch waits (learner_samples): 1.12-1.19x over four
#     runs, idle 0-0.6%  <- default. Both cores stay busy; what is left is the work itself, which
#     machine_ceiling() measures in the same run: 1.31x before start-up (~10 s of importing torch +
#     peft in each arm), 1.27x with it.
# LoRA r=4 on q_proj/v_proj (the LoRA paper's choice) and bfloat16 adapter sync: 1/77 of the base's
# bytes per version (r=16 on every projection in float32: 1/3).
DEFAULT_OVERRIDES = ASYNC_OVERRIDES  # benchmarks/harness.py: components.py measures the same run's parts
# --smoke: the same run at sizes that take seconds (a budget of 3 batches, which the learner and
# the sampler share as in the full run), and the ceiling's processes start as soon as they are ready.
# A 3-step SFT earns no reward spread, so every update would skip all its rows: smoke scores them all.
SMOKE_OVERRIDES = ["sft.steps=3", "async_rl.batches_per_sampler=3", "async_rl.checkpoint_every=2",
                   "train.prompts_per_iter=2", "train.group_size=4", "eval.num_problems=8",
                   "update.skip_zero_variance=false"]
REPLAY_LEAD_S = 25.0  # seconds the replay's processes get to load and read their batches before the shared start
SMOKE_REPLAY_LEAD_S = 0.0


def timed_loop(cfg_json: str, base: str, threads: int, batches: int):
    """rollout -> reward -> update ``batches`` times with ``threads`` torch threads, through the
    synchronous run (collect commits each batch; consume updates, checkpoints and publishes) ->
    (learner, rollout seconds, update seconds, rows the updates scored)."""
    import torch

    torch.set_num_threads(threads)
    from miles_core.allocator import apply_heap_setting
    from miles_core.config import load_recipe

    cfg = load_recipe(json.loads(cfg_json))
    apply_heap_setting(cfg.async_rl.retain_heap_mb)  # the async workers' allocator setting, so both arms run alike
    roll = upd = rows = 0.0
    with local_run(cfg, base) as run:  # the synchronous run `miles train` trains: it commits, checkpoints, publishes
        for seq in range(batches):
            t0 = time.perf_counter()
            bid, _, _ = run.collect(seq)
            t1 = time.perf_counter()
            rows += run.consume(bid)[1].get("rows", 0.0)
            roll, upd = roll + t1 - t0, upd + time.perf_counter() - t1
    return run.learner, roll, upd, rows


def sync_arm(cfg_json: str, base: str, threads: int, out: str) -> None:
    """The synchronous loop, in its own process (so start-up costs match the async arm)."""
    a = json.loads(cfg_json)["async_rl"]
    n = a["num_samplers"] * a["batches_per_sampler"]
    learner, roll, upd, rows = timed_loop(cfg_json, base, threads, n)
    learner.save_adapter(out)
    Path(out, "timing.json").write_text(json.dumps({"rollout_s": roll, "update_s": upd, "batches": n, "rows": rows}))


def sync_process(cfg: Any, base: str, threads: int, out: Path) -> float:
    """:func:`sync_arm` in its own process (so start-up costs match the async arm's) -> its seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from benchmarks.async_vs_sync import sync_arm; "
                    "sync_arm(*sys.argv[1:3], int(sys.argv[3]), sys.argv[4])",
                    json.dumps(cfg.to_dict()), base, str(threads), str(out)],
                   check=True, cwd=Path(__file__).resolve().parents[2])
    return time.perf_counter() - t0


# ---- the compute floor of the async run: its own work, redone with no asynchrony at all
#
# The compute floor of one asynchronous run: its own work, redone with no asynchrony at all.
#
# An asynchronous run's batches differ from any other run's: their prompts and noise are seeded by
# (worker, sequence number), the policy that sampled each is a different version, and the number of
# rows an update scores (the denoising steps of every trajectory whose group had a reward spread)
# varies from batch to batch by a factor of two. A floor measured on a few other batches is therefore
# a floor for other work: the 8-batch probe this benchmark used before held 232 rows per update
# where the run it was compared with held 300, and that alone put the floor ~5 s low.
#
# So the floor replays the run. Every consumed batch is sampled again with the adapter version that
# sampled it (same worker seed, same sequence number: ``sample_batch`` is deterministic in them) and
# its stored copy is updated on again, each in a single-thread process, the batches dealt out over
# as many such processes as the run had cores, all starting at one instant (so they contend for
# caches and memory bandwidth as the run's processes did). Nothing is read, written, published or
# polled inside the timed region. The floor is the total of those seconds over the number of
# processes: the wall clock of a perfectly balanced split of the same work with no coordination.


def replay_share(cfg_json: str, base: str, run_uri: str, bids: list[str], start_at: float) -> dict[str, Any]:
    """Redo ``bids`` (rollout with the batch's own adapter version, then the update on its stored
    copy), one torch thread, from wall-clock ``start_at`` -> seconds and how faithful the replay was."""
    import torch

    torch.set_num_threads(1)
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from miles_core.algo.rl import batch_seq, sample_batch
    from miles_core.allocator import apply_heap_setting
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.learner.policy import Learner, build_policy
    from miles_core.models.lora import ADAPTER_WEIGHTS
    from miles_core.rewards.registry import reward_for_recipe
    from miles_core.storage.run import RunStore

    cfg = load_recipe(json.loads(cfg_json))
    apply_heap_setting(cfg.async_rl.retain_heap_mb)  # as the run's workers do (miles_core/allocator.py)
    rs = RunStore(run_uri)
    model, tok = build_policy(cfg, base, trainable=False)  # as a sampler builds it
    learner = Learner(cfg, base, total_updates=len(bids))
    data, reward_fn = build_task(cfg), reward_for_recipe(cfg)
    stored = {bid: rs.trajectories.read_batch(bid) for bid in bids}
    adapters = {}
    with TemporaryDirectory() as tmp:
        for v in sorted({int(b.policy_version.min()) for b in stored.values()}):
            adapters[v] = load_file(str(rs.adapters.fetch(v, Path(tmp) / f"v{v}") / ADAPTER_WEIGHTS))
    time.sleep(max(0.0, start_at - time.time()))
    roll = upd = 0.0
    identical, rows = 0, {}
    for bid in bids:
        batch = stored[bid]
        version = int(batch.policy_version.min())
        worker = bid.split("-", 1)[1]
        index = cfg.async_rl.num_samplers if worker == "learner" else int(worker[1:])
        set_peft_model_state_dict(model, adapters[version])
        t0 = time.perf_counter()
        again = sample_batch(cfg, model, tok, data, reward_fn, worker, index, batch_seq(bid), version)
        t1 = time.perf_counter()
        stats = learner.update(batch)
        t2 = time.perf_counter()
        roll, upd = roll + t1 - t0, upd + t2 - t1
        identical += bool(torch.equal(again.completion_ids, batch.completion_ids))
        rows[bid] = float(stats.get("rows", 0.0))
    return {"rollout_s": roll, "update_s": upd, "identical": identical, "rows": rows}


def replay_floor(cfg: Any, base: str, run_uri: str, consumed: list[dict[str, Any]], history: list[dict[str, Any]],
                 processes: int, lead_s: float = REPLAY_LEAD_S) -> dict[str, Any]:
    """Replay the run's ``consumed`` batches over ``processes`` single-thread processes -> the floor
    and the per-batch costs it is made of. ``history`` (the learner's, in the same order) gives the
    rows each real update scored, to check that the replay did the same work. The processes start
    together ``lead_s`` seconds after the pool is made (each then starts at once if it is late)."""
    bids = [e["id"] for e in consumed]
    shares = [bids[i::processes] for i in range(processes)]
    cfg_json = json.dumps(cfg.to_dict())
    with mp.get_context("spawn").Pool(processes) as pool:
        start = time.time() + lead_s  # every process has loaded and read its batches before the shared start
        parts = pool.starmap(replay_share, [(cfg_json, base, run_uri, s, start) for s in shares])
    n = len(bids)
    roll = sum(p["rollout_s"] for p in parts)
    upd = sum(p["update_s"] for p in parts)
    replay_rows = {k: v for p in parts for k, v in p["rows"].items()}
    real_rows = {e["id"]: float(h.get("rows", 0.0)) for e, h in zip(consumed, history)}
    return {"batches": n, "processes": processes, "rollout_s_per_batch": roll / max(n, 1),
            "update_s_per_batch": upd / max(n, 1), "async_compute_floor_s": (roll + upd) / processes,
            "rollouts_identical": sum(p["identical"] for p in parts) / max(n, 1),
            "update_rows_per_batch": sum(real_rows.values()) / max(n, 1),
            "update_rows_matching": sum(replay_rows.get(k) == v for k, v in real_rows.items()) / max(n, 1)}


def machine_ceiling(cfg, base: str, run_uri: str, sync_timing: dict, consumed: list[dict], history: list[dict],
                    lead_s: float = REPLAY_LEAD_S) -> dict:
    """The best asynchronous time this machine allows for this run's work, measured, not assumed.

    Async runs single-threaded processes side by side, so its floor is the single-thread work of
    every batch it consumed, redone two processes at once (``replay_floor`` above) and spread
    over the cores. Sync's compute is what the sync arm measured with all threads. Their ratio
    bounds the speedup before start-up costs (equal in both arms); the rows each arm's updates
    scored say how much of the ratio is the two runs' different batches.
    """
    f = replay_floor(cfg, base, run_uri, consumed, history, min(usable_cpus(), cfg.async_rl.num_samplers + 1), lead_s)
    n = sync_timing["batches"]
    sync_compute = sync_timing["rollout_s"] + sync_timing["update_s"]
    return {**f, "sync_rollout_s_per_batch": sync_timing["rollout_s"] / n,
            "sync_update_s_per_batch": sync_timing["update_s"] / n,
            "sync_update_rows_per_batch": sync_timing.get("rows", 0.0) / n, "sync_compute_s": sync_compute,
            "speedup_ceiling_before_startup": sync_compute / f["async_compute_floor_s"]}


def learner_breakdown(history: list[dict], summary: dict) -> dict[str, float]:
    """Where the async learner's loop time went, in seconds per consumed batch: reading the batch,
    the ADPO update, checkpointing, publishing the adapter, sampling batches itself, idling, and
    the rest (listing the store, the ledger and status writes). When the learner is the bottleneck,
    everything but ``update_s`` is what asynchrony costs over the synchronous loop."""
    n = max(len(history), 1)
    per = {k: sum(h.get(k, 0.0) for h in history) / n for k in ("read_s", "update_s", "checkpoint_s", "publish_s")}
    per["self_sample_s"] = summary.get("self_sample_s", 0.0) / n
    per["idle_s"] = summary["idle_s"] / n
    per["other_s"] = summary["wall_s"] / n - sum(per.values())
    return per


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, checkpoint=True, workdir=True)
    ap.add_argument("--s3", action="store_true", help="run the async store on a loopback moto S3 server")
    ap.add_argument("--no-ceiling", action="store_true", help="skip measuring this machine's speedup ceiling "
                    "(the async run's batches redone by single-thread processes at once, ~1 minute)")
    ap.add_argument("--cold", action="store_true", help="start each async worker as a fresh interpreter "
                    "(default: fork them from one preloaded server, as long-lived workers would be)")
    args = ap.parse_args(argv)
    import torch

    from miles_core.asyncrl.launch import prepare_run, run_local
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    cores = usable_cpus()
    overrides = DEFAULT_OVERRIDES + (SMOKE_OVERRIDES if args.smoke else []) + args.set
    cfg = load_recipe("arith", overrides)
    work = workdir(args, "async")
    torch.set_num_threads(cores)
    sft = sft_checkpoint(cfg, cfg.sft.seed, work, args.checkpoint, build_task(cfg), validate=False, progress=True)
    base = sft["path"]
    if sft["trained"]:
        print(f"SFT checkpoint trained in {sft['seconds']:.0f}s", flush=True)

    # --- sync
    sync_seconds = sync_process(cfg, base, cores, work / "sync_adapter")
    timing = json.loads((work / "sync_adapter" / "timing.json").read_text())
    print(f"sync: {sync_seconds:.1f}s (rollout {timing['rollout_s']:.1f}s, update {timing['update_s']:.1f}s)", flush=True)

    # --- async
    server = None
    env: dict[str, str] = {}
    run_uri = str(work / "async_run")
    if args.s3:
        from tools.loopback_s3 import start_loopback_s3

        server, env = start_loopback_s3("miles-bench")
        run_uri = "s3://miles-bench/async_run"
    try:
        with mock.patch.dict(os.environ, env):  # this process's store calls too, restored after (main runs in tests)
            prepare_run(run_uri, cfg, base)
            t1 = time.perf_counter()
            summary = run_local(run_uri, cfg.async_rl.num_samplers, work / "logs", timeout=3600, env=env,
                                warm=not args.cold)
            async_seconds = time.perf_counter() - t1
            from miles_core.storage.run import RunStore

            rs = RunStore(run_uri)
            rs.adapters.fetch(summary["version"], work / "async_adapter")
            record = rs.read_json("learner", "history.json")
            learner_time = learner_breakdown(record["history"], summary)
            print(f"async: {async_seconds:.1f}s, learner idle {summary['idle_fraction']:.3f}", flush=True)
            ceiling = None if args.no_ceiling else machine_ceiling(
                cfg, base, run_uri, timing, record["ledger"]["consumed"], record["history"],
                SMOKE_REPLAY_LEAD_S if args.smoke else REPLAY_LEAD_S)
    finally:
        if server is not None:
            server.stop()

    sync_pass1, sync_correct = evaluate_adapter(cfg, base, str(work / "sync_adapter"))
    async_pass1, async_correct = evaluate_adapter(cfg, base, str(work / "async_adapter"))
    from miles_core.models.base import load_checkpoint

    full_bytes = sum(p.stat().st_size for p in Path(base).glob("*.safetensors"))
    n_params = sum(p.numel() for p in load_checkpoint(base)[0].parameters())
    completions = cfg.async_rl.num_samplers * cfg.async_rl.batches_per_sampler * cfg.train.prompts_per_iter * cfg.train.group_size
    payload = {
        "sync_seconds": sync_seconds, "async_seconds": async_seconds, "speedup": sync_seconds / async_seconds,
        "learner_idle_fraction": summary["idle_fraction"],
        "learner_idle_fraction_steady": summary["idle_fraction_steady"], "pipeline_fill_s": summary["fill_s"],
        "sync_pass1": sync_pass1, "async_pass1": async_pass1,
        "max_staleness_seen": summary["max_staleness_seen"], "staleness_bound": summary["staleness_bound"],
        "staleness_hist": summary["staleness_hist"], "dropped_batches": summary["dropped"],
        "adapter_sync_bytes": summary["adapter_sync_bytes_mean"], "adapter_sync_bytes_total": summary["adapter_sync_bytes"],
        "adapter_syncs": summary["adapter_syncs"], "adapter_sync_seconds_mean": summary["adapter_sync_seconds_mean"],
        "adapter_sync_lag_seconds_mean": summary["adapter_sync_lag_seconds_mean"],
        "full_weights_bytes": full_bytes, "base_parameters": n_params,
        "completions": completions, "completions_consumed_async": summary["completions"],
        "samples_per_s_sync": completions / sync_seconds, "samples_per_s_async": completions / async_seconds,
        "sync_rollout_s": timing["rollout_s"], "sync_update_s": timing["update_s"],
        "threads": {"sync": cores, "async_sampler": cfg.async_rl.sampler_threads,
                    "async_learner": cfg.async_rl.learner_threads, "async_processes": cfg.async_rl.num_samplers + 1,
                    "cores": cores},
        "learner_self_sampled_batches": summary.get("self_sampled_batches", 0),
        "learner_self_sample_fraction": summary.get("self_sample_fraction", 0.0),
        "lora": {"r": cfg.lora.r, "targets": cfg.lora.targets or "backend default"}, "sync_dtype": cfg.async_rl.sync_dtype,
        "store": "s3 (loopback moto)" if args.s3 else "local folder", "overrides": overrides,
        "sft_checkpoint": {k: v for k, v in sft.items() if k != "curve"},
        "async_workers": "fresh interpreters" if args.cold else "forked from one preloaded server",
        "learner_seconds_per_update": learner_time,
        "pass1_agreement": sum(a == b for a, b in zip(sync_correct, async_correct)) / max(len(sync_correct), 1),
        "sync_batches": timing["batches"], "smoke": args.smoke,
    }
    rows = [["sync", f"{sync_seconds:.1f}", f"{completions / sync_seconds:.1f}", "-", sync_pass1, "-"],
            ["async", f"{async_seconds:.1f}", f"{completions / async_seconds:.1f}",
             f"{summary['idle_fraction']:.3f}", async_pass1, summary["max_staleness_seen"]]]
    print(table(rows, ["arm", "seconds", "samples/s", "learner idle", "pass@1", "max staleness"]))
    print(f"learner idle after the first batch arrived: {summary['idle_fraction_steady']:.3f} "
          f"(pipeline fill {summary['fill_s']:.1f}s); the learner sampled {payload['learner_self_sampled_batches']} "
          f"of the batches itself ({payload['learner_self_sample_fraction']:.0%} of its time)")
    print("async learner, seconds per consumed batch: " + ", ".join(f"{k[:-2]} {v:.4f}" for k, v in learner_time.items())
          + f"; sync: {(timing['rollout_s'] + timing['update_s']) / timing['batches']:.4f} per batch (rollout + update)")
    print(f"speedup {payload['speedup']:.2f}x; adapter sync {payload['adapter_sync_bytes']:.0f} B per version vs "
          f"full weights {full_bytes} B (1/{full_bytes / max(payload['adapter_sync_bytes'], 1):.0f}); "
          f"dropped {summary['dropped']}")
    if ceiling is not None:
        c = ceiling
        payload["machine_ceiling"] = c
        payload["async_compute_s"] = summary["wall_s"]  # the learner's loop: start-up and teardown excluded
        payload["async_compute_over_floor"] = summary["wall_s"] / c["async_compute_floor_s"]
        print(table([[f"the async run's batches redone, {c['processes']} single-thread processes at once",
                      f"{c['rollout_s_per_batch']:.3f}", f"{c['update_s_per_batch']:.3f}", f"{c['update_rows_per_batch']:.0f}"],
                     [f"sync, {cores} threads", f"{c['sync_rollout_s_per_batch']:.3f}", f"{c['sync_update_s_per_batch']:.3f}",
                      f"{c['sync_update_rows_per_batch']:.0f}"]],
                    ["per batch", "rollout s", "update s", "update rows"]))
        print(f"replay: {c['rollouts_identical']:.0%} of rollouts token-identical, {c['update_rows_matching']:.0%} of "
              f"updates scored the same rows")
        print(f"machine ceiling: sync compute {c['sync_compute_s']:.1f}s / async floor {c['async_compute_floor_s']:.1f}s "
              f"= {c['speedup_ceiling_before_startup']:.2f}x before start-up; the async learner's loop took "
              f"{summary['wall_s']:.1f}s = {payload['async_compute_over_floor']:.3f}x the floor")
    # what the benchmark exists to measure: both arms ran and consumed batches, the learner's loop
    # was timed, adapters were synced, and (unless --no-ceiling) the replay redid the run's batches
    positive = ["sync_seconds", "async_seconds", "speedup", "sync_batches", "sync_rollout_s", "sync_update_s",
                "completions_consumed_async", "samples_per_s_sync", "samples_per_s_async", "adapter_syncs",
                "adapter_sync_bytes", "full_weights_bytes", "learner_seconds_per_update.update_s"]
    if ceiling is not None:
        positive += ["machine_ceiling.batches", "machine_ceiling.async_compute_floor_s", "machine_ceiling.sync_compute_s",
                     "machine_ceiling.update_rows_per_batch", "machine_ceiling.sync_update_rows_per_batch",
                     "machine_ceiling.speedup_ceiling_before_startup", "async_compute_s"]
    present = ["sync_pass1", "async_pass1", "learner_idle_fraction", "max_staleness_seen", "dropped_batches",
               "pass1_agreement"]
    print(f"wrote {write_result('async_vs_sync', payload, args.out, positive=positive, present=present)}")


if __name__ == "__main__":
    main()
