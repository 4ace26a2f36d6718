"""What each part of an asynchronous run costs on this machine: the inputs of benchmarks/scale/scale_model.py.

    python -m benchmarks.components [--reps 30] [--smoke]

Measured with the real code paths, on the ``arith`` recipe with the async benchmark's settings
(benchmarks/harness.py ASYNC_OVERRIDES: LoRA r=4 on q/v, bf16 adapter sync), one torch
thread (what an async worker gets): a rollout + reward of one batch (``algo/rl.py::sample_batch``),
one ADPO update of it (``Learner.update``; random-init weights, so rewards are set to one winner
per group, as benchmarks/scale/scaling.py does, and every row carries signal), and the store operations, against a local folder and
against the loopback S3 server (moto): the Parquet batch write (data + commit marker) and read,
the commit-marker check, a shared-budget claim (exclusive create), a listing of committed batches,
and adapter publish and fetch. Medians over ``--reps``. Writes benchmarks/results/components.json
(``--smoke``: 3 reps of 2 x 4-completion batches, components_smoke.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

from benchmarks.harness import ASYNC_OVERRIDES, add_smoke, table, write_result
from tools.loopback_s3 import start_loopback_s3


def _median(fn: Callable[[int], Any], reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compute_costs(cfg, work: Path, reps: int) -> dict[str, Any]:
    """Rollout and update seconds per batch (one thread) and the batch's and adapter's bytes."""
    import torch

    from miles_core.algo.rl import assign_advantages, sample_batch
    from miles_core.data.registry import build_task
    from miles_core.learner.policy import Learner
    from miles_core.learner.baseline import new_model
    from miles_core.models.base import save_checkpoint
    from miles_core.rewards.registry import reward_for_recipe
    from miles_core.tokenizer import CharTokenizer

    torch.set_num_threads(1)
    tok = CharTokenizer()
    save_checkpoint(new_model(cfg, tok, 0), tok, work / "base")
    learner = Learner(cfg, work / "base")
    data, reward = build_task(cfg), reward_for_recipe(cfg)
    batches = []
    rollout = _median(lambda i: batches.append(sample_batch(cfg, learner.model, tok, data, reward, "w0", 0, i, 0)),
                      reps)
    for b in batches:  # a random-init model earns no reward; one winner per group keeps every row informative,
        b.reward = (torch.arange(len(b)) % cfg.train.group_size == 0).float()  # as a learning run's update costs
        assign_advantages(b)
    update = _median(lambda i: learner.update(batches[i % len(batches)]), max(3, reps // 3))
    learner.save_adapter(work / "adapter")
    adapter_bytes = sum(f.stat().st_size for f in (work / "adapter").iterdir())
    return {"rollout_s": rollout, "update_s": update, "completions_per_batch": batches[0].completion_ids.shape[0],
            "adapter_bytes": adapter_bytes, "batch": batches[0]}


def store_costs(uri: str, batch: Any, adapter_dir: Path, reps: int, storage_options: dict | None = None) -> dict:
    """Seconds per store operation against ``uri`` (medians)."""
    from miles_core.storage import AdapterRegistry, TrajectoryStore
    from miles_core.storage import uri as U

    ts, reg = TrajectoryStore(f"{uri}/trajectories", storage_options), AdapterRegistry(uri, storage_options)
    fs, root = U.resolve(uri, storage_options)
    out = {"write_batch_s": _median(lambda i: ts.write_batch(batch, batch_id=f"b{i:04d}"), reps),
           "read_batch_s": _median(lambda i: ts.read_batch(f"b{i:04d}"), reps),
           "marker_check_s": _median(lambda i: U.exists(ts.fs, ts.marker_path(f"b{i:04d}")), reps),
           "list_batches_s": _median(lambda i: ts.list_batches(), reps),
           "claim_s": _median(lambda i: U.create_exclusive(fs, U.join(root, "claims", f"slot-{i:06d}"), b"w0"), reps),
           "publish_adapter_s": _median(lambda i: reg.publish(adapter_dir), max(3, reps // 3)),
           "latest_pointer_s": _median(lambda i: reg.latest_version(), reps)}
    with tempfile.TemporaryDirectory() as d:
        out["fetch_adapter_s"] = _median(lambda i: reg.fetch(1, Path(d) / f"v{i}"), max(3, reps // 3))
    out["batch_bytes"] = sum(fs.size(p) for p in fs.find(U.join(ts.root, "batches"))) / reps
    return out


# --smoke: the same measurements, 3 reps of a batch of 2 prompts x 4 completions (seconds).
SMOKE_REPS = 3
SMOKE_OVERRIDES = ["train.prompts_per_iter=2", "train.group_size=4"]
STORE_OPS = ("write_batch_s", "read_batch_s", "marker_check_s", "list_batches_s", "claim_s", "publish_adapter_s",
             "latest_pointer_s", "fetch_adapter_s", "batch_bytes")


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    from miles_core.config import load_recipe

    if args.smoke:
        args.reps = SMOKE_REPS
    overrides = ASYNC_OVERRIDES + (SMOKE_OVERRIDES if args.smoke else [])
    cfg = load_recipe("arith", overrides)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        compute = compute_costs(cfg, work, args.reps)
        batch = compute.pop("batch")
        stores = {"local": store_costs(str(work / "store"), batch, work / "adapter", args.reps)}
        server, env = start_loopback_s3("miles-components")
        try:  # the store reads its endpoint from MILES_S3_ENDPOINT_URL; restored after (main runs in tests too)
            with mock.patch.dict(os.environ, env):
                stores["loopback_s3"] = store_costs("s3://miles-components/run", batch, work / "adapter", args.reps)
        finally:
            server.stop()
    rows = [[k, f"{1000 * v:.2f} ms" if k.endswith("_s") else f"{v:.0f}"] for k, v in compute.items()]
    print(table(rows, ["compute (1 thread)", "median"]))
    keys = list(stores["local"])
    print()
    print(table([[k, *(f"{1000 * s[k]:.2f} ms" if k.endswith("_s") else f"{s[k]:.0f} B" for s in stores.values())]
                 for k in keys], ["store operation", *stores]))
    payload = {"compute": compute, "store": stores, "threads": 1, "reps": args.reps, "overrides": overrides,
               "smoke": args.smoke}
    path = write_result("components", payload, positive=["compute.rollout_s", "compute.update_s",
                                                         "compute.completions_per_batch", "compute.adapter_bytes",
                                                         *(f"store.*.{k}" for k in STORE_OPS)])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
