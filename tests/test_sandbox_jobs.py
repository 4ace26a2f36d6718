"""A job leaves nothing for the next (infra/sandbox.md, "A job leaves nothing for the next").

A shared worker (``bwrap_shared``) serves job after job in one set of namespaces, so whatever a
run can set that outlives it is a channel to a later job: under a check that stops at the first
failing assert, "the next call arrived" already tells a completion its last answer was right.
Each observable a run could leave is set by an attacker between two observers, with the audit
hook off (the kernel must hold alone); the observers must see the same as around a job that did
nothing. Runs as root in ``make test`` and as an ordinary user in .ci/sandbox-unprivileged."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from miles_core.rewards.jobs import Job, SandboxLimits
from miles_core.rewards.pool import SandboxPool

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=1, memory_mb=256, tmpfs_mb=8)

OBSERVE = """
import os
def f(x):
    st, vfs = os.stat('/tmp'), os.statvfs('/tmp')
    try:
        xattrs = sorted(os.listxattr('/tmp'))
    except OSError as e:
        xattrs = type(e).__name__
    return [os.fstat(1).st_ino, os.fstat(3).st_ino, st.st_mode, st.st_atime_ns // 10**9, xattrs, vfs.f_bfree,
            vfs.f_ffree, os.stat('/dev/null').st_mtime_ns, os.get_blocking(3)]
"""

# Each way a run could leave state behind; the result names what the kernel allowed.
ATTACK = """
import os
def f(x):
    acts = [
        ("xattr", lambda: os.setxattr('/tmp', 'user.k', b'1')),
        ("atime", lambda: os.utime('/tmp', (2**33, 2**33))),
        ("atime_fd", lambda: os.utime(os.open('/tmp', os.O_RDONLY), (2**33, 2**33))),
        ("chmod", lambda: os.chmod('/tmp', 0o700)),
        ("inodes", lambda: [os.close(os.open('/tmp/i%d' % i, os.O_CREAT | os.O_WRONLY)) for i in range(50)]),
        ("tmpfile", lambda: os.open('/tmp', os.O_TMPFILE | os.O_WRONLY)),
        ("mkdir", lambda: [os.mkdir('/tmp/d%d' % i) for i in range(50)]),
        ("pipes", lambda: [os.close(fd) for i in range(50) for fd in os.pipe()]),
        ("nonblock", lambda: os.set_blocking(3, False)),
        ("pipe_size", lambda: __import__('fcntl').fcntl(3, 1031, 4096)),
        ("dev_null", lambda: os.utime('/dev/null')),
    ]
    got = []
    for name, act in acts:
        try:
            act()
            got.append([name, "done"])
        except OSError as e:
            got.append([name, type(e).__name__])
    return got
"""

NOOP = "def f(x):\n    return 0\n"
BIG = "def f(x):\n    return ['y' * 10_000] * 30\n"  # a report larger than a pipe's buffer: needs a blocking channel


@pytest.fixture(scope="module", params=("bwrap", "bwrap_shared"))
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(1, LIMITS, audit_hook=False, isolation=request.param, cache_size=0) as p:
        yield p


KEYS = ("stdout_ino", "report_ino", "mode", "atime", "xattrs", "free_blocks", "free_inodes", "null_mtime",
        "report_blocking")


def _one(pool: SandboxPool, source: str) -> Any:
    res = pool.run([Job(source, [[0]])])[0]
    assert res.status == "ok", res
    return res.outputs[0]


def test_every_trace_a_run_could_leave_is_refused_by_the_kernel(pool: SandboxPool) -> None:
    got = _one(pool, ATTACK)
    assert got == [[name, "PermissionError"] for name, _ in got], got


def test_a_later_job_observes_nothing_of_an_earlier_one(pool: SandboxPool) -> None:
    """Two jobs between observers each time: first a job that does nothing, then the attacker.
    Every observable moves the same way (inode numbers grow by what the worker itself makes per
    job, nothing else), and the report channel is a new one in every job."""
    seen = []
    for between in (None, NOOP, ATTACK):
        if between is not None:
            _one(pool, between)
        seen.append(dict(zip(KEYS, _one(pool, OBSERVE))))
    before, quiet, after = seen
    assert after["stdout_ino"] - quiet["stdout_ino"] == quiet["stdout_ino"] - before["stdout_ino"], seen
    for key in ("mode", "xattrs", "free_blocks", "free_inodes", "null_mtime"):
        assert before[key] == quiet[key] == after[key], (key, seen)
    assert after["atime"] <= time.time() + 1 and after["xattrs"] == [], seen
    assert before["report_blocking"] and after["report_blocking"], seen
    if pool.isolation.mode == "bwrap_shared":  # (in bwrap every job is a fresh sandbox anyway)
        assert len({s["report_ino"] for s in seen}) == 3, seen


def test_an_honest_large_report_after_the_attacker_still_arrives(pool: SandboxPool) -> None:
    _one(pool, ATTACK)
    assert _one(pool, BIG) == ["y" * 10_000] * 30


def test_a_flood_of_large_wrong_reports_keeps_the_cache_under_its_bound() -> None:
    """Each report is ~0.75 MB of floats (~1.5 MB parsed). 40 distinct ones under a 24 MiB bound
    keep the trainer's memory (traced allocations, pool still open) under the bound plus slack; the
    control, with no byte bound, grows past it, so the check can fail."""
    import tracemalloc

    grown = {}
    for bound in (24 << 20, 1 << 40):
        with SandboxPool(1, LIMITS, isolation="bwrap_shared", cache_bytes=bound) as pool:
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            for i in range(40):
                res = pool.run([Job(f"def f(x):\n    return [x + k / 7 + {i} for k in range(1000)]\n",
                                    [[j] for j in range(40)])])[0]
                assert res.status == "ok", res
            grown[bound] = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            assert pool._cached_bytes <= bound
    assert grown[24 << 20] < (24 << 20) + (8 << 20), grown
    assert grown[1 << 40] > (40 << 20), grown  # the control: unbounded, it holds them all
