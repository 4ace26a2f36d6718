"""The compute floor of one asynchronous run: its own work, redone with no asynchrony at all.

An asynchronous run's batches differ from any other run's: their prompts and noise are seeded by
(worker, sequence number), the policy that sampled each is a different version, and the number of
rows an update scores (the denoising steps of every trajectory whose group had a reward spread)
varies from batch to batch by a factor of two. A floor measured on a few other batches is therefore
a floor for other work: the 8-batch probe this benchmark used before held 232 rows per update
where the run it was compared with held 300, and that alone put the floor ~5 s low.

So the floor replays the run. Every consumed batch is sampled again with the adapter version that
sampled it (same worker seed, same sequence number: ``sample_batch`` is deterministic in them) and
its stored copy is updated on again, each in a single-thread process, the batches dealt out over
as many such processes as the run had cores, all starting at one instant (so they contend for
caches and memory bandwidth as the run's processes did). Nothing is read, written, published or
polled inside the timed region. The floor is the total of those seconds over the number of
processes: the wall clock of a perfectly balanced split of the same work with no coordination.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any


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
    from miles_core.learner.policy import Learner
    from miles_core.models.base import load_base
    from miles_core.models.lora import ADAPTER_WEIGHTS, add_lora_from
    from miles_core.rewards.registry import reward_for_recipe
    from miles_core.storage.run import RunStore

    cfg = load_recipe(json.loads(cfg_json))
    apply_heap_setting(cfg.async_rl.retain_heap_mb)  # as the run's workers do (miles_core/allocator.py)
    rs = RunStore(run_uri)
    model, tok = load_base(cfg, base)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    model = add_lora_from(model, cfg.lora, dropout=0.0)  # as a sampler builds it
    learner = Learner(cfg, base, seed=cfg.train.seed, total_updates=len(bids))
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
                 processes: int) -> dict[str, Any]:
    """Replay the run's ``consumed`` batches over ``processes`` single-thread processes -> the floor
    and the per-batch costs it is made of. ``history`` (the learner's, in the same order) gives the
    rows each real update scored, to check that the replay did the same work."""
    bids = [e["id"] for e in consumed]
    shares = [bids[i::processes] for i in range(processes)]
    cfg_json = json.dumps(cfg.to_dict())
    with mp.get_context("spawn").Pool(processes) as pool:
        start = time.time() + 25  # every process has loaded and read its batches before the shared start
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
