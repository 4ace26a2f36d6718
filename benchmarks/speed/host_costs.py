"""Host work per update of one learner rank, and per batch of one sampler, at the real shapes: what
the scale model charges for the work this 2-core machine cannot show at 4,096 GPUs.

Run: python -m benchmarks.host_costs [--points NAME ...] [--smoke]

A learner rank's update, before the device computes anything (the code the rank runs, on
synthetic batches of the real shape: n completions of L tokens committed over K steps, prompts
of P tokens): plan its share (``my_share``, ``first_reader``), read it from a local store
(Parquet), agree on verdicts (the real ``agree``, the collective's receiving side stood in for:
every rank's verdicts on its share, unpickled), cut its rows out of the batches it read
and key them (and their groups' first members: single trajectories are dealt, learner/shares.py),
the collapse guard's health, the estimator's rows (ADPO covering a quarter of the
steps, algo/step_choice.py), the minibatch deal (algo/draws.py), the chunk plan's row costs and the
behaviour log-prob gather (algo/update.py). ``after``: the rank's own share (learner/shares.py);
``before``: every trajectory of the global batch, as a rank did when each built the whole batch
(the same functions over all B n trajectories, plus the metadata it then exchanged, pickled and
unpickled: per row the prompt length, step map, group, version, reward, advantage, NFE and text).
Each point is measured on rank 0 (which also publishes) and on the rank with the most batches
to read and trajectories to hold (``busiest_rank``: the update waits for the slower; the fit is of the
slower, with a term in D). Rank 0 also publishes the adapter every update and checkpoints every ``checkpoint_every``
(LLaDA-8B's r = 64 LoRA, saved as the learner saves them); a sampler loads each new adapter and
writes its batch. Each (point, mode) runs in a fresh process, so its peak memory is its own
(``ru_maxrss`` above the process after imports). Seconds depend on this machine's CPU: the
figure is for this machine class, and the scale model takes it as measured.
Writes benchmarks/results/host_costs.json (with a least-squares fit the scale model reads).
``--smoke``: one small point (before and after, each still in its own process) and rank 0's and a
sampler's costs at a 1/256 LoRA, through the same functions; the fit is then of one point.
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.harness import bench_args, check_measured, finish

REPO = Path(__file__).resolve().parents[2]
# (B sampler batches, D ranks, n completions per batch, G group size); K steps, L and P tokens fixed below
POINTS = {
    "emulated 64 procs": (64, 27, 64, 8),
    "4,096 GPUs, today's weak batch": (1260, 2016, 96, 6),
    "4,096 GPUs, old weak batch": (1171, 1755, 64, 8),
    "4,096 GPUs, fixed 4,096": (64, 256, 64, 8),
    # the sweep the fit is made on: share sizes 8 .. 384 trajectories, B from 4 to 512
    "fit 1": (4, 1, 96, 6), "fit 2": (16, 4, 96, 6), "fit 3": (64, 16, 96, 6), "fit 4": (512, 128, 96, 6),
    "fit 5": (128, 512, 96, 6), "fit 6": (16, 16, 96, 6),
}
# --smoke (and scale_model's smoke, which computes its host costs here): shares of 8 and 16 trajectories
SMOKE_POINTS = {"smoke 1": (2, 1, 8, 4), "smoke 2": (4, 2, 8, 4)}
SMOKE_LORA = 256  # --smoke: rank 0's and the sampler's costs at 1/256 of LLaDA-8B's LoRA
K, L, P = 128, 256, 256
LORA_PARAMS = 32 * (4 * (4096 * 64 * 2) + 3 * (4096 + 12288) * 64)  # LLaDA-8B, r = 64 on every projection
CHECKPOINT_EVERY = 10


def _batch(n: int, group: int, seed: int) -> Any:
    import torch

    from benchmarks.harness import synthetic_batch
    from miles_core.tokenizer import CharTokenizer

    b = synthetic_batch(CharTokenizer(), n, P, L, K, seed)
    b.group_id = torch.arange(n) // group + seed * n
    b.reward = (torch.arange(n) % 2).float()
    b.completions = ["x" * L] * n
    b.prompts = ["p" * P] * n
    return b


def _gathered_as(D: int, B: int, n: int, group: int) -> Callable[[Any], list]:
    """``World.all_gather_object`` as rank r of D sees it: every rank's verdicts on the batches it
    read (``my_share``), pickled on their side (outside the timer), unpickled on this one."""
    from miles_core.learner.ledger import Verdict
    from miles_core.learner.shares import deal_unit, my_share
    from miles_core.parallel import World

    sent = [pickle.dumps({j: Verdict.fresh(0) for j in my_share(B, n, deal_unit(group, "adpo"), World(r, D))})
            for r in range(D)]

    def all_gather_object(obj: Any) -> list:
        return [pickle.loads(blob) for blob in sent]
    return all_gather_object


def one(B: int, D: int, n: int, group: int, mode: str, rank: int = 0) -> dict[str, Any]:
    """Rank ``rank``'s host seconds per phase and peak bytes, in this (fresh) process: the calls
    ``LearnerRun._read_share`` makes (its share, whether it reads each batch first, the verdicts
    agreed over D ranks, its rows cut and keyed), then the update's host work."""

    import torch

    from miles_core.algo.draws import Draws, minibatches, trajectory_keys
    from miles_core.algo.estimators import get_estimator
    from miles_core.algo.guard import batch_health
    from miles_core.config import AdpoSettings, UpdateConfig
    from miles_core.learner.ledger import Verdict
    from miles_core.learner.shares import agree, deal_unit, first_reader, held_rows, my_share
    from miles_core.parallel import World
    from miles_core.storage import TrajectoryStore
    from miles_core.tokenizer import CharTokenizer
    from miles_core.types import TrajectoryBatch

    torch.set_num_threads(1)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    world = World(rank, D)
    gather = _gathered_as(D, B, n, group) if D > 1 and mode == "after" else None
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    unit = deal_unit(group, "adpo")  # the estimator timed here
    share = my_share(B, n, unit, world)
    first = [j for j in share if first_reader(j, n, B, unit, world)]  # the batches it would quarantine
    t["share_plan"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        store = TrajectoryStore(tmp)
        for j in share:  # committed by the samplers: not this rank's time
            store.write_batch(_batch(n, group, j), f"b{j:05d}")
        t0 = time.perf_counter()
        read = {j: store.read_batch(f"b{j:05d}") for j in share}
        t["read"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if mode == "after":  # the real agree; the collective's receiving side stood in for (_gathered_as)
        if gather is not None:
            world.all_gather_object = gather  # type: ignore[method-assign]
        verdicts: Any = agree(B, {j: Verdict.fresh(0) for j in read}, world)
    else:  # the design before: verdicts as tuples, each rank's pickled, all unpickled
        per_rank = max(1, B // D + 1)
        gathered = [pickle.dumps({j: ("fresh", 0) for j in range(r * per_rank, (r + 1) * per_rank)}) for r in range(D)]
        verdicts = [pickle.loads(g) for g in gathered]
    t["agree"] = time.perf_counter() - t0
    del verdicts, first
    if mode == "before":  # the whole global batch on this rank: its share real, the rest as built from metadata
        others = [_batch(n, group, j) for j in range(B) if j not in read]  # built outside the timer
        t0 = time.perf_counter()
        meta = [{"prompt_lens": [len(p) for p in b.prompt_ids], "step_map": b.step_map, "nfe": b.nfe,
                 "group_id": b.group_id, "policy_version": b.policy_version, "reward": b.reward,
                 "advantage": b.advantage, "completions": list(b.completions)} for b in others]
        pickle.loads(pickle.dumps(meta))
        t["agree"] += time.perf_counter() - t0
        del meta
        t0 = time.perf_counter()
        local = TrajectoryBatch.concat(list(read.values()) + others)
        keys = torch.cat([trajectory_keys(f"b{j:05d}", n) for j in range(B)])
        leads = None
        t["share"] = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        held = [held_rows(f"b{j:05d}", j, b, B, unit, group, world) for j, b in read.items()]
        local = TrajectoryBatch.concat([part for part, _, _ in held])
        keys, leads = torch.cat([k for _, k, _ in held]), torch.cat([x for _, _, x in held])
        t["share"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch_health(local)
    t["health"] = time.perf_counter() - t0
    cfg = UpdateConfig(num_minibatches=4, chunk_tokens=8192)
    t0 = time.perf_counter()
    draws = Draws(1, keys, local.group_id, leads)
    rows, scorer = get_estimator("adpo").rows(local, AdpoSettings(step_fraction=0.25), cfg.epochs, CharTokenizer(), 1.0,
                                               draws)
    t["rows"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    before = None if leads is None else torch.zeros(len(local), dtype=torch.long)  # Ranks.rows_before's answer
    minibatches(rows.traj, draws, cfg.num_minibatches, 0, before)
    scorer.row_cost(rows.traj, rows.step, 1.0)
    mu = scorer.behaviour(rows.traj, rows.step)
    t["plan"] = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    return {"B": B, "D": D, "n": n, "group": group, "mode": mode, "rank": rank, "trajectories": len(local),
            "rows": int(rows.traj.numel()), "batches_read": len(share), "behaviour_bytes": mu.numel() * 4,
            "phases": t, "host_s": sum(t.values()), "peak_bytes": peak}


def rank0_and_sampler(lora_params: int = LORA_PARAMS) -> dict[str, float]:
    """Rank 0's publish (every update) and checkpoint (every ``CHECKPOINT_EVERY``), a sampler's
    adapter load and batch write, at ``lora_params`` (LLaDA-8B's LoRA size; smaller for --smoke)."""
    import torch
    from safetensors.torch import load_file, save_file

    from miles_core.storage import TrajectoryStore

    torch.set_num_threads(1)
    rows = 4096
    adapter = {f"l{i}": torch.randn(rows, max(1, lora_params // rows // 64), dtype=torch.bfloat16) for i in range(64)}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        save_file(adapter, f"{tmp}/adapter.safetensors")
        publish = time.perf_counter() - t0
        t0 = time.perf_counter()  # read and cast into float32 LoRA tensors, as a sampler swaps them in
        loaded = {k: v.float() for k, v in load_file(f"{tmp}/adapter.safetensors").items()}
        fetch = time.perf_counter() - t0
        del loaded
        state = {k: v.float() for k, v in adapter.items()}  # adapter + AdamW's two moments, float32
        t0 = time.perf_counter()
        torch.save({"adapter": state, "exp_avg": state, "exp_avg_sq": state}, f"{tmp}/ckpt.pt")
        ckpt = time.perf_counter() - t0
        batch = _batch(96, 6, 0)
        t0 = time.perf_counter()
        TrajectoryStore(tmp).write_batch(batch, "w0-00000")
        write = time.perf_counter() - t0
    return {"publish_s": publish, "checkpoint_s": ckpt, "checkpoint_every": CHECKPOINT_EVERY,
            "rank0_per_update_s": publish + ckpt / CHECKPOINT_EVERY, "sampler_fetch_s": fetch,
            "sampler_write_s": write, "sampler_per_batch_s": fetch + write, "adapter_bytes": 2 * lora_params}


def slowest(points: list[dict]) -> list[dict]:
    """Per (point, mode), the measurement of its slowest rank (the update waits for it)."""
    out: dict[tuple[str, str], dict] = {}
    for p in points:
        key = (p["point"], p["mode"])
        if key not in out or p["host_s"] > out[key]["host_s"]:
            out[key] = p
    return list(out.values())


def fit(points: list[dict]) -> dict[str, float]:
    """Least squares host_s = a + b x trajectories + c x B + d x batches read + e x D over the
    slowest rank's ``after`` measurements: the per-rank host seconds as a function of the shape
    (benchmarks/scale/scale_model.py). D counts: every rank unpickles every rank's verdicts."""
    import numpy as np

    after = [p for p in slowest(points) if p["mode"] == "after"]
    x = np.array([[1.0, p["trajectories"], p["B"], p["batches_read"], p["D"]] for p in after])
    y = np.array([p["host_s"] for p in after])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative cost is noise: clipped at 0
    pred = x @ coef
    return {"const_s": float(coef[0]), "per_trajectory_s": float(coef[1]), "per_batch_in_update_s": float(coef[2]),
            "per_batch_read_s": float(coef[3]), "per_rank_s": float(coef[4]),
            "max_rel_error": float(np.max(np.abs(pred - y) / y))}


def host_seconds(model: dict[str, float], trajectories: float, batches: float, read: float, ranks: float = 1.0) -> float:
    """One rank's host seconds per update from :func:`fit`'s coefficients (a fit made before the
    D term has none)."""
    return (model["const_s"] + model["per_trajectory_s"] * trajectories + model["per_batch_in_update_s"] * batches
            + model["per_batch_read_s"] * read + model.get("per_rank_s", 0.0) * ranks)


def busiest_rank(B: int, D: int, n: int, group: int) -> int:
    """The rank with the most sampler batches to read, then the most units (closed forms, O(D)):
    a rank whose share straddles a batch boundary reads two batches where its neighbours read one."""
    from miles_core.learner.shares import deal_unit, my_share, owned_units
    from miles_core.parallel import World

    unit = deal_unit(group, "adpo")  # the estimator timed here
    return max(range(D), key=lambda r: (len(my_share(B, n, unit, World(r, D))),
                                        len(owned_units(B, n, unit, World(r, D))), -r))


def in_fresh_process(job: Sequence[Any]) -> dict[str, Any]:
    """:func:`one` for ``job`` (B, D, n, G, mode, rank) in a fresh interpreter, so its peak memory is its own."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.host_costs", "--one", json.dumps(list(job))], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{job} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(points: dict[str, tuple[int, int, int, int]], before: Sequence[str], lora_params: int = LORA_PARAMS,
            run: Callable[[Sequence[Any]], dict[str, Any]] = in_fresh_process) -> dict[str, Any]:
    """Every point ``after`` (and ``before`` for those named), rank 0's and a sampler's costs, and
    the fit: what host_costs.json holds and the scale model reads. ``run`` measures one (point,
    mode); scale_model's --smoke passes :func:`one` itself (same code, its peak memory then not its own)."""
    measured = []
    for name, shape in points.items():
        busy = busiest_rank(*shape)  # besides rank 0, which publishes: the update waits for the slowest
        jobs = ([("before", 0)] if name in before else []) + [("after", 0)] + ([("after", busy)] if busy else [])
        for mode, rank in jobs:
            measured.append({"point": name, **run([*shape, mode, rank])})
            m = measured[-1]
            print(f"  {name} {mode} rank {rank}: {m['host_s']:.3f} s, {m['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    extra = rank0_and_sampler(lora_params)
    # what must be measured: every (point, mode)'s seconds and work, and rank 0's and the sampler's
    check_measured("host_costs", {"points": {f"{m['point']} ({m['mode']})": m for m in measured},
                                  "rank0_and_sampler": extra},
                   positive=["points.*.host_s", "points.*.trajectories", "points.*.rows", "points.*.batches_read",
                             "rank0_and_sampler.publish_s", "rank0_and_sampler.checkpoint_s",
                             "rank0_and_sampler.sampler_fetch_s", "rank0_and_sampler.sampler_write_s"])
    return {"points": measured, "rank0_and_sampler": extra, "fit": fit(measured),
            "shape": {"K": K, "L": L, "P": P, "lora_params": lora_params}}


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, sets=False)
    ap.add_argument("--points", nargs="+", default=list(POINTS), choices=list(POINTS))
    ap.add_argument("--before", nargs="*", default=["emulated 64 procs", "4,096 GPUs, old weak batch",
                                                     "4,096 GPUs, fixed 4,096"], help="points also measured before")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one (point, mode) in this process
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(*json.loads(args.one))))
        return
    t0 = time.perf_counter()
    if args.smoke:  # one point of 2 ranks, before and after (two fresh processes), a small LoRA
        points, before, lora = {"smoke 2": SMOKE_POINTS["smoke 2"]}, ["smoke 2"], LORA_PARAMS // SMOKE_LORA
    else:
        points, before, lora = {name: POINTS[name] for name in args.points}, args.before, LORA_PARAMS
    result = measure(points, before, lora)
    measured, extra, model = result["points"], result["rank0_and_sampler"], result["fit"]
    rows = [[m["point"], m["B"], m["D"], m["mode"], m["rank"], m["trajectories"], m["batches_read"], f"{m['host_s']:.3f}",
             f"{m['peak_bytes'] / 2**20:.0f}", " ".join(f"{k} {v:.3f}" for k, v in m["phases"].items())]
            for m in measured]
    print(f"rank 0 adds per update: publish {extra['publish_s']:.2f} s + checkpoint {extra['checkpoint_s']:.2f} s / "
          f"{CHECKPOINT_EVERY}; a sampler per batch: adapter load {extra['sampler_fetch_s']:.2f} s + write "
          f"{extra['sampler_write_s']:.3f} s")
    print(f"fit: {model}")
    finish("host_costs", {**result, "smoke": args.smoke, "seconds": time.perf_counter() - t0}, rows,
           ["point", "B", "D", "mode", "rank", "traj", "read", "host s", "peak MiB", "phases (s)"], out=args.out,
           positive=["seconds", "rank0_and_sampler.rank0_per_update_s", "rank0_and_sampler.sampler_per_batch_s",
                     "rank0_and_sampler.adapter_bytes"],
           present=["fit.const_s", "fit.per_trajectory_s", "fit.per_batch_in_update_s", "fit.per_batch_read_s",
                    "fit.per_rank_s", "points"])


if __name__ == "__main__":
    main()
