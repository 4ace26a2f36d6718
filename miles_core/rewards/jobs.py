"""What a sandbox job is and what comes back: the contract between the code rewards and the pool.

:class:`Job` (the completion's source, the inputs of its calls, or a benchmark's trusted tests),
:class:`SandboxLimits` (what one run may use), :class:`ExecResult` (how a run ended, its outputs per
input) and :func:`job_message`, the checked form a job travels in to a worker
(:mod:`miles_core.rewards.pool`). Expected outputs are no part of a job: the caller compares them
(:mod:`miles_core.rewards.code`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 2.0          # wall clock per run (sleeping or blocked code)
    cpu_s: int = 1                  # RLIMIT_CPU seconds (busy loops)
    memory_mb: int = 256            # RLIMIT_AS
    output_bytes: int = 1 << 20     # RLIMIT_FSIZE: stdout/stderr and any file written
    open_files: int = 32            # RLIMIT_NOFILE
    result_bytes: int = 1 << 20     # cap on the result message read back
    tmpfs_mb: int = 64              # size of the run's /tmp, its only writable place (bwrap)

    def __post_init__(self) -> None:
        for name, low in (("timeout_s", 0.05), ("cpu_s", 1), ("memory_mb", 64), ("output_bytes", 1024),
                          ("open_files", 8), ("result_bytes", 1024), ("tmpfs_mb", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise ValueError(f"SandboxLimits.{name}: need a number >= {low}, got {value!r}")
        if not isinstance(self.cpu_s, int):
            raise ValueError(f"SandboxLimits.cpu_s: need whole seconds (RLIMIT_CPU), got {self.cpu_s!r}")


@dataclass(frozen=True)
class Job:
    """``source``: an expression (body of ``def entry(params)``) or a module defining ``entry``."""

    source: str
    inputs: Sequence[Sequence[Any]]   # one argument list per test call
    entry: str = "f"
    params: str = "x"
    kind: str = "auto"                # "expression" | "module" | "auto" (expression if it parses as one)
    #                                   | "tests": run ``tests`` against ``entry`` (sandbox_tests.py)
    tests: Sequence[str] = ()         # tests: trusted snippets, each passing unless it raises
    setup: str = ""                   # tests: trusted code the tester runs first (helpers, imports)


@dataclass
class ExecResult:
    """How one run ended. ``status`` is "ok" or a failure kind; ``reason`` says why in words."""

    status: str
    reason: str
    outputs: list[Any] = field(default_factory=list)        # per input; None where the call raised
    errors: list[str | None] = field(default_factory=list)  # per input; "raised TypeError" where it raised
    seconds: float = 0.0
    pid: int = 0
    output_tail: str = ""                                    # last bytes of stdout/stderr


def job_message(job: Job, k: int) -> dict:
    if not isinstance(job, Job) or not isinstance(job.source, str):
        raise TypeError(f"SandboxPool: jobs[{k}] must be a Job with a str source, got {type(job).__name__}")
    if job.kind not in ("expression", "module", "auto", "tests"):
        raise ValueError(f"SandboxPool: jobs[{k}].kind must be 'expression', 'module', 'auto' or 'tests', "
                         f"got {job.kind!r}")
    if job.kind == "tests":
        if not job.tests or not all(isinstance(t, str) for t in job.tests) or not isinstance(job.setup, str):
            raise ValueError(f"SandboxPool: jobs[{k}] of kind 'tests' needs tests (non-empty list of str) "
                             "and a str setup")
        return {"source": job.source, "inputs": [], "entry": job.entry, "params": job.params, "kind": "module",
                "tests": list(job.tests), "setup": job.setup, "run": "tests"}
    if not job.entry.isidentifier():
        raise ValueError(f"SandboxPool: jobs[{k}].entry must be an identifier, got {job.entry!r}")
    msg = {"source": job.source, "inputs": [list(a) for a in job.inputs], "entry": job.entry, "params": job.params,
           "kind": job.kind}
    try:
        json.loads(json.dumps(msg["inputs"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"SandboxPool: jobs[{k}].inputs must be JSON values ({e})") from None
    return msg
