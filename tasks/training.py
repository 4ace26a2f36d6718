"""Prefect tasks of the training loop: SFT, rollout, reward scoring, ADPO update, evaluation and
model registration. Arguments and results are paths, URIs and small dicts, never tensors.

Why the learner lives in a per-process cache: building it (base model, LoRA, optimizer) is the
expensive part, so consecutive tasks in one flow process reuse it, keyed by ``run_dir``. The
source of truth is the checkpoint ``run_dir/learner.pt`` (written atomically after every rollout
and update), so a retried task, a resumed flow or a task in another process reloads it and carries
on. A task that fails drops the cached learner, because a half-applied update must never leak
into the retry.

Store layout under ``store_uri`` (local folder or ``s3://``): ``rollouts/`` raw committed batches,
``trajectories/`` scored batches (what a learner consumes), ``adapters/`` published versions
(v0 = the initial, zero LoRA). Batch ids are ``{run_key}-it{N:06d}``, so a retried rollout or a
resumed run reuses a committed batch instead of sampling it again, and each batch is consumed once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from miles_core.algo.rl import assign_advantages, rollout_stats
from miles_core.algo.rl import rollout as rl_rollout
from miles_core.algo.rl import score_rewards as rl_score
from miles_core.config import ConfigError, RecipeConfig, load_recipe
from miles_core.models.base import load_base
from miles_core.models.lora import load_adapter
from miles_core.rewards import get_reward
from miles_core.session import Learner, TaskData, build_task, run_eval, train_baseline
from miles_core.storage import AdapterRegistry, BatchNotFoundError, TrajectoryStore
from miles_core.storage.retry import is_transient as storage_is_transient
from tasks import tracking

CHECKPOINT, META = "learner.pt", "learner.json"
RAW, SCORED = "rollouts", "trajectories"


def is_transient(exc: BaseException | None) -> bool:
    """Storage and network failures (see :func:`miles_core.storage.retry.is_transient`) and a busy
    SQLite/SQL tracking store are worth a retry; a bug, a bad config or a missing file is not."""
    if storage_is_transient(exc):
        return True
    return exc is not None and type(exc).__module__.split(".")[0] == "sqlalchemy"


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return is_transient(exc if isinstance(exc, BaseException) else None)


STORAGE = {"retries": 3, "retry_delay_seconds": [1, 2, 4], "retry_condition_fn": _retry_transient}
LIGHT = {"persist_result": False, "cache_policy": NO_CACHE}  # results are small dicts, never cached
# Settings that may change when a run is resumed (length of the run, evaluation); anything else
# would silently change the experiment, so it is refused.
RESUMABLE = ("train.iterations", "train.eval_every", "eval.", "torch_threads")
_ADAPTER_URI = re.compile(r"^(?P<root>.+)/adapters/v(?P<version>\d+)/?$")
SAMPLE_ROWS = 8


@dataclass
class _Entry:
    learner: Learner
    cfg: RecipeConfig
    data: TaskData
    meta: dict[str, Any] = field(default_factory=dict)


_CACHE: dict[str, _Entry] = {}
_LOCK = threading.Lock()


def _key(run_dir: str | os.PathLike[str]) -> str:
    return str(Path(run_dir).resolve())


def _threads(cfg: RecipeConfig) -> None:
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)


def release(run_dir: str | os.PathLike[str]) -> None:
    """Forget the cached learner of ``run_dir`` (frees its memory; the checkpoint stays)."""
    with _LOCK:
        _CACHE.pop(_key(run_dir), None)


def checkpoint_meta(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON side of the learner checkpoint (iteration, base, run key, cfg), or None if absent."""
    path = Path(run_dir) / META
    if not (Path(run_dir) / CHECKPOINT).exists() or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: unreadable learner metadata ({e})") from None


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save(run_dir: str, e: _Entry) -> None:
    """Checkpoint = learner state (adapter, optimizer, RNGs, version) + JSON meta, both atomic."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    meta = {**e.meta, "version": e.learner.version, "cfg": e.cfg.to_dict()}
    _atomic_write(d / CHECKPOINT, lambda p: torch.save({"learner": e.learner.state(), "meta": meta}, p))
    _atomic_write(d / META, lambda p: p.write_text(json.dumps(meta, indent=1, default=str)))
    e.meta = meta


def _load(run_dir: str) -> _Entry:
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"no learner checkpoint {path}; run init_learner first")
    blob = torch.load(path, weights_only=True)
    cfg = load_recipe(blob["meta"]["cfg"])
    _threads(cfg)
    learner = Learner(cfg, blob["meta"]["base_checkpoint"], seed=cfg.train.seed)
    learner.load_state(blob["learner"])
    return _Entry(learner, cfg, build_task(cfg), dict(blob["meta"]))


def _entry(run_dir: str) -> _Entry:
    key = _key(run_dir)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(key)
        return _CACHE[key]


def _stores(store_uri: str) -> tuple[TrajectoryStore, TrajectoryStore, AdapterRegistry]:
    root = store_uri.rstrip("/")
    return TrajectoryStore(f"{root}/{RAW}"), TrajectoryStore(f"{root}/{SCORED}"), AdapterRegistry(root)


def _publish(store_uri: str, e: _Entry, local: Path) -> str:
    """Publish the adapter of the learner's current version unless this run already did (idempotent)."""
    reg, v = _stores(store_uri)[2], e.learner.version
    if reg.is_committed(v):
        owner = reg.metadata(v).get("run_key")
        if owner != e.meta["run_key"]:
            raise FileExistsError(f"{reg.root_uri}: adapter version {v} belongs to another run ({owner}); "
                                  "use a separate store_uri per training run")
    else:
        reg.publish(local, version=v, metadata={"run_key": e.meta["run_key"], "iteration": e.meta["iteration"],
                                                "base_checkpoint": e.meta["base_checkpoint"]})
    return f"{store_uri.rstrip('/')}/adapters/v{v:06d}"


def _save_adapter(run_dir: str, e: _Entry) -> Path:
    """Local copy of the current adapter (``run_dir/adapters/vN``); older local copies are pruned,
    since the store keeps every published version."""
    root = Path(run_dir) / "adapters"
    dest = root / f"v{e.learner.version:06d}"
    if not (dest / "adapter_config.json").exists():
        tmp = root / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
        e.learner.save_adapter(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    for old in root.glob("v*"):
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    return dest


def _check_resumable(run_dir: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and not k.startswith(RESUMABLE))
    if changed:
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:5])
        raise ConfigError(f"cannot resume {run_dir}: it was trained with different settings ({diff})")


@task(name="init-learner", **STORAGE, **LIGHT)
def init_learner(run_dir: str, cfg: dict[str, Any], base_checkpoint: str, store_uri: str,
                 resume: bool = False) -> dict[str, Any]:
    """Create the learner (and publish adapter v0), or resume the checkpoint in ``run_dir``."""
    new_cfg = load_recipe(cfg)
    meta = checkpoint_meta(run_dir)
    if meta is not None:
        if not resume:
            raise FileExistsError(f"{run_dir} already holds a learner checkpoint (iteration {meta['iteration']}); "
                                  "pass resume=True to continue it, or choose a new run_dir")
        _check_resumable(run_dir, load_recipe(meta["cfg"]).flat(), new_cfg.flat())
        if Path(base_checkpoint).resolve() != Path(meta["base_checkpoint"]).resolve():
            raise ValueError(f"cannot resume {run_dir}: it was trained on base {meta['base_checkpoint']}, "
                             f"not {base_checkpoint}")
        if store_uri.rstrip("/") != str(meta["store_uri"]).rstrip("/"):
            raise ValueError(f"cannot resume {run_dir}: its batches and adapters are in {meta['store_uri']}, "
                             f"not {store_uri}")
        release(run_dir)
        e = _entry(run_dir)
        e.cfg = new_cfg
        resumed = True
    else:
        if not (Path(base_checkpoint) / "config.json").exists():
            raise FileNotFoundError(f"base_checkpoint {base_checkpoint} is not a Miles checkpoint folder (no config.json)")
        _threads(new_cfg)
        e = _Entry(Learner(new_cfg, base_checkpoint, seed=new_cfg.train.seed), new_cfg, build_task(new_cfg),
                   {"run_key": uuid.uuid4().hex[:12], "base_checkpoint": str(Path(base_checkpoint).resolve()),
                    "iteration": 0, "consumed": [], "store_uri": store_uri})
        _save(run_dir, e)
        with _LOCK:
            _CACHE[_key(run_dir)] = e
        resumed = False
    local = _save_adapter(run_dir, e)
    uri = _publish(store_uri, e, local)
    return {"iteration": e.meta["iteration"], "version": e.learner.version, "run_key": e.meta["run_key"],
            "base_checkpoint": e.meta["base_checkpoint"], "adapter_dir": str(local), "adapter_uri": uri,
            "resumed": resumed}


def _guarded(run_dir: str, fn: Any) -> Any:
    try:
        return fn(_entry(run_dir))
    except BaseException:
        release(run_dir)  # never let a half-mutated learner serve the retry
        raise


@task(name="rollout", **STORAGE, **LIGHT)
def rollout(run_dir: str, store_uri: str, iteration: int) -> dict[str, Any]:
    """Sample G completions per fresh prompt with the current adapter; commit them as a raw batch."""
    def go(e: _Entry) -> dict[str, Any]:
        raw = _stores(store_uri)[0]
        bid = f"{e.meta['run_key']}-it{iteration:06d}"
        t0 = time.perf_counter()
        try:
            batch, reused = raw.read_batch(bid), True
        except BatchNotFoundError:
            cfg, lrn = e.cfg, e.learner
            probs = lrn.draw_prompts(e.data, cfg.train.prompts_per_iter)
            batch = rl_rollout(lrn.model, lrn.tok, [p.prompt for p in probs], [p.answer for p in probs], cfg.sampler,
                               cfg.task.completion_len, cfg.train.group_size, lrn.gen, lrn.version,
                               group_offset=lrn.groups_seen)
            lrn.groups_seen += len(probs)
            raw.write_batch(batch, bid)
            _save(run_dir, e)  # RNG and group counter advanced: a resume must not redraw these prompts
            reused = False
        seconds = time.perf_counter() - t0
        tokens = batch.completion_ids.numel()
        stats = {"nfe_mean": float(batch.nfe.float().mean()), "steps_mean": float(batch.num_steps.float().mean()),
                 "completions": float(len(batch)), "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
                 "policy_version": float(batch.policy_version.max())}
        return {"batch_id": bid, "uri": f"{raw.root_uri}/batches/{bid}.parquet", "reused": reused, "stats": stats}
    return _guarded(run_dir, go)


@task(name="score-rewards", **STORAGE, **LIGHT)
def score_rewards(run_dir: str, store_uri: str, batch_id: str) -> dict[str, Any]:
    """Reward + group-relative advantages for a raw batch; commit the scored batch (same id)."""
    meta = checkpoint_meta(run_dir)
    if meta is None:
        raise FileNotFoundError(f"no learner checkpoint in {run_dir}")
    cfg = load_recipe(meta["cfg"])
    raw, scored, _ = _stores(store_uri)
    t0 = time.perf_counter()
    try:
        batch = scored.read_batch(batch_id)
    except BatchNotFoundError:
        batch = assign_advantages(rl_score(raw.read_batch(batch_id), get_reward(cfg.train.reward)),
                                  cfg.adpo.std_normalize)
        scored.write_batch(batch, batch_id)
    stats = {**rollout_stats(batch), "seconds": time.perf_counter() - t0}
    samples = [{"prompt": batch.prompts[i], "completion": batch.completions[i],
                "answer": str(batch.meta[i].get("answer", "")) if batch.meta else "",
                "reward": float(batch.reward[i]), "advantage": float(batch.advantage[i])}
               for i in range(min(SAMPLE_ROWS, len(batch)))]
    return {"batch_id": batch_id, "uri": f"{scored.root_uri}/batches/{batch_id}.parquet", "stats": stats,
            "samples": samples}


@task(name="adpo-update", **STORAGE, **LIGHT)
def adpo_update(run_dir: str, store_uri: str, batch_id: str) -> dict[str, Any]:
    """One ADPO update on a scored batch, checkpoint, then publish the new adapter version.

    Idempotent per batch: the checkpoint lists consumed batches, so a retry after a failed publish
    publishes without updating twice."""
    def go(e: _Entry) -> dict[str, Any]:
        t0 = time.perf_counter()
        if batch_id not in e.meta["consumed"]:
            batch = _stores(store_uri)[1].read_batch(batch_id)
            stats = e.learner.update(batch, temperature=e.cfg.sampler.temperature)
            stats["staleness"] = float(e.learner.version - 1 - int(batch.policy_version.min()))
            stats["seconds"] = time.perf_counter() - t0
            stats["tokens_per_s"] = stats.get("tokens", 0.0) / max(stats["seconds"], 1e-9)
            e.meta.update(iteration=e.meta["iteration"] + 1, consumed=[*e.meta["consumed"], batch_id],
                          last_update=stats, guard_event=e.learner.guard_event)
            _save(run_dir, e)
        local = _save_adapter(run_dir, e)
        uri = _publish(store_uri, e, local)
        return {"version": e.learner.version, "iteration": e.meta["iteration"], "adapter_dir": str(local),
                "adapter_uri": uri, "stats": dict(e.meta.get("last_update") or {}),
                "guard_event": e.meta.get("guard_event", "")}
    return _guarded(run_dir, go)


def _eval_summary(result: Any, path: Path) -> dict[str, Any]:
    d = result.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda p: p.write_text(json.dumps(d, indent=1)))
    return {"pass1": float(d["pass_at"]["pass@1"]), "pass_at": d["pass_at"], "metrics": d["metrics"],
            "config": d["config"], "fingerprint": d["config_fingerprint"], "num_problems": d["num_problems"],
            "samples": d["samples"][:SAMPLE_ROWS], "path": str(path)}


@task(name="evaluate-policy", **LIGHT)
def evaluate_policy(run_dir: str, version: int, progress: bool = False) -> dict[str, Any]:
    """pass@k of the learner's current policy on the held-out split (full eval config recorded)."""
    def go(e: _Entry) -> dict[str, Any]:
        if e.learner.version != version:
            raise RuntimeError(f"evaluate_policy: learner in {run_dir} is at version {e.learner.version}, not {version}")
        res = run_eval(e.learner.model, e.learner.tok, e.cfg, e.data, progress=progress)
        return _eval_summary(res, Path(run_dir) / "evals" / f"v{version:06d}.json")
    return _guarded(run_dir, go)


@task(name="fetch-adapter", **STORAGE, **LIGHT)
def fetch_adapter(adapter: str, dest: str) -> str:
    """A local PEFT folder for ``adapter``: the folder itself, or a download of ``<store>/adapters/vN``."""
    if (Path(adapter) / "adapter_config.json").exists():
        return str(Path(adapter).resolve())
    m = _ADAPTER_URI.match(adapter)
    if m is None:
        raise ValueError(f"adapter {adapter!r} is neither a PEFT folder (adapter_config.json) nor a "
                         "published version URI '<store_uri>/adapters/vNNNNNN'")
    return str(AdapterRegistry(m["root"]).fetch(int(m["version"]), dest))


@task(name="evaluate-checkpoint", **LIGHT)
def evaluate_checkpoint(base_checkpoint: str, adapter_dir: str | None, cfg: dict[str, Any], out_path: str,
                        progress: bool = False) -> dict[str, Any]:
    """pass@k of a base checkpoint, with a LoRA adapter folder on top when given."""
    rc = load_recipe(cfg)
    _threads(rc)
    model, tok = load_base(rc, base_checkpoint)
    if adapter_dir is not None:
        model = load_adapter(model, adapter_dir)
    res = run_eval(model, tok, rc, build_task(rc), progress=progress)
    return _eval_summary(res, Path(out_path))


@task(name="sft-baseline", **LIGHT)
def sft_baseline(cfg: dict[str, Any], out_dir: str, run_id: str, eval_problems: int | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Train the SFT baseline, logging the held-out plateau curve as ``sft/*`` metrics, then
    evaluate it with the recipe's full eval config. The checkpoint folder appears atomically."""
    rc = load_recipe(cfg)
    _threads(rc)
    dest = Path(out_dir)
    if (dest / "config.json").exists():
        raise FileExistsError(f"{dest} already holds a checkpoint; choose a new run_dir")
    data = build_task(rc)
    n_eval = eval_problems or rc.eval.num_problems

    def on_eval(step: int, pass1: float, stats: dict[str, float]) -> None:
        tracking.log_metrics(run_id, {"sft/pass1": pass1, **{f"sft/{k}": v for k, v in stats.items()}}, step)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    t0 = time.perf_counter()
    try:
        model, tok = train_baseline(rc, data, tmp, on_eval=on_eval, progress=progress, eval_problems=n_eval)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    ev = _eval_summary(run_eval(model, tok, rc, data, progress=progress), dest.parent / "evals" / "sft.json")
    return {"base_checkpoint": str(dest.resolve()), "pass1": ev["pass1"], "eval": ev, "seconds": seconds}


@task(name="register-policy", retries=2, retry_delay_seconds=[2, 4], retry_condition_fn=_retry_transient, **LIGHT)
def register_policy(run_id: str, name: str, base_checkpoint: str, adapter_dir: str | None, cfg: dict[str, Any],
                    pass1: float, fingerprint: str, tags: dict[str, str]) -> dict[str, Any]:
    """Register the policy as a pyfunc model version; ``champion`` moves only if pass@1 improves."""
    return tracking.register_model(run_id, name, base_checkpoint, adapter_dir, cfg, pass1, fingerprint, tags)
