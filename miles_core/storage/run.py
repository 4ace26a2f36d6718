"""Where a training run keeps its state: one store URI, shared by every process of the run.

The synchronous flow and the asynchronous learner use the same layout (see ARCHITECTURE.md):

    {run}/run.json                  the run spec (recipe, seed): written once, exclusive create
    {run}/base/                     the frozen base checkpoint, uploaded once (COMMITTED last)
    {run}/trajectories/             committed, scored Parquet batches (TrajectoryStore): what a learner consumes
    {run}/adapters/vNNNNNN/         published LoRA versions (AdapterRegistry)
    {run}/learner/checkpoints/      learner state: adapter, optimizer, RNGs, version, ledger
    {run}/learner/CHECKPOINT        pointer to the newest checkpoint and the two before it (+ sha256s), written last
    {run}/learner/status.json       progress the samplers read for back-pressure
    {run}/samplers/{worker}.json    each sampler's progress (next sequence number, sync stats)
    {run}/control/STOP              ask every process to stop cleanly

Why one layout object: samplers and the learner never talk to each other, only to storage, so
they must agree on these paths; every read and write goes through :func:`call_with_retry`.
The tensor-free ``run.json`` check lives here too, because a resumed run and a second sampler
re-open the same run and must be refused if its recipe changed.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from miles_core.config import ConfigError, RecipeConfig, flatten, migrate
from miles_core.storage.requests import PROCESS
from miles_core.storage import AdapterRegistry, TrajectoryStore
from miles_core.storage import uri as U
from miles_core.storage.retry import call_with_retry

T = TypeVar("T")
BASE_FILES_MARKER = "COMMITTED"
# learner checkpoints a run keeps: the newest and the ones a resume falls back to when it is damaged
KEEP_CHECKPOINTS = 3
log = logging.getLogger(__name__)


class RunSpecMismatch(ConfigError):
    """``run.json`` already exists with a different recipe: refusing to mix two experiments."""


def changed_settings(old: dict[str, Any], new: dict[str, Any], resumable: tuple[str, ...] = ()) -> list[str]:
    """Recipe keys whose values differ between two nested cfg dicts, ignoring ``resumable`` prefixes.
    A key one side lacks counts as the field's default (a run recorded before the field existed ran
    with what the default does); keys of the old ``adpo`` section count where they now live."""
    a, b = flatten(migrate(old, "run.json")), flatten(migrate(new, "recipe"))
    default = flatten(RecipeConfig().to_dict())
    return sorted(k for k in set(a) | set(b)
                  if a.get(k, default.get(k)) != b.get(k, default.get(k)) and not k.startswith(resumable))


class RunStore:
    """Paths and small JSON/bytes helpers for one asynchronous run under ``run_uri``."""

    def __init__(self, run_uri: str, storage_options: dict[str, Any] | None = None, retry_budget_s: float = 60.0):
        self.uri = run_uri.rstrip("/")
        self.options = storage_options
        self.fs, self.root = U.resolve(self.uri, storage_options)
        self.trajectories = TrajectoryStore(f"{self.uri}/trajectories", storage_options)
        self.adapters = AdapterRegistry(self.uri, storage_options)
        self.retry_budget_s = retry_budget_s
        self.requests = PROCESS  # this process's S3 requests, reported in its status file
        for fs in (self.fs, self.trajectories.fs, self.adapters.fs):
            PROCESS.attach(fs)

    def path(self, *parts: str) -> str:
        return U.join(self.root, *parts)

    def retry(self, fn: Callable[[], T], what: str) -> T:
        return call_with_retry(fn, f"{what} ({self.uri})", self.retry_budget_s)

    # ------------------------------------------------------------------ small objects
    def read_json(self, *parts: str) -> dict[str, Any] | None:
        """The JSON object at ``parts``, or None if it does not exist (retried on outages)."""
        path = self.path(*parts)

        def go() -> dict[str, Any] | None:
            try:
                return U.read_json(self.fs, path)
            except FileNotFoundError:
                return None
        return self.retry(go, f"reading {'/'.join(parts)}")

    def write_json(self, obj: dict[str, Any], *parts: str) -> None:
        path = self.path(*parts)
        self.retry(lambda: U.write_bytes_atomic(self.fs, path, U.dumps(obj)), f"writing {'/'.join(parts)}")

    def exists(self, *parts: str) -> bool:
        """Whether the object (a file, not a folder) ``parts`` names exists."""
        path = self.path(*parts)
        return self.retry(lambda: U.object_exists(self.fs, path), f"checking {'/'.join(parts)}")

    # ------------------------------------------------------------------ run spec
    def write_spec(self, spec: dict[str, Any], resumable: tuple[str, ...] = ()) -> dict[str, Any]:
        """Create ``run.json`` or, if it exists, check it describes the same run (settings under a
        ``resumable`` prefix may differ: a resumed run may be longer); return the stored spec."""
        path = self.path("run.json")
        try:
            self.retry(lambda: U.create_exclusive(self.fs, path, U.dumps(spec)), "creating run.json")
            return spec
        except U.AlreadyExistsError:
            old = self.read_spec()
            changed = changed_settings(old.get("cfg") or {}, spec.get("cfg") or {}, resumable)
            if changed:
                a, b = flatten(old.get("cfg") or {}), flatten(spec.get("cfg") or {})
                diff = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:5])
                raise RunSpecMismatch(f"{self.uri}/run.json describes a different recipe ({diff}); use a new run "
                                      "URI (or the same recipe to resume)") from None
            return old

    def read_spec(self) -> dict[str, Any]:
        spec = self.read_json("run.json")
        if spec is None:
            raise FileNotFoundError(f"{self.uri}/run.json does not exist: prepare the run first (miles_core.asyncrl.launch.prepare_run)")
        return spec

    # ------------------------------------------------------------------ base checkpoint
    def upload_base(self, local_dir: str | os.PathLike[str]) -> None:
        """Copy the base checkpoint into the run once (files, then the marker), so workers on other
        machines load exactly the weights the run was prepared with."""
        if self.exists("base", BASE_FILES_MARKER):
            return
        files = sorted(p for p in Path(local_dir).iterdir() if p.is_file())
        if not files:
            raise FileNotFoundError(f"base checkpoint {local_dir} has no files")
        manifest = {}
        for p in files:
            data = p.read_bytes()
            manifest[p.name] = hashlib.sha256(data).hexdigest()
            dest = self.path("base", p.name)
            self.retry(lambda: U.write_bytes_atomic(self.fs, dest, data), f"uploading base/{p.name}")
        marker = self.path("base", BASE_FILES_MARKER)
        try:
            info = {"files": manifest, "name": Path(local_dir).resolve().name}  # the name adapters record
            self.retry(lambda: U.create_exclusive(self.fs, marker, U.dumps(info)), "committing base/")
        except U.AlreadyExistsError:
            pass

    def fetch_base(self, cache_dir: str | os.PathLike[str]) -> Path:
        """Download (once per cache folder) and checksum the base checkpoint; return the local folder."""
        info = self.read_json("base", BASE_FILES_MARKER)
        if info is None:
            raise FileNotFoundError(f"{self.uri}/base has no {BASE_FILES_MARKER}: the base checkpoint was never uploaded")
        digest = hashlib.sha256(U.dumps(info)).hexdigest()[:16]
        # base-{digest}/{name}: the folder keeps the base's own name, which adapters record as theirs
        dest = Path(cache_dir) / f"base-{digest}" / str(info.get("name") or "base")
        if (dest / BASE_FILES_MARKER).exists():
            return dest
        tmp = Path(cache_dir) / f".base-{digest}-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        for name, sha in info["files"].items():
            src = self.path("base", name)
            data = self.retry(lambda: self.fs.cat_file(src), f"downloading base/{name}")
            if hashlib.sha256(data).hexdigest() != sha:
                raise ValueError(f"{self.uri}/base/{name}: checksum mismatch with {BASE_FILES_MARKER}")
            (tmp / name).write_bytes(data)
        (tmp / BASE_FILES_MARKER).write_bytes(U.dumps(info))
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process on this machine won the race: use its copy
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    # ------------------------------------------------------------------ learner checkpoints
    def save_checkpoint(self, blob: dict[str, Any], version: int) -> str:
        """Write ``learner/checkpoints/v{version}.pt`` then move the pointer; both atomic, pointer last.

        A learner killed anywhere in here leaves the previous pointer intact, so a resume sees
        either the old checkpoint or the new one, never a mix. The pointer also lists the
        :data:`KEEP_CHECKPOINTS` - 1 checkpoints before it (file and sha256), so a resume can fall
        back when the newest is damaged (:meth:`load_checkpoint`); older files are deleted once the
        pointer no longer names them (a day-long run would otherwise keep every one)."""
        buf = io.BytesIO()
        torch.save(blob, buf)
        data = buf.getvalue()
        name = f"v{version:06d}.pt"
        path = self.path("learner", "checkpoints", name)
        self.retry(lambda: U.write_bytes_atomic(self.fs, path, data), f"writing learner checkpoint {name}")
        old = self.read_json("learner", "CHECKPOINT")
        chain = [] if old is None else [{k: old[k] for k in ("file", "version", "sha256", "bytes")},
                                        *old.get("previous", [])]
        chain = [c for c in chain if c["file"] != name]
        kept, dropped = chain[:KEEP_CHECKPOINTS - 1], chain[KEEP_CHECKPOINTS - 1:]
        self.write_json({"file": name, "version": version, "sha256": hashlib.sha256(data).hexdigest(),
                         "bytes": len(data), "previous": kept}, "learner", "CHECKPOINT")
        for entry in dropped:  # only after the pointer stopped naming them
            old_path = self.path("learner", "checkpoints", entry["file"])
            if self.fs.exists(old_path):
                self.retry(lambda: self.fs.rm(old_path), f"removing learner checkpoint {entry['file']}")
        return name

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The newest intact learner checkpoint the pointer names (each verified against its
        sha256), or None when there is no pointer. A damaged newest one is skipped for the one before
        it, with a warning naming both and ``fallback`` in the result (the file used, the files
        skipped and why): the batches consumed after the older one are not in its ledger, so they
        are consumed again, as after a learner killed between checkpoints. None intact raises
        ValueError naming every file and why."""
        ptr = self.read_json("learner", "CHECKPOINT")
        if ptr is None:
            return None
        skipped: list[str] = []
        for entry in [ptr, *ptr.get("previous", [])]:
            where = f"{self.uri}/learner/checkpoints/{entry['file']}"
            path = self.path("learner", "checkpoints", entry["file"])
            try:
                data = self.retry(lambda: self.fs.cat_file(path), f"reading learner checkpoint {entry['file']}")
            except FileNotFoundError:
                skipped.append(f"{where}: missing")
                continue
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                skipped.append(f"{where}: sha256 does not match learner/CHECKPOINT")
                continue
            blob = torch.load(io.BytesIO(data), weights_only=True)
            if skipped:
                log.warning("resuming from %s (version %d): skipped %s", where, entry["version"], "; ".join(skipped))
                blob["fallback"] = {"used": entry["file"], "skipped": skipped}
            return blob
        raise ValueError("no intact learner checkpoint: " + "; ".join(skipped))

    # ------------------------------------------------------------------ control
    def stop_requested(self) -> bool:
        return self.exists("control", "STOP")

    def request_stop(self, reason: str = "") -> None:
        self.write_json({"reason": reason}, "control", "STOP")


def prepare_run(run_uri: str, cfg: RecipeConfig, base_dir: str | os.PathLike[str],
                storage_options: dict[str, Any] | None = None, resumable: tuple[str, ...] = ()) -> dict[str, Any]:
    """Create (or re-open, if the recipe matches up to ``resumable`` settings) the run at
    ``run_uri``; return its spec. A changed setting raises RunSpecMismatch naming it."""
    if not (Path(base_dir) / "config.json").exists():
        raise FileNotFoundError(f"base checkpoint {base_dir} is not a Miles checkpoint folder (no config.json)")
    rs = RunStore(run_uri, storage_options, cfg.async_rl.retry_budget_s)
    # protocol: what the run's processes agree on beyond the recipe; "inbox": commits are announced
    # (learner/channels.py::BatchChannel). A run re-opened keeps the protocol it was created with.
    spec = rs.write_spec({"cfg": cfg.to_dict(), "base_source": str(Path(base_dir).resolve()),
                          "created_unix": time.time(), "protocol": {"inbox": True}}, resumable)
    rs.upload_base(base_dir)
    return spec
