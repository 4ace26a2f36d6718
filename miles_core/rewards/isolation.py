"""The kernel boundary around every code run: bubblewrap namespaces plus seccomp, failing closed.

Model-written code is hostile, so the boundary is what the kernel enforces, never a Python hook
(the harness in sandbox.py keeps one only for readable reasons). A sandbox is one ``bwrap``
invocation that starts a fresh interpreter (the worker of sandbox.py, which forks each run), with

* its own **user namespace** (inside: uid/gid 65534, no capabilities, no further user namespaces)
  and, when the caller is root, bwrap itself started as uid 65534, so a run owns no host file;
* its own **mount namespace**: a read-only tmpfs root holding private copies of the interpreter,
  the shared objects it loads (found with ``ldd``) and its standard library, packed as a zip
  (image.py: no host file is ever mapped or read by a run, so the host's page cache, locks and
  watches are no channel between jobs), the host's ``/dev/null``, and a size-capped tmpfs at
  ``/tmp`` that is the run's only writable place and its working directory; no ``/proc``, no home,
  no repository, no trajectory store;
* its own **PID namespace** (it sees and can signal only itself), **network namespace** (no
  interface, not even a usable loopback), IPC, UTS and cgroup namespaces; a new session (no
  TIOCSTI into a terminal); an empty environment; ``--die-with-parent``;
* **seccomp** in two stages. Stage one, loaded by bwrap before the interpreter starts, denies by
  default: it allows STAGE_ONE_ALLOW (anything else fails with ENOSYS) and refuses (EPERM) what
  neither the worker nor a run needs: STAGE_ONE less WORKER_NEEDS. Stage two, loaded
  in each run's child before user code, refuses all of STAGE_ONE plus exec: process and thread
  creation, every way to send a signal, ptrace and process_vm_*, sockets of every family, memfd,
  mount and namespace calls, bpf, keyctl, perf_event_open, io_uring, module and kexec loading,
  file locks, leases and watches of every kind, and the page-cache calls (fadvise, readahead,
  mincore, cachestat): what could reach or read state another job also touches.

``isolation=bwrap`` starts one such sandbox per run (every run has namespaces of its own, at
about 45 ms of copies, interpreter and namespace start-up per run); ``bwrap_shared`` keeps one
sandbox per pool worker and forks each run inside it (its runs share the worker's namespaces and
copies, one at a time, and the worker wipes the tmpfs between them), several times faster. Both are the kernel boundary
above; benchmarks/speed/sandbox.py measures both.

Why these tools: bubblewrap (Debian ``bubblewrap``) is the well-kept setuid-free sandbox behind
Flatpak, and libseccomp's Python bindings (Debian ``python3-seccomp``) compile the filter to BPF
here in the trusted process, so no syscall numbers or BPF are hand-written. Landlock would not
give PID or network isolation on its own. If any piece is missing, :func:`prepare` raises
:class:`IsolationUnavailable` naming it; only ``isolation="none"`` (an explicit opt-out) runs
without the boundary. See infra/sandbox.md for Kubernetes.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from miles_core.rewards.image import HARNESS_PACKAGE, Image, build_image
from miles_core.rewards.sandbox import seccomp_arg

NOBODY = 65534
Mode = Literal["bwrap", "bwrap_shared", "none"]
MODES = ("bwrap", "bwrap_shared", "none")
# Refused for the whole run, interpreter start-up included (none of it is needed to start Python).
STAGE_ONE = (
    "fork", "vfork", "clone", "clone3",                                    # no processes or threads
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",     # no signals to anyone
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",             # no reading other processes
    "socket", "socketpair",                                                # no sockets of any family
    "memfd_create", "memfd_secret", "userfaultfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "open_by_handle_at", "name_to_handle_at",
    "mknod", "mknodat", "fanotify_init", "personality", "ioperm", "iopl", "vhangup",
    "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
    # scheduling and I/O priority: a run must not slow its worker, or the runs after it, down
    "setpriority", "sched_setscheduler", "sched_setparam", "sched_setattr", "sched_setaffinity", "ioprio_set",
    "process_madvise", "process_mrelease",
    # SysV and POSIX IPC outlive a run inside a shared worker's IPC namespace: no run may make any
    "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl",
    "semtimedop", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    # state shared with whoever else opens an inode (the host's /dev/null, a shared worker's copies):
    # locks, watches, and the page cache's advice and residency (image.py: a sandbox's files are tmpfs)
    "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_mark",
    "fadvise64", "readahead", "mincore", "cachestat",
)
# Refused for the whole run too, but only with these arguments: another process's limits or pages,
# and the owner settings that make the kernel signal a process chosen by the caller (O_ASYNC/SIGIO).
# "eq32" compares the low 32 bits, as the kernel reads an int argument (no high-bit bypass).
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
# record locks (classic and open-file-description), leases and directory notification (dnotify)
FCNTL_LOCKS = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)  # F_GETLK F_SETLK F_SETLKW F_OFD_* F_SETLEASE F_GETLEASE F_NOTIFY
FIOSETOWN, SIOCSPGRP, TIOCSPGRP = 0x8901, 0x8902, 0x5410
STAGE_ONE_IF = (
    ("prlimit64", ((0, "ne", 0),)), ("migrate_pages", ((0, "ne", 0),)), ("move_pages", ((0, "ne", 0),)),
    *(("fcntl", ((1, "eq32", cmd),)) for cmd in (F_SETOWN, F_SETSIG, F_SETOWN_EX, *FCNTL_LOCKS)),
    *(("ioctl", ((1, "eq32", cmd),)) for cmd in (FIOSETOWN, SIOCSPGRP, TIOCSPGRP)),
)
# Refused to every run's child, with all of STAGE_ONE: exec, and everything that would leave a
# trace on the worker's tmpfs or /dev/null for a later job of a shared worker to read (infra/sandbox.md,
# "A job leaves nothing for the next"): extended attributes, chosen timestamps, mode and owner
# changes, and new inodes (the tmpfs numbers inodes from a counter that only grows; pipes draw
# from the kernel's shared counter). A run reads its directory and writes only its report and
# its stdout; HumanEval and MBPP programs never create files.
STAGE_TWO = (
    "execve", "execveat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "setxattrat", "removexattrat",
    "utime", "utimes", "futimesat", "utimensat",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "mkdir", "mkdirat", "creat", "symlink", "symlinkat", "link", "linkat", "openat2", "pipe", "pipe2",
)
O_CREAT, O_TMPFILE_BIT, F_SETFL, F_SETPIPE_SZ, FIONBIO, FIOASYNC = 0o100, 0o20000000, 4, 1031, 0x5421, 0x5452
STAGE_TWO_IF = (
    *((call, ((arg, "has", bit),)) for call, arg in (("open", 1), ("openat", 2)) for bit in (O_CREAT, O_TMPFILE_BIT)),
    # a run's descriptors are its report channel and its program pipes: no flags or sizes to change
    # (CPython's os.set_blocking uses the FIONBIO ioctl, not fcntl)
    *(("fcntl", ((1, "eq32", cmd),)) for cmd in (F_SETFL, F_SETPIPE_SZ)),
    *(("ioctl", ((1, "eq32", cmd),)) for cmd in (FIONBIO, FIOASYNC)),
)
# Deny by default: stage one is two programs, this allow-list (anything else, a syscall a newer
# kernel adds included, fails with ENOSYS, which glibc treats as "not implemented") and the EPERM
# refusals above, loaded after it so that their EPERM is what a refused call sees. It is what the
# interpreter, the worker and honest programs call (strace of the sandbox test suite and the honest
# corpus), with the read-only variants of each family.
STAGE_ONE_ALLOW = (
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2", "lseek",
    "open", "openat", "close", "close_range", "dup", "dup2", "dup3", "fcntl", "ioctl", "pipe", "pipe2",
    "stat", "lstat", "fstat", "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2",
    "readlink", "readlinkat", "getdents64", "getcwd", "chdir", "fchdir", "getxattr", "lgetxattr", "fgetxattr",
    "listxattr", "llistxattr", "flistxattr", "ftruncate", "fsync", "fdatasync", "sendfile", "copy_file_range",
    # the worker's own file work (FIFOs, run folders, the wipe); stage two refuses runs what creates or changes
    "mkdir", "mkdirat", "mknodat", "unlink", "unlinkat", "rmdir", "rename", "renameat", "renameat2", "chmod",
    "fchmod", "fchmodat", "utimensat", "umask", "truncate",
    "select", "pselect6", "poll", "ppoll", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
    "mmap", "munmap", "mprotect", "mremap", "madvise", "brk", "msync",
    "execve", "exit", "exit_group", "clone", "wait4", "waitid", "kill", "pidfd_open", "setsid",
    "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid", "getresgid",
    "getpgrp", "getpgid", "getsid", "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "arch_prctl",
    "prctl", "seccomp", "prlimit64", "getrlimit", "setrlimit", "getrusage", "times", "sysinfo", "uname",
    "sched_getaffinity", "sched_yield", "sched_getparam", "sched_getscheduler", "getpriority", "getcpu", "futex",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigsuspend", "rt_sigpending", "rt_sigtimedwait",
    "sigaltstack", "restart_syscall", "setitimer", "getitimer", "alarm", "pause",
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time", "getrandom",
)
# The worker forks runs, kills late ones, and makes each job's report FIFO (mknodat: in a user
# namespace no device node can be made, so a FIFO, socket or empty file is all it allows).
WORKER_NEEDS = ("fork", "clone", "kill", "pidfd_open", "mknodat")


def filter_rules(stage: int) -> list[tuple[str, tuple]]:
    """The (syscall, conditions) rules of stage one (the worker) or two (each run)."""
    if stage == 1:
        return [(n, ()) for n in STAGE_ONE if n not in WORKER_NEEDS] + list(STAGE_ONE_IF)
    return [(n, ()) for n in (*STAGE_ONE, *STAGE_TWO)] + list(STAGE_ONE_IF) + list(STAGE_TWO_IF)
_PROBE = r"""
import json, sys, sysconfig
paths = sysconfig.get_paths()
print(json.dumps({"version": list(sys.version_info[:2]), "stdlib": paths["stdlib"], "platstdlib": paths["platstdlib"]}))
"""


class IsolationUnavailable(RuntimeError):
    """The isolation a code reward needs is missing here; the message says what and how to fix it."""


@dataclass(frozen=True)
class Interpreter:
    """The interpreter runs start in, and everything it needs mounted (all read-only)."""

    executable: str
    version: tuple[int, int]
    stdlib: tuple[str, ...]      # on the host: mode none reads it in place
    image: Image                 # what a bwrap sandbox gets copied instead (image.py)


@dataclass(frozen=True)
class Isolation:
    """How runs are started: ``command()`` gives the argv of one run; ``layers`` says what holds."""

    mode: Mode
    interpreter: Interpreter
    uid: int | None              # started as this uid (root callers drop to nobody), None: as is
    seccomp_module: str          # libseccomp's bindings, for the harness's stage two ('' if none)
    bpf: tuple[bytes, ...]       # stage one: the allow-list, then the refusals (bwrap --add-seccomp-fd); () for none
    bwrap: str

    @property
    def layers(self) -> dict[str, bool]:
        iso = self.mode != "none"
        return {"kernel_isolation": iso, "user_namespace": iso, "mount_namespace": iso, "pid_namespace": iso,
                "network_namespace": iso, "seccomp": iso, "namespaces_per_run": self.mode == "bwrap",
                "uid_drop": self.uid is not None, "process_per_run": True, "rlimits": True, "empty_env": True}

    def command(self, job_dir: str, tmpfs_bytes: int, bpf_fds: Sequence[int], image_argv: Sequence[str] = ()) -> list[str]:
        """argv of one sandbox worker: a fresh ``python -I -S -B`` running the harness package the
        image's zip holds (``_miles_sandbox.sandbox_worker``, compiled with the standard library).
        Mode none puts the zip on its path itself. ``image_argv``: image.copy_args."""
        exe, start = self.interpreter.executable, f"from {HARNESS_PACKAGE}.sandbox_worker import main; main()"
        if self.mode == "none":
            return [exe, "-I", "-S", "-B", "-c", f"import sys; sys.path.insert(0, {self.interpreter.image.zip_host!r}); "
                    + start]
        # No --disable-userns: stage one refuses unshare, clone and setns, so no namespace can be made.
        argv = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--uid", str(NOBODY), "--gid", str(NOBODY),
                "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
        argv += [*image_argv, "--dev-bind", "/dev/null", "/dev/null", "--perms", "1777", "--size", str(tmpfs_bytes),
                 "--tmpfs", job_dir, "--chdir", job_dir]
        for fd in bpf_fds:  # in order: the last loaded decides the errno of a call both refuse
            argv += ["--add-seccomp-fd", str(fd)]
        return argv + ["--remount-ro", "/", "--", exe, "-I", "-S", "-B", "-c", start]


def sandbox_uid() -> int | None:
    """Root callers start runs as nobody (a run then owns no host file); others as themselves."""
    return NOBODY if os.geteuid() == 0 else None


def _readable_by(path: str, uid: int | None) -> bool:
    """Can ``uid`` (None: this process) traverse to and read ``path``? Mode bits for others only,
    which is what nobody gets."""
    if uid is None:
        return os.access(path, os.R_OK | os.X_OK)
    p = Path(path).resolve()
    for d in reversed(p.parents):
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(p).st_mode & stat.S_IROTH)


def _candidates() -> list[str]:
    v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    base = getattr(sys, "_base_executable", sys.executable)
    return list(dict.fromkeys(os.path.realpath(p) for p in (base, f"/usr/bin/{v}", f"/usr/local/bin/{v}")
                              if os.path.isfile(p)))


def choose_interpreter(uid: int | None) -> str:
    """This Python if the sandbox user can run it, else the system's of the same version."""
    for exe in _candidates():
        if _readable_by(exe, uid):
            return exe
    v = f"{sys.version_info[0]}.{sys.version_info[1]}"
    raise IsolationUnavailable(
        f"no Python {v} that the sandbox user (uid {uid if uid is not None else os.getuid()}) can read: tried "
        f"{', '.join(_candidates()) or 'none'}; install the system one (apt-get install python{v}) or run as a "
        "user who can read this interpreter")


def shared_libs(paths: list[str]) -> list[str]:
    """Every shared object that ``paths`` load, as ``ldd`` resolves them (loader included)."""
    libs: set[str] = set()
    for p in paths:
        out = subprocess.run(["ldd", p], capture_output=True, text=True, env={"LC_ALL": "C"}).stdout
        for line in out.splitlines():
            parts = line.split()
            for tok in parts:
                if tok.startswith("/") and os.path.exists(tok):
                    libs.add(tok)
    return sorted(libs)


@functools.lru_cache(maxsize=None)
def describe_interpreter(exe: str, seccomp_module: str = "") -> Interpreter:
    """Ask ``exe`` for its standard library and pack it for the sandbox (once per process)."""
    res = subprocess.run([exe, "-I", "-S", "-c", _PROBE],
                         capture_output=True, text=True, env={}, timeout=60)
    if res.returncode != 0:
        raise IsolationUnavailable(f"the sandbox interpreter {exe} failed to start: {res.stderr.strip()[-300:]}")
    info = json.loads(res.stdout)
    stdlib = sorted({os.path.realpath(info["stdlib"]), os.path.realpath(info["platstdlib"])})
    stdlib = [s for s in stdlib if not any(s.startswith(t + os.sep) for t in stdlib)]
    image = build_image(exe, info["stdlib"], tuple(shared_libs([exe])), seccomp_module)
    return Interpreter(exe, tuple(info["version"]), tuple(stdlib), image)


def find_seccomp_module(version: tuple[int, int]) -> str:
    """libseccomp's Python bindings for ``version`` (Debian's python3-seccomp, or a pip install)."""
    tag = f"cpython-{version[0]}{version[1]}"
    dirs = ["/usr/lib/python3/dist-packages", *[p for p in sys.path if p.endswith("-packages")]]
    for d in dirs:
        for so in sorted(glob.glob(os.path.join(d, f"seccomp.{tag}*.so"))):
            return os.path.realpath(so)
    raise IsolationUnavailable(
        "libseccomp's Python bindings are missing (no seccomp.%s*.so in %s): apt-get install python3-seccomp, "
        "or set sandbox.isolation=none to run completions without a kernel boundary (not recommended)"
        % (tag, ", ".join(dirs)))


def _load_seccomp(path: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("seccomp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def stage_one_bpf(module_path: str, allow: bool = False) -> bytes:
    """A stage-one program as BPF, compiled by libseccomp: the refusals (STAGE_ONE less
    WORKER_NEEDS, with STAGE_ONE_IF's conditions: EPERM, anything else allowed), or with ``allow``
    the allow-list (STAGE_ONE_ALLOW allowed, anything else ENOSYS). Two programs because a
    conditional refusal of a call the allow-list allows outright would be dropped in one. A call
    from another architecture's ABI (int 0x80, x32) kills the process (libseccomp's default)."""
    import errno
    import tempfile

    sc = _load_seccomp(module_path)
    if allow:
        f = sc.SyscallFilter(defaction=sc.ERRNO(errno.ENOSYS))
        rules: list = [(sc.ALLOW, name, ()) for name in STAGE_ONE_ALLOW]
    else:
        f = sc.SyscallFilter(defaction=sc.ALLOW)
        rules = [(sc.ERRNO(errno.EPERM), name, conds) for name, conds in filter_rules(1)]
    for action, name, conds in rules:
        try:
            f.add_rule(action, name, *[seccomp_arg(sc, *c) for c in conds])
        except (ValueError, RuntimeError):  # a call this libseccomp/kernel does not know
            continue
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read()


@functools.lru_cache(maxsize=None)
def prepare(mode: Mode = "bwrap") -> Isolation:
    """Everything a pool needs to start runs in ``mode``; raises IsolationUnavailable if missing."""
    if mode not in MODES:
        raise ValueError(f"sandbox.isolation: {mode!r} is not one of {', '.join(MODES)}")
    uid = sandbox_uid()
    exe = choose_interpreter(uid)
    if mode == "none":
        return Isolation("none", describe_interpreter(exe), uid, "", (), "")
    bwrap = shutil.which("bwrap") or ""
    if not bwrap:
        raise IsolationUnavailable("bubblewrap is not installed (no bwrap on PATH): apt-get install bubblewrap, "
                                   "or set sandbox.isolation=none to run completions without a kernel boundary")
    if sys.platform != "linux":
        raise IsolationUnavailable(f"kernel isolation needs Linux namespaces and seccomp; this is {sys.platform}")
    module = find_seccomp_module(sys.version_info[:2])  # choose_interpreter only offers this Python's version
    return Isolation(mode, describe_interpreter(exe, module), uid, module,
                     (stage_one_bpf(module, allow=True), stage_one_bpf(module)), bwrap)


USERNS_HINT = ("bwrap could not create its namespaces. Unprivileged user namespaces must be enabled "
               "(sysctl kernel.unprivileged_userns_clone=1 on Debian, user.max_user_namespaces > 0, and on "
               "Ubuntu 24.04+ kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap); "
               "in Kubernetes see infra/sandbox.md")
