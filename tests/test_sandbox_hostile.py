"""What a completion must not get out of the code reward, beyond the kernel boundary itself
(infra/sandbox.md lists the invariants): it never sees the tests it is scored on or an earlier
job's data, cannot poison or slow its worker for later runs, cannot crash or jam the reward with
a forged report, cannot signal anyone through fcntl/ioctl, gets only sized and wiped writable
space, and costs the trainer linear time. Each attack runs with the audit hook off (the kernel and
the harness's structure must hold on their own), in ``bwrap`` and ``bwrap_shared``, and is followed
by honest completions that must still score right. CI runs this file as root and as an ordinary
user (.ci/sandbox-unprivileged), with the standard library, fsspec and pytest only."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from miles_core.data.code import encode_answer
from miles_core.data import codesets
from miles_core.data.codesets import program
from miles_core.rewards.code import MAX_COMPLETION_CHARS, score_completions
from miles_core.rewards.jobs import ExecResult, Job, SandboxLimits
from miles_core.rewards.pool import SandboxPool
from miles_core.rewards.reports import json_depth

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=1, memory_mb=256, tmpfs_mb=8)
SECRET = 918273645
NEEDLE = "qz" + "MARK"  # what the tests carry beside the expected value; never spelled whole in a completion
FIND = "def f(x):\n    return search('qz' + 'MARK')\n"
CHECK = f"def check(candidate):\n    assert candidate(1) == {SECRET}  # {NEEDLE}\ncheck(f)\n"

# Finds any string or bytes in its own interpreter that holds `needle` (frames and their globals,
# every object the collector tracks, every module) and returns the first number after "== ".
SEARCH = '''
import gc, sys
def _texts(roots, needle):
    seen, stack = set(), list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (str, bytes)):
            s = o.decode("latin-1") if isinstance(o, bytes) else o
            if needle in s and len(s) > len(needle) + 4:
                yield s
        elif isinstance(o, dict):
            stack.extend(o.keys()); stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif type(o).__name__ in ("frame", "module", "function", "code", "cell"):
            stack.extend(gc.get_referents(o))
def search(needle):
    roots = list(gc.get_objects()) + list(sys.modules.values())
    f = sys._getframe()
    while f is not None:
        roots += [f.f_locals, f.f_globals]
        f = f.f_back
    for s in _texts(roots, needle):
        m = __import__("re").search(r"== (-?[0-9]+)", s)
        return int(m.group(1)) if m else s[:80]
    return -1
'''


@pytest.fixture(scope="module", params=("bwrap", "bwrap_shared"))
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(1, LIMITS, audit_hook=False, isolation=request.param, cache_size=0) as p:
        yield p


def _tests_job(source: str, check: str = CHECK) -> Job:
    return Job(source, [], "f", kind="tests", tests=[check], setup="")


def _answer(pairs: list[tuple[object, object]]) -> str:
    return encode_answer([[[a], b] for a, b in pairs])


def _honest_still_scores(pool: SandboxPool) -> None:
    got = score_completions(["x * 2", "def f(x):\n    return x * 2\n"], [_answer([(3, 6), (4, 8)])] * 2, pool=pool)
    assert [(s.score, s.status) for s in got] == [(1.0, "ok"), (1.0, "ok")]
    tests = codesets.tests_answer("f", ["assert f(2) == 4"])
    assert score_completions(["def f(x):\n    return x * 2\n"], [tests], pool=pool)[0].score == 1.0


# ---- 1, 2: nothing the completion should not know is in its address space ----------------------


def test_the_search_finds_what_is_in_its_address_space(pool: SandboxPool) -> None:
    """The control: the program's own inputs are its to see, and the search finds them."""
    res = pool.run([Job(SEARCH + FIND, [[f"x == 77 {NEEDLE}"]])])[0]
    assert res.outputs == [77], res


def test_a_program_never_finds_its_tests(pool: SandboxPool) -> None:
    """HumanEval's check() holds the expected value; the program searches its frames, gc and modules."""
    found = SEARCH + FIND
    res = pool.run([_tests_job(found)])[0]
    assert (res.status, res.outputs) == ("ok", [False]), res
    tests = codesets.tests_answer("f", [CHECK.replace("check(f)\n", "check(f)")])
    assert score_completions([found], [tests], pool=pool)[0].score == 0.0


def test_a_run_never_finds_an_earlier_jobs_data(pool: SandboxPool) -> None:
    """bwrap_shared: one worker served the earlier jobs; their tests and outputs are nowhere."""
    pool.run([_tests_job(f"def f(x):\n    return {SECRET}\n")])          # a sibling that passes
    pool.run([Job(f"def f(x):\n    return 'out == 4242 ' + {NEEDLE!r}\n", [[1]])])  # an output to copy
    res = pool.run([Job(SEARCH + FIND, [[1]])])[0]
    assert res.outputs == [-1], res


def _children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Does any readable mapping of ``pid`` contain ``needle``? (/proc/PID/mem, read from outside)"""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            addr, perms = line.split()[:2]
            if perms[0] != "r" or line.rstrip().endswith(("[vvar]", "[vsyscall]")):
                continue
            lo, hi = (int(a, 16) for a in addr.split("-"))
            try:
                mem.seek(lo)
                if needle in mem.read(hi - lo):
                    return True
            except (OSError, OverflowError, ValueError):
                continue
    return False


def test_the_programs_memory_holds_no_expected_value() -> None:
    """Read from the host while the program runs: its memory holds no byte of the tests (the
    tester's does: the control), because it was forked from a zygote that never held a job."""
    with SandboxPool(1, LIMITS, audit_hook=False, isolation="bwrap_shared", cache_size=0) as pool:
        fut = pool.submit([_tests_job("import time\ndef f(x):\n    time.sleep(1.5)\n    return 0\n")])
        time.sleep(0.7)
        worker = pool.worker_pids()[0]
        tree = {worker}
        for _ in range(4):
            tree |= {c for p in tree for c in _children(p)}
        by_depth = {}
        for pid in tree:
            parents = [pid]
            while parents[-1] != worker:
                parents.append(int(open(f"/proc/{parents[-1]}/stat").read().rsplit(")", 1)[1].split()[1]))
            by_depth.setdefault(len(parents), []).append(pid)
        runs = by_depth[max(by_depth)]  # bwrap > init > dispatcher > zygote > program, tester
        try:
            held = {pid: _memory_holds(pid, str(SECRET).encode()) for pid in runs}
        except PermissionError:
            pytest.skip("this user may not read the sandbox's memory (/proc/PID/mem); the root lane checks it")
        assert fut.result(timeout=30)[0].status == "ok"
    assert len(runs) == 2 and sorted(held.values()) == [False, True], held


# ---- 3, 4, 7: no run can change its worker or signal anyone -----------------------------------


REACH = """
import os, resource, fcntl, struct
def f(x):
    errors = []
    def attempt(name, fn, *args):
        try:
            fn(*args)
            errors.append(name + " ALLOWED")
        except OSError as e:
            errors.append(type(e).__name__)
    for pid in range(1, 8):
        if pid == os.getpid():
            continue
        attempt("prlimit", resource.prlimit, pid, resource.RLIMIT_AS, (1 << 20, 1 << 20))
        attempt("setpriority", os.setpriority, os.PRIO_PROCESS, pid, 19)
        attempt("sched", os.sched_setscheduler, pid, os.SCHED_IDLE, os.sched_param(0))
        attempt("F_SETOWN", fcntl.fcntl, 3, fcntl.F_SETOWN, pid)
        attempt("FIOSETOWN", fcntl.ioctl, 3, 0x8901, struct.pack("i", pid))
    attempt("PRIO_USER", os.setpriority, os.PRIO_USER, 0, 19)
    attempt("PRIO_PGRP", os.setpriority, os.PRIO_PGRP, 0, 19)
    attempt("F_SETSIG", fcntl.fcntl, 3, 10, 19)
    attempt("own sched", os.sched_setscheduler, 0, os.SCHED_IDLE, os.sched_param(0))
    return sorted(set(errors))
"""
STATE = ("import os, resource\ndef f(x):\n    return [os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0),"
         " list(resource.getrlimit(resource.RLIMIT_AS))]\n")


def test_a_run_cannot_reach_its_worker_or_anyone(pool: SandboxPool) -> None:
    before = pool.run([Job(STATE, [[0]])])[0].outputs
    res = pool.run([Job(REACH, [[0]])])[0]
    assert res.outputs == [["PermissionError"]], res       # every attempt refused by seccomp (EPERM)
    assert pool.run([Job(STATE + "#again", [[0]])])[0].outputs == before  # nice 0, SCHED_OTHER, own limits
    _honest_still_scores(pool)


def test_a_run_that_lowers_its_own_limits_affects_only_itself(pool: SandboxPool) -> None:
    lower = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (1 << 20, 1 << 20))\ndef f(x):\n    return x\n"
    pool.run([Job(lower, [[1]])])
    _honest_still_scores(pool)


def test_a_setup_failure_is_named_never_cached_and_replaces_the_worker() -> None:
    ans = [_answer([(3, 6)])]
    for mode in ("bwrap", "bwrap_shared"):
        with SandboxPool(1, LIMITS, isolation=mode) as pool:
            good = pool._opts
            pool._opts = {**good, "limits": {**good["limits"], "cpu_s": "not a number"}}  # setrlimit raises
            for i, w in enumerate(pool._workers):  # the next job starts a worker with these options
                if w is not None:
                    w.kill()
                    pool._workers[i] = None
            res = pool.run([Job("x * 2", [[3]])])[0]
            assert res.status == "setup_failed" and "replaced" in res.reason, res
            assert score_completions(["x * 2"], ans, pool=pool)[0].status == "setup_failed"
            assert not pool._cache  # never cached: the same job runs again once the worker is sound
            pool._opts = good
            assert score_completions(["x * 2"], ans, pool=pool)[0].score == 1.0


# ---- 5, 6: a forged report costs a score, never the reward call, a worker or a descriptor ------


def _forged(depth: int) -> str:
    body = "'{\"status\":\"ok\",\"reason\":\"x\",\"outputs\":[' + '[' * D + ']' * D + '],\"errors\":[null]}'"
    return (f"import os, struct\nD = {depth}\nb = ({body}).encode()\nos.write(3, struct.pack('>I', len(b)) + b)\n"
            "os._exit(0)\ndef f(x):\n    return x\n")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_forged_deep_reports_score_zero_and_leak_nothing(pool: SandboxPool) -> None:
    ans = _answer([(1, 1)])
    score_completions(["x"], [ans], pool=pool)  # warm: the pool's own descriptors exist
    fds, workers = _open_fds(), pool.worker_pids()
    for depth in (990, 5000, 100_000):
        got = score_completions([_forged(depth) + f"#{k}" for k in range(8)], [ans] * 8, pool=pool)
        assert all(s.score == 0.0 and s.status == "bad_result" for s in got), got
    assert _open_fds() == fds and pool.worker_pids() == workers  # no descriptor or worker lost
    _honest_still_scores(pool)


def test_report_depth_is_measured_outside_strings() -> None:
    assert json_depth(b'{"a":[1,[2]]}') == 3
    assert json_depth(b'["[[[[", "\\\\", "\\"[[[["]') == 1
    assert json_depth(b"[" * 5000) == 5000


# ---- 8: writable space is sized, read-only elsewhere, and wiped -------------------------------


FILL = """
import os
def f(x):
    got = []
    for path in ("/tmp/big", "./big"):
        try:
            with open(path, "wb") as fh:
                for _ in range(64):
                    fh.write(b"x" * (1 << 18))
            got.append("wrote")
        except OSError as e:
            got.append(type(e).__name__)
    for i in range(40):
        try:
            with open(f"/tmp/f{i}", "wb") as fh:
                fh.write(b"x" * (1 << 19))
        except OSError as e:
            got.append(type(e).__name__)
            break
    return got
"""


def test_a_run_creates_no_file_and_the_tmpfs_is_wiped(pool: SandboxPool) -> None:
    """Stage two refuses O_CREAT (a new inode would move the tmpfs's counter for a later job); a
    run's only writes are its report and its stdout, which RLIMIT_FSIZE caps."""
    res = pool.run([Job(FILL, [[0]])])[0]
    assert res.status == "ok" and res.outputs[0] == ["PermissionError"] * 3, res
    seen = pool.run([Job("import os\ndef f(x):\n    return sorted(os.listdir('/tmp'))\n", [[0]])])[0]
    assert len(seen.outputs[0]) <= 2 and all(n.startswith(("run", ".output")) for n in seen.outputs[0]), seen


# ---- 9: the trainer's own parsing is linear -----------------------------------------------------


def test_trainer_side_parsing_is_linear_in_the_completion() -> None:
    """Worst cases of the old patterns, at 10x the length cap (quadratic, they took about 45 s
    each; linear, milliseconds): each must finish long before the alarm."""
    spec = {"entry": "f", "prefix": "def f(x):\n"}
    n = 10 * MAX_COMPLETION_CHARS
    cases = ["```" + " " * n, "```python" + " \t" * (n // 2), "[BEGIN]" + (" " * 100 + "x") * (n // 101),
             "\n" * n + "x", "def f" + " " * n, "```\n" + "`" * n]
    old = signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(10)
    try:
        for text in cases:
            program(spec, text)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert program(spec, "```python\ndef f(x):\n    return 1\n```") == "def f(x):\n\ndef f(x):\n    return 1\n"
    assert program(spec, "[BEGIN]  def f(x): return 2  [DONE]") == "def f(x):\n\ndef f(x): return 2"


def test_the_length_cap_applies_to_the_raw_text() -> None:
    got = score_completions([" " * MAX_COMPLETION_CHARS + "x"], [_answer([(1, 1)])])[0]
    assert got.status == "too_long"


# ---- 10: the audit hook survives a completion rewriting the harness's globals -------------------


def test_rewriting_harness_globals_does_not_switch_the_hook_off() -> None:
    attack = ("import sys\nf0 = sys._getframe()\nwhile f0 is not None:\n    g = f0.f_globals\n"
              "    for k in ('_DENY_EVENTS', '_DENY_PREFIXES', '_PATH_EVENTS'):\n"
              "        if k in g:\n            g[k] = frozenset() if k != '_DENY_PREFIXES' else ()\n"
              "    if 'SAFE_MODULES' in g:\n        g['SAFE_MODULES'] = frozenset(['socket', 'ctypes'])\n"
              "    f0 = f0.f_back\ndef f(x):\n    sys._current_frames()\n    return 1\n")
    with SandboxPool(1, LIMITS, isolation="bwrap_shared", cache_size=0) as pool:
        res = pool.run([Job(attack, [[0]])])[0]
        assert res.status == "blocked" and "sys._current_frames" in res.reason, res
        assert pool.run([Job("x + 1", [[1]])])[0].outputs == [2]


def test_a_policy_refusal_in_the_program_reaches_the_tester_as_blocked() -> None:
    with SandboxPool(1, LIMITS, isolation="bwrap_shared", cache_size=0) as pool:
        res = pool.run([_tests_job("import sys\nsys._current_frames()\ndef f(x):\n    return 1\n")])[0]
    assert isinstance(res, ExecResult) and res.status == "blocked" and "_current_frames" in res.reason, res
    assert re.search(r"blocked by sandbox policy", res.reason)


# ---- the same, with a Docker-style interpreter (site-packages inside the standard library) --------


@pytest.fixture(scope="module", params=("bwrap", "bwrap_shared"))
def docker_pool(request: pytest.FixtureRequest) -> Iterator[tuple[SandboxPool, str]]:
    """An interpreter laid out as python:3.11-slim's (PREFIX/lib/python3.11/site-packages), made by
    copying the one the sandbox would use; the sandbox must start from it and not hold that folder."""
    import shutil
    import sys
    import sysconfig
    import tempfile

    from miles_core.rewards import isolation as iso_mod

    exe = iso_mod.choose_interpreter(iso_mod.sandbox_uid())
    v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    prefix = tempfile.mkdtemp(prefix="miles-docker-python-", dir="/var/tmp")  # the sandbox mounts its own /tmp
    os.chmod(prefix, 0o755)
    stdlib = sysconfig.get_paths()["stdlib"] if os.path.realpath(sys.executable) == exe else f"/usr/lib/{v}"
    shutil.copytree(stdlib, f"{prefix}/lib/{v}", symlinks=True, ignore=shutil.ignore_patterns("site-packages", "test"))
    os.makedirs(f"{prefix}/bin")
    shutil.copy2(exe, f"{prefix}/bin/{v}")
    site = f"{prefix}/lib/{v}/site-packages"
    os.makedirs(site)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(iso_mod, "_candidates", lambda: [f"{prefix}/bin/{v}"])
        iso_mod.prepare.cache_clear()
        try:
            with SandboxPool(1, LIMITS, audit_hook=False, isolation=request.param, cache_size=0) as p:
                yield p, site
        finally:
            iso_mod.prepare.cache_clear()
            shutil.rmtree(prefix, ignore_errors=True)


MASK = """
import os
def f(site):
    got = []
    for attempt in (lambda: open(site + "/zz_evil.pth", "w").write("import os"),
                    lambda: os.mkdir(site + "/pkg"), lambda: os.chmod(site, 0o777), lambda: os.listdir(site)):
        try:
            attempt()
            got.append("ALLOWED")
        except OSError as e:
            got.append(type(e).__name__)
    return sorted(set(got))
"""


def test_a_docker_style_site_packages_is_not_in_the_sandbox(docker_pool: tuple) -> None:
    """The sandbox holds copies of the standard library (image.py), never the host's folder, so a
    site-packages inside it is simply absent."""
    pool, site = docker_pool
    res = pool.run([Job(MASK, [[site]])])[0]
    assert res.status == "ok" and set(res.outputs[0]) <= {"FileNotFoundError", "OSError", "PermissionError"}, res
    assert os.listdir(site) == []  # nothing reached the host's folder
    test_a_run_creates_no_file_and_the_tmpfs_is_wiped(pool)
    test_a_run_cannot_reach_its_worker_or_anyone(pool)
    test_a_program_never_finds_its_tests(pool)
