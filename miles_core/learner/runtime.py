"""The run around one :class:`~miles_core.learner.policy.Learner`: the one learner runtime.

The synchronous flow (a collect and an update task per iteration: tasks/training.py) and the
asynchronous learner (asyncrl/learner.py) drive the same object, so resume and exactly-once are
one implementation:

    collect(seq):       sample batch seq with the current policy (algo/rl.py::sample_batch), score
                        it, commit it to trajectories/ (a retry samples the same prompts and noise)
    consume(batch id):
        read the batch (a corrupt one is quarantined and recorded, never fatal)
        staleness s = current version - the batch's policy version; s > S: drop it and record it
        ADPO update with the truncated importance weight against the stored behaviour log-probs
        version += 1; checkpoint every N updates; publish the adapter

Exactly-once: the *ledger* (which batch ids were consumed, dropped or quarantined) lives inside
the learner checkpoint, next to the adapter and optimizer it produced, and both are written in
one atomic object. A learner killed after an update but before its checkpoint resumes from the
previous checkpoint, whose ledger does not list that batch, so the batch is used again by the
surviving lineage and exactly once there. Adapter versions the dead learner published after its
last checkpoint are orphaned: the resumed learner numbers its next version above them, so a
number is never reused for different weights. The store layout is miles_core/storage/run.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_core.algo.rl import batch_id
from miles_core.algo.update import global_counts
from miles_core.config import ConfigError, RecipeConfig, flatten, load_recipe, migrate, set_dotted
from miles_core.data.registry import TaskData, build_task
from miles_core.learner.channels import BatchChannel, PolicyChannel
from miles_core.learner.policy import Learner
from miles_core.learner.shares import Verdict, agree, first_reader, held_rows, my_share
from miles_core.parallel import World
from miles_core.storage import CorruptBatchError
from miles_core.types import Batch, TrajectoryBatch
from miles_core.storage import uri as U
from miles_core.storage.run import RunStore, changed_settings, prepare_run

log = logging.getLogger(__name__)
# Settings that may change when a run is resumed (its length, evaluation, threads); anything else
# would silently change the experiment, so it is refused.
RESUMABLE = ("train.iterations", "train.eval_every", "eval.", "torch_threads", "async_rl.fsdp")
POINTER = "learner.json"  # run_dir/learner.json: which store and base a local run folder trains
HISTORY_KEYS = ("loss", "clip_frac", "approx_kl", "iw_mean", "iw_max", "entropy", "rows", "rolled_back",
                "guard_skipped", "guard_rollbacks")


class LearnerRun:
    """A learner bound to the run at ``run_uri``: its ledger, checkpoints and published adapters.

    ``cfg``: the recipe to run with (default: the run's own); it may differ from ``run.json`` only
    in :data:`RESUMABLE` settings. ``total_updates``: how many policy updates the LR schedule spans.
    ``checkpoint_every``: default ``async_rl.checkpoint_every`` (the synchronous flow passes 1).
    """

    def __init__(self, run_uri: str, cache_dir: str | None = None, storage_options: dict[str, Any] | None = None,
                 cfg: RecipeConfig | None = None, total_updates: int | None = None,
                 checkpoint_every: int | None = None, world: World | None = None) -> None:
        self.world = world or World()  # D data-parallel ranks: one ledger, rank 0 writes and publishes
        self.rs = RunStore(run_uri, storage_options)
        spec = self.rs.read_spec()
        if cfg is not None:
            changed = changed_settings(spec["cfg"], cfg.to_dict(), RESUMABLE)
            if changed:
                raise ValueError(f"{run_uri}: cfg differs from run.json in {changed[:5]}, which a resume may not change")
        self.cfg = cfg or load_recipe(spec["cfg"])
        self.rs.retry_budget_s = self.cfg.async_rl.retry_budget_s
        self.cache = Path(cache_dir or tempfile.mkdtemp(prefix="miles-learner-"))
        self.owns_cache = cache_dir is None  # a temp folder of its own: removed when the run ends
        self.checkpoint_every = checkpoint_every or self.cfg.async_rl.checkpoint_every
        self.learner = Learner(self.cfg, self.rs.fetch_base(self.cache),
                               total_updates=total_updates, world=self.world)
        self.batches, self.policy = BatchChannel(self.rs, self.cfg), PolicyChannel(self.rs)  # learner/channels.py
        self.ledger: dict[str, list[dict[str, Any]]] = {"consumed": [], "dropped": [], "quarantined": []}
        self.history: list[dict[str, Any]] = []
        self.totals: dict[str, Any] = {"idle_s": 0.0, "wall_s": 0.0, "fill_s": 0.0, "resumes": 0, "version_skips": 0}
        ckpt = self.rs.load_checkpoint()
        if ckpt is not None:
            self.learner.load_state(ckpt["learner"])
            self.ledger, self.history, self.totals = ckpt["ledger"], ckpt["history"], ckpt["totals"]
            self.totals["resumes"] += 1
            if "fallback" in ckpt:  # the newest was damaged: storage/run.py::load_checkpoint said which it used
                self.totals["checkpoint_fallbacks"] = [*self.totals.get("checkpoint_fallbacks", []), ckpt["fallback"]]
        latest = self.rs.retry(self.rs.adapters.latest_version, "polling adapters")
        if latest is not None and latest > self.learner.version:
            # versions published after the last checkpoint by a learner that died: never reuse them
            log.warning("resuming at checkpoint version %d below published %d; next version is %d",
                        self.learner.version, latest, latest + 1)
            self.learner.version = latest
            self.totals["version_skips"] += 1
        if not self.learner.sharded:  # as DDP does at start (equal already: same seed or checkpoint)
            self.world.broadcast_(self.learner.params)
        self._since_ckpt = 0
        self._data: TaskData | None = None
        self._collected: tuple[str, Batch] | None = None  # the batch collect() just committed
        unpublished = self.world.is_main and not self.rs.retry(
            lambda: self.rs.adapters.is_committed(self.learner.version), "checking adapter")
        if self.world.broadcast_object(unpublished):  # rank 0's answer: every rank joins a sharded publish
            self.publish()

    def handled(self) -> set[str]:
        """Batch ids the ledger lists (consumed, dropped or quarantined): never taken again."""
        return {e["id"] for entries in self.ledger.values() for e in entries}

    def checkpoint(self) -> None:
        self._since_ckpt = 0
        if not (self.world.is_main or self.learner.sharded):  # same state everywhere; rank 0 writes it
            return
        state = self.learner.state()  # sharded: gathered on every rank (a collective)
        if not self.world.is_main:
            return
        blob = {"learner": state, "ledger": self.ledger, "history": self.history,
                "totals": self.totals, "version": self.learner.version}
        with self.rs.requests.phase("checkpoint"):
            self.rs.save_checkpoint(blob, self.learner.version)

    def publish(self) -> None:
        """Upload the current adapter as version ``learner.version`` (idempotent on resume)."""
        v = self.learner.version
        tensors = self.learner.full_adapter()  # sharded: every rank gathers (a collective); else None
        if not self.world.is_main:
            return
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp, self.rs.requests.phase("publish"):
            self.learner.save_adapter(tmp, getattr(torch, self.cfg.async_rl.sync_dtype), tensors)
            self.policy.publish(tmp, v)

    def adapter_uri(self, version: int | None = None) -> str:
        return f"{self.rs.uri}/adapters/v{self.learner.version if version is None else version:06d}"

    @property
    def data(self) -> TaskData:
        """The recipe's task (prompts to sample, the held-out split), built on first use."""
        if self._data is None:
            self._data = build_task(self.cfg)
        return self._data

    def collect(self, seq: int, worker: str = "learner", index: int = 0) -> tuple[str, Batch, bool]:
        """Sample batch ``seq`` of ``worker`` with the current policy, score it and commit it to
        ``trajectories/`` -> (batch id, batch, reused). The prompts and noise are seeded from the
        batch id, so a retry samples the same batch; when an earlier attempt's commit landed, the
        stored batch is the one that counts (``reused``). The batch stays in memory until the next
        collect, so a ``consume`` of it in this process does not read it back."""
        bid = batch_id(seq, worker)
        if bid in self.handled():  # already consumed (a resumed run's backfill): read it, do not sample it again
            batch = self.rs.retry(lambda: self.rs.trajectories.read_batch(bid), f"reading batch {bid}")
            self._collected = (bid, batch)
            return bid, batch, True
        batch, reused = self.learner.sample(self.data, seq, worker, index), False
        if not self.batches.commit(batch, bid):
            batch = self.rs.retry(lambda: self.rs.trajectories.read_batch(bid), f"reading batch {bid}")
            reused = True
        self._collected = (bid, batch)
        return bid, batch, reused

    def _judge(self, bid: str, quarantine: bool = True) -> tuple[Verdict, Batch | None]:
        """Read batch ``bid`` (the one :meth:`collect` holds, else from the store) and judge it:
        corrupt (quarantined in the store here when ``quarantine``: one rank moves it),
        staler than ``async_rl.max_staleness``, or fresh."""
        if self._collected is not None and self._collected[0] == bid:
            batch, self._collected = self._collected[1], None  # committed by this process: no read back
        else:
            rs = self.rs
            try:
                with rs.requests.phase("read"):  # what reading one batch costs on the wire
                    batch = rs.retry(lambda: rs.trajectories.read_batch(bid), f"reading batch {bid}")
            except CorruptBatchError as e:
                reason = str(e)
                if quarantine:
                    rs.retry(lambda: rs.trajectories.quarantine(bid, reason), f"quarantining {bid}")
                return ("quarantined", reason), None
        verdict = self.batches.verdict(batch, self.learner.version)
        return verdict, batch if verdict[0] == "fresh" else None

    def consume(self, bids: str | list[str]) -> tuple[str, dict[str, float]]:
        """One update on the committed batches ``bids`` (one global batch: ``async_rl.global_batch``
        completions) -> ('consumed' | 'dropped' | 'quarantined', update stats). Each batch is
        judged on its own: a corrupt one is quarantined, one staler than ``async_rl.max_staleness``
        dropped, both recorded; the rest are updated on together, and the ledger lists each with
        the update that consumed it. With D ranks each reads only its share (learner/shares.py)."""
        bids = [bids] if isinstance(bids, str) else list(bids)
        t_read, world, m = time.perf_counter(), self.world, len(bids)
        group = self.cfg.train.group_size
        n = self.cfg.train.prompts_per_iter * group  # rows of a sampler batch
        multi = world.size > 1
        share = my_share(m, n, group, world) if multi else range(m)
        judged = {j: self._judge(bids[j], first_reader(j, n, m, group, world)) for j in share}
        verdicts = agree(m, {j: v for j, (v, _) in judged.items()}, world)
        fresh: list[tuple[str, int, int]] = []  # (id, behaviour version, rows)
        parts: list[Batch] = []                 # this rank's rows of each fresh batch it read
        keys: list[Tensor] = []                 # their trajectories' keys (algo/draws.py)
        dropped = 0
        for j, (bid, (what, info)) in enumerate(zip(bids, verdicts)):
            if what == "quarantined":
                self.ledger["quarantined"].append({"id": bid, "reason": str(info)[:300]})
            elif what == "dropped":
                self.ledger["dropped"].append({"id": bid, "staleness": info})
                dropped += 1
            else:
                batch = judged[j][1] if j in judged else None
                fresh.append((bid, info, n if batch is None else len(batch)))
                if batch is None:
                    continue
                if multi and len(batch) != n:
                    raise ValueError(f"batch {bid} has {len(batch)} rows; the ranks split sampler batches of "
                                     f"{n} (train.prompts_per_iter x train.group_size)")
                part, part_keys = held_rows(bid, j, batch, m, group, world)
                parts.append(part)
                keys.append(part_keys)
        if not fresh:
            return ("dropped" if dropped else "quarantined"), {}
        batch: Batch = (parts[0] if len(parts) == 1 else type(parts[0]).concat(parts) if parts
                        else TrajectoryBatch.empty(self.cfg.task.completion_len))
        version_before = self.learner.version
        staleness = version_before - min(v for _, v, _ in fresh)
        t0 = time.perf_counter()
        stats = self.learner.update(batch, world=world if multi else None, keys=torch.cat(keys) if keys else None)
        t1 = time.perf_counter()
        stats.update(staleness=float(staleness), seconds=t1 - t0, batches=float(len(fresh)),
                     tokens_per_s=stats.get("tokens", 0.0) / max(t1 - t0, 1e-9))
        update = len(self.history) + 1
        for bid, v, rows in fresh:
            self.ledger["consumed"].append({"id": bid, "staleness": version_before - v, "policy_version": v,
                                            "learner_version": self.learner.version, "rows": rows, "update": update})
        reward_sum, count = global_counts(world if multi else None, float(torch.nan_to_num(batch.reward, nan=0.0).sum()),
                                          len(batch))
        self.history.append({"update": update, "version": self.learner.version, "batches": len(fresh), "at": time.time(),
                             "staleness": staleness, "reward_mean": reward_sum / max(count, 1.0),
                             "read_s": t0 - t_read, "update_s": t1 - t0, "guard_event": self.learner.guard_event,
                             **{k: float(v) for k, v in stats.items() if k in HISTORY_KEYS}})
        self._since_ckpt += 1
        if self._since_ckpt >= self.checkpoint_every:
            self.checkpoint()
        t2 = time.perf_counter()
        self.publish()
        self.history[-1].update(checkpoint_s=t2 - t1, publish_s=time.perf_counter() - t2)
        return "consumed", stats

    def last_update(self, bid: str) -> dict[str, Any]:
        """The history row of the update that consumed ``bid`` (a retried task reports it again)."""
        n = next((i for i, e in enumerate(self.ledger["consumed"]) if e["id"] == bid), None)
        row = dict(self.history[n]) if n is not None and n < len(self.history) else {}
        return {**row, "seconds": row.get("update_s", 0.0)}


# ---------------------------------------------------------------------- a run driven step by step
def _own_store(run_dir: Path, store_uri: str) -> str | None:
    """``store_uri`` relative to ``run_dir`` (``./store``) when it is a folder inside it, else None."""
    if "://" in store_uri:
        return None
    try:
        return "./" + Path(store_uri).resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return None


def read_pointer(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``run_dir``'s pointer (store, base, run key, resumed settings, iteration, version), or None if absent.

    A store inside the folder is recorded relative to it, so a copied or moved folder trains its own
    copy of the store. A folder copied from another whose store is outside both is refused: resuming
    it would write into the original run's store (a moved folder, whose original is gone, is not)."""
    run_dir = Path(run_dir)
    path = run_dir / POINTER
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: unreadable learner metadata ({e})") from None
    store = str(meta.get("store_uri", ""))
    if store.startswith("./"):
        meta["store_uri"] = str((run_dir / store).resolve())
    elif (meta.get("run_dir") and Path(meta["run_dir"]) != run_dir.resolve() and Path(meta["run_dir"]).exists()):
        raise ValueError(f"{run_dir} is a copy of {meta['run_dir']}, whose batches and adapters are in {store} "
                         "(outside both folders): resuming the copy would write into the original's store. Resume "
                         "the original, or start a new run from this folder's adapters")
    return meta


def write_pointer(run_dir: str | os.PathLike[str], run: LearnerRun, /, **extra: Any) -> dict[str, Any]:
    """Record where ``run_dir``'s run lives and how far it got (atomic; the store stays the truth).
    The recipe is not kept here: it is the store's ``run.json`` with ``resumed_settings``, the
    resumable settings this folder's latest start changed (:func:`pointed_recipe`)."""
    meta = {k: v for k, v in (read_pointer(run_dir) or {}).items() if k != "cfg"}
    meta = {**meta, **{k: v for k, v in extra.items() if k != "cfg"}, "iteration": len(run.handled()),
            "version": run.learner.version, "consumed": [e["id"] for e in run.ledger["consumed"]]}
    stored = {**meta, "run_dir": str(Path(run_dir).resolve()),
              "store_uri": _own_store(Path(run_dir), str(meta["store_uri"])) or meta["store_uri"]}
    fs, root = U.resolve(str(run_dir))
    U.write_bytes_atomic(fs, U.join(root, POINTER), json.dumps(stored, indent=1, default=str).encode())
    return meta


def _step_run(run_dir: str | os.PathLike[str], store_uri: str, cfg: RecipeConfig) -> LearnerRun:
    """A run as the synchronous flow drives it: one checkpoint per update, the LR schedule over
    ``train.iterations``, the base cached under ``run_dir/.cache``."""
    return LearnerRun(store_uri, str(Path(run_dir) / ".cache"), cfg=cfg, total_updates=cfg.train.iterations,
                      checkpoint_every=1)


def pointed_recipe(run_dir: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> RecipeConfig:
    """The recipe of the run ``run_dir`` points at: its store's ``run.json``, with the resumable
    settings the folder's latest start changed (a pointer written before it recorded the whole recipe).
    ``meta``: the pointer, when the caller read it already."""
    meta = meta or read_pointer(run_dir)
    if meta is None:
        raise FileNotFoundError(f"no learner in {run_dir}; start the run first")
    if "cfg" in meta:
        return load_recipe(meta["cfg"])
    data = migrate(RunStore(meta["store_uri"]).read_spec()["cfg"], f"{meta['store_uri']}/run.json")
    for key, value in meta.get("resumed_settings", {}).items():
        set_dotted(data, key, value)
    return load_recipe(data)


def open_step_run(run_dir: str | os.PathLike[str]) -> LearnerRun:
    """The run ``run_dir`` points at (see :func:`start_step_run`)."""
    meta = read_pointer(run_dir)
    if meta is None:
        raise FileNotFoundError(f"no learner in {run_dir}; start the run first")
    return _step_run(run_dir, meta["store_uri"], pointed_recipe(run_dir, meta))


def existing_run(run_dir: str | os.PathLike[str], resume: bool) -> dict[str, Any] | None:
    """``run_dir``'s pointer (None for a new folder); a folder that holds a run is refused unless
    ``resume``: the one check, made by the flow before it trains an SFT base and again at the start."""
    meta = read_pointer(run_dir)
    if meta is not None and not resume:
        raise FileExistsError(f"{run_dir} already holds a learner checkpoint (iteration {meta['iteration']}); "
                              "pass --resume to continue it (resume=True from Python), or choose a new --run-dir")
    return meta


def resumed_recipe(store_uri: str, overrides: list[str]) -> tuple[RecipeConfig, dict[str, list[Any]]]:
    """The recipe a resume continues: the run's own, as ``run.json`` recorded it at the start, with
    the overrides given now on top -> (recipe, {key: [before, now]} for each key they change).

    So a run started with ``train.iterations=30 eval.num_problems=100`` and resumed with a bare
    ``--resume`` keeps both. A change to an evaluation setting is refused here: the curve would mix
    two evaluations under one name; other changes outside :data:`RESUMABLE` are refused by
    ``prepare_run``."""
    stored = RunStore(store_uri).read_spec()["cfg"]
    cfg = load_recipe(stored, overrides)
    was, now = flatten(migrate(stored, "run.json")), cfg.flat()
    changed = {k: [was.get(k), now[k]] for k in changed_settings(stored, cfg.to_dict())}
    evals = sorted(k for k in changed if k.startswith("eval."))
    if evals:
        diff = ", ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in evals)
        raise ConfigError(f"cannot resume with {diff}: the run's held-out curve was measured with the first value; "
                          "resume without it, or start a new run (--run-dir) to evaluate differently")
    return cfg, changed


def start_step_run(run_dir: str, cfg: RecipeConfig, base_checkpoint: str, store_uri: str,
                   resume: bool = False) -> tuple[LearnerRun, bool]:
    """Start the run of ``run_dir`` in ``store_uri`` (publishing adapter v0), or resume it -> (run, resumed).

    Refused, naming why: a folder that already holds a run without ``resume``; a resume on another
    base or store; a store that holds another run; a changed setting outside :data:`RESUMABLE`."""
    meta = existing_run(run_dir, resume)
    if meta is not None:
        if Path(base_checkpoint).resolve() != Path(meta["base_checkpoint"]).resolve():
            raise ValueError(f"cannot resume {run_dir}: it was trained on base {meta['base_checkpoint']}, "
                             f"not {base_checkpoint}")
        if store_uri.rstrip("/") != str(meta["store_uri"]).rstrip("/"):
            raise ValueError(f"cannot resume {run_dir}: its batches and adapters are in {meta['store_uri']}, "
                             f"not {store_uri}")
    elif RunStore(store_uri).exists("run.json"):
        _restart_or_refuse(Path(run_dir), store_uri)
    if not (Path(base_checkpoint) / "config.json").exists():
        raise FileNotFoundError(f"base_checkpoint {base_checkpoint} is not a Miles checkpoint folder (no config.json)")
    spec = prepare_run(store_uri, cfg, base_checkpoint, resumable=RESUMABLE)  # a changed setting fails, naming it
    flat = cfg.flat()
    resumed = {k: flat[k] for k in changed_settings(spec["cfg"], cfg.to_dict())}  # resumable ones only
    fresh = {"run_key": uuid.uuid4().hex[:12], "base_checkpoint": str(Path(base_checkpoint).resolve()),
             "store_uri": store_uri}
    run = _step_run(run_dir, store_uri, cfg)  # the pointer is written only once the run opened
    write_pointer(run_dir, run, **{**fresh, **(meta or {}), "resumed_settings": resumed})
    return run, meta is not None


def _restart_or_refuse(run_dir: Path, store_uri: str) -> None:
    """A store that holds a run but no pointer to it from ``run_dir``: the folder's own store left by a
    start that failed before its first checkpoint is cleared (nothing was learned); anything else is
    another run's, and refused."""
    rs = RunStore(store_uri)
    if _own_store(run_dir, store_uri) and not rs.exists("learner", "CHECKPOINT"):
        log.warning("%s: clearing the store of a start that failed before its first update", store_uri)
        shutil.rmtree(store_uri)
        return
    raise FileExistsError(f"{store_uri} already holds another training run (its run.json{', and checkpoints' if rs.exists('learner', 'CHECKPOINT') else ''}); "
                          "use a separate --store per run")


def save_local_adapter(run: LearnerRun, root: str | os.PathLike[str]) -> Path:
    """A local copy of the current adapter (``root/vN``, for tracking and registration); older
    copies are pruned, since the store keeps every published version."""
    root = Path(root)
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
