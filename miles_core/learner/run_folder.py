"""A run folder of the synchronous flow and its pointer to the run's store (``learner.json``).

``miles train`` trains in a local folder (``--run-dir``) whose learner lives in a store (a folder
inside it by default, or object storage). The folder holds only a pointer: which store, which base,
the run's key, the resumable settings its latest start changed, and how far it got. The store is
the truth (``run.json``, the checkpoints with their ledger: learner/runtime.py). Here: starting a
run in a folder, refusing what would mix two runs (a folder that holds one, another base or store,
a copied folder writing into the original's store, a changed setting outside
:data:`~miles_core.learner.runtime.RESUMABLE`), and opening it again step by step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from miles_core.config import ConfigError, RecipeConfig, flatten, load_recipe, migrate, set_dotted
from miles_core.learner.runtime import RESUMABLE, LearnerRun
from miles_core.storage import uri as U
from miles_core.storage.run import RunStore, changed_settings, prepare_run

log = logging.getLogger(__name__)
POINTER = "learner.json"  # run_dir/learner.json: which store and base a local run folder trains


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
    meta = {**meta, **{k: v for k, v in extra.items() if k != "cfg"}, "iteration": len(run.ledger),
            "version": run.learner.version, "consumed": [e["id"] for e in run.ledger.consumed]}
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
