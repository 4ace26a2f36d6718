"""Prefect tasks of the synchronous training loop: a sampler and a learner in one process, thin
wrappers over the learner runtime (miles_core/learner/runtime.py), the object the asynchronous
learner also runs. Arguments and results are paths, URIs and small dicts, never tensors (see
ARCHITECTURE.md). Per iteration: ``collect`` (sample, score, commit to ``trajectories/``) and
``update`` (consume it: update, checkpoint, publish).

The learner's lifetime is the flow's ``with learner(run_dir):`` block: building it (base model,
LoRA, optimizer) is the expensive part, so the tasks inside reuse the one the block opened. The
source of truth is the run's store (``{store_uri}/learner/CHECKPOINT``, written after every
update, ledger inside), so a retried task, a resumed flow or a task in another process reloads it
and carries on. A task that fails drops the open runtime, because a half-applied update must
never leak into the retry. ``run_dir/learner.json`` only says which store and base the folder
trains, so ``resume=True`` finds them.

Batch ids are ``{iteration:06d}-learner`` and each batch's prompts and noise are seeded from
(run seed, id), so a retried collect samples the same batch (or finds it committed) and the
ledger consumes each batch once.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from prefect import task

from miles_core.algo.rl import rollout_stats
from miles_core.config import load_recipe
from miles_core.eval.evaluate import run_eval
from miles_core.learner.runtime import (LearnerRun, open_step_run, read_pointer, save_local_adapter, start_step_run,
                                       write_pointer)
from tasks.common import LIGHT, SAMPLE_ROWS, STORAGE, eval_summary

_OPEN: dict[str, LearnerRun] = {}  # the runtimes of the open learner(run_dir) blocks of this process
_LOCK = threading.Lock()
checkpoint_meta = read_pointer  # run_dir/learner.json: which store and base the folder trains


def _key(run_dir: str | os.PathLike[str]) -> str:
    return str(Path(run_dir).resolve())


def _drop(run_dir: str | os.PathLike[str]) -> None:
    with _LOCK:
        _OPEN.pop(_key(run_dir), None)


@contextmanager
def learner(run_dir: str | os.PathLike[str]) -> Iterator[None]:
    """The learner of ``run_dir`` lives for this block: tasks inside reuse it; on exit its memory
    goes (the checkpoint in the store stays)."""
    try:
        yield
    finally:
        _drop(run_dir)


def _open(run_dir: str, run: LearnerRun) -> LearnerRun:
    if run.cfg.torch_threads > 0:
        torch.set_num_threads(run.cfg.torch_threads)
    with _LOCK:
        _OPEN[_key(run_dir)] = run
    return run


def _guarded(run_dir: str, fn: Callable[[LearnerRun], Any]) -> Any:
    try:
        with _LOCK:
            run = _OPEN.get(_key(run_dir))
        return fn(run or _open(run_dir, open_step_run(run_dir)))
    except BaseException:
        _drop(run_dir)  # never let a half-mutated learner serve the retry
        raise


@task(name="init-learner", **STORAGE, **LIGHT)
def init_learner(run_dir: str, cfg: dict[str, Any], base_checkpoint: str, store_uri: str,
                 resume: bool = False) -> dict[str, Any]:
    """Prepare the run in the store and create its learner (publishing adapter v0), or resume it."""
    _drop(run_dir)
    new_cfg = load_recipe(cfg)
    if new_cfg.torch_threads > 0:
        torch.set_num_threads(new_cfg.torch_threads)
    run, resumed = start_step_run(run_dir, new_cfg, base_checkpoint, store_uri, resume)
    _open(run_dir, run)
    meta = read_pointer(run_dir) or {}
    return {"iteration": meta["iteration"], "version": run.learner.version, "run_key": meta["run_key"],
            "base_checkpoint": meta["base_checkpoint"], "resumed": resumed, "adapter_uri": run.adapter_uri(),
            "adapter_dir": str(save_local_adapter(run, Path(run_dir) / "adapters"))}


@task(name="collect", **STORAGE, **LIGHT)
def collect(run_dir: str, iteration: int) -> dict[str, Any]:
    """Batch ``iteration``: G completions per fresh prompt with the current adapter, rewards and
    group advantages, committed to ``trajectories/`` (LearnerRun.collect)."""
    def go(run: LearnerRun) -> dict[str, Any]:
        t0 = time.perf_counter()
        bid, batch, reused = run.collect(iteration)
        seconds = time.perf_counter() - t0
        stats = {**rollout_stats(batch), "seconds": seconds,
                 "tokens_per_s": batch.completion_ids.numel() / max(seconds, 1e-9),
                 "policy_version": float(batch.policy_version.max())}
        samples = [{"prompt": batch.prompts[i], "completion": batch.completions[i],
                    "answer": str(batch.meta[i].get("answer", "")) if batch.meta else "",
                    "reward": float(batch.reward[i]), "advantage": float(batch.advantage[i])}
                   for i in range(min(SAMPLE_ROWS, len(batch)))]
        # the commit marker: it names the data object that counts (storage/SCHEMA.md)
        return {"batch_id": bid, "uri": f"{run.rs.trajectories.root_uri}/commits/{bid}.json", "reused": reused,
                "stats": stats, "samples": samples}
    return _guarded(run_dir, go)


@task(name="update", **STORAGE, **LIGHT)
def update(run_dir: str, batch_id: str, local_copy: bool = True) -> dict[str, Any]:
    """One ADPO update on a committed batch: checkpoint (ledger inside), then publish the new
    adapter; ``local_copy``: also write it under ``run_dir/adapters`` (for MLflow and registration).

    Idempotent per batch: a batch the ledger lists is not used again, so a retry after a failed
    publish publishes without updating twice."""
    def go(run: LearnerRun) -> dict[str, Any]:
        if batch_id not in run.handled():
            _, stats = run.consume(batch_id)
        else:
            stats = run.last_update(batch_id)
        meta = write_pointer(run_dir, run)
        local = save_local_adapter(run, Path(run_dir) / "adapters") if local_copy else None
        return {"version": run.learner.version, "iteration": meta["iteration"],
                "adapter_dir": str(local) if local else None, "adapter_uri": run.adapter_uri(),
                "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
                "guard_event": run.learner.guard_event}
    return _guarded(run_dir, go)


@task(name="evaluate-policy", **LIGHT)
def evaluate_policy(run_dir: str, version: int, progress: bool = False) -> dict[str, Any]:
    """pass@k of the learner's current policy on the held-out split (full eval config recorded)."""
    def go(run: LearnerRun) -> dict[str, Any]:
        if run.learner.version != version:
            raise RuntimeError(f"evaluate_policy: learner in {run_dir} is at version {run.learner.version}, not {version}")
        res = run_eval(run.learner.model, run.learner.tok, run.cfg, run.data, progress=progress)
        return eval_summary(res, Path(run_dir) / "evals" / f"v{version:06d}.json")
    return _guarded(run_dir, go)
