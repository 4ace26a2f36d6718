"""Nothing a completion can read, lock, evict or time is shared with another job or the host (issue
68): the sandbox's files are private tmpfs copies (miles_core/rewards/image.py), locks, watches and
page-cache calls are refused by the kernel, the program cannot read what the tester prints, and
the audit hook (defence in depth) holds whatever file name code is compiled under. Kernel checks
run with the hook off; each class in ``bwrap`` and ``bwrap_shared``. CI runs this file as root and
as an ordinary user (.ci/sandbox-unprivileged)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from miles_core.rewards.jobs import Job, SandboxLimits
from miles_core.rewards.pool import SandboxPool

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=2, memory_mb=256, tmpfs_mb=8)
MODES = ("bwrap", "bwrap_shared")


@pytest.fixture(scope="module", params=MODES)
def bare(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    """Audit hook off: what the kernel and the file system hold on their own."""
    with SandboxPool(2, LIMITS, audit_hook=False, isolation=request.param, cache_size=0) as p:
        yield p


@pytest.fixture(scope="module", params=MODES)
def hooked(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(2, LIMITS, isolation=request.param, cache_size=0) as p:
        yield p


def _one(pool: SandboxPool, source: str, arg: object = 0) -> object:
    res = pool.run([Job(source, [[arg]], kind="module")])[0]
    assert res.status == "ok" and res.errors == [None], res
    return res.outputs[0]


WALK = """
import os
def f(_):
    root = os.stat("/").st_dev
    seen, other = 0, []
    for d, dirs, files in os.walk("/"):
        if d in ("/tmp", "/dev") or d.startswith("/tmp/"):
            dirs[:] = []
            continue
        for name in dirs + files:
            p = os.path.join(d, name)
            if p in ("/tmp", "/dev"):
                continue
            seen += 1
            if os.lstat(p).st_dev != root:
                other.append(p)
    return [seen, sorted(other), sorted(os.listdir("/dev")), os.stat("/tmp").st_dev != root]
"""


def test_every_file_a_run_can_reach_is_the_sandboxs_own_copy(bare: SandboxPool) -> None:
    """Everything under / except /dev and /tmp lies on the sandbox's own root tmpfs: copies, not
    binds of host files (a bind keeps the host file system's device number). /dev holds /dev/null
    alone, a device (no page cache; locks on it are refused below)."""
    seen, other, dev, tmp_own = _one(bare, WALK)
    assert seen > 10 and other == [] and dev == ["null"] and tmp_own, (seen, other, dev)
    host = os.stat(os.path.realpath("/usr/bin/python3.11") if os.path.exists("/usr/bin/python3.11") else "/").st_dev
    inside = _one(bare, "import os, sys\ndef f(_):\n    return os.stat(sys.executable).st_dev\n")
    assert inside != host


REFUSALS = """
import errno, fcntl, mmap, os, struct, sys
def f(_):
    out = {}
    def attempt(name, call):
        try:
            call()
            out[name] = "ALLOWED"
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno, str(e.errno))
    fd = os.open(sys.executable, os.O_RDONLY)
    null = os.open("/dev/null", os.O_RDWR)
    attempt("fadvise DONTNEED", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))
    attempt("flock /dev/null", lambda: fcntl.flock(null, fcntl.LOCK_EX | fcntl.LOCK_NB))
    attempt("flock the interpreter", lambda: fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB))
    attempt("lockf", lambda: fcntl.lockf(null, fcntl.LOCK_EX | fcntl.LOCK_NB))
    lk = struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 0, 0)
    attempt("OFD lock", lambda: fcntl.fcntl(fd, 37, lk))
    attempt("F_GETLK", lambda: fcntl.fcntl(fd, fcntl.F_GETLK, lk))
    attempt("lease", lambda: fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK))
    attempt("dnotify", lambda: fcntl.fcntl(os.open("/", os.O_RDONLY), fcntl.F_NOTIFY, fcntl.DN_ACCESS))
    m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
    attempt("madvise PAGEOUT", lambda: m.madvise(21))  # a tmpfs page cannot be paged out: no swap
    try:  # never cold: tmpfs pages are the file (and tmpfs may not take RWF_NOWAIT at all)
        warm = os.preadv(fd, [bytearray(1 << 16)], 0, os.RWF_NOWAIT) == 1 << 16
    except OSError as e:
        warm = e.errno == errno.EOPNOTSUPP
    return [sorted(out.items()), warm]
"""


def test_locks_watches_and_cache_advice_are_refused_by_the_kernel(bare: SandboxPool) -> None:
    pairs, warm = _one(bare, REFUSALS)
    out = dict(pairs)
    refused = {k: v for k, v in out.items() if k != "madvise PAGEOUT"}
    assert set(refused.values()) == {"EPERM"}, out
    assert warm


def test_a_secret_cannot_cross_jobs_through_locks_or_the_cache(bare: SandboxPool) -> None:
    """A cross-job channel, end to end: job A tries to leave one bit by locking or evicting a file
    both jobs can open; job B, on the same worker and on the other, reads what it can see."""
    leave = ("import fcntl, os, sys\ndef f(bit):\n    fd = os.open(sys.executable, os.O_RDONLY)\n"
             "    for call in (lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB),\n"
             "                 lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)):\n"
             "        try:\n            call() if bit else None\n        except OSError:\n            pass\n"
             "    return bit\n")
    read = ("import fcntl, os, sys\ndef f(_):\n    fd = os.open(sys.executable, os.O_RDONLY)\n"
            "    n = os.fstat(fd).st_size\n    cold = 0\n    for off in range(0, n, 1 << 16):\n"
            "        try:\n            os.preadv(fd, [bytearray(4096)], off, os.RWF_NOWAIT)\n"
            "        except BlockingIOError:\n            cold += 1\n"
            "        except OSError as e:\n            cold = -e.errno\n"
            "    try:\n        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n        locked = 'free'\n"
            "    except OSError as e:\n        locked = e.errno\n    return [cold, locked]\n")
    seen = []
    for bit in (0, 1, 0, 1):
        res = bare.run([Job(leave, [[bit]], kind="module"), Job(read, [[0]], kind="module"),
                        Job(read + "#2", [[0]], kind="module")])
        assert res[0].outputs == [bit]
        seen.append([r.outputs[0] for r in res[1:]])
    assert all(s == seen[0] for s in seen) and seen[0][0][0] <= 0, seen  # identical whatever the bit


TESTER_PRINTS = "print('EXPECTED-' + str(2 * 3 * 7))\nimport sys\nsys.stderr.write('EXPECTED-42')\n"
PEEK = """
import os
def f(x):
    got = []
    for fd in (1, 2):
        for attempt in (lambda: os.pread(fd, 4096, 0), lambda: os.read(fd, 4096)):
            try:
                got.append(attempt().decode(errors="replace"))
            except OSError as e:
                got.append(type(e).__name__)
    return x * 0 + (42 if any("EXPECTED" in g for g in got) else 0)
"""


def test_the_program_cannot_read_what_the_tester_prints(bare: SandboxPool) -> None:
    job = Job(PEEK, [], "f", kind="tests", tests=["assert f(1) == 42"], setup=TESTER_PRINTS)
    res = bare.run([job])[0]
    assert res.status == "ok" and res.outputs == [False], res  # the program saw no EXPECTED text
    assert "EXPECTED" not in res.output_tail


SPOOFS = {
    "compile under a stdlib name": "import sys\nexec(compile('import os\\nos.listdir(\"/\")', "
                                   "sys.modules['os'].__file__ or '/usr/lib/python3.11/os.py', 'exec'))\n",
    "compile under a frozen name": "exec(compile('1', '<frozen importlib._bootstrap>', 'exec'))\n",
    "plain exec reaches the hook": "exec('import os\\nos.listdir(\"/\")')\n",
    "code.replace": "import os\nc = (lambda: os.listdir('/')).__code__.replace(co_filename=os.__file__ or 'x')\n",
    "unmarshal code": "import marshal\nmarshal.loads(marshal.dumps((lambda: 0).__code__))\n",
    "swap a stdlib function's code": "import functools, os\nfunctools.update_wrapper(os.path.realpath, "
                                     "lambda p: '/tmp', assigned=('__code__',))\n",
    "dir_fd walk from generated code": "exec('import os\\nfd = os.open(\"/tmp\", os.O_RDONLY)\\n"
                                       "os.open(\"x\", os.O_WRONLY, dir_fd=fd)')\n",
    "a PathLike that lies": "class P:\n    def __fspath__(self):\n        return '/tmp/ok'\n"
                            "open(P(), 'w')\n",
}


@pytest.mark.parametrize("name", sorted(SPOOFS))
def test_the_hook_holds_whatever_name_code_is_compiled_under(hooked: SandboxPool, name: str) -> None:
    res = hooked.run([Job(SPOOFS[name] + "def f(x):\n    return x\n", [[1]], kind="module")])[0]
    assert res.status == "blocked", (name, res)


def test_no_original_builtin_factory_is_reachable_from_the_guard(hooked: SandboxPool) -> None:
    probe = ("import _imp\nfrom importlib.machinery import BuiltinImporter\n"
             "def f(_):\n    g = _imp.create_builtin\n    held = [c.cell_contents for c in (g.__closure__ or ())]\n"
             "    held += list(g.__defaults__ or ())\n    funcs = [h for h in held if callable(h)]\n"
             "    made = [k for h in held if isinstance(h, dict) for k in h]\n"
             "    try:\n        g(BuiltinImporter.find_spec('gc'))\n        gc = 'made'\n"
             "    except ImportError:\n        gc = 'refused'\n"
             "    return [len(funcs), 'gc' in made or 'fcntl' in made or '_socket' in made, gc]\n")
    assert _one(hooked, probe) == [0, False, "refused"]


def test_honest_imports_that_fall_back_and_lazy_stdlib_imports_score(hooked: SandboxPool) -> None:
    src = ("try:\n    import numpy as np\nexcept ImportError:\n    np = None\n"
           "import datetime, time, codecs, base64, zlib, csv, difflib, pickle, queue, unittest, io\n"
           "def f(x):\n    d = datetime.datetime.strptime('2024-03-05', '%Y-%m-%d').day + time.strptime('7', '%H').tm_hour\n"
           "    s = codecs.encode('abc', 'rot13') + 'é'.encode('utf-16-le').decode('utf-16-le') + 'é'.encode('cp1252').decode('cp1252')\n"
           "    t = base64.b64encode(zlib.compress(pickle.dumps([x]))).decode()\n"
           "    rows = list(csv.reader(io.StringIO('a,b')))\n"
           "    return [np is None, d, s, len(t) > 0, rows, difflib.SequenceMatcher(None, 'ab', 'ac').ratio()]\n")
    assert _one(hooked, src) == [True, 12, "nopéé", True, [["a", "b"]], 0.5]


def test_the_trainer_keeps_a_verdict_per_completion_not_its_report() -> None:
    """Trainer memory: each report becomes its Score as it arrives (pool.submit's ``reduce``), so a
    batch never holds its parsed reports at once, and after the call only Scores remain, their
    reasons cut. 24 completions each report a 100,000-item list (~3.6 MB parsed): held together
    that is ~86 MB; the bound asserted is two workers' worth of reports at a time."""
    import tracemalloc

    from miles_core.data.code import encode_answer
    from miles_core.rewards.code import score_completions

    big = "def f(x):\n    return list(range(100_000 + x))\n"
    answers = [encode_answer([[[k], 0]]) for k in range(24)]
    with SandboxPool(2, LIMITS, isolation="bwrap_shared", cache_size=0) as pool:
        score_completions([big], [answers[0]], pool=pool)  # warm the worker and the parser
        tracemalloc.start()
        try:
            scores = score_completions([big + f"#{k}" for k in range(24)], answers, pool=pool)
            retained, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert all(s.score == 0.0 and len(s.reason) < 400 for s in scores), scores[0]
    assert peak < 30 << 20 and retained < 1 << 20, (peak >> 20, retained >> 10)


def test_a_runs_error_text_is_cut_before_it_reaches_the_trainer() -> None:
    from miles_core.data.code import encode_answer
    from miles_core.rewards.code import score_completions

    src = "def f(x):\n    raise ValueError('x' * 900_000)\n"
    with SandboxPool(1, LIMITS, isolation="bwrap_shared", cache_size=0) as pool:
        res = pool.run([Job(src, [[1]], kind="module")])[0]
        score = score_completions([src], [encode_answer([[[1], 2]])], pool=pool)[0]
    assert res.status == "ok" and len(res.errors[0]) <= 200 and len(score.reason) < 400, (res.errors, score)


def test_the_kernel_filter_denies_by_default(bare: SandboxPool) -> None:
    """Stage one is an allow-list (isolation.STAGE_ONE_ALLOW): a call nobody listed, here eventfd2
    and sched_rr_get_interval, fails with ENOSYS, while the named refusals keep EPERM."""
    probe = ("import errno, os\ndef f(_):\n    out = []\n"
             "    for call in (lambda: os.eventfd(0), lambda: os.sched_rr_get_interval(0), lambda: os.setpriority(0, 0, 5)):\n"
             "        try:\n            call()\n            out.append('ALLOWED')\n"
             "        except OSError as e:\n            out.append(errno.errorcode[e.errno])\n    return out\n")
    assert _one(bare, probe) == ["ENOSYS", "ENOSYS", "EPERM"]
