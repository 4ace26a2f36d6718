"""The sandbox pool: runs code jobs in parallel, each in a fresh child inside the kernel boundary.

:class:`SandboxPool` starts the workers of :mod:`miles_core.rewards.sandbox` under the isolation of
:mod:`miles_core.rewards.isolation` (which says what each layer holds) and turns their replies into
:class:`ExecResult`. Expected outputs never reach it: a job carries inputs only
(:mod:`miles_core.rewards.code` compares outputs with the expected values).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from miles_core.rewards.image import copy_args
from miles_core.rewards.jobs import ExecResult, Job, SandboxLimits, job_message
from miles_core.rewards.isolation import MODES, USERNS_HINT, IsolationUnavailable, Mode, filter_rules, prepare
from miles_core.rewards.reports import interpret, parse_report
from miles_core.rewards.sandbox import read_frame, send_frame

log = logging.getLogger("miles.rewards.sandbox")


class SandboxPool:
    """Sandbox workers that run a batch of jobs in parallel, one fresh child process per job.

    ``isolation`` (see :mod:`miles_core.rewards.isolation`): ``"bwrap"`` (default) starts a new
    bubblewrap sandbox for every job; ``"bwrap_shared"`` keeps one per worker thread and runs job
    after job in it; ``"none"`` is the explicit opt-out (same worker, rlimits and audit hook, no
    kernel boundary), logged as a warning. If the isolation cannot be set up here, construction
    fails closed with :class:`IsolationUnavailable` saying what is missing. ``submit`` returns a
    Future at once, so a caller can keep sampling while a batch is scored; ``run`` waits. A worker
    that fails (it should not: runs happen in its children) is killed and replaced, and its job
    reports ``worker_error``. :attr:`layers` says which layers are active.
    """

    def __init__(self, workers: int | None = None, limits: SandboxLimits | None = None, *, audit_hook: bool = True,
                 isolation: Mode = "bwrap", cache_size: int = 20_000, cache_bytes: int = 64 << 20) -> None:
        import queue
        import tempfile

        self.limits = limits or SandboxLimits()
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # taskset-aware
        n = workers if workers is not None else max(1, min(4, cpus))
        if n < 1:
            raise ValueError(f"SandboxPool: workers must be >= 1, got {n}")
        self.isolation = iso = prepare(isolation)
        self.layers: dict[str, bool] = {**iso.layers, "audit_hook": audit_hook}
        self._dir = tempfile.mkdtemp(prefix="miles-sandbox-")  # workers' stderr; mode none: their run dirs
        os.chmod(self._dir, 0o711)  # a worker started as nobody (mode none) reaches its own dir, lists nothing
        self._opts = {"limits": dataclasses.asdict(self.limits), "audit_hook": audit_hook,
                      "read_roots": sorted({*(iso.interpreter.stdlib if iso.mode == "none" else
                                                iso.interpreter.image.read_roots), os.devnull}),
                      "trusted_files": sorted({*iso.interpreter.stdlib, *iso.interpreter.image.read_roots}),
                      "importable": list(iso.interpreter.image.importable), "seccomp_module": iso.seccomp_module,
                      "stage_two": filter_rules(2), "preimport": iso.mode != "bwrap"}
        self._count = itertools.count()
        self._queue: Any = queue.SimpleQueue()
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self._cache: OrderedDict[str, tuple[ExecResult, int]] = OrderedDict()  # key -> (result, its bytes)
        self._cached_bytes = 0
        self._cache_lock = threading.Lock()
        self.closed = False
        if iso.mode == "none":
            log.warning("sandbox.isolation=none: completions run WITHOUT a kernel boundary (rlimits and an audit "
                        "hook only); model-written code can read and write what uid %s can",
                        iso.uid if iso.uid is not None else os.getuid())
        self._workers: list[_Worker | None] = [None] * n
        self._check_live()  # a long-lived mode keeps the checked worker as worker 0
        if iso.mode != "bwrap":
            self._workers[1:] = [self._spawn() for _ in range(n - 1)]
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True, name=f"miles-sandbox-{i}")
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _check_live(self) -> None:
        """Fail closed: one real run through the whole boundary before any completion is scored."""
        shared = self.isolation.mode != "bwrap"
        w = None
        try:
            w = self._spawn()
            res = self._run_in(w, job_message(Job("x + 1", [[1]]), 0), once=not shared)
        except RuntimeError as e:
            res = ExecResult("worker_error", str(e))
        ok = res.status == "ok" and res.outputs == [2]
        if shared and w is not None and res.status != "worker_error":  # _run_in retired it on a worker error
            if ok:
                self._workers[0] = w
            else:
                w.kill()
        if not ok:
            shutil.rmtree(self._dir, ignore_errors=True)
            hint = f"; {USERNS_HINT}" if self.isolation.mode != "none" else ""
            raise IsolationUnavailable(f"sandbox ({self.isolation.mode}) failed its start-up run: {res.reason}; "
                                       f"{res.output_tail.strip()[-300:]!r}{hint}")

    def _spawn(self) -> "_Worker":
        """Start one sandbox worker and wait for its hello; RuntimeError (with bwrap's words) if it fails."""
        import marshal
        import subprocess

        iso, k = self.isolation, next(self._count)
        base = "/tmp" if iso.mode != "none" else os.path.join(self._dir, f"w{k}")
        if iso.mode == "none":
            os.mkdir(base, 0o700)
            if iso.uid is not None:
                os.chown(base, iso.uid, iso.uid)
        err_path = os.path.join(self._dir, f"w{k}.err")
        err = os.open(err_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fds = [err]
        bpf = [_data_pipe(prog, fds) for prog in iso.bpf]
        ids = {} if iso.uid is None else {"user": iso.uid, "group": iso.uid, "extra_groups": []}
        try:
            image_argv, image_fds = copy_args(iso.interpreter.image) if iso.mode != "none" else ([], [])
            fds += image_fds
            argv = iso.command(base, self.limits.tmpfs_mb << 20, bpf, image_argv)
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                 pass_fds=(*bpf, *image_fds), env={},
                                 start_new_session=True, **ids)
        finally:
            for fd in fds[1:]:
                os.close(fd)
        w = _Worker(p, err, err_path, base if iso.mode == "none" else "")
        try:
            send_frame(p.stdin.fileno(), marshal.dumps({**self._opts, "base": base}))
            hello = read_frame(p.stdout.fileno(), time.monotonic() + 60)
            if hello is None:
                raise EOFError("exited before the handshake")
        except (OSError, TimeoutError, EOFError) as e:
            tail = w.stderr_tail()
            w.kill()
            raise RuntimeError(f"sandbox worker failed to start ({type(e).__name__}: {e}): {tail!r}") from e
        return w

    def _run_in(self, w: "_Worker", msg: dict, once: bool = False) -> ExecResult:
        """Send one job to worker ``w`` and turn its reply into an ExecResult; ``once``: then retire
        it. Fails closed: any error while talking to the worker kills it (RuntimeError), and so does
        a run whose setup failed (status ``setup_failed``), so nothing a run did can reach the next."""
        import marshal

        try:
            send_frame(w.proc.stdin.fileno(), marshal.dumps(msg))
            body = read_frame(w.proc.stdout.fileno(), time.monotonic() + self.limits.timeout_s + 15)
            reply = parse_report(body) if body is not None else None
            if not isinstance(reply, dict) or "worker_error" in reply:
                why = reply["worker_error"] if isinstance(reply, dict) else f"worker exited: {w.stderr_tail()!r}"
                raise EOFError(why)
            res = interpret(reply["data"].encode("latin-1"), int(reply["signal"]), int(reply["code"]),
                             bool(reply["timed_out"]), self.limits, setup_ok=reply["setup_ok"] is True)
            out = ExecResult(**res, seconds=float(reply["seconds"]), pid=int(reply["pid"]),
                             output_tail=str(reply["output_tail"]))
            once = once or out.status == "setup_failed"
            return out
        except Exception as e:  # noqa: BLE001 - whatever went wrong, this worker is done
            once = True
            raise RuntimeError(f"sandbox worker failed ({type(e).__name__}: {e}) and was replaced") from e
        finally:
            if once:
                w.kill()

    def _attempt(self, i: int, job: dict) -> ExecResult:
        if self.isolation.mode == "bwrap":  # a new sandbox for every job
            return self._run_in(self._spawn(), job, once=True)
        w = self._workers[i] or self._spawn()
        self._workers[i] = w
        try:
            res = self._run_in(w, job)
        except RuntimeError:
            self._workers[i] = None  # replaced at the next job
            raise
        if res.status == "setup_failed":
            self._workers[i] = None  # _run_in killed it
        return res

    def _serve(self, i: int) -> None:
        while (item := self._queue.get()) is not None:
            job, done, key = item
            try:
                res = self._attempt(i, job)
                if res.status == "setup_failed":  # once more, on a fresh worker
                    res = self._attempt(i, job)
            except Exception as e:  # noqa: BLE001 - reported per job, the pool keeps serving
                res = ExecResult("worker_error", str(e)[:300])
            done(key, res)
            del item, job, done, res  # nothing of this job stays alive while the thread waits for the next

    def submit(self, jobs: Sequence[Job], reduce: Callable[[int, ExecResult], Any] | None = None) -> "Future[list]":
        """Queue ``jobs``; the Future resolves to their results, in order, or to ``reduce(k, result)``
        of each, computed as each result arrives, so a caller that keeps only a verdict (the code
        reward's Score) never holds a batch of parsed reports (up to ~10 MiB each) at once.

        Identical jobs (same source and inputs: common within an RL group) run once, and results
        of recent jobs are reused from an LRU cache (at most ``cache_size`` results and
        ``cache_bytes`` of them in the trainer's memory, :func:`_cost`), except timeouts, worker
        errors and setup failures, which may be transient. Programs are assumed deterministic for this purpose.
        """
        if self.closed:
            raise RuntimeError("SandboxPool.submit: the pool is closed")
        msgs = [job_message(j, k) for k, j in enumerate(jobs)]
        fut: Future = Future()
        results: list[Any] = [None] * len(msgs)
        groups: dict[str, list[int]] = {}
        for k, m in enumerate(msgs):
            key = json.dumps(m, sort_keys=True)
            with self._cache_lock:
                entry = self._cache.get(key)
                if entry is not None:
                    self._cache.move_to_end(key)
            hit = entry[0] if entry is not None else None
            if hit is not None:
                results[k] = reduce(k, hit) if reduce else hit
            else:
                groups.setdefault(key, []).append(k)
        left, lock = [len(groups)], threading.Lock()

        def done(key: str, res: ExecResult) -> None:
            cost = _cost(key, res) if self.cache_size and res.status not in _NOT_CACHED else 0
            if cost and cost <= self.cache_bytes // 16:  # one large report never takes the cache over
                with self._cache_lock:
                    old = self._cache.pop(key, None)
                    self._cached_bytes += cost - (old[1] if old else 0)
                    self._cache[key] = (res, cost)
                    while len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes:
                        self._cached_bytes -= self._cache.popitem(last=False)[1][1]
            with lock:
                for k in groups[key]:
                    results[k] = reduce(k, res) if reduce else res
                left[0] -= 1
                if left[0] == 0:
                    fut.set_result(results)
        if not groups:
            fut.set_result(results)
        for key, idx in groups.items():
            self._queue.put((msgs[idx[0]], done, key))
        return fut

    def run(self, jobs: Sequence[Job]) -> list[ExecResult]:
        return self.submit(jobs).result()

    def worker_pids(self) -> list[int]:
        """The long-lived workers' pids (bwrap_shared, none); empty for bwrap's per-job sandboxes."""
        return [w.proc.pid for w in self._workers if w is not None]

    def status(self) -> list[dict]:
        """Per long-lived worker: files left in its run area and whether a child is still alive."""
        import marshal

        out = []
        for w in self._workers:
            if w is not None:
                send_frame(w.proc.stdin.fileno(), marshal.dumps({"op": "status"}))
                out.append(json.loads(read_frame(w.proc.stdout.fileno(), time.monotonic() + 30) or b"null"))
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=self.limits.timeout_s + 20)
        for w in self._workers:
            if w is not None:
                w.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cost(key: str, res: ExecResult) -> int:
    """Bytes a cached result holds in the trainer: the key, the texts and every parsed output
    (sys.getsizeof over the objects, containers walked; a report is at most result_bytes)."""
    total, stack = sys.getsizeof(key) + sys.getsizeof(res.reason) + sys.getsizeof(res.output_tail) + 200, [
        res.outputs, res.errors]
    while stack:
        o = stack.pop()
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


def _data_pipe(data: bytes, fds: list[int]) -> int:
    """A pipe holding ``data`` (the stage-one filter, the compiled harness: tens of KB) for bwrap
    to read; its read end. The buffer is sized to hold it all, so the write never waits."""
    r, w = os.pipe()
    fds.append(r)
    if len(data) > 1 << 16:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(data))  # up to fs.pipe-max-size (1 MiB by default)
    os.write(w, data)
    os.close(w)
    return r


@dataclass
class _Worker:
    """One sandbox worker process (bwrap, or the bare interpreter for mode none)."""

    proc: Any
    err: int                     # our descriptor of its stderr file (bwrap's own errors land there)
    err_path: str
    base: str                    # mode none: its run area on the host, removed with it

    def stderr_tail(self, n: int = 300) -> str:
        return os.pread(self.err, n, max(0, os.fstat(self.err).st_size - n)).decode("utf-8", "replace").strip()

    def kill(self) -> None:
        """SIGKILL the worker's group; bwrap's death takes its namespaces, and every run, along."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        os.close(self.err)
        os.unlink(self.err_path)
        if self.base:
            shutil.rmtree(self.base, ignore_errors=True)


_NOT_CACHED = frozenset({"timeout", "worker_error", "setup_failed"})


_SHARED: dict[tuple[int, str], SandboxPool] = {}
_SHARED_LOCK = threading.Lock()


@contextlib.contextmanager
def shared_pools_closed_after() -> Iterator[None]:
    """The shared pools (:func:`shared_pool`) first started inside the block are closed when it
    ends, so a run inside a longer-lived process (a benchmark's ``main`` called by a test) leaves
    no sandbox workers behind; pools that existed before stay as they were."""
    before = set(_SHARED)
    try:
        yield
    finally:
        for key in set(_SHARED) - before:
            _SHARED[key].close()


def shared_pool(isolation: Mode = "bwrap") -> SandboxPool:
    """One pool per process and isolation mode with default limits, closed at exit (what the code
    rewards use). ``isolation`` is each call's (a recipe's ``sandbox.isolation``, carried by the
    reward ``rewards/registry.py::reward_for_recipe`` binds), never process state, so one part of
    a program cannot change how another's completions are run. Raises IsolationUnavailable where
    that isolation cannot be had."""
    if isolation not in MODES:
        raise ValueError(f"sandbox.isolation: {isolation!r} is not one of {', '.join(MODES)}")
    key = (os.getpid(), isolation)
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        if pool is None or pool.closed:
            pool = _SHARED[key] = SandboxPool(isolation=isolation)
            atexit.register(pool.close)
        return pool
