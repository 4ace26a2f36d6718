"""Chaos: an asynchronous run on the loopback S3 endpoint while samplers and the learner are
SIGKILLed at random moments and restarted (they resume from the store).

Afterwards the store is audited against the learner's ledger (the one in its last checkpoint):
  batches_committed   committed batch ids (plus quarantined ones)
  batches_consumed    ids the surviving learner lineage trained on
  batches_lost        committed ids neither consumed, dropped for staleness nor quarantined
  batches_duplicated  consumed entries minus distinct consumed ids
  max_staleness_seen  largest staleness among consumed batches (must be <= staleness_bound)
Checkpoints are written every 2 updates, so a killed learner also exercises the orphaned-version
path (updates after its last checkpoint are redone and numbered above what it had published).
Writes benchmarks/results/chaos.json. Run: python -m benchmarks.chaos [--kills 8] [--smoke]
(--smoke: 2 kills, one sampler's and then the learner's, 0.5-1 s apart, in a run of 2 x 6 batches of
2 x 4 completions from a 3-step SFT; writes chaos_smoke.json).
"""

from __future__ import annotations

import os
import random
import signal
import time
from unittest import mock

from benchmarks.harness import bench_args, sft_checkpoint, table, usable_cpus, workdir, write_result
from tools.loopback_s3 import start_loopback_s3

DEFAULT_OVERRIDES = ["async_rl.num_samplers=2", "async_rl.batches_per_sampler=15",
                     "async_rl.checkpoint_every=2", "async_rl.max_staleness=3", "sft.steps=300",
                     "async_rl.retry_budget_s=120", "async_rl.poll_interval=0.05"]
# --smoke: the same run and audit in seconds. Every update scores all its rows (a 3-step SFT earns no
# reward spread, and updates that skip every row would end the run before a kill could land).
SMOKE_OVERRIDES = ["sft.steps=3", "async_rl.batches_per_sampler=6", "train.prompts_per_iter=2", "train.group_size=4",
                   "update.skip_zero_variance=false"]
SMOKE = {"kills": 2, "min_gap": 0.5, "max_gap": 1.0}


def audit(run_uri: str, expected: int) -> dict:
    from miles_core.learner.ledger import stored_state
    from miles_core.storage.run import RunStore

    rs = RunStore(run_uri)
    committed = set(rs.trajectories.list_batches()) | set(rs.trajectories.list_quarantined())
    ledger = stored_state(rs, rs.load_checkpoint()["ledger"])
    consumed = [e["id"] for e in ledger["consumed"]]
    accounted = set(consumed) | {e["id"] for e in ledger["dropped"]} | {e["id"] for e in ledger["quarantined"]}
    status = rs.read_json("learner", "status.json") or {}
    return {"batches_expected": expected, "batches_committed": len(committed), "batches_consumed": len(set(consumed)),
            "batches_dropped": len(ledger["dropped"]), "batches_quarantined": len(ledger["quarantined"]),
            "batches_lost": len(committed - accounted), "batches_duplicated": len(consumed) - len(set(consumed)),
            "batches_unexpected": len(accounted - committed),
            "max_staleness_seen": max((e["staleness"] for e in ledger["consumed"]), default=0),
            # resumes that reached a checkpoint (a learner killed again during start-up leaves none)
            "learner_resumes_checkpointed": status.get("resumes"), "version_skips": status.get("version_skips"),
            "final_version": status.get("version")}


def learner_started(rs) -> bool:
    """Kills start once the learner has consumed a batch, so every kill lands in real work."""
    return int((rs.read_json("learner", "status.json") or {}).get("updates", 0)) > 0


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, checkpoint=True, workdir=True)
    ap.add_argument("--kills", type=int, default=8, help="SIGKILLs to deliver (bounded)")
    ap.add_argument("--min-gap", type=float, default=4.0, help="seconds between kills, at least")
    ap.add_argument("--max-gap", type=float, default=12.0, help="seconds between kills, at most")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    import torch

    from miles_core.asyncrl.launch import LocalRun, local_env, prepare_run, worker_names
    from miles_core.storage.run import RunStore
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    overrides = DEFAULT_OVERRIDES + (SMOKE_OVERRIDES if args.smoke else []) + args.set
    cfg = load_recipe("arith", overrides)
    work = workdir(args, "chaos")
    torch.set_num_threads(usable_cpus())
    base = sft_checkpoint(cfg, cfg.sft.seed, work, args.checkpoint, build_task(cfg), validate=False)["path"]  # a short SFT
    server, env = start_loopback_s3("miles-chaos")
    environ = mock.patch.dict(os.environ, env)  # this process's store calls too; restored after (main runs in tests)
    environ.start()
    run_uri = "s3://miles-chaos/run"
    rng = random.Random(args.seed)
    kills: list[dict] = []
    t0 = time.perf_counter()
    run = None
    try:
        prepare_run(run_uri, cfg, base)
        rs = RunStore(run_uri)
        run = LocalRun(run_uri, cfg.async_rl.num_samplers, local_env(env), work / "logs")
        run.start_all()
        next_kill = time.monotonic() + rng.uniform(args.min_gap, args.max_gap)
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            for name in list(run.failed()):
                run.start(name)  # a killed process comes back and resumes from the store
            if all(p.poll() == 0 for p in run.procs.values()):
                break
            if len(kills) < args.kills and time.monotonic() >= next_kill and learner_started(rs):
                # alternate: the learner on every other kill, a random sampler otherwise
                pool = ["learner"] if len(kills) % 2 else worker_names(cfg.async_rl.num_samplers)
                alive = [n for n in pool if run.procs[n].poll() is None]
                if alive:
                    victim = rng.choice(alive)
                    os.kill(run.procs[victim].pid, signal.SIGKILL)
                    run.procs[victim].wait()
                    kills.append({"process": victim, "at_s": round(time.perf_counter() - t0, 2)})
                    print(f"[chaos] t={kills[-1]['at_s']:.1f}s SIGKILL {victim}", flush=True)
                next_kill = time.monotonic() + rng.uniform(args.min_gap, args.max_gap)
            time.sleep(0.1)
        else:
            run.stop()
            raise TimeoutError("chaos run did not finish within an hour")
        expected = cfg.async_rl.num_samplers * cfg.async_rl.batches_per_sampler
        result = audit(run_uri, expected)
    finally:
        if run is not None:
            run.close()  # the killed workers' download caches
        server.stop()
        environ.stop()
    seconds = time.perf_counter() - t0
    payload = {"kills": len(kills), "kill_log": kills, **result, "staleness_bound": cfg.async_rl.max_staleness,
               "seconds": seconds, "restarts": {n: c - 1 for n, c in run.starts.items()},
               "processes": ["learner"] + worker_names(cfg.async_rl.num_samplers), "store": "s3 (loopback moto)",
               "overrides": overrides, "smoke": args.smoke}
    payload["learner_restarts"] = run.starts["learner"] - 1
    payload["sampler_restarts"] = sum(c - 1 for n, c in run.starts.items() if n != "learner")
    ok = (result["batches_lost"] == 0 and result["batches_duplicated"] == 0
          and result["max_staleness_seen"] <= cfg.async_rl.max_staleness and result["batches_committed"] == expected)
    payload["target_met"] = ok
    keys = ["kills", "batches_committed", "batches_consumed", "batches_dropped", "batches_lost", "batches_duplicated",
            "max_staleness_seen", "staleness_bound", "learner_restarts", "sampler_restarts", "version_skips"]
    print(table([[payload[k] for k in keys]], keys))
    print(f"{'OK' if ok else 'FAILED'}: lost={result['batches_lost']} duplicated={result['batches_duplicated']} "
          f"staleness {result['max_staleness_seen']} <= {cfg.async_rl.max_staleness}; {seconds:.0f}s")
    # a run with no kill landed, no batch committed or consumed, audited nothing
    path = write_result("chaos", payload, args.out,
                        positive=["kills", "sampler_restarts", "batches_committed", "batches_consumed", "seconds"],
                        present=["batches_lost", "batches_duplicated", "max_staleness_seen", "learner_restarts",
                                 "target_met"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
