"""What the ``miles`` command does around every subcommand: Prefect's settings before Prefect is
imported, overrides accepted anywhere on the line, Prefect's lines and tracebacks in the run's log
file rather than the console, and one line of advice when Prefect's temporary server cannot start.

Why here and not in the flows: a flow can run from a deployment, a notebook or ``python -m``,
where the caller owns its logging and settings; the console is the CLI's.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

# Prefect 3 reads its settings once, when it is imported; the embedded server's default start-up
# limit (20 s) is what a busy two-core machine misses: `make demo` with both cores loaded took 21 s to start it.
STARTUP_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_BASE_S = 120
STARTUP_MAX_S = 600
LOG_NAME = "prefect.log"


def startup_timeout_s(load: float | None = None, cpus: int | None = None) -> int:
    """Seconds the temporary Prefect server may take to start: 120, scaled up by how oversubscribed
    the machine is now (1-minute load average per core), at most 600."""
    cpus = cpus or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not on every platform
            load = 0.0
    return int(min(STARTUP_MAX_S, STARTUP_BASE_S * max(1.0, load / cpus)))


MLFLOW_RETRY = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def prefect_defaults() -> None:
    """Set Prefect's embedded-mode defaults in the environment; must run before Prefect is imported
    (``main`` calls it first). A value the user exported wins."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault(STARTUP_ENV, str(startup_timeout_s()))
    # A tracking server that goes away mid-run: MLflow's defaults (7 retries, backoff factor 2, 120 s
    # a request) keep a finished run retrying for minutes. These bound a request that is refused to
    # about 15 s (1 + 2 + 4 + 8) and one that hangs to 5 x 30 s.
    for key, value in MLFLOW_RETRY.items():
        os.environ.setdefault(key, value)


def startup_advice(err: BaseException) -> str | None:
    """What to do when Prefect's temporary server did not start in time; None for other errors."""
    if "ephemeral Prefect API server" not in str(err):
        return None
    limit = os.environ.get(STARTUP_ENV, "20")
    return (f"Prefect's temporary API server did not start within {limit} s (this machine is busy: load "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores). Retry with {STARTUP_ENV}=600, or start a "
            "server once (`prefect server start --host 127.0.0.1`) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api so every run uses it")


def merge_overrides(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """Words argparse left over because they came after an option (``miles train tiny --iterations 3
    optim.lr=1e-3``): ``key=value`` words join the overrides, a first bare word is the recipe when none
    was given. Returns the words that are neither (unknown options, stray words)."""
    rest: list[str] = []
    for word in extra:
        if hasattr(args, "overrides") and not word.startswith("-") and "=" in word:
            args.overrides = [*(args.overrides or []), word]
        elif hasattr(args, "recipe") and args.recipe is None and not word.startswith("-") and "=" not in word:
            args.recipe = word
        else:
            rest.append(word)
    return rest


class _NoTracebacks(logging.Filter):
    """On the console, a record's first line only: the traceback is in the run's log file."""

    def __init__(self, log_file: Path) -> None:
        super().__init__()
        self.log_file = log_file

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info or "Traceback (most recent call last)" in text:
            first = text.split("\n", 1)[0].rstrip(": ")
            record.msg, record.args = f"{first} (traceback in {self.log_file})", None
            record.exc_info = record.exc_text = None
            record.stack_info = None
        return True


def log_to_file(path: Path, task_lines: bool = False) -> Path:
    """Prefect's and Miles' log lines (tracebacks included) to ``path``; on the console, tracebacks
    shortened to their first line naming ``path``. ``task_lines``: Prefect's per-task lines go to the
    file only (the demo keeps its console for the learning curve); they still reach the Prefect UI,
    whose API handler sits on the same logger."""
    import prefect.main  # noqa: F401 - configures Prefect's logging (handlers this adjusts)

    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s | %(message)s"))
    if task_lines:
        logging.getLogger("prefect.task_runs").propagate = False  # not to the root's console handler
    for name in ("prefect.task_runs", "prefect", "miles"):  # flow-run lines reach "prefect" by propagation
        logger = logging.getLogger(name)
        if name != "prefect.task_runs" or task_lines:
            logger.addHandler(handler)
    for h in logging.getLogger().handlers:  # Prefect's console handler sits on the root logger
        if not any(isinstance(f, _NoTracebacks) for f in h.filters):
            h.addFilter(_NoTracebacks(path))
    return path
