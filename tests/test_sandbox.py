"""The execution sandbox: hostile completions score 0, reach nothing outside their run, leave
nothing behind, and the pool keeps scoring. The attacks run with the audit hook OFF, so each
guarantee is shown by the kernel (namespaces, seccomp, rlimits), the layer that must provide it;
a hooked pool then checks the readable reasons. CI runs this file as root and as an ordinary user
(.ci/run), with the standard library, fsspec and pytest only."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.data.code import encode_answer
from miles_core.rewards import get_reward
from miles_core.rewards import isolation as iso_mod
from miles_core.rewards.code import code_tests_reward, score_completions
from miles_core.rewards.jobs import ExecResult, Job, SandboxLimits
from miles_core.rewards.pool import SandboxPool
from miles_core.rewards.isolation import IsolationUnavailable

SECRET = 73914263  # the hidden expected output: only a leak (or a lucky guess) could score
ENV_SECRET = "4242"
LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=1, memory_mb=256, tmpfs_mb=16)
KERNEL_MODES = ("bwrap", "bwrap_shared")
AS_NOBODY = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """What hostile code goes after: a world-writable folder with a world-readable secret, a
    victim process of the sandbox user's own uid, TCP / unix / abstract listeners, a site folder."""
    root = tmp_path_factory.mktemp("world")
    os.chmod(root, 0o755)
    victim = root / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    (victim / "secret.txt").write_text(str(SECRET))
    os.chmod(victim, 0o777)
    for f in ("keep.txt", "secret.txt"):
        os.chmod(victim / f, 0o666)
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True, **AS_NOBODY)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    unix = socket.socket(socket.AF_UNIX)
    unix_path = str(victim / "sock")
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix.listen(8)
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"miles-test-{os.getpid()}"
    abstract.bind("\0" + abstract_name)
    abstract.listen(8)
    for s in (tcp, unix, abstract):
        s.setblocking(False)
    os.environ["MILES_SANDBOX_TEST_SECRET"] = ENV_SECRET  # must never reach a completion
    yield {"victim": victim, "pid": proc.pid, "port": tcp.getsockname()[1], "unix": unix_path,
           "abstract": abstract_name, "listeners": (tcp, unix, abstract), "proc": proc,
           "site": sysconfig.get_paths()["purelib"], "root": root}
    os.environ.pop("MILES_SANDBOX_TEST_SECRET", None)
    proc.kill()
    for s in (tcp, unix, abstract):
        s.close()


# name -> module source defining f(x); each returns SECRET only if its attack succeeded.
HOSTILE = {
    "open a world-readable file": "def f(x):\n    return int(open({secret!r}).read())\n",
    "os.open with dir_fd up to /": (
        "import os\ndef f(x):\n    d = os.open('.', os.O_PATH)\n    os.makedirs('a/b/c/d', exist_ok=True)\n"
        "    os.chdir('a/b/c/d')\n    r = os.open('../../../../../../../../..', os.O_PATH, dir_fd=d)\n"
        "    fd = os.open({secret_rel!r}, os.O_RDONLY, dir_fd=r)\n    return int(os.read(fd, 100))\n"),
    "O_PATH on the folder then openat": (
        "import os\ndef f(x):\n    d = os.open({victim!r}, os.O_PATH | os.O_DIRECTORY)\n"
        "    return int(os.read(os.open('secret.txt', os.O_RDONLY, dir_fd=d), 100))\n"),
    "openat2 through ctypes": (
        "def f(x):\n    import ctypes\n    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    how = (ctypes.c_uint64 * 3)(0, 0, 0)\n    fd = libc.syscall(437, -100, {secret!r}.encode(), how, 24)\n"
        "    return int(__import__('os').read(fd, 100))\n"),
    "io.open with an opener": (
        "import io, os\ndef f(x):\n    return int(io.open({secret!r}, opener=lambda p, fl: os.open(p, fl)).read())\n"),
    "symlink to a host file": (
        "import os\ndef f(x):\n    os.symlink({keep!r}, 'l')\n    open('l', 'w').write('pwned')\n"
        "    return int(open(os.path.join(os.path.dirname({keep!r}), 'secret.txt')).read())\n"),
    "hard link to a host file": (
        "import os\ndef f(x):\n    os.link({keep!r}, 'h')\n    open('h', 'w').write('pwned')\n    return 0\n"),
    "/proc/self/root": "def f(x):\n    return int(open('/proc/self/root' + {secret!r}).read())\n",
    "/proc/PID/cwd of the victim": (
        "import os\ndef f(x):\n    return int(open('/proc/{pid}/cwd/../../' + {secret_rel!r}).read())\n"),
    "list /proc": "import os\ndef f(x):\n    return {SECRET} if len(os.listdir('/proc')) > 2 else 0\n",
    "write into the host folder": "def f(x):\n    open({victim!r} + '/pwned', 'w').write('x')\n    return 0\n",
    "delete a host file": "import os\ndef f(x):\n    os.remove({keep!r})\n    return 0\n",
    "write host /tmp": "def f(x):\n    open('/tmp/../tmp/' + {marker!r}, 'w').write('x')\n    return 0\n",
    "plant a .pth in site-packages": "def f(x):\n    open({site!r} + '/zz_miles_evil.pth', 'w').write('import os')\n    return 0\n",
    "plant sitecustomize and usercustomize": (
        "def f(x):\n    for n in ('sitecustomize.py', 'usercustomize.py'):\n"
        "        open({victim!r} + '/' + n, 'w').write('import os')\n    return 0\n"),
    "PYTHONSTARTUP for the next interpreter": (
        "import os\ndef f(x):\n    os.environ['PYTHONSTARTUP'] = {victim!r} + '/s.py'\n"
        "    open({victim!r} + '/s.py', 'w').write('x')\n    return 0\n"),
    "kill the victim": "import os\ndef f(x):\n    os.kill({pid}, 9)\n    return {SECRET}\n",
    "killpg the victim": "import os\ndef f(x):\n    os.killpg({pid}, 9)\n    return {SECRET}\n",
    "kill every pid": (
        "import os\ndef f(x):\n    n = 0\n    for p in range(1, 4096):\n        try:\n            os.kill(p, 9)\n"
        "            n += 1\n        except OSError:\n            pass\n    return {SECRET} if n else 0\n"),
    "pidfd_send_signal": (
        "import os, signal\ndef f(x):\n    signal.pidfd_send_signal(os.pidfd_open({pid}), 9)\n    return {SECRET}\n"),
    "pthread_kill": "import signal\ndef f(x):\n    signal.pthread_kill({pid}, 9)\n    return {SECRET}\n",
    "sigqueue through ctypes": (
        "def f(x):\n    import ctypes\n    r = ctypes.CDLL(None).sigqueue({pid}, 9, 0)\n"
        "    return {SECRET} if r == 0 else 0\n"),
    "ptrace attach through ctypes": (
        "def f(x):\n    import ctypes\n    r = ctypes.CDLL(None).ptrace(16, {pid}, 0, 0)\n"
        "    return {SECRET} if r == 0 else 0\n"),
    "kill the parent": "import os\ndef f(x):\n    os.kill(os.getppid(), 9)\n    return {SECRET}\n",
    "TCP to loopback": (
        "import _socket as socket\ndef f(x):\n    s = socket.socket()\n    s.connect(('127.0.0.1', {port}))\n    s.send(b'x')\n"
        "    return {SECRET}\n"),
    "AF_UNIX to a host socket": (
        "import _socket as socket\ndef f(x):\n    s = socket.socket(socket.AF_UNIX)\n    s.connect({unix!r})\n    return {SECRET}\n"),
    "abstract AF_UNIX": (
        "import _socket as socket\ndef f(x):\n    s = socket.socket(socket.AF_UNIX)\n    s.connect('\\0' + {abstract!r})\n"
        "    return {SECRET}\n"),
    "netlink, packet and inet6 sockets": (
        "import _socket as socket\ndef f(x):\n    n = 0\n    for fam, t in ((16, 3), (17, 3), (10, 1), (2, 2)):\n"
        "        try:\n            socket.socket(fam, t)\n            n += 1\n        except OSError:\n            pass\n"
        "    return {SECRET} if n else 0\n"),
    "socketpair": "import _socket as socket\ndef f(x):\n    socket.socketpair()\n    return {SECRET}\n",
    "fork bomb": "import os\ndef f(x):\n    while True:\n        os.fork()\n",
    "thread bomb": (
        "import _thread, time\ndef f(x):\n    for _ in range(10000):\n        _thread.start_new_thread(time.sleep, (60,))\n"
        "    return {SECRET}\n"),
    "posix_spawn": "import os\ndef f(x):\n    os.posix_spawn('/bin/sh', ['sh'], {{}})\n    return {SECRET}\n",
    "subprocess": "import subprocess\ndef f(x):\n    subprocess.run(['true'])\n    return {SECRET}\n",
    "memfd + exec": (
        "import os\ndef f(x):\n    fd = os.memfd_create('x')\n    os.write(fd, open('/proc/self/exe', 'rb').read())\n"
        "    os.execv('/proc/self/fd/%d' % fd, ['x'])\n"),
    "exec the interpreter": "import os, sys\ndef f(x):\n    os.execv(sys.executable, [sys.executable, '-c', 'pass'])\n",
    "mmap memory bomb": (
        "import mmap\ndef f(x):\n    m = mmap.mmap(-1, 8 << 30)\n    m[::4096] = b'x' * len(m[::4096])\n"
        "    return {SECRET}\n"),
    "disk fill": (
        "def f(x):\n    n = 0\n    for i in range(100000):\n        with open('fill%d' % i, 'wb') as fh:\n"
        "            fh.write(b'x' * (1 << 20))\n        n += 1\n    return {SECRET}\n"),
    "stdout flood": "def f(x):\n    while True:\n        print('x' * 1000000)\n",
    "stderr flood": "import sys\ndef f(x):\n    while True:\n        sys.stderr.write('x' * 1000000)\n",
    "forge a result on fd 3": (
        "import os, struct\ndef f(x):\n    b = b'{{\"status\":\"ok\",\"reason\":\"finished\",\"outputs\":[12345],\"errors\":[null]}}'\n"
        "    os.write(3, struct.pack('>I', len(b)) + b)\n    os._exit(0)\n"),
    "patch the harness's report": (
        "import sys\ndef f(x):\n    m = sys.modules['__main__']\n    m._tag = lambda v, *a, **k: 12345\n"
        "    return 1\n"),
    "raise its own rlimits": (
        "import resource\ndef f(x):\n    for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NPROC):\n"
        "        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "    return {SECRET} + len(bytearray(1 << 30)) * 0\n"),
    "look for the expected output": (
        "import os\ndef f(x):\n    for d in ('/tmp', '.', '/'):\n        for n in os.listdir(d):\n"
        "            p = os.path.join(d, n)\n            if os.path.isfile(p) and str({SECRET}) in open(p, errors='ignore').read():\n"
        "                return {SECRET}\n    return 0\n"),
    "read the environment": "import os\ndef f(x):\n    return int(os.environ.get('MILES_SANDBOX_TEST_SECRET', '0')) * 0 + len(os.environ)\n",
    "devices beyond /dev/null": (
        "import os\ndef f(x):\n    return {SECRET} if set(os.listdir('/dev')) - {{'null'}} else 0\n"),
    "the host's root folder": (
        "import os\ndef f(x):\n    return {SECRET} if {{'home', 'root', 'etc', 'work'}} & set(os.listdir('/')) else 0\n"),
}


def _sources(world: dict) -> dict[str, str]:
    v = world["victim"]
    fields = {"secret": str(v / "secret.txt"), "secret_rel": str(v / "secret.txt").lstrip("/"), "victim": str(v),
              "keep": str(v / "keep.txt"), "pid": world["pid"], "port": world["port"], "unix": world["unix"],
              "abstract": world["abstract"], "site": world["site"], "marker": f"miles-hostile-{os.getpid()}",
              "SECRET": SECRET}
    return {name: src.format(**fields) for name, src in HOSTILE.items()}


def _answer(pairs: list[tuple[int, object]]) -> str:
    return encode_answer([[[x], y] for x, y in pairs])


def _no_connection(world: dict) -> bool:
    for s in world["listeners"]:
        try:
            conn, _ = s.accept()
        except (BlockingIOError, TimeoutError):
            continue
        conn.close()
        return False
    return True


@pytest.fixture(scope="module", params=KERNEL_MODES)
def attacked(request: pytest.FixtureRequest, world: dict) -> Iterator[dict]:
    """Every hostile completion, once, through a pool with the audit hook off; then the checks."""
    mode = request.param
    before = set(_sandbox_processes())  # other pools of this test session (e.g. the shared reward pool)
    with SandboxPool(2, LIMITS, audit_hook=False, isolation=mode, cache_size=0) as pool:
        names, sources = zip(*_sources(world).items())
        scores = score_completions(list(sources), [_answer([(1, SECRET)])] * len(sources), pool=pool)
        after = score_completions(["x + 1"] * 3, [_answer([(1, 2)])] * 3, pool=pool)
        status = pool.status()
    left = sorted(set(_sandbox_processes()) - before)
    for _ in range(50):  # the kernel tears a killed sandbox's PID namespace down asynchronously
        if not left:
            break
        time.sleep(0.1)
        left = sorted(set(_sandbox_processes()) - before)
    yield {"mode": mode, "scores": dict(zip(names, scores)), "after": after, "status": status, "left_running": left}


def _is_sandbox(cmd: str) -> bool:
    return "_miles_sandbox" in cmd or cmd.startswith(("bwrap ", "/usr/bin/bwrap "))


def _ours(pid: str) -> bool:
    """Started by this process, or orphaned (only sandbox processes between it and init): not a
    sandbox of another test process running beside this one (pytest-xdist)."""
    while pid not in (str(os.getpid()), "1", "0"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return True  # gone while we looked: count it, the caller's wait decides
        if not _is_sandbox(cmd):
            return False
        pid = stat.rsplit(")", 1)[1].split()[1]
    return True


def _sandbox_processes() -> list[str]:
    """pid and command line of live sandbox processes (bwrap, or its worker) of this test process."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if _is_sandbox(cmd) and _ours(pid):
            found.append(f"{pid} {cmd[:120]}")
    return found


def test_hostile_list_is_long_enough() -> None:
    assert len(HOSTILE) >= 45


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_completion_scores_zero(attacked: dict, name: str) -> None:
    s = attacked["scores"][name]
    assert s is not None and s.score == 0.0, (attacked["mode"], name, s)
    assert s.reason


def test_nothing_escaped_the_hostile_batch(attacked: dict, world: dict) -> None:
    v = world["victim"]
    assert [s.score for s in attacked["after"]] == [1.0] * 3  # the pool is alive and scores correctly
    assert sorted(p.name for p in v.iterdir()) == ["keep.txt", "secret.txt", "sock"]  # nothing written
    assert (v / "keep.txt").read_text() == "precious"
    assert not Path("/tmp", f"miles-hostile-{os.getpid()}").exists()
    assert not Path(world["site"], "zz_miles_evil.pth").exists()
    assert world["proc"].poll() is None  # no host process was signalled
    assert _no_connection(world)          # no TCP, unix or abstract connection was made
    assert all(st == {"leftover_files": [], "live_children": False} for st in attacked["status"])
    assert attacked["left_running"] == []  # nothing outlives its run (or its pool)


def test_specific_kernel_refusals(attacked: dict) -> None:
    sc = attacked["scores"]
    assert sc["fork bomb"].reason == "passed 0/1 tests; first failure f(1,) raised PermissionError, expected 73914263"
    assert "raised PermissionError" in sc["kill the victim"].reason           # seccomp, whatever the uid
    assert "raised PermissionError" in sc["TCP to loopback"].reason           # seccomp: no socket at all
    assert "FileNotFoundError" in sc["open a world-readable file"].reason     # not in the mount namespace
    # endless output is drained and cut (never fatal, never to a file): the run ends at its time limit
    assert {sc["stdout flood"].status, sc["stderr flood"].status} <= {"timeout", "cpu_limit"}
    assert sc["forge a result on fd 3"].reason.endswith("returned 12345, expected 73914263")
    assert sc["read the environment"].reason.endswith("returned 0, expected 73914263")  # empty environment
    assert sc["mmap memory bomb"].status in ("ok", "memory_limit")


def test_each_run_is_alone_in_its_namespaces() -> None:
    probe = ("import os\ndef f(x):\n    return [os.getpid(), os.getppid(), os.getuid(), sorted(os.listdir('/')),"
             " os.getcwd()]\n")
    with SandboxPool(1, LIMITS, audit_hook=False, isolation="bwrap", cache_size=0) as pool:
        a, b = pool.run([Job(probe, [[0]]), Job(probe + "#2", [[0]])])
    # a fresh PID namespace each time: bwrap's init 1, the dispatcher 2, the zygote 3, the run 4
    assert a.outputs[0][:3] == [4, 3, 65534] == b.outputs[0][:3]
    image = {inside.split("/")[1] for inside, _, _ in pool.isolation.interpreter.image.files}
    assert a.outputs[0][3] == sorted(image | {"dev", "tmp"}), a.outputs[0][3]  # the copies, /dev/null, /tmp
    assert a.outputs[0][4].startswith("/tmp/run")


def test_layers_are_reported() -> None:
    with SandboxPool(1, LIMITS, isolation="bwrap_shared", cache_size=0) as pool:
        assert pool.layers["kernel_isolation"] and pool.layers["seccomp"] and pool.layers["pid_namespace"]
        assert not pool.layers["namespaces_per_run"]
        assert pool.layers["uid_drop"] == (os.geteuid() == 0)


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    """The hooked default pool: readable reasons on top of the kernel boundary."""
    with SandboxPool(2, LIMITS, cache_size=0) as p:
        yield p


@pytest.mark.parametrize("bad", [{"timeout_s": 0}, {"cpu_s": 0.5}, {"memory_mb": 8}, {"open_files": True}])
def test_bad_limits_name_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=f"SandboxLimits.{next(iter(bad))}"):
        SandboxLimits(**bad)


def test_bad_jobs_are_rejected_before_running(pool: SandboxPool) -> None:
    with pytest.raises(ValueError, match=r"jobs\[1\].kind"):
        pool.submit([Job("x", [[1]]), Job("x", [[1]], kind="shell")])
    with pytest.raises(ValueError, match=r"jobs\[0\].inputs"):
        pool.submit([Job("x", [[object()]])])


def test_scores_are_fractions_of_tests_passed(pool: SandboxPool) -> None:
    ans = _answer([(0, 1), (1, 3), (2, 5), (5, 12)])
    comps = ["2*x+1", "x+x+1", "def f(x):\n    return 2 * x + 1\n", "x*2", "x*2+1 if x < 2 else 1//(x-x)", "x*", "", "True"]
    got = score_completions(comps, [ans] * len(comps), pool=pool)
    assert [s.score for s in got] == [0.75, 0.75, 0.75, 0.0, 0.5, 0.0, 0.0, 0.0]
    assert "first failure f(5,) returned 11, expected 12" in got[0].reason
    assert got[4].reason.startswith("passed 2/4") and "ZeroDivisionError" in got[4].reason
    assert got[5].status == "syntax_error" and got[6].reason == "empty completion"
    ok = score_completions(["2*x+1"], [_answer([(0, 1), (4, 9), (-3, -5)])], pool=pool)[0]
    assert (ok.score, ok.reason) == (1.0, "passed 3/3 tests")


def test_true_is_not_one_and_objects_cannot_fake_equality(pool: SandboxPool) -> None:
    ans = _answer([(0, 1), (1, 1)])
    liar = "type('A', (), {'__eq__': lambda s, o: True, '__hash__': lambda s: 0})()"
    got = score_completions(["x == x", liar, "1"], [ans] * 3, pool=pool)
    assert [s.score for s in got] == [0.0, 0.0, 1.0]


def test_allowed_modules_import_lazily(pool: SandboxPool) -> None:
    src = ("import statistics, fractions, dataclasses, random, re, json, decimal, datetime\n"
           "def f(x):\n    return int(statistics.mean([x, 3 * x])) + len(json.dumps([re.sub('a', 'b', 'a')]))\n")
    assert score_completions([src], [_answer([(2, 4 + 5)])], pool=pool)[0].score == 1.0


HOOKED = {  # the audit hook's readable reasons (the kernel would also stop each of these)
    "infinite loop": ("[x for _ in iter(int, 1)]", ("timeout", "cpu_limit", "memory_limit")),
    "sleep forever": ("__import__('time').sleep(3600)", ("timeout",)),
    "memory bomb": ("len(bytearray(8 * 2**30))", ("memory_limit",)),
    "fork": ("import os\ndef f(x):\n    while True:\n        os.fork()\n", ("blocked",)),
    "print gigabytes": ("[print('x' * 10**6) for _ in range(10**5)]", ("timeout", "cpu_limit")),  # cut, not fatal
    "os._exit": ("__import__('os')._exit(0)", ("exited",)),
    "sys.exit": ("__import__('sys').exit(3)", ("exited",)),
    "recursion bomb": ("(lambda g: g(g))(lambda g: g(g))", ("recursion_limit",)),
    "deep recursion, raised limit": ("import sys\nsys.setrecursionlimit(10**7)\ndef f(x):\n    return f(x) + 1\n",
                                     ("crashed", "cpu_limit", "memory_limit", "timeout", "recursion_limit")),
    "subprocess": ("__import__('_posixsubprocess').fork_exec", ("ok",)),  # a missing module: ModuleNotFoundError
    "ctypes": ("__import__('ctypes').CDLL(None).getpid()", ("ok",)),
    "kill the worker": ("__import__('os').kill(__import__('os').getppid(), 9)", ("blocked",)),
    "find every frame": ("__import__('sys')._current_frames()", ("blocked",)),
    "socket": ("__import__('_socket').socket()", ("ok",)),
}


@pytest.mark.parametrize("name", sorted(HOOKED))
def test_hooked_pool_gives_reasons(pool: SandboxPool, name: str) -> None:
    source, statuses = HOOKED[name]
    s = score_completions([source], [_answer([(1, 1), (2, 2)])], pool=pool)[0]
    assert s.score == 0.0 and s.status in statuses, (name, s)
    assert s.reason and (s.status != "ok" or "ModuleNotFoundError" in s.reason), s  # refused as if absent


def test_a_chatty_correct_program_scores_one_and_keeps_the_tail(pool: SandboxPool) -> None:
    src = "import sys\ndef f(x):\n    for i in range(3000):\n        print('debug', i, 'x' * 1000)\n" \
          "    sys.stderr.write('the end')\n    return x + 1\n"
    res = pool.run([Job(src, [[1], [2]], kind="module")])[0]
    assert res.status == "ok" and res.outputs == [2, 3] and res.output_tail.endswith("the end"), res


def test_submit_does_not_block_the_caller(pool: SandboxPool) -> None:
    fut = pool.submit([Job("__import__('time').sleep(0.4) or x", [[7]])] + [Job(f"x*{k}", [[3]]) for k in range(12)])
    assert not fut.done()  # the caller is free to keep sampling
    res = fut.result(timeout=60)
    assert res[0].outputs == [7] and [r.outputs[0] for r in res[1:]] == [3 * k for k in range(12)]


def test_a_dead_shared_worker_is_replaced() -> None:
    with SandboxPool(2, LIMITS, isolation="bwrap_shared", cache_size=0) as pool:
        victim_pid = pool.worker_pids()[0]
        os.killpg(victim_pid, signal.SIGKILL)
        time.sleep(0.1)
        res = pool.run([Job(f"x+{k}", [[1]]) for k in range(6)])
        assert all(isinstance(r, ExecResult) for r in res)
        assert sum(r.status == "worker_error" for r in res) <= 1
        assert [r.outputs for r in pool.run([Job(f"x+{k}", [[1]]) for k in range(6)])] == [[k + 1] for k in range(6)]
        assert victim_pid not in pool.worker_pids()


def test_code_reward_is_registered_and_reports_reasons() -> None:
    fn = get_reward("code_tests")
    ans = _answer([(0, 0), (3, 9)])
    out = fn(["0,1,4"] * 4, ["x*x", "x**2", "x*4", "__import__('socket')"], answer=[ans, ans, ans, "not json"])
    assert out == [1.0, 1.0, 0.5, None]
    assert out.stats["status_counts"] == {"ok": 3, "unscorable": 1}  # returned with the scores
    assert not hasattr(code_tests_reward, "last_stats")  # and kept nowhere between calls
    combo = get_reward("code_tests:1.0")(["p"], ["x*x"], answer=[ans])
    assert combo == [1.0]


def test_a_recipes_isolation_travels_with_its_reward_never_through_the_process(monkeypatch) -> None:
    """reward_for_recipe binds the recipe's sandbox.isolation to the reward it returns; a reward
    taken by name afterwards in the same process still runs a sandbox per run (bwrap), and the
    bound one runs its own mode, in either order."""
    import dataclasses
    import pickle

    from miles_core.config import RecipeConfig, SandboxSettings
    from miles_core.rewards import code as code_mod
    from miles_core.rewards.registry import reward_for_recipe

    seen: list[str] = []
    real = code_mod.shared_pool
    monkeypatch.setattr(code_mod, "shared_pool", lambda isolation="bwrap": seen.append(isolation) or real(isolation))
    ans = _answer([(0, 0), (3, 9)])
    recipe = dataclasses.replace(RecipeConfig(), sandbox=SandboxSettings(isolation="bwrap_shared"))  # no YAML here
    shared = reward_for_recipe(recipe, "code_tests")
    assert shared(["0,1,4"], ["x*x"], answer=[ans]) == [1.0]
    assert get_reward("code_tests")(["0,1,4"], ["x*x"], answer=[ans]) == [1.0]
    assert shared(["0,1,4"], ["x*4"], answer=[ans]) == [0.5]
    assert seen == ["bwrap_shared", "bwrap", "bwrap_shared"]
    assert pickle.loads(pickle.dumps(shared)).isolation == "bwrap_shared" and shared.__name__ == "code_tests_reward"


# ---- failing closed -------------------------------------------------------------------------


@pytest.fixture
def fresh_prepare() -> Iterator[None]:
    iso_mod.prepare.cache_clear()
    yield
    iso_mod.prepare.cache_clear()


def test_missing_bubblewrap_refuses(monkeypatch: pytest.MonkeyPatch, fresh_prepare: None) -> None:
    monkeypatch.setattr(iso_mod.shutil, "which", lambda name: None)
    with pytest.raises(IsolationUnavailable, match="apt-get install bubblewrap"):
        SandboxPool(1, LIMITS)


def test_missing_seccomp_bindings_refuse(monkeypatch: pytest.MonkeyPatch, fresh_prepare: None) -> None:
    monkeypatch.setattr(iso_mod.glob, "glob", lambda pattern: [])
    with pytest.raises(IsolationUnavailable, match="python3-seccomp"):
        SandboxPool(1, LIMITS)


def test_bwrap_without_user_namespaces_refuses(monkeypatch: pytest.MonkeyPatch, fresh_prepare: None) -> None:
    """A bwrap that cannot make its namespaces (what a host without user namespaces gives)."""
    import tempfile

    d = Path(tempfile.mkdtemp())  # reachable by nobody, whom a root caller starts bwrap as
    try:
        os.chmod(d, 0o755)
        fake = d / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
        fake.chmod(0o755)
        monkeypatch.setattr(iso_mod.shutil, "which", lambda name: str(fake))
        with pytest.raises(IsolationUnavailable, match=r"uid map: Permission denied.*user namespaces"):
            SandboxPool(1, LIMITS)
    finally:
        shutil.rmtree(d)


def test_isolation_none_runs_only_when_asked_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="sandbox.isolation"):
        SandboxPool(1, LIMITS, isolation="off")  # type: ignore[arg-type]
    with caplog.at_level("WARNING"), SandboxPool(1, LIMITS, isolation="none", cache_size=0) as p:
        assert not p.layers["kernel_isolation"] and p.layers["audit_hook"]
        assert p.run([Job("x * 3", [[2]])])[0].outputs == [6]
    assert "WITHOUT a kernel boundary" in caplog.text


def test_bwrap_is_installed_here() -> None:
    """The kernel lanes above must not be skipped quietly: CI installs bubblewrap and python3-seccomp."""
    assert shutil.which("bwrap"), "bubblewrap is missing: .ci/run installs it (apt-get install bubblewrap)"


def test_filters_cover_what_a_run_must_never_call() -> None:
    """The calls the kernel must refuse a run are all in its stage-two filter."""
    from miles_core.rewards.isolation import STAGE_ONE, STAGE_ONE_IF, STAGE_TWO, WORKER_NEEDS, filter_rules

    required = {"ptrace", "process_vm_readv", "process_vm_writev", "kill", "tkill", "tgkill", "pidfd_open",
                "pidfd_send_signal", "pidfd_getfd", "rt_sigqueueinfo", "mount", "umount2", "unshare", "setns",
                "bpf", "keyctl", "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register",
                "fork", "vfork", "clone", "clone3", "execve", "execveat", "socket", "socketpair", "memfd_create"}
    required |= {"setpriority", "sched_setscheduler", "sched_setparam", "sched_setattr", "ioprio_set"}
    assert required <= set(STAGE_ONE + STAGE_TWO)
    assert set(WORKER_NEEDS) <= set(STAGE_ONE)  # refused to runs, allowed only to the worker itself
    conditional = {(name, cond) for name, conds in STAGE_ONE_IF for cond in conds}
    assert {("prlimit64", (0, "ne", 0)), ("fcntl", (1, "eq32", 8)), ("fcntl", (1, "eq32", 10)),
            ("ioctl", (1, "eq32", 0x8901))} <= conditional  # another's limits; SIGIO owner and signal
    assert set(STAGE_ONE_IF) <= set(filter_rules(1)) and set(STAGE_ONE_IF) <= set(filter_rules(2))
