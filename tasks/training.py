"""Prefect tasks of the synchronous training loop: a sampler and a learner in one process, thin
wrappers over the learner runtime (miles_core/learner/runtime.py), the object the asynchronous
learner also runs. Arguments and results are paths, URIs, small dicts and the learner's handle
(which pickles as its path), never tensors (see ARCHITECTURE.md). Per iteration: ``collect``
(sample, score, commit to ``trajectories/``) and ``update`` (consume it: update, checkpoint,
publish).

The learner a flow trains is an explicit handle: ``with learner(run_dir) as lr:`` opens a
:class:`LearnerSession`, ``init_learner(lr, ...)`` starts or resumes the run in it, and every task
takes ``lr``. Building the runtime (base model, LoRA, optimizer) is the expensive part, so the
tasks reuse the one the session holds. The source of truth is the run's store
(``{store_uri}/learner/CHECKPOINT``, written after every update, ledger inside): a task that fails
drops the session's runtime, because a half-applied update must never leak into the retry, and
the next task reopens it from the checkpoint; a session that crosses into another process
(pickled) reopens it there the same way. A task on a session that was never started, or whose
block has ended, is an error. ``run_dir/learner.json`` only says which store and base the folder
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
from miles_core.config import RecipeConfig
from miles_core.eval.evaluate import run_eval
from miles_core.learner.run_folder import existing_run, resumed_recipe  # noqa: F401  (the flow's checks before it trains an SFT base)
from miles_core.learner.run_folder import open_step_run, read_pointer, save_local_adapter, start_step_run, write_pointer
from miles_core.learner.runtime import LearnerRun
from tasks.common import LIGHT, SAMPLE_ROWS, STORAGE, eval_summary

checkpoint_meta = read_pointer  # run_dir/learner.json: which store and base the folder trains


class LearnerSession:
    """The learner of ``run_dir`` for one ``with learner(run_dir)`` block: the handle the flow
    passes to every task (module docstring). Thread-safe: Prefect may run tasks in threads."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = str(Path(run_dir).resolve())
        self._run: LearnerRun | None = None
        self._started = False  # init_learner ran, here or (for a pickled session) in the process that sent it
        self._closed = False
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple:  # another process gets the handle, never the model: it reopens from the store
        return _arrived, (self.run_dir, self._started and not self._closed)

    def start(self, run: LearnerRun) -> LearnerRun:
        """Hold ``run`` (init_learner's started or resumed runtime, built with the recipe's threads)."""
        with self._lock:
            self._run, self._started = run, True
        return run

    def run(self) -> LearnerRun:
        """The open runtime; reopened from the store's checkpoint when a failed task dropped it or
        the session arrived from another process."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the learner block of {self.run_dir} has ended; open a new one")
            if not self._started:
                raise RuntimeError(f"the learner of {self.run_dir} was not started: call init_learner first")
            if self._run is None:
                self._run = open_step_run(self.run_dir)  # its checkpoint restores the process's generator
                if self._run.cfg.torch_threads > 0:
                    torch.set_num_threads(self._run.cfg.torch_threads)
            return self._run

    def drop(self) -> None:
        """Forget the runtime (its memory goes; the checkpoint in the store stays)."""
        with self._lock:
            self._run = None

    def close(self) -> None:
        self.drop()
        self._closed = True


def _arrived(run_dir: str, started: bool) -> LearnerSession:
    """A session unpickled in another process: started there if it was where it came from."""
    session = LearnerSession(run_dir)
    session._started = started
    return session


@contextmanager
def learner(run_dir: str | os.PathLike[str]) -> Iterator[LearnerSession]:
    """The learner of ``run_dir`` lives for this block: the tasks take the session it yields; on
    exit its memory goes (the checkpoint in the store stays)."""
    session = LearnerSession(run_dir)
    try:
        yield session
    finally:
        session.close()


def _guarded(session: LearnerSession, fn: Callable[[LearnerRun], Any]) -> Any:
    try:
        return fn(session.run())
    except BaseException:
        session.drop()  # never let a half-mutated learner serve the retry
        raise


@task(name="init-learner", **STORAGE, **LIGHT)
def init_learner(session: LearnerSession, cfg: RecipeConfig, base_checkpoint: str, store_uri: str,
                 resume: bool = False) -> dict[str, Any]:
    """Prepare the run in the store and create its learner (publishing adapter v0), or resume it;
    ``session`` holds it for the tasks that follow. ``cfg``: the recipe the flow loaded (a small
    frozen value, so it is handed on, not parsed again)."""
    session.drop()
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.train.seed)  # this process's generator (LoRA dropout's draws): the task owns it
    run_dir = session.run_dir
    run, resumed = start_step_run(run_dir, cfg, base_checkpoint, store_uri, resume)
    session.start(run)
    meta = read_pointer(run_dir) or {}
    return {"iteration": meta["iteration"], "version": run.learner.version, "run_key": meta["run_key"],
            "base_checkpoint": meta["base_checkpoint"], "resumed": resumed, "adapter_uri": run.adapter_uri(),
            "adapter_dir": str(save_local_adapter(run, Path(run_dir) / "adapters"))}


@task(name="collect", **STORAGE, **LIGHT)
def collect(session: LearnerSession, iteration: int) -> dict[str, Any]:
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
    return _guarded(session, go)


@task(name="update", **STORAGE, **LIGHT)
def update(session: LearnerSession, batch_id: str, local_copy: bool = True) -> dict[str, Any]:
    """One ADPO update on a committed batch: checkpoint (ledger inside), then publish the new
    adapter; ``local_copy``: also write it under ``run_dir/adapters`` (for MLflow and registration).

    Idempotent per batch: a batch the ledger lists is not used again, so a retry after a failed
    publish publishes without updating twice."""
    def go(run: LearnerRun) -> dict[str, Any]:
        if batch_id not in run.ledger:
            _, stats = run.consume(batch_id)
        else:
            stats = run.last_update(batch_id)
        meta = write_pointer(session.run_dir, run)
        local = save_local_adapter(run, Path(session.run_dir) / "adapters") if local_copy else None
        return {"version": run.learner.version, "iteration": meta["iteration"],
                "adapter_dir": str(local) if local else None, "adapter_uri": run.adapter_uri(),
                "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
                "guard_event": run.learner.guard_event}
    return _guarded(session, go)


@task(name="evaluate-policy", **LIGHT)
def evaluate_policy(session: LearnerSession, version: int, progress: bool = False) -> dict[str, Any]:
    """pass@k of the learner's current policy on the held-out split (full eval config recorded)."""
    def go(run: LearnerRun) -> dict[str, Any]:
        if run.learner.version != version:
            raise RuntimeError(f"evaluate_policy: learner in {session.run_dir} is at version {run.learner.version}, "
                               f"not {version}")
        res = run_eval(run.learner.model, run.learner.tok, run.cfg, run.data, progress=progress)
        return eval_summary(res, Path(session.run_dir) / "evals" / f"v{version:06d}.json")
    return _guarded(session, go)
