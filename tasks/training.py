"""Prefect tasks of the synchronous training loop: thin wrappers over the learner runtime
(miles_core/learner/runtime.py), the same object the asynchronous learner runs. Arguments and
results are paths, URIs and small dicts, never tensors (see ARCHITECTURE.md).

Why the runtime lives in a per-process cache: building it (base model, LoRA, optimizer) is the
expensive part, so consecutive tasks in one flow process reuse it, keyed by ``run_dir``. The
source of truth is the run's store (``{store_uri}/learner/CHECKPOINT``, written after every
update, ledger inside), so a retried task, a resumed flow or a task in another process reloads it
and carries on. A task that fails drops the cached runtime, because a half-applied update must
never leak into the retry. ``run_dir/learner.json`` only says which store and base the folder
trains, so ``resume=True`` finds them.

Batch ids are ``{iteration:06d}-learner`` and each batch's prompts and noise are seeded from
(run seed, id), so a retried rollout or a resumed run reuses the committed batch (or samples the
same one again) and the ledger consumes each batch once.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from prefect import task

from miles_core.algo.rl import assign_advantages, batch_id, rollout_stats, sample_batch
from miles_core.algo.rl import score_rewards as rl_score
from miles_core.config import load_recipe
from miles_core.data.registry import TaskData, build_task
from miles_core.eval.evaluate import run_eval
from miles_core.learner.runtime import (LearnerRun, open_step_run, read_pointer, save_local_adapter, start_step_run,
                                       write_pointer)
from miles_core.rewards.registry import reward_for_recipe
from miles_core.storage import BatchExistsError, BatchNotFoundError
from miles_core.storage.run import RunStore
from tasks.common import LIGHT, SAMPLE_ROWS, STORAGE, eval_summary

_CACHE: dict[str, tuple[LearnerRun, TaskData]] = {}
_LOCK = threading.Lock()
checkpoint_meta = read_pointer  # run_dir/learner.json: which store and base the folder trains


def _key(run_dir: str | os.PathLike[str]) -> str:
    return str(Path(run_dir).resolve())


def release(run_dir: str | os.PathLike[str]) -> None:
    """Forget the cached runtime of ``run_dir`` (frees its memory; the checkpoint stays)."""
    with _LOCK:
        _CACHE.pop(_key(run_dir), None)


def _cache(run_dir: str, run: LearnerRun) -> tuple[LearnerRun, TaskData]:
    if run.cfg.torch_threads > 0:
        torch.set_num_threads(run.cfg.torch_threads)
    with _LOCK:
        _CACHE[_key(run_dir)] = entry = (run, build_task(run.cfg))
    return entry


def _guarded(run_dir: str, fn: Any) -> Any:
    try:
        with _LOCK:
            entry = _CACHE.get(_key(run_dir))
        return fn(*(entry or _cache(run_dir, open_step_run(run_dir))))
    except BaseException:
        release(run_dir)  # never let a half-mutated learner serve the retry
        raise


@task(name="init-learner", **STORAGE, **LIGHT)
def init_learner(run_dir: str, cfg: dict[str, Any], base_checkpoint: str, store_uri: str,
                 resume: bool = False) -> dict[str, Any]:
    """Prepare the run in the store and create its learner (publishing adapter v0), or resume it."""
    release(run_dir)
    new_cfg = load_recipe(cfg)
    if new_cfg.torch_threads > 0:
        torch.set_num_threads(new_cfg.torch_threads)
    run, resumed = start_step_run(run_dir, new_cfg, base_checkpoint, store_uri, resume)
    _cache(run_dir, run)
    meta = read_pointer(run_dir) or {}
    return {"iteration": meta["iteration"], "version": run.learner.version, "run_key": meta["run_key"],
            "base_checkpoint": meta["base_checkpoint"], "resumed": resumed, "adapter_uri": run.adapter_uri(),
            "adapter_dir": str(save_local_adapter(run, Path(run_dir) / "adapters"))}


@task(name="rollout", **STORAGE, **LIGHT)
def rollout(run_dir: str, store_uri: str, iteration: int) -> dict[str, Any]:
    """Sample G completions per fresh prompt with the current adapter; commit them as a raw batch."""
    def go(run: LearnerRun, data: TaskData) -> dict[str, Any]:
        raw, bid, t0 = run.rs.rollouts, batch_id(iteration, "learner"), time.perf_counter()
        try:
            batch, reused = raw.read_batch(bid), True
        except BatchNotFoundError:
            lrn = run.learner
            batch = sample_batch(run.cfg, lrn.model, lrn.tok, data, None, "learner", 0, iteration, lrn.version)
            try:
                raw.write_batch(batch, bid)
            except BatchExistsError:  # committed by an attempt whose reply was lost: the stored one counts
                batch = raw.read_batch(bid)
            reused = False
        seconds = time.perf_counter() - t0
        stats = {"nfe_mean": float(batch.nfe.float().mean()), "steps_mean": float(batch.num_steps.float().mean()),
                 "completions": float(len(batch)), "seconds": seconds,
                 "tokens_per_s": batch.completion_ids.numel() / max(seconds, 1e-9),
                 "policy_version": float(batch.policy_version.max())}
        return {"batch_id": bid, "uri": f"{raw.root_uri}/batches/{bid}.parquet", "reused": reused, "stats": stats}
    return _guarded(run_dir, go)


@task(name="score-rewards", **STORAGE, **LIGHT)
def score_rewards(run_dir: str, store_uri: str, batch_id: str) -> dict[str, Any]:
    """Reward + group-relative advantages for a raw batch; commit the scored batch (same id)."""
    meta = read_pointer(run_dir)
    if meta is None:
        raise FileNotFoundError(f"no learner checkpoint in {run_dir}")
    cfg, rs, t0 = load_recipe(meta["cfg"]), RunStore(store_uri), time.perf_counter()
    try:
        batch = rs.trajectories.read_batch(batch_id)
    except BatchNotFoundError:
        batch = assign_advantages(rl_score(rs.rollouts.read_batch(batch_id), reward_for_recipe(cfg)),
                                  cfg.adpo.std_normalize)
        rs.trajectories.write_batch(batch, batch_id)
    stats = {**rollout_stats(batch), "seconds": time.perf_counter() - t0}
    samples = [{"prompt": batch.prompts[i], "completion": batch.completions[i],
                "answer": str(batch.meta[i].get("answer", "")) if batch.meta else "",
                "reward": float(batch.reward[i]), "advantage": float(batch.advantage[i])}
               for i in range(min(SAMPLE_ROWS, len(batch)))]
    return {"batch_id": batch_id, "uri": f"{rs.trajectories.root_uri}/batches/{batch_id}.parquet", "stats": stats,
            "samples": samples}


@task(name="adpo-update", **STORAGE, **LIGHT)
def adpo_update(run_dir: str, store_uri: str, batch_id: str) -> dict[str, Any]:
    """One ADPO update on a scored batch: checkpoint (ledger inside), then publish the new adapter.

    Idempotent per batch: a batch the ledger lists is not used again, so a retry after a failed
    publish publishes without updating twice."""
    def go(run: LearnerRun, data: TaskData) -> dict[str, Any]:
        if batch_id not in run.handled():
            _, stats = run.consume(batch_id)
        else:
            stats = run.last_update(batch_id)
        meta = write_pointer(run_dir, run)
        return {"version": run.learner.version, "iteration": meta["iteration"],
                "adapter_dir": str(save_local_adapter(run, Path(run_dir) / "adapters")), "adapter_uri": run.adapter_uri(),
                "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
                "guard_event": run.learner.guard_event}
    return _guarded(run_dir, go)


@task(name="evaluate-policy", **LIGHT)
def evaluate_policy(run_dir: str, version: int, progress: bool = False) -> dict[str, Any]:
    """pass@k of the learner's current policy on the held-out split (full eval config recorded)."""
    def go(run: LearnerRun, data: TaskData) -> dict[str, Any]:
        if run.learner.version != version:
            raise RuntimeError(f"evaluate_policy: learner in {run_dir} is at version {run.learner.version}, not {version}")
        res = run_eval(run.learner.model, run.learner.tok, run.cfg, data, progress=progress)
        return eval_summary(res, Path(run_dir) / "evals" / f"v{version:06d}.json")
    return _guarded(run_dir, go)
