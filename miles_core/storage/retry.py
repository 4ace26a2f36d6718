"""Retry storage calls through transient outages (S3 endpoint down, throttling, a busy disk).

Why here and not in Prefect: sampler and learner workers are long loops that talk to the store
hundreds of times; retrying the whole flow on every blip would lose in-flight work. A call is
retried with capped exponential backoff until ``budget_s`` is spent, then
:class:`StorageUnavailableError` names the operation, the URI and the last error. Permanent
errors (missing file, already exists, bad data) are never retried: retrying cannot fix them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from miles_core.storage.errors import StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")
_PERMANENT = (FileExistsError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "s3fs")


class StorageUnavailableError(StorageError):
    """The store stayed unreachable for the whole retry budget."""


def is_transient(exc: BaseException | None) -> bool:
    """I/O and network failures are worth a retry; a bug, bad data or a missing file is not."""
    if exc is None or isinstance(exc, _PERMANENT) or isinstance(exc, StorageError):
        return False
    if isinstance(exc, OSError):  # includes ConnectionError and TimeoutError
        return True
    return type(exc).__module__.split(".")[0] in _NETWORK_MODULES


def call_with_retry(fn: Callable[[], T], what: str, budget_s: float = 60.0, base_delay: float = 0.1,
                    max_delay: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried on transient errors for up to ``budget_s`` seconds (jittered backoff).

    ``what`` names the operation and URI in logs and in the final error, so an operator reading
    "storage unavailable for 60 s while committing batch w0-000012 to s3://..." knows what to fix.
    """
    start = time.monotonic()
    delay, attempt = base_delay, 0
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - filtered by is_transient, re-raised otherwise
            if not is_transient(e):
                raise
            attempt += 1
            elapsed = time.monotonic() - start
            if elapsed >= budget_s:
                raise StorageUnavailableError(
                    f"storage unavailable for {elapsed:.1f}s (retry budget {budget_s:.0f}s, {attempt} attempts) "
                    f"while {what}: {type(e).__name__}: {e}") from e
            wait = min(delay, max_delay, max(budget_s - elapsed, 0.0)) * (0.5 + random.random() / 2)
            log.warning("transient storage error while %s (attempt %d, retrying in %.2fs): %s", what, attempt, wait, e)
            sleep(wait)
            delay = min(delay * 2, max_delay)
