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

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from prefect import task

from miles_core.algo.rl import assign_advantages, batch_id, rollout_stats, sample_batch
from miles_core.algo.rl import score_rewards as rl_score
from miles_core.asyncrl.launch import prepare_run
from miles_core.config import RecipeConfig, load_recipe
from miles_core.data.registry import TaskData, build_task
from miles_core.eval.evaluate import run_eval
from miles_core.learner.runtime import RESUMABLE, LearnerRun
from miles_core.rewards.registry import reward_for_recipe
from miles_core.storage import BatchExistsError, BatchNotFoundError
from miles_core.storage.run import RunStore
from tasks.common import LIGHT, SAMPLE_ROWS, STORAGE, atomic_write, eval_summary

POINTER = "learner.json"
_CACHE: dict[str, tuple[LearnerRun, TaskData]] = {}
_LOCK = threading.Lock()


def _key(run_dir: str | os.PathLike[str]) -> str:
    return str(Path(run_dir).resolve())


def _threads(cfg: RecipeConfig) -> None:
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)


def release(run_dir: str | os.PathLike[str]) -> None:
    """Forget the cached runtime of ``run_dir`` (frees its memory; the checkpoint stays)."""
    with _LOCK:
        _CACHE.pop(_key(run_dir), None)


def checkpoint_meta(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``run_dir``'s pointer (store, base, run key, cfg, iteration, version), or None if absent."""
    path = Path(run_dir) / POINTER
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: unreadable learner metadata ({e})") from None


def _write_meta(run_dir: str, run: LearnerRun, **extra: Any) -> dict[str, Any]:
    meta = {**(checkpoint_meta(run_dir) or {}), **extra, "iteration": len(run.handled()),
            "version": run.learner.version, "consumed": [e["id"] for e in run.ledger["consumed"]]}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(run_dir) / POINTER, lambda p: p.write_text(json.dumps(meta, indent=1, default=str)))
    return meta


def _open(run_dir: str, meta: dict[str, Any]) -> tuple[LearnerRun, TaskData]:
    cfg = load_recipe(meta["cfg"])
    _threads(cfg)
    run = LearnerRun(meta["store_uri"], str(Path(run_dir) / ".cache"), cfg=cfg,
                     total_updates=cfg.train.iterations, checkpoint_every=1)
    return run, build_task(cfg)


def _entry(run_dir: str) -> tuple[LearnerRun, TaskData]:
    key = _key(run_dir)
    with _LOCK:
        if key not in _CACHE:
            meta = checkpoint_meta(key)
            if meta is None:
                raise FileNotFoundError(f"no learner in {run_dir}; run init_learner first")
            _CACHE[key] = _open(key, meta)
        return _CACHE[key]


def _guarded(run_dir: str, fn: Any) -> Any:
    try:
        return fn(*_entry(run_dir))
    except BaseException:
        release(run_dir)  # never let a half-mutated learner serve the retry
        raise


def _local_adapter(run_dir: str, run: LearnerRun) -> Path:
    """Local copy of the current adapter (``run_dir/adapters/vN``) for MLflow and registration;
    older local copies are pruned, since the store keeps every published version."""
    root = Path(run_dir) / "adapters"
    dest = root / f"v{run.learner.version:06d}"
    if not (dest / "adapter_config.json").exists():
        tmp = root / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
        run.learner.save_adapter(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    for old in root.glob("v*"):
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    return dest


@task(name="init-learner", **STORAGE, **LIGHT)
def init_learner(run_dir: str, cfg: dict[str, Any], base_checkpoint: str, store_uri: str,
                 resume: bool = False) -> dict[str, Any]:
    """Prepare the run in the store and create its learner (publishing adapter v0), or resume it."""
    new_cfg = load_recipe(cfg)
    meta = checkpoint_meta(run_dir)
    resumed = meta is not None
    if meta is not None:
        if not resume:
            raise FileExistsError(f"{run_dir} already holds a learner checkpoint (iteration {meta['iteration']}); "
                                  "pass resume=True to continue it, or choose a new run_dir")
        if Path(base_checkpoint).resolve() != Path(meta["base_checkpoint"]).resolve():
            raise ValueError(f"cannot resume {run_dir}: it was trained on base {meta['base_checkpoint']}, "
                             f"not {base_checkpoint}")
        if store_uri.rstrip("/") != str(meta["store_uri"]).rstrip("/"):
            raise ValueError(f"cannot resume {run_dir}: its batches and adapters are in {meta['store_uri']}, "
                             f"not {store_uri}")
    elif RunStore(store_uri).exists("run.json"):
        raise FileExistsError(f"{store_uri} already holds another training run; use a separate store_uri per run")
    if not (Path(base_checkpoint) / "config.json").exists():
        raise FileNotFoundError(f"base_checkpoint {base_checkpoint} is not a Miles checkpoint folder (no config.json)")
    prepare_run(store_uri, new_cfg, base_checkpoint, resumable=RESUMABLE)  # a changed setting fails, naming it
    release(run_dir)
    fresh = {"run_key": uuid.uuid4().hex[:12], "base_checkpoint": str(Path(base_checkpoint).resolve()),
             "store_uri": store_uri}
    meta = {**fresh, **(meta or {}), "cfg": new_cfg.to_dict()}
    with _LOCK:
        _CACHE[_key(run_dir)] = entry = _open(run_dir, meta)
    run = entry[0]
    meta = _write_meta(run_dir, run, **meta)
    return {"iteration": meta["iteration"], "version": run.learner.version, "run_key": meta["run_key"],
            "base_checkpoint": meta["base_checkpoint"], "adapter_dir": str(_local_adapter(run_dir, run)),
            "adapter_uri": run.adapter_uri(), "resumed": resumed}


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
    meta = checkpoint_meta(run_dir)
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
        meta = _write_meta(run_dir, run)
        return {"version": run.learner.version, "iteration": meta["iteration"],
                "adapter_dir": str(_local_adapter(run_dir, run)), "adapter_uri": run.adapter_uri(),
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
