"""What every Prefect task of Miles shares: which failures are retried, result handling, and the
small JSON summary an evaluation returns (the full result is written next to the run)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from prefect.cache_policies import NO_CACHE

from miles_core.storage.retry import is_transient as storage_is_transient

SAMPLE_ROWS = 8  # completions shown per table in MLflow


def is_transient(exc: BaseException | None) -> bool:
    """Storage and network failures (see :func:`miles_core.storage.retry.is_transient`) and a busy
    SQLite/SQL tracking store are worth a retry; a bug, a bad config or a missing file is not."""
    if storage_is_transient(exc):
        return True
    return exc is not None and type(exc).__module__.split(".")[0] == "sqlalchemy"


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return is_transient(exc if isinstance(exc, BaseException) else None)


STORAGE = {"retries": 3, "retry_delay_seconds": [1, 2, 4], "retry_condition_fn": retry_transient}
LIGHT = {"persist_result": False, "cache_policy": NO_CACHE}  # results are small dicts, never cached


def atomic_write(path: Path, write: Any) -> None:
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def eval_summary(result: Any, path: Path) -> dict[str, Any]:
    """Write an EvalResult's full record to ``path``; return what a flow logs and compares."""
    d = result.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(json.dumps(d, indent=1)))
    return {"pass1": float(d["pass_at"]["pass@1"]), "pass_at": d["pass_at"], "metrics": d["metrics"],
            "config": d["config"], "fingerprint": d["config_fingerprint"], "num_problems": d["num_problems"],
            "samples": d["samples"][:SAMPLE_ROWS], "path": str(path)}
