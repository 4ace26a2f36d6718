"""Run untrusted Python (model completions) against test inputs, contained by layered defences.

This file is the worker: :class:`miles_core.rewards.code.SandboxPool` starts a few persistent
``python -I -S sandbox.py`` processes with an empty environment and sends them jobs. Each job
runs in its own child forked from a worker, so a hostile completion can never take down the
worker, the caller, or another completion. It is one file (over the usual 400 lines) on purpose:
``-I -S`` puts neither this folder nor site-packages on ``sys.path``, so the worker can import only
the standard library and must carry all of its code here. What each layer does:

* **Process per run, killed as a group.** The child calls ``setsid``; on a wall-clock timeout the
  worker ``killpg``s the group with SIGKILL. The child also gets ``PR_SET_PDEATHSIG`` so it dies
  with its worker. Not covered: a descendant that leaves the group (needs fork, see next layers).
* **rlimits (kernel).** CPU seconds (SIGXCPU), address space, file size (stdout/stderr go to a
  capped file, so "print gigabytes" dies with SIGXFSZ), open files, no core dumps, and
  ``RLIMIT_NPROC = 0`` so the child cannot fork or start threads. NPROC does not bind root,
  hence the next layer.
* **Privilege drop (kernel).** When the worker is root the child switches to uid/gid 65534
  (``nobody``) with no supplementary groups and ``PR_SET_NO_NEW_PRIVS``. It then cannot write
  anything root owns, read ``/root`` or other processes' ``/proc/PID/environ``, or signal
  processes it does not own; it can still read world-readable files and write world-writable
  places (the next two layers). Not root: no drop (NPROC then binds the user's own uid).
* **Namespaces (kernel, when available).** The worker enters a fresh network namespace (no
  interface is up, so no connection can be made, not even to 127.0.0.1) and, when root, a mount
  namespace with private size-capped tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm``, the
  world-writable places ``nobody`` could otherwise write; they vanish with the worker. Containers
  without ``CAP_SYS_ADMIN``/user namespaces refuse ``unshare``; the pool then reports the layer
  as off (``SandboxPool.layers``) and the audit hook below is the fallback. Not root: a user
  namespace is used to get the network namespace, without the private tmpfs.
* **Empty environment.** Workers start with ``env={}`` and the child clears ``os.environ``: no
  inherited secrets.
* **Audit hook (best effort, in-process).** Installed in the child before user code runs; it
  refuses imports outside a small pure-computation allowlist, sockets, subprocesses, fork/exec,
  ctypes, signals, ``gc``/frame introspection, writes/deletes outside the run's temporary
  directory and reads outside it and the standard library. A refusal ends the run at once with
  the event as the reason (``except`` cannot swallow it). CPython documents audit hooks as *not*
  a security boundary: native code or an interpreter bug can bypass them. They give clear
  reasons and the fallback where the kernel layers are missing; they are never the only layer.
* **The oracle stays outside.** Only test *inputs* reach the child; it reports raw outputs on a
  pipe (size-capped) and the caller compares them with the expected values, so tampering with
  the in-sandbox harness can at most misreport its own outputs.

Not provided: a PID namespace, seccomp, or disk-inode limits beyond the tmpfs size.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import struct
import sys
import time
from typing import Any, Callable

NOBODY = 65534
VIOLATION_EXIT = 86
_HDR = struct.Struct(">I")
SAFE_MODULES = frozenset(
    "math cmath itertools functools operator collections re string json heapq bisect fractions decimal "
    "statistics random typing dataclasses enum copy numbers datetime array abc types keyword reprlib "
    "textwrap unicodedata _heapq _bisect _random _decimal _statistics _datetime _json _operator "
    "_functools _collections _collections_abc _string _sre _abc _weakref weakref".split())
_DENY_PREFIXES = ("ctypes.", "socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "gc.",
                  "_posixsubprocess", "pty.", "resource.", "signal.")
_DENY_EVENTS = frozenset({"os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "_thread.start_new_thread",
                          "sys._getframe", "sys._current_frames", "sys.setprofile", "sys.settrace",
                          "sys.addaudithook", "object.__getattr__", "os.link", "os.symlink", "mmap.__new__"})
_PATH_EVENTS = frozenset({"os.remove", "os.rmdir", "os.rename", "os.replace", "shutil.rmtree", "os.mkdir",
                          "os.chmod", "os.chown", "os.truncate", "os.utime", "os.listdir", "os.scandir",
                          "os.chdir", "os.chflags", "os.mkfifo", "os.mknod", "shutil.copyfile", "shutil.move"})


def send_msg(fd: int, obj: Any) -> None:
    """Length-prefixed JSON: the protocol between the pool and its workers."""
    data = json.dumps(obj).encode()
    data = _HDR.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def recv_msg(fd: int, deadline: float | None = None) -> Any:
    """One framed message, or None at EOF. Raises TimeoutError past ``deadline``."""
    def exact(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError("sandbox worker did not answer in time")
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf
    hdr = exact(_HDR.size)
    body = exact(_HDR.unpack(hdr)[0]) if hdr else None
    return None if body is None else json.loads(body)


def _user_net_namespace(libc: Any, probe_dir: str) -> bool:
    """Non-root: a user namespace mapping our own uid/gid (file creation needs a mapping) + a netns."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
        return False
    try:
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
        probe = os.path.join(probe_dir, f".miles-sandbox-probe-{os.getpid()}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600))
        os.unlink(probe)
    except OSError:
        return False
    return True


def _unshare_namespaces(tmpfs_mb: int, probe_dir: str) -> tuple[bool, bool]:
    """Enter a fresh network namespace (+ a mount namespace with private tmpfs when root).

    Returns (network_namespace, private_tmp). Non-root, the user namespace is first tried in a
    throwaway child, because a half-set-up one cannot be left again.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() != 0:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if _user_net_namespace(libc, probe_dir) else 1)
        ok = os.waitpid(pid, 0)[1] == 0
        return (ok and _user_net_namespace(libc, probe_dir)), False
    newns, newnet = 0x00020000, 0x40000000
    if libc.unshare(newnet | newns) != 0:
        return libc.unshare(newnet) == 0, False
    ms_rec, ms_private, ms_nosuid, ms_nodev = 0x4000, 0x40000, 0x2, 0x4
    if libc.mount(None, b"/", None, ms_rec | ms_private, None) != 0:
        return True, False
    ok = True
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            opts = f"size={tmpfs_mb}m,mode=1777".encode()
            ok &= libc.mount(b"tmpfs", d.encode(), b"tmpfs", ms_nosuid | ms_nodev, opts) == 0
    return True, ok


def _encode(v: Any, depth: int = 0, _t=type, _int=int, _len=len) -> Any:
    """JSON-safe copy of a return value using only exact builtin types (no user __eq__/__repr__)."""
    t = _t(v)
    if v is None or t is bool or t is float or (t is _int and -(1 << 62) < v < (1 << 62)):
        return v
    if t is str and _len(v) <= 10_000:
        return v
    if (t is list or t is tuple) and depth < 5 and _len(v) <= 1000:
        return [_encode(x, depth + 1) for x in v]
    return {"__unencodable__": t.__name__}


def _fatal(e: BaseException, where: str) -> dict | None:
    """The report for an exception that ends the run; None for an ordinary one (a failed test)."""
    if isinstance(e, MemoryError):
        return {"status": "memory_limit", "reason": f"memory limit exceeded (MemoryError) {where}"}
    if isinstance(e, RecursionError):
        return {"status": "recursion_limit", "reason": f"recursion limit exceeded {where}"}
    if isinstance(e, SyntaxError):
        return {"status": "syntax_error", "reason": f"syntax error: {e.msg} (line {e.lineno})"}
    if not isinstance(e, Exception):  # SystemExit and friends
        return {"status": "exited", "reason": f"raised {type(e).__name__} {where}"}
    return None


def _harness(job: dict, out_fd: int) -> None:
    """Define the function from the completion, call it on each input, report, exit."""
    import builtins

    def report(msg: dict) -> None:
        send_msg(out_fd, msg)
        os._exit(0)
    src, kind, entry, params = job["source"], job["kind"], job["entry"], job["params"]
    try:
        is_expr = kind == "expression"
        if kind == "auto":
            try:
                compile(src, "<completion>", "eval")
                is_expr = True
            except SyntaxError:
                pass
        g: dict[str, Any] = {"__name__": "__completion__", "__builtins__": builtins}
        if is_expr:
            compile(src, "<completion>", "eval")  # a bare expression, nothing that escapes the wrapper
            fn = eval(compile(f"lambda {params}: ({src}\n)", "<completion>", "eval"), g)  # noqa: S307 - sandboxed
        else:
            exec(compile(src, "<completion>", "exec"), g)  # noqa: S102 - sandboxed
            fn = g.get(entry)
    except BaseException as e:  # noqa: BLE001 - every way of failing becomes a reason
        report(_fatal(e, "while defining the function")
               or {"status": "definition_error", "reason": f"defining the function raised {type(e).__name__}"})
    if not callable(fn):
        report({"status": "definition_error", "reason": f"the completion defines no function {entry!r}"})
    outputs: list[Any] = []
    errors: list[str | None] = []
    for args in job["inputs"]:
        try:
            outputs.append(_encode(fn(*args)))
            errors.append(None)
        except BaseException as e:  # noqa: BLE001 - an ordinary exception is a failed test
            msg = _fatal(e, f"on {entry}{tuple(args)}")
            if msg is not None:
                report(msg)
            outputs.append(None)
            errors.append(f"raised {type(e).__name__}")
    report({"status": "ok", "reason": "finished", "outputs": outputs, "errors": errors})


def _audit_hook(job_dir: str, read_roots: tuple[str, ...], out_fd: int) -> Callable[[str, tuple], None]:
    """The in-process policy (see module docstring); a refusal reports and exits immediately."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    inside = lambda p, root: p == root or p.startswith(root + os.sep)  # noqa: E731

    def deny(what: str) -> None:
        send_msg(out_fd, {"status": "blocked", "reason": f"blocked by sandbox policy: {what}"[:300]})
        os._exit(VIOLATION_EXIT)

    def real(p: Any) -> str:  # relative paths resolve against the current directory, as the OS does
        return os.path.realpath(os.fsdecode(os.fspath(p)))

    def hook(event: str, args: tuple) -> None:
        if event in _DENY_EVENTS or event.startswith(_DENY_PREFIXES):
            deny(event)
        elif event == "import" and args[0].split(".")[0] not in SAFE_MODULES:
            deny(f"import {args[0]}")
        elif event == "object.__setattr__" and type(args[0]).__name__ in ("function", "code"):
            deny(f"setting {args[1]} on a {type(args[0]).__name__}")
        elif event == "open" and not isinstance(args[0], int):
            mode, flags = args[1] or "", args[2] or 0
            p = real(args[0])
            writing = any(c in mode for c in "wax+") or bool(flags & write_flags)
            if not inside(p, job_dir) and (writing or not any(inside(p, r) for r in read_roots)):
                deny(f"open {p!r} for {'writing' if writing else 'reading'} outside the sandbox directory")
        elif event in _PATH_EVENTS:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(real(a), job_dir):
                    deny(f"{event} {real(a)!r} outside the sandbox directory")
    return hook


def _child(job: dict, opts: dict, job_dir: str, wfd: int, worker_pid: int) -> None:
    import resource

    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(os.path.join(job_dir, ".output"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(wfd, 3)
    os.closerange(4, 1 << 16)
    os.chdir(job_dir)
    lim = opts["limits"]
    for res, val in ((resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2), (resource.RLIMIT_FSIZE, (lim["output_bytes"],) * 2),
                     (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2), (resource.RLIMIT_NPROC, (0, 0))):
        resource.setrlimit(res, val)
    if os.geteuid() == 0:
        os.fchown(1, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    if _LIBC is not None:  # after setuid, which clears the parent-death signal
        _LIBC.prctl(38, 1, 0, 0, 0)                   # PR_SET_NO_NEW_PRIVS
        _LIBC.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != worker_pid:
        os._exit(71)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; let the kernel kill the writer
    os.environ.clear()
    for name in [m for m in sys.modules if m.split(".")[0] not in SAFE_MODULES and m not in _KEEP]:
        del sys.modules[name]
    if opts["audit_hook"]:
        sys.addaudithook(_audit_hook(os.path.realpath(job_dir), tuple(opts["read_roots"]), 3))
    _harness(job, 3)


_KEEP = frozenset({"sys", "builtins", "os", "posix", "posixpath", "os.path", "io", "abc", "codecs", "encodings",
                   "encodings.utf_8", "encodings.aliases", "_io", "_codecs", "stat", "_stat", "genericpath", "time",
                   "marshal", "_imp", "_frozen_importlib", "_frozen_importlib_external", "_warnings", "zipimport",
                   "_thread", "_signal", "errno", "struct", "_struct", "select"})
_LIBC: Any = None


def _run_job(job: dict, opts: dict, base: str, n: int) -> dict:
    lim = opts["limits"]
    job_dir = os.path.join(base, f"run{n}")
    os.mkdir(job_dir, 0o700)
    if os.geteuid() == 0:
        os.chown(job_dir, NOBODY, NOBODY)
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: never returns
        try:
            os.close(r)
            _child(job, opts, job_dir, w, os.getppid())
        except BaseException as e:  # noqa: BLE001 - a setup failure must be visible, never a silent pass
            os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}".encode())
        finally:
            os._exit(70)
    os.close(w)
    buf, status, timed_out = _collect(pid, r, t0 + lim["timeout_s"], lim["result_bytes"])
    for kill in (os.killpg, os.kill):  # the whole group, whatever happened
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if status is None:
        status = os.waitpid(pid, 0)[1]
    os.close(r)
    tail = _tail(os.path.join(job_dir, ".output"))
    shutil.rmtree(job_dir, ignore_errors=True)
    res = _interpret(bytes(buf), status, timed_out, lim)
    res.update(seconds=time.monotonic() - t0, pid=pid, output_tail=tail)
    return res


def _collect(pid: int, r: int, deadline: float, cap: int) -> tuple[bytearray, int | None, bool]:
    """Read the result pipe until the child exits or the deadline: (data, wait status or None, timed_out)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # pre-5.3 kernels: poll instead
        pidfd = None
    buf, eof = bytearray(), False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return buf, None, True
            fds = [fd for fd in (None if eof else r, pidfd) if fd is not None]
            ready = select.select(fds, [], [], left if pidfd is not None else min(left, 0.002))[0]
            if r in ready:
                chunk = os.read(r, 1 << 16)
                buf += chunk
                eof = not chunk
                if len(buf) > cap:
                    return buf, None, False
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:  # drain what is buffered; never wait on some other holder of the pipe
                while not eof and len(buf) <= cap and select.select([r], [], [], 0)[0]:
                    chunk = os.read(r, 1 << 16)
                    buf += chunk
                    eof = not chunk
                return buf, status, False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _tail(path: str, n: int = 400) -> str:
    """Last bytes of the run's stdout/stderr; regular files only (the child could swap in a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        return os.pread(fd, n, max(0, st.st_size - n)).decode("utf-8", "replace") if stat.S_ISREG(st.st_mode) else ""
    finally:
        os.close(fd)


def _interpret(data: bytes, status: int, timed_out: bool, lim: dict) -> dict:
    if timed_out:
        return {"status": "timeout", "reason": f"timed out after {lim['timeout_s']}s wall clock; process group killed"}
    if len(data) > lim["result_bytes"]:
        return {"status": "bad_result", "reason": f"result message larger than {lim['result_bytes']} bytes"}
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        known = {signal.SIGXCPU: ("cpu_limit", f"CPU time limit ({lim['cpu_s']}s) exceeded"),
                 signal.SIGXFSZ: ("output_limit", f"wrote more than {lim['output_bytes']} bytes (output/file limit)"),
                 signal.SIGKILL: ("cpu_limit", "killed (SIGKILL): hard CPU limit or out of memory"),
                 signal.SIGSEGV: ("crashed", "segmentation fault (e.g. stack overflow from runaway recursion)")}
        status_reason = known.get(sig, ("crashed", f"killed by signal {signal.Signals(sig).name}"))
        return {"status": status_reason[0], "reason": status_reason[1]}
    code = os.WEXITSTATUS(status)
    try:
        msg = _decode_frame(data)
    except ValueError:  # includes JSON and UTF-8 decoding errors
        msg = None
    if code == VIOLATION_EXIT and isinstance(msg, dict):
        return {"status": "blocked", "reason": str(msg.get("reason", "blocked by sandbox policy"))[:300]}
    if code == 0 and isinstance(msg, dict) and isinstance(msg.get("status"), str):
        out = {"status": msg["status"], "reason": str(msg.get("reason", ""))[:300]}
        if msg["status"] == "ok":
            outs, errs = msg.get("outputs"), msg.get("errors")
            if not (isinstance(outs, list) and isinstance(errs, list) and len(outs) == len(errs)):
                return {"status": "bad_result", "reason": "malformed result message"}
            out.update(outputs=outs, errors=[e if isinstance(e, str) or e is None else "?" for e in errs])
        return out
    if data and msg is None:
        return {"status": "bad_result", "reason": f"exited with code {code} after writing a malformed result"}
    return {"status": "exited", "reason": f"exited with code {code} without reporting a result (os._exit/sys.exit?)"}


def _decode_frame(data: bytes) -> Any:
    n = _HDR.unpack(data[:_HDR.size])[0] if len(data) >= _HDR.size else -1
    return json.loads(data[_HDR.size:]) if n == len(data) - _HDR.size else None


def _worker_main() -> None:
    """Set up the namespaces once, pre-import the allowed modules, then serve jobs until EOF."""
    global _LIBC
    import importlib

    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # stray prints must never corrupt the protocol
    inherited = sorted(k for k in os.environ if k != "LC_CTYPE")  # LC_CTYPE: set by Python's locale coercion
    os.environ.clear()
    opts = recv_msg(proto_in)
    netns = private_tmp = False
    if opts["namespaces"]:
        try:
            netns, private_tmp = _unshare_namespaces(opts["limits"]["tmpfs_mb"], opts["tmp_parent"])
        except OSError:
            pass
    try:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        _LIBC = None
    for m in sorted(SAFE_MODULES):
        try:
            importlib.import_module(m)
        except ImportError:
            pass
    parent = "/tmp" if private_tmp else opts["tmp_parent"]
    base = os.path.join(parent, f"miles-sandbox-{os.getpid()}")
    os.makedirs(base, mode=0o711, exist_ok=True)
    opts["read_roots"] = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.devnull)})
    layers = {"process_per_run": True, "rlimits": True, "uid_drop": os.geteuid() == 0, "network_namespace": netns,
              "private_tmp": private_tmp, "audit_hook": bool(opts["audit_hook"]), "empty_env": not inherited}
    send_msg(proto_out, {"layers": layers, "pid": os.getpid()})
    n = 0
    try:
        while (req := recv_msg(proto_in)) is not None:
            if req.get("op") == "status":
                try:
                    os.waitpid(-1, os.WNOHANG)
                    children = True
                except ChildProcessError:
                    children = False
                send_msg(proto_out, {"leftover_files": os.listdir(base), "live_children": children})
                continue
            n += 1
            try:
                res = _run_job(req, opts, base, n)
            except Exception as e:  # noqa: BLE001 - the worker must survive anything a run does
                res = {"status": "worker_error", "reason": f"sandbox worker error: {type(e).__name__}: {e}"[:300]}
            send_msg(proto_out, res)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    _worker_main()
