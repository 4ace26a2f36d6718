"""The price of the kernel sandbox: completions per second and latency, old isolation against new.

Side by side in one run, on the same 1,000 benign completions (distinct expressions, 3 tests each,
no result cache, one worker per usable CPU):

* ``before (fork worker, audit hook)``: the sandbox as it was at BASELINE_REV, its worker script
  taken from this repository's git history and driven through its own protocol (persistent
  workers forking each run; the audit hook was the only file-system boundary);
* ``bwrap``: a new bubblewrap sandbox and interpreter per run (own namespaces per run), the default;
* ``bwrap_shared``: one bubblewrap sandbox per worker, each run forked inside it;
* ``none``: the explicit opt-out (no kernel boundary), for reference.

Throughput: 1,000 completions submitted at once. Latency: 200 more, one at a time, end to end
(what one call of the reward waits for a single completion). Run: python -m benchmarks.sandbox
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.common import table, usable_cpus, write_result
from miles_core.rewards.pool import Job, SandboxLimits, SandboxPool

BASELINE_REV = "65b1da5"  # the last commit with the fork-worker sandbox (audit hook as the boundary)
ROOT = Path(__file__).resolve().parents[1]


def jobs(n: int, offset: int = 0) -> list[Job]:
    return [Job(f"x * {i + offset} + {i % 7}", [[1], [2], [3]]) for i in range(n)]


class BeforePool:
    """The pre-bwrap sandbox worker (git show BASELINE_REV:miles_core/rewards/sandbox.py), driven
    with its own framing: opts, a hello, then one JSON job and one JSON result per run."""

    def __init__(self, workers: int, limits: SandboxLimits) -> None:
        import struct

        self._hdr = struct.Struct(">I")
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE_REV}:miles_core/rewards/sandbox.py"],
                             capture_output=True, text=True, check=True).stdout
        self._dir = tempfile.mkdtemp(prefix="miles-sandbox-before-")
        script = Path(self._dir, "sandbox_before.py")
        script.write_text(src)
        opts = {"limits": asdict(limits), "audit_hook": True, "namespaces": True, "tmp_parent": self._dir}
        self._procs = []
        for _ in range(workers):
            p = subprocess.Popen([sys.executable, "-I", "-S", "-B", str(script)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, env={}, start_new_session=True)
            self._send(p, opts)
            self._recv(p)
            self._procs.append(p)

    def _send(self, p: Any, obj: Any) -> None:
        data = json.dumps(obj).encode()
        p.stdin.write(self._hdr.pack(len(data)) + data)
        p.stdin.flush()

    def _recv(self, p: Any) -> Any:
        n = self._hdr.unpack(p.stdout.read(self._hdr.size))[0]
        return json.loads(p.stdout.read(n))

    def run(self, batch: Sequence[Job]) -> list[dict]:
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for k, j in enumerate(batch):
            todo.put((k, {"source": j.source, "inputs": [list(a) for a in j.inputs], "entry": j.entry,
                          "params": j.params, "kind": j.kind}))
        out: list[Any] = [None] * len(batch)

        def serve(p: Any) -> None:
            while True:
                try:
                    k, msg = todo.get_nowait()
                except queue.Empty:
                    return
                self._send(p, msg)
                out[k] = self._recv(p)
        threads = [threading.Thread(target=serve, args=(p,)) for p in self._procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def close(self) -> None:
        for p in self._procs:
            p.stdin.close()
            p.wait()
            p.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def measure(name: str, run: Callable[[Sequence[Job]], list], status: Callable[[Any], str], n: int,
            n_latency: int) -> dict:
    run(jobs(8, offset=10**6))  # warm-up: worker start, page cache
    t0 = time.perf_counter()
    results = run(jobs(n))
    wall = time.perf_counter() - t0
    bad = sum(status(r) != "ok" for r in results)
    lat = []
    for j in jobs(n_latency, offset=10**7):
        t = time.perf_counter()
        run([j])
        lat.append(time.perf_counter() - t)
    q = statistics.quantiles(lat, n=100)
    row = {"name": name, "completions": n, "seconds": wall, "per_s": n / wall, "not_ok": bad,
           "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * q[98]}
    print(f"  {name}: {row['per_s']:.1f}/s, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, "
          f"{bad} not ok", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="benign completions for the throughput figure")
    ap.add_argument("--latency-n", type=int, default=200, help="completions scored one at a time for p50/p99")
    args = ap.parse_args(argv)
    workers, limits = usable_cpus(), SandboxLimits()
    print(f"sandbox throughput: {args.n} completions, {workers} workers, uid {os.geteuid()}", flush=True)
    rows = []
    try:
        before = BeforePool(workers, limits)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"  before: skipped, {BASELINE_REV} not readable from git here ({e})")
    else:
        try:
            rows.append(measure("before (fork worker, audit hook)", before.run, lambda r: r.get("status"),
                                args.n, args.latency_n))
        finally:
            before.close()
    for mode in ("bwrap", "bwrap_shared", "none"):
        with SandboxPool(workers, limits, isolation=mode, cache_size=0) as pool:
            rows.append(measure(mode, pool.run, lambda r: r.status, args.n, args.latency_n))
    base = rows[0]["per_s"] if rows and rows[0]["name"].startswith("before") else None
    for r in rows:
        r["vs_before"] = r["per_s"] / base if base else None
    print(table([[r["name"], r["per_s"], r["vs_before"] if r["vs_before"] is not None else "-", r["p50_ms"],
                  r["p99_ms"], r["not_ok"]] for r in rows],
                ["isolation", "completions/s", "vs before", "p50 ms", "p99 ms", "not ok"]))
    path = write_result("sandbox", {"workers": workers, "uid": os.geteuid(), "baseline_rev": BASELINE_REV,
                                    "limits": asdict(limits), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
