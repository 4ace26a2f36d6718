"""Prefect tasks around training: the SFT baseline, evaluating a checkpoint (with an adapter
folder or a published version), and registering a policy in MLflow. Paths and small dicts in and
out; the work is in miles_core (learner/baseline.py, eval/evaluate.py) and tracking/registry.py."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from prefect import task

from miles_core.config import load_recipe
from miles_core.data.registry import build_task
from miles_core.eval.evaluate import run_eval
from miles_core.learner.baseline import train_baseline
from miles_core.models.base import load_base, set_prompt_format
from miles_core.models.lora import load_adapter
from miles_core.storage import AdapterRegistry
import tracking
from tracking import registry
from tasks.common import LIGHT, STORAGE, eval_summary, retry_transient

_ADAPTER_URI = re.compile(r"^(?P<root>.+)/adapters/v(?P<version>\d+)/?$")


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


TEST_FILE_NAMES = ("{t}.jsonl", "{t}.jsonl.gz", "{t}.json", "{t}.csv", "{t}.parquet", "{t}/test.jsonl",
                   "{t}/test.jsonl.gz", "{t}/test.csv", "{t}/test.parquet")


def find_test_file(data_dir: str, name: str) -> str:
    """``name``'s test file in ``data_dir`` (a folder or fsspec URI), by the names TEST_FILE_NAMES lists."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(data_dir)
    for pattern in TEST_FILE_NAMES:
        path = f"{root.rstrip('/')}/{pattern.format(t=name)}"
        if fs.exists(path):
            return path if "://" not in data_dir else f"{data_dir.split('://')[0]}://{path}"
    raise FileNotFoundError(f"data_dir {data_dir}: no test file for task {name!r}; looked for "
                            + ", ".join(p.format(t=name) for p in TEST_FILE_NAMES))


def _mtimes(folder: str | None) -> tuple:
    """When each file of ``folder`` last changed: a rewritten checkpoint is never served from the cache."""
    if folder is None:
        return ()
    return tuple(sorted((p.name, p.stat().st_mtime_ns) for p in Path(folder).iterdir() if p.is_file()))


class ModelCache:
    """The one model an evaluation loop reuses across benchmarks (a base with its adapter), owned
    by the flow block that opens it (``with evaluation.model_cache() as models``) and passed to each
    :func:`evaluate_checkpoint`; its memory goes when the block ends."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._model: tuple[Any, Any] | None = None
        self._lock = threading.Lock()

    def get(self, key: tuple, load: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
        """The (model, tokenizer) of ``key``, loaded by ``load`` unless it is the one held."""
        with self._lock:
            if self._key != key:
                self._key, self._model = None, None  # the old model goes before the new one loads
                self._model, self._key = load(), key
            assert self._model is not None
            return self._model

    def clear(self) -> None:
        with self._lock:
            self._key, self._model = None, None


@contextmanager
def model_cache() -> Iterator[ModelCache]:
    cache = ModelCache()
    try:
        yield cache
    finally:
        cache.clear()


@task(name="evaluate-checkpoint", **LIGHT)
def evaluate_checkpoint(base_checkpoint: str, adapter_dir: str | None, cfg: dict[str, Any], out_path: str,
                        progress: bool = False, models: ModelCache | None = None) -> dict[str, Any]:
    """pass@k of a base checkpoint, with a LoRA adapter folder on top when given; ``models``: the
    loop's cache, when it evaluates one model on several benchmarks (else loaded for this call)."""
    rc = load_recipe(cfg)
    if rc.torch_threads > 0:
        torch.set_num_threads(rc.torch_threads)

    def load() -> tuple[Any, Any]:
        model, tok = load_base(rc, base_checkpoint)
        return (load_adapter(model, adapter_dir) if adapter_dir is not None else model), tok
    key = (str(Path(base_checkpoint).resolve()), adapter_dir, repr(rc.model), _mtimes(base_checkpoint),
           _mtimes(adapter_dir))
    model, tok = models.get(key, load) if models is not None else load()
    set_prompt_format(tok, rc, base_checkpoint)
    res = run_eval(model, tok, rc, build_task(rc), progress=progress)
    return eval_summary(res, Path(out_path))


@task(name="sft-baseline", **LIGHT)
def sft_baseline(cfg: dict[str, Any], out_dir: str, run_id: str, eval_problems: int | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Train the SFT baseline, logging the held-out plateau curve as ``sft/*`` metrics, then
    evaluate it with the recipe's full eval config. The checkpoint folder appears atomically."""
    rc = load_recipe(cfg)
    if rc.torch_threads > 0:
        torch.set_num_threads(rc.torch_threads)
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
    ev = eval_summary(run_eval(model, tok, rc, data, progress=progress), dest.parent / "evals" / "sft.json")
    return {"base_checkpoint": str(dest.resolve()), "pass1": ev["pass1"], "eval": ev, "seconds": seconds}


@task(name="register-policy", retries=2, retry_delay_seconds=[2, 4], retry_condition_fn=retry_transient, **LIGHT)
def register_policy(run_id: str, name: str, base_checkpoint: str, adapter_dir: str | None, cfg: dict[str, Any],
                    pass1: float, fingerprint: str, tags: dict[str, str], eval_record: str | None = None,
                    alpha: float | None = None) -> dict[str, Any]:
    """Log the policy as a LoggedModel and register it as a version with its per-problem outcomes
    (``eval_record``: the evaluation's JSON, ``ev["path"]``); ``champion`` moves only on a significant
    paired win on the same evaluation (``alpha``: the recipe's ``eval.champion_alpha``, else 0.05)."""
    return registry.register_model(run_id, name, base_checkpoint, adapter_dir, cfg, pass1, fingerprint, tags,
                                   eval_record=eval_record, alpha=alpha)
