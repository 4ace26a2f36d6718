"""The execution sandbox: hostile completions are contained, score 0 with a reason, leave nothing
behind, and the workers keep scoring. Kernel layers are also checked with the audit hook off,
so each guarantee is shown by the layer that is supposed to provide it."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.data.code import encode_answer
from miles_core.rewards import get_reward
from miles_core.rewards.code import ExecResult, Job, SandboxLimits, SandboxPool, code_tests_reward, score_completions

SECRET = "4242"
LIMITS = SandboxLimits(timeout_s=1.5, cpu_s=1, memory_mb=256)


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    os.environ["MILES_SANDBOX_TEST_SECRET"] = SECRET  # must never reach a completion
    try:
        with SandboxPool(2, LIMITS, cache_size=0) as p:
            yield p
    finally:
        os.environ.pop("MILES_SANDBOX_TEST_SECRET", None)


@pytest.fixture(scope="module")
def bare_pool() -> Iterator[SandboxPool]:
    """Audit hook off: only the kernel layers (rlimits, uid drop, namespaces, empty env) remain."""
    os.environ["MILES_SANDBOX_TEST_SECRET"] = SECRET
    try:
        with SandboxPool(1, LIMITS, audit_hook=False, cache_size=0) as p:
            yield p
    finally:
        os.environ.pop("MILES_SANDBOX_TEST_SECRET", None)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    s.settimeout(0.3)
    yield s
    s.close()


def _no_connection(s: socket.socket) -> bool:
    try:
        conn, _ = s.accept()
    except TimeoutError:
        return True
    conn.close()
    return False


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A world-writable directory with a file in it: what hostile code tries to write or delete."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "keep.txt").write_text("precious")
    os.chmod(tmp_path, 0o755)
    os.chmod(d, 0o777)
    os.chmod(d / "keep.txt", 0o666)
    return d


def _answer(pairs: list[tuple[int, object]]) -> str:
    return encode_answer([[[x], y] for x, y in pairs])


@pytest.mark.parametrize("bad", [{"timeout_s": 0}, {"cpu_s": 0.5}, {"memory_mb": 8}, {"open_files": True}])
def test_bad_limits_name_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=f"SandboxLimits.{next(iter(bad))}"):
        SandboxLimits(**bad)


def test_bad_jobs_are_rejected_before_running(pool: SandboxPool) -> None:
    with pytest.raises(ValueError, match=r"jobs\[1\].kind"):
        pool.submit([Job("x", [[1]]), Job("x", [[1]], kind="shell")])
    with pytest.raises(ValueError, match=r"jobs\[0\].inputs"):
        pool.submit([Job("x", [[object()]])])


def test_layers_are_reported(pool: SandboxPool) -> None:
    assert set(pool.layers) == {"process_per_run", "rlimits", "uid_drop", "network_namespace", "private_tmp",
                                "audit_hook", "empty_env"}
    assert pool.layers["audit_hook"] and pool.layers["empty_env"]
    assert pool.layers["uid_drop"] == (os.geteuid() == 0)


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


HOSTILE = {
    "infinite loop": ("[x for _ in iter(int, 1)]", ("timeout", "cpu_limit")),
    "sleep forever": ("__import__('time').sleep(3600)", ("timeout",)),
    "memory bomb": ("len(bytearray(8 * 2**30))", ("memory_limit",)),
    "fork bomb": ("import os\ndef f(x):\n    while True:\n        os.fork()\n", ("blocked",)),
    "print gigabytes": ("[print('x' * 10**6) for _ in range(10**4)]", ("output_limit",)),
    "os._exit": ("__import__('os')._exit(0)", ("exited",)),
    "sys.exit": ("__import__('sys').exit(3)", ("exited",)),
    "recursion bomb": ("(lambda g: g(g))(lambda g: g(g))", ("recursion_limit",)),
    "deep recursion, raised limit": ("import sys\nsys.setrecursionlimit(10**7)\ndef f(x):\n    return f(x) + 1\n",
                                     ("crashed", "cpu_limit", "memory_limit", "timeout", "recursion_limit")),
    "read environ file": ("open('/proc/self/environ').read()", ("blocked",)),
    "subprocess": ("__import__('subprocess').run(['true'])", ("blocked",)),
    "ctypes": ("__import__('ctypes').CDLL(None).getpid()", ("blocked",)),
    "kill the worker": ("__import__('os').kill(__import__('os').getppid(), 9)", ("blocked",)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_completion_is_contained(pool: SandboxPool, name: str) -> None:
    source, statuses = HOSTILE[name]
    s = score_completions([source], [_answer([(1, 1), (2, 2)])], pool=pool)[0]
    assert s.score == 0.0 and s.status in statuses, (name, s)
    assert s.reason


def test_writing_and_deleting_outside_the_sandbox_is_refused(pool: SandboxPool, victim: Path) -> None:
    comps = [f"open({str(victim / 'pwned')!r}, 'w').write('x')",
             f"__import__('os').remove({str(victim / 'keep.txt')!r})",
             f"__import__('shutil').rmtree({str(victim)!r})",
             f"__import__('os').rename({str(victim / 'keep.txt')!r}, 'stolen')",
             "open('/etc/hosts', 'a').write('1.2.3.4 evil')"]
    got = score_completions(comps, [_answer([(1, 1)])] * len(comps), pool=pool)
    assert all(s.score == 0.0 and s.status == "blocked" for s in got), got
    assert "outside the sandbox" in got[1].reason and "import shutil" in got[2].reason
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "precious"
    assert "evil" not in Path("/etc/hosts").read_text()


def test_network_is_refused(pool: SandboxPool, listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    s = score_completions([f"__import__('socket').create_connection(('127.0.0.1', {port})).send(b'x')"],
                          [_answer([(1, 1)])], pool=pool)[0]
    assert (s.score, s.status) == (0.0, "blocked") and "socket" in s.reason
    assert _no_connection(listener)


def test_environment_secrets_do_not_leak(pool: SandboxPool) -> None:
    ans = _answer([(1, int(SECRET))])
    got = score_completions(["int(__import__('os').environ.get('MILES_SANDBOX_TEST_SECRET', '0'))",  # 1.0 = leak
                             f"len(__import__('os').environ) + {SECRET}"], [ans] * 2, pool=pool)  # 1.0 = empty env
    assert [s.score for s in got] == [0.0, 1.0]


def test_workers_survive_hostile_batch_and_leave_nothing(pool: SandboxPool) -> None:
    before = pool.worker_pids()
    comps = [src for src, _ in HOSTILE.values() if "sleep" not in src and "iter(int" not in src] + ["x+1"] * 3
    got = score_completions(comps, [_answer([(1, 2)])] * len(comps), pool=pool)
    assert [s.score for s in got[-3:]] == [1.0] * 3 and all(s.score == 0.0 for s in got[:-3])
    assert pool.worker_pids() == before
    assert pool.status() == [{"leftover_files": [], "live_children": False}] * 2
    res = pool.run([Job("x", [[0]])] * 2)  # distinct children: no pid of a finished run is alive
    for r in res:
        with pytest.raises(ProcessLookupError):
            os.kill(r.pid, 0)


def test_fork_is_stopped_by_nproc_without_the_hook(bare_pool: SandboxPool) -> None:
    src = ("import os\ndef f(x):\n    try:\n        pid = os.fork()\n    except OSError:\n        return -1\n"
           "    if pid == 0:\n        os._exit(0)\n    return pid\n")
    res = bare_pool.run([Job(src, [[0]])])[0]
    assert (res.status, res.outputs) == ("ok", [-1])


def test_kernel_layers_without_the_hook(bare_pool: SandboxPool, victim: Path, listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    probe = ("import os\ndef f(what):\n    try:\n        if what == 'env':\n            return len(os.environ)\n"
             "        if what == 'write':\n            open(" + repr(str(victim / "pwned")) + ", 'w').write('x')\n"
             "        if what == 'net':\n            import socket\n"
             f"            socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
             "        if what == 'mem':\n            return len(bytearray(1 << 30))\n"
             "        if what == 'ifaces':\n"
             "            return [l.split(':')[0].strip() for l in open('/proc/self/net/dev').readlines()[2:]]\n"
             "        return 'allowed'\n    except Exception as e:\n        return type(e).__name__\n")
    res = bare_pool.run([Job(probe, [["env"], ["write"]])])[0]
    assert res.outputs[0] == 0
    if bare_pool.layers["uid_drop"] or bare_pool.layers["private_tmp"]:
        assert res.outputs[1] != "allowed"
    assert not (victim / "pwned").exists()
    mem = bare_pool.run([Job(probe, [["mem"]])])[0]
    assert mem.outputs == ["MemoryError"]  # RLIMIT_AS, not the hook
    net = bare_pool.run([Job(probe, [["net"], ["ifaces"]])])[0]
    assert net.outputs[0] != "allowed" and _no_connection(listener)
    if bare_pool.layers["network_namespace"]:  # a fresh namespace: loopback only (and it is down)
        assert net.outputs[1] == ["lo"]


def test_submit_does_not_block_the_caller(pool: SandboxPool) -> None:
    fut = pool.submit([Job("__import__('time').sleep(0.4) or x", [[7]])] + [Job(f"x*{k}", [[3]]) for k in range(40)])
    assert not fut.done()  # the caller is free to keep sampling
    res = fut.result(timeout=60)
    assert res[0].outputs == [7] and [r.outputs[0] for r in res[1:]] == [3 * k for k in range(40)]


def test_a_dead_worker_is_replaced(pool: SandboxPool) -> None:
    victim_pid = pool.worker_pids()[0]
    os.killpg(victim_pid, 9)
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
    stats = code_tests_reward.last_stats
    assert stats["status_counts"] == {"ok": 3, "unscorable": 1}
    combo = get_reward("code_tests:1.0")(["p"], ["x*x"], answer=[ans])
    assert combo == [1.0]
