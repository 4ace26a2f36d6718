"""What the learner's poll and checkpoint cost as a run ages, on SeaweedFS: every commit marker
listed (how the learner found new batches before the inbox) against the inbox (how it finds them
now, ``BatchChannel.waiting``), with 1,000 to 50,000 batches committed and the same batches in flight.

A run's age is the batches it has committed: at the scale model's 4,096-GPU point, 617,760 after
24 hours. At each size the store holds that many commit markers (the markers alone: a listing reads
no data), ids as samplers name them (``{seq:06d}-w{k}``, 64 workers), of which the newest
``--in-flight`` are announced and not yet taken. Per size, the median of ``--reps`` polls: seconds
and S3 requests of ``TrajectoryStore.list_batches`` and of ``BatchChannel.waiting`` on the run's
store; the retirement a checkpoint does (``retire`` of the in-flight batches, as if all were taken
since the checkpoint before, then announced again for the next rep); and the pickle of a ledger listing every batch, which the checkpoint
still writes whole (it grows with the run: its compaction is still to come).

Run: python -m benchmarks.run_age [--sizes 1000 10000 50000] [--in-flight 64] [--reps 5] [--smoke]
(--smoke: sizes 200 and 1,200, 1 rep; writes run_age_smoke.json).
"""

from __future__ import annotations

import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import add_smoke, finish, seaweed
from miles_core.algo.rl import batch_id
from miles_core.config import load_recipe
from miles_core.learner.channels import BatchChannel
from miles_core.learner.ledger import Ledger, save_part
from miles_core.storage.requests import RequestCounter
from miles_core.storage.run import RunStore

WORKERS = 64
SMOKE_SIZES, SMOKE_REPS = (200, 1200), 1


def ids_up_to(n: int) -> list[str]:
    """The first ``n`` batch ids of a run with :data:`WORKERS` samplers, in commit order."""
    return [batch_id(i // WORKERS, f"w{i % WORKERS}") for i in range(n)]


def timed(fn: Callable[[], Any], counter: RequestCounter, reps: int) -> tuple[float, int, Any]:
    """(median seconds, requests per call, the last result) of ``reps`` calls of ``fn``."""
    seconds, requests, out = [], [], None
    for _ in range(reps):
        counter.reset()
        t0 = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - t0)
        requests.append(sum(counter.snapshot().values()))
    return statistics.median(seconds), max(requests), out


def measure(rs: RunStore, sizes: list[int], in_flight: int, reps: int) -> list[dict[str, Any]]:
    channel = BatchChannel(rs, load_recipe("tiny", []), inbox=True)
    store, counter = rs.trajectories, RequestCounter()
    counter.attach(store.fs)
    rows, written = [], 0
    for n in sorted(sizes):
        ids = ids_up_to(n)
        store.fs.pipe({store.marker_path(b): b"{}" for b in ids[written:]})  # markers, concurrently
        written = n
        store.retire(store.list_inbox())
        flight = ids[-in_flight:]
        store.fs.pipe({store.inbox_path(b): b"" for b in flight})
        markers_s, markers_req, listed = timed(store.list_batches, counter, reps)
        inbox_s, inbox_req, waiting = timed(channel.waiting, counter, reps)
        if sorted(listed) != sorted(ids) or waiting != sorted(flight):
            raise RuntimeError(f"run_age: the listings at {n} batches are not what the store holds")
        taken = sorted(flight)  # a checkpoint retires the batches taken since the one before

        def retire_one_checkpoint() -> None:
            store.retire(taken)

        retire = []
        for _ in range(reps):
            counter.reset()
            t0 = time.perf_counter()
            retire_one_checkpoint()
            retire.append((time.perf_counter() - t0, sum(counter.snapshot().values())))
            store.fs.pipe({store.inbox_path(b): b"" for b in taken})
        ledger, parts = Ledger(), [f"{k:06d}-v{k:06d}.json" for k in range((n - in_flight) // in_flight)]
        for i, b in enumerate(ids):
            ledger.consume(b, policy_version=i // 8, learner_version=i // 8 + 1, rows=8, update=i // 8 + 1, staleness=0)
            if i == n - in_flight - 1:
                ledger.mark_saved()  # the checkpoints before hold all but the newest in-flight batches
        t0 = time.perf_counter()
        blob = pickle.dumps(ledger.state())  # what a checkpoint pickled before the ledger's parts
        pickle_s = time.perf_counter() - t0
        counter.reset()
        t0 = time.perf_counter()
        named = save_part(rs, ledger, parts, version=n)  # what it writes now: one part, and the parts' names
        now_bytes = len(pickle.dumps({"parts": named}))
        part_s, part_req = time.perf_counter() - t0, sum(counter.snapshot().values())
        rows.append({"batches": n, "markers_s": markers_s, "markers_requests": markers_req,
                     "inbox_s": inbox_s, "inbox_requests": inbox_req, "in_flight": len(waiting),
                     "retire_s": statistics.median(r[0] for r in retire), "retire_requests": max(r[1] for r in retire),
                     "retired_per_checkpoint": len(taken), "ledger_pickle_s": pickle_s, "ledger_bytes": len(blob),
                     "ledger_part_s": part_s, "ledger_part_requests": part_req, "ledger_names_bytes": now_bytes})
        print(f"{n} batches: markers {markers_s:.3f} s ({markers_req} requests), inbox {inbox_s:.3f} s "
              f"({inbox_req} requests)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse

    ap = add_smoke(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000], help="batches committed")
    ap.add_argument("--in-flight", type=int, default=64, help="batches announced and not yet taken at each size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/run_age.json)")
    args = ap.parse_args(argv)
    sizes, reps = (list(SMOKE_SIZES), SMOKE_REPS) if args.smoke else (args.sizes, args.reps)
    with tempfile.TemporaryDirectory(prefix="miles-run-age-") as tmp:
        server = seaweed().start(Path(tmp) / "s3", bucket="miles")
        try:
            rs = RunStore("s3://miles/run", server.storage_options())
            rows = measure(rs, sizes, args.in_flight, reps)
        finally:
            server.stop()
    first, last = rows[0], rows[-1]
    payload = {"rows": rows, "store": "seaweedfs", "workers": WORKERS, "reps": reps, "smoke": args.smoke,
               "markers_growth": last["markers_s"] / first["markers_s"], "inbox_growth": last["inbox_s"] / first["inbox_s"]}
    table = [[r["batches"], r["markers_s"], r["markers_requests"], r["inbox_s"], r["inbox_requests"], r["retire_s"],
              r["retire_requests"], r["ledger_pickle_s"], f"{r['ledger_bytes'] / 2**20:.1f}", r["ledger_part_s"],
              f"{r['ledger_names_bytes'] / 2**10:.1f}"] for r in rows]
    finish("run_age", payload, table, ["batches", "list markers s", "requests", "inbox s", "requests", "retire s",
                                       "requests", "whole ledger pickle s", "MiB", "its part s", "names KiB"], args.out,
           positive=["rows.*.markers_s", "rows.*.inbox_s", "rows.*.markers_requests", "rows.*.inbox_requests",
                     "rows.*.retire_requests", "rows.*.ledger_part_requests"])
    return payload


if __name__ == "__main__":
    main()
