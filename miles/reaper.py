"""No process of a ``miles`` command outlives it, however it ends (kill -9 included).

Why: a flow command starts Prefect's temporary API server as a child (``uvicorn``, ~200 MB). Ctrl-C
and SIGTERM end the CLI through Python, and Prefect stops the server at exit; ``kill -9`` (the OOM
killer, a scheduler's last resort) skips that, and the server is re-parented to PID 1 and lives on.
Linux's parent-death signal would stop it, but it is set inside the child and Prefect starts that
child itself. So the CLI starts this watchdog beside it instead: the watchdog holds the read end of
a pipe whose only write end the CLI holds, notes the CLI's descendants every half second, and when
the pipe reaches end-of-file (the CLI died, by any means) it stops the descendants it noted that are
still the same processes (same start time), with SIGTERM then SIGKILL, and exits.

    python -m miles.reaper PID FD      (started by :func:`start`, never by hand)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
GRACE_S = 2.0


def start() -> None:
    """Watch this process: its descendants are stopped when it dies (module docstring). Linux only
    (``/proc``); elsewhere a no-op."""
    if not Path("/proc/self/task").is_dir():
        return
    r, w = os.pipe()  # both non-inheritable: only this process keeps ``w``
    subprocess.Popen([sys.executable, "-m", "miles.reaper", str(os.getpid()), str(r)], pass_fds=(r,),
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    os.close(r)
    _KEEP.append(w)


_KEEP: list[int] = []  # the write end, open for this process's life


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): a reused PID has another."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid`` -> its start time (from /proc/PID/task/*/children)."""
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            for k in kids:
                t = _start_time(k)
                if t is not None and k not in out:
                    out[k] = t
                    todo.append(k)
    return out


def _stop(seen: dict[int, str]) -> None:
    alive = lambda: [p for p, t in seen.items() if _start_time(p) == t]  # noqa: E731
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive():
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + GRACE_S
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)


def main(argv: list[str]) -> int:
    pid, fd = int(argv[0]), int(argv[1])
    seen: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and not os.read(fd, 1):  # end of file: the watched process is gone
            break
        seen.update(descendants(pid))
    _stop({p: t for p, t in seen.items() if p != os.getpid()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
