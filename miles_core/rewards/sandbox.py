"""The sandbox harness: what each run of an untrusted completion executes, inside the kernel boundary.

:class:`miles_core.rewards.pool.SandboxPool` starts this file as a *fresh* interpreter
(``python -I -S -B``) under bubblewrap, with the isolation of :mod:`miles_core.rewards.isolation`:
own user, mount, PID, network, IPC and UTS namespaces; a read-only root holding only the
interpreter and its standard library; a size-capped tmpfs at ``/tmp`` as the only writable place;
seccomp stage one. With ``isolation=bwrap`` the pool starts one such sandbox per run, so every run
has namespaces of its own; with ``bwrap_shared`` a sandbox lives on and serves run after run (same
namespaces for its runs, which it wipes between them) at several times the throughput.

Either way a run is a process forked from the worker's zygote (sandbox_worker.py), which never
holds a job: a run's address space has its own part of the job and nothing else (expected outputs
of the procedural tasks never enter the sandbox at all: the caller compares outputs). This file
runs on the standard library alone (``-I -S``), so it carries its own framing helpers, which the
pool reuses. The pool sends ``marshal`` frames (it is trusted); runs answer with JSON frames,
which the pool bounds, parses and checks and never trusts further. What a run sets up, in
:func:`_child`, before user code runs:

* **seccomp stage two**: everything of isolation.STAGE_ONE (which the worker itself needs in part:
  fork, kill for timeouts) plus execve/execveat, loaded with libseccomp's bindings. From here on
  the run cannot create a process or thread, signal or trace anything (nor have the kernel signal
  anyone for it: no fcntl/ioctl owner settings), open a socket of any family, make a memfd, exec,
  touch mounts and namespaces, or change the priority, scheduling, limits or pages of any other
  process.
* **rlimits**: CPU seconds (SIGXCPU), address space (MemoryError), file size (SIGXFSZ ends a flood
  of output), open files, no core dumps, no processes. A process cannot raise a hard limit again.
* **an empty environment**, the worker's modules dropped from ``sys.modules``, a fresh directory;
  then one byte, SETUP_OK, on its report pipe: a run without it failed setup, and the pool
  replaces its worker.
* **the audit hook**, defence in depth and the source of readable reasons ("blocked by sandbox
  policy: import socket"). CPython documents audit hooks as *not* a security boundary; the kernel
  is the boundary here, and the hook only ends obvious attempts early with a clear reason.
"""

from __future__ import annotations

import marshal
import os
import select
import struct
import sys
import time

import _json
import _signal

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs ~5 ms of imports per sandbox start; annotations are strings here
    from typing import Any, Callable

VIOLATION_EXIT = 86
_HARNESS_FILE = "<miles-harness>"  # the file-name prefix the harness is compiled under (image.HARNESS_FILE)
SETUP_OK = b"+"  # first byte a run writes on its report pipe, once limits, filter and hook are in place
_HDR = struct.Struct(">I")
SAFE_MODULES = frozenset(
    "math cmath itertools functools operator collections re string json heapq bisect fractions decimal "
    "statistics random typing dataclasses enum copy numbers datetime array abc types keyword reprlib "
    "textwrap unicodedata _heapq _bisect _random _decimal _statistics _datetime _json _operator "
    "_functools _collections _collections_abc _string _sre _abc _weakref weakref "
    # what the benchmarks' canonical solutions import (HumanEval/162 hashes with hashlib, MBPP uses calendar)
    "hashlib calendar struct".split())
_DENY_PREFIXES = ("ctypes.", "socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "gc.",
                  "_posixsubprocess", "pty.", "resource.", "signal.", "os.fork", "os.memfd")
# sys._getframe and object.__getattr__ (frame and code attributes) stay allowed: stdlib modules use
# them while they import lazily (namedtuple, typing, inspect), and with no ctypes in the sandbox a
# frame gives no way to touch the installed hook; the kernel is the boundary either way.
_DENY_EVENTS = frozenset({"os.system", "os.kill", "os.killpg", "sys._current_frames",
                          "sys.setprofile", "sys.settrace", "sys.addaudithook", "os.link",
                          "os.symlink", "mmap.__new__", "os.pidfd_open", "signal.pthread_kill"})
_PATH_EVENTS = frozenset({"os.remove", "os.rmdir", "os.rename", "os.replace", "shutil.rmtree", "os.mkdir",
                          "os.chmod", "os.chown", "os.truncate", "os.utime", "os.listdir", "os.scandir",
                          "os.chdir", "os.chflags", "os.mkfifo", "os.mknod", "shutil.copyfile", "shutil.move"})


def to_json(v: Any) -> str:
    """JSON text of a report: dicts with str keys, lists, str, int, float, bool, None only."""
    if v is None or v is True or v is False:
        return {None: "null", True: "true", False: "false"}[v]
    t = type(v)
    if t is str:
        return _json.encode_basestring_ascii(v)
    if t is int:
        return int.__repr__(v)
    if t is float:
        return float.__repr__(v) if v == v and v not in (float("inf"), float("-inf")) else (
            "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity"))
    if t is list:
        return "[" + ",".join(to_json(x) for x in v) + "]"
    if t is dict:
        return "{" + ",".join(_json.encode_basestring_ascii(str(k)) + ":" + to_json(x) for k, x in v.items()) + "}"
    raise TypeError(f"to_json: {t.__name__} is not a report value")


def send_msg(fd: int, obj: Any) -> None:
    """One length-framed JSON message on ``fd`` (a run's report, a worker's reply)."""
    send_frame(fd, to_json(obj).encode())


def frame_body(data: bytes) -> bytes | None:
    """The body of exactly one frame, or None when ``data`` is anything else (the pool's check)."""
    n = _HDR.unpack(data[:_HDR.size])[0] if len(data) >= _HDR.size else -1
    return data[_HDR.size:] if n == len(data) - _HDR.size else None


def read_frame(fd: int, deadline: float | None = None) -> bytes | None:
    """The body of the next frame on ``fd``; None at EOF. Raises TimeoutError past ``deadline``."""
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
    return exact(_HDR.unpack(hdr)[0]) if hdr else None


def send_frame(fd: int, data: bytes) -> None:
    data = _HDR.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


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


def flush_output() -> None:
    """Flush what the program printed before the run ends with ``os._exit`` (which would drop it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the program's own streams, possibly replaced or closed
            pass


def _audit_hook(job_dir: str, read_roots: tuple[str, ...], importable: frozenset[str], out_fd: int,
                trusted: tuple[str, ...] = ()) -> Callable[[str, tuple], None]:
    """The in-process policy (see module docstring); a refusal reports and exits immediately.

    ``importable``: the top-level modules a completion may import (image.py: what the sandbox
    holds, less the refused built-ins); any other import raises ImportError, as a missing module
    would, so an honest ``try: import numpy / except ImportError`` takes its fallback.
    ``trusted``: the standard library's files; code from anywhere else (the completion, whatever
    file name it compiles under, ``exec``, generated code) counts as the completion's, and it may
    not compile, build or unmarshal code that claims a trusted file name. Everything the hook
    consults is bound in its closure (a completion reaches the harness's module globals through
    its caller's frame), and it never calls into an object a run made (paths must be exact str or
    bytes). It stays defence in depth: the kernel is the boundary."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    deny_events, deny_prefixes, path_events = _DENY_EVENTS, _DENY_PREFIXES, _PATH_EVENTS
    getframe, realpath, fsdecode, sep, type_ = sys._getframe, os.path.realpath, os.fsdecode, os.sep, type
    isabs = os.path.isabs
    write, exit_, encode, pack = os.write, os._exit, _json.encode_basestring_ascii, _HDR.pack
    inside = lambda p, root: p == root or p.startswith(root + sep)  # noqa: E731
    trusted_names = (*trusted, "<frozen ", _HARNESS_FILE)
    code_attrs = frozenset({"__code__", "__defaults__", "__kwdefaults__"})

    def deny(what: str) -> None:
        body = ('{"status":"blocked","reason":' + encode(f"blocked by sandbox policy: {what}"[:300]) + "}").encode()
        write(out_fd, pack(len(body)) + body)
        exit_(VIOLATION_EXIT)

    def path(p: Any, event: str) -> str:
        if type_(p) is not str and type_(p) is not bytes:  # no __fspath__ of a run's making runs here
            deny(f"{event} of a {type_(p).__name__} path (give a str)")
        return fsdecode(p)

    def by_completion() -> bool:
        """Was the event raised by code other than the standard library's and the harness's?"""
        f = getframe(2)
        while f is not None and f.f_code.co_filename.startswith("<frozen importlib"):
            f = f.f_back
        return f is None or not f.f_code.co_filename.startswith(trusted_names)

    def hook(event: str, args: tuple) -> None:
        if event in deny_events or event.startswith(deny_prefixes):
            deny(event)
        elif event == "import":
            if args[0].split(".")[0] not in importable:
                raise ModuleNotFoundError(f"No module named {args[0]!r} (refused by the sandbox policy)")
        elif event == "object.__setattr__" and type_(args[0]).__name__ == "function" and args[1] in code_attrs and (
                args[1] == "__code__" or by_completion()):  # namedtuple sets __defaults__; nothing sets __code__
            deny(f"setting {args[1]} on a function")
        elif event == "object.__setattr__" and type_(args[0]).__name__ in ("code", "cell") and by_completion():
            deny(f"setting {args[1]} on a {type_(args[0]).__name__}")
        elif event == "compile" and by_completion() and type_(args[1]) in (str, bytes) and (
                fsdecode(args[1]).startswith(trusted_names)):
            deny("compiling code under a standard-library file name")
        elif event in ("code.__new__", "marshal.load", "marshal.loads") and by_completion():
            deny(event)
        elif event == "open" and type_(args[0]) is int:
            if args[0] > 2 and by_completion():  # its report and pipes are written by the harness alone
                deny(f"open of descriptor {args[0]}")
        elif event == "open":
            mode, flags, name = args[1] or "", args[2] or 0, path(args[0], event)
            if not isabs(name) and by_completion():
                deny("open of a relative path (the event does not say which directory a dir_fd names)")
            p = realpath(name)
            writing = any(c in mode for c in "wax+") or bool(flags & write_flags)
            if not inside(p, job_dir) and (writing or not any(inside(p, r) for r in read_roots)):
                deny(f"open {p!r} for {'writing' if writing else 'reading'} outside the sandbox directory")
        elif event in path_events:
            listing = event in ("os.listdir", "os.scandir")  # the import system lists the stdlib
            for a in args[:2]:
                if type_(a) is int and by_completion():
                    deny(f"{event} on descriptor {a}")
                if a is None or type_(a) is int:
                    continue
                name = path(a, event)
                if not isabs(name) and by_completion():
                    deny(f"{event} of a relative path")
                if not inside(realpath(name), job_dir) and not (
                        listing and any(inside(realpath(name), r) for r in read_roots)):
                    deny(f"{event} {realpath(name)!r} outside the sandbox directory")
    return hook


def _load_filter(module_path: str, rules: list) -> Any:
    """Stage two, built with libseccomp's bindings and loaded in each run. ``rules``: (syscall,
    conditions) pairs; a call is refused (EPERM) when all its conditions hold, each condition an
    (argument index, "eq"|"ne"|"eq32"|"has", value) triple (:func:`seccomp_arg`; no conditions: always). The module can only ever
    add restrictions (no_new_privs is set), so it is nothing to a run."""
    import _frozen_importlib as bootstrap  # importlib.util costs ~6 ms of imports; this is free
    import _frozen_importlib_external as external

    spec = bootstrap.spec_from_loader("seccomp", external.ExtensionFileLoader("seccomp", module_path))
    mod = bootstrap.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = mod.SyscallFilter(defaction=mod.ALLOW)
    for name, conds in rules:
        try:
            f.add_rule(mod.ERRNO(1), name, *[seccomp_arg(mod, *c) for c in conds])  # EPERM
        except (ValueError, RuntimeError):  # a call this libseccomp does not know
            pass
    sys.modules.pop("seccomp", None)
    return f


def seccomp_arg(sc: Any, index: int, op: str, value: int) -> Any:
    """One rule condition in libseccomp's terms: "eq", "ne", "eq32" (the low 32 bits, as the
    kernel reads an int argument, so high bits cannot slip a value past the rule), or "has" (every
    bit of ``value`` set: a flag in open's flags)."""
    if op == "eq32":
        return sc.Arg(index, sc.MASKED_EQ, 0xFFFFFFFF, value)
    if op == "has":
        return sc.Arg(index, sc.MASKED_EQ, value, value)
    return sc.Arg(index, sc.EQ if op == "eq" else sc.NE, value)


def _child(job: dict, opts: dict, job_dir: str, wfd: int, out: int, seccomp: Any,
           harness: "Callable[..., None]", extra: "tuple[int, ...]" = ()) -> None:
    """Between fork and the completion: limits, filter, environment, hook; then ``harness``
    (default: :func:`_harness`) with fd 3 for its report and ``extra`` pipes as fds 4, 5, ..."""
    import resource

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    keep = [os.dup(fd) for fd in (wfd, *extra)]  # out of the way of the numbers they move to
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for i, fd in enumerate(keep):
        os.dup2(fd, 3 + i)
    os.closerange(3 + len(keep), 1 << 16)
    os.chdir(job_dir)
    lim = opts["limits"]
    for res, val in ((resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2),
                     (resource.RLIMIT_FSIZE, (lim["output_bytes"],) * 2),
                     (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2), (resource.RLIMIT_NPROC, (0, 0))):
        resource.setrlimit(res, val)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)  # Python ignores it; let the kernel kill the writer
    if seccomp is not None:
        seccomp.load()
    os.environ.clear()
    for name in [m for m in sys.modules if m.split(".")[0] not in SAFE_MODULES and m not in _KEEP
                 and not m.startswith(__package__ or "-")]:  # the harness's own modules stay
        del sys.modules[name]
    if opts["audit_hook"]:
        importable = frozenset(opts["importable"])
        _guard_builtins(importable)
        sys.addaudithook(_audit_hook(os.path.realpath(job_dir), tuple(opts["read_roots"]), importable, 3,
                                     tuple(opts["trusted_files"])))
    os.write(3, SETUP_OK)  # the last word of trusted code: without it, the reader knows setup failed
    harness(job, *range(3, 3 + len(keep)))


_MADE: dict = {}  # the allowed built-in modules, made once per worker before its zygote forks (make_builtins)


def make_builtins(allowed: frozenset[str]) -> None:
    """Make the allowed built-in modules once, in the worker (their initialisation would cost every
    run; forks share them), for :func:`_guard_builtins` to hand out."""
    import _imp
    from _frozen_importlib import BuiltinImporter

    for name in sorted(allowed & frozenset(sys.builtin_module_names)):
        if name not in _MADE:
            _MADE[name] = sys.modules[name] if name in sys.modules else _imp.create_builtin(
                BuiltinImporter.find_spec(name))


def _guard_builtins(allowed: frozenset[str]) -> None:
    """``_imp.create_builtin`` makes a built-in module (gc, fcntl, _socket) without an import
    event: the import system's loaders call it through the ``_imp`` module. A run gets a
    replacement that hands out the allowed built-ins, made in advance (:func:`make_builtins`), and
    refuses the rest; the original is dropped, so nothing a run can reach (a closure cell, a
    default) leads to it."""
    import _imp

    make_builtins(allowed)  # a no-op where the worker made them already

    def create_builtin(spec: Any, _made: dict = dict(_MADE)) -> Any:  # a copy: the global is reachable
        name = getattr(spec, "name", None)
        if type(name) is not str or name not in _made:
            raise ImportError(f"built-in module {name!r} refused by the sandbox policy")
        return _made[name]
    _imp.create_builtin = create_builtin


_KEEP = frozenset({"sys", "builtins", "os", "posix", "posixpath", "os.path", "io", "abc", "codecs", "encodings",
                   "encodings.utf_8", "encodings.aliases", "_io", "_codecs", "stat", "_stat", "genericpath", "time",
                   "marshal", "_imp", "_frozen_importlib", "_frozen_importlib_external", "_warnings", "zipimport",
                   "_thread", "_signal", "errno", "struct", "_struct", "select", "_json"})
