"""The price of the code sandbox: completions per second and latency, before and after a change
to the harness, side by side in one run.

Two workloads, as the rewards send them (no result cache, one worker per usable CPU):

* ``expressions``: 1,000 distinct benign functions, 3 calls each (the procedural code tasks;
  one run process per completion);
* ``benchmark tests``: 400 distinct benign HumanEval-style programs, each scored by a ``check``
  with 3 asserts (HumanEval, MBPP; a program process and a tester process per completion).

Arms: ``bwrap`` (a new sandbox per completion, the default), ``bwrap_shared`` (one sandbox per
worker; the code recipe's choice) and ``none`` (no kernel boundary, for reference), each as the
code is now; and ``before: bwrap`` / ``before: bwrap_shared``, the same pools at BASELINE_REV (the
commit before a job left nothing for the next: one report pipe for all runs, no refusal of xattrs,
times, new inodes; no callbacks or mutated arguments in the tester), taken from this repository's
git history and run in a subprocess with the same measurement code. Throughput: every completion
submitted at once. Latency: 200 more, one at a time, end to end. ``--smoke`` (CI): every arm on
16 + 8 completions and 4 one at a time; the ``before`` arms only when BASELINE_REV is in this clone's
history (a shallow clone lacks it: they are skipped, and the result says so).
Beside the speed, what a harness change does to correct code: the honest corpora of tests/ (228
solutions of 57 tasks in four styles, the audit's honest cases, code fences; ``honest_items``)
scored now and at BASELINE_REV, and which scored differently (``--smoke``: the first 12).
Run: python -m benchmarks.sandbox [--no-before] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from benchmarks.harness import add_smoke, table, usable_cpus, write_result
# through pool.py, where BASELINE_REV also has them: this module runs against both versions
from miles_core.rewards.pool import Job, SandboxLimits, SandboxPool

BASELINE_REV = "d03d5ab"  # the last commit before private file copies (image.py), the output FIFO, the one value encoder
ROOT = Path(__file__).resolve().parents[2]
CHECK = "def check(candidate):\n    assert candidate(1) == {a}\n    assert candidate(2) == {b}\n" \
        "    assert candidate(-3) == {c}\ncheck(f)\n"


def jobs(workload: str, n: int, offset: int = 0) -> list[Job]:
    if workload == "expressions":
        return [Job(f"x * {i + offset} + {i % 7}", [[1], [2], [3]]) for i in range(n)]
    return [Job(f"def f(x):\n    return x * {k} + 1\n", [], "f", kind="tests", setup="",
                tests=[CHECK.format(a=k + 1, b=2 * k + 1, c=-3 * k + 1)]) for k in range(offset, offset + n)]


def measure(name: str, workload: str, run: Callable[[Sequence[Job]], list], n: int, n_latency: int) -> dict:
    run(jobs(workload, 8, offset=10**6))  # warm-up: worker start, page cache
    t0 = time.perf_counter()
    results = run(jobs(workload, n))
    wall = time.perf_counter() - t0
    bad = sum(r.status != "ok" or (workload != "expressions" and r.outputs != [True]) for r in results)
    lat = []
    for j in jobs(workload, n_latency, offset=10**7):
        t = time.perf_counter()
        run([j])
        lat.append(time.perf_counter() - t)
    q = statistics.quantiles(lat, n=100)
    row = {"name": name, "workload": workload, "completions": n, "seconds": wall, "per_s": n / wall,
           "not_ok": bad, "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * q[98]}
    print(f"  {workload:>15} {name}: {row['per_s']:.1f}/s, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, "
          f"{bad} not ok", flush=True)
    return row


def measure_modes(modes: Sequence[str], prefix: str, sizes: dict[str, int], n_latency: int) -> list[dict]:
    """Every (workload, mode) row with the ``miles_core`` this interpreter imports."""
    workers, limits = usable_cpus(), SandboxLimits()
    rows = []
    for workload, n in sizes.items():
        for mode in modes:
            with SandboxPool(workers, limits, isolation=mode, cache_size=0) as pool:
                rows.append(measure(prefix + mode, workload, pool.run, n, n_latency))
    return rows


def honest_items(limit: int | None = None) -> list[tuple[str, str, str, str]]:
    """(name, completion, entry, test) of the honest corpora in tests/ (test_sandbox_corpus.py's 228
    solutions, test_sandbox_honest.py's audit cases and code fences): correct code that must score 1.0."""
    import importlib.util

    def load(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(f"_honest_{name}", ROOT / "tests" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        return mod
    corpus, honest = load("test_sandbox_corpus"), load("test_sandbox_honest")
    items = [(f"corpus/{k}", c, e, t) for k, (c, e, t) in corpus.CASES.items()]
    items += [(f"honest/{k}", c, "f", t) for k, (c, t) in honest.CASES.items()]
    items += [(f"fence/{k}", c, "f", "assert candidate(1) == 2") for k, c in honest.FENCES.items()]
    return items[:limit]


def score_honest(limit: int | None = None) -> dict[str, float]:
    """Each honest item's score through the code reward (bwrap_shared), with the ``miles_core`` this
    interpreter imports: what a harness change does to correct code."""
    from miles_core.data import codesets

    items = honest_items(limit)
    scores = score_now([c for _, c, _, _ in items],
                       [codesets.tests_answer(e, [t], setup="", prefix="") for _, _, e, t in items])
    return {name: score for (name, *_), score in zip(items, scores)}


@contextlib.contextmanager
def miles_core_at(rev: str) -> Iterator[str]:
    """A folder holding ``rev``'s ``miles_core`` (from this repository's git history), for a
    subprocess to import instead of this checkout's."""
    with tempfile.TemporaryDirectory(prefix="miles-sandbox-before-") as d:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "miles_core"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
        yield d


def _run_at(rev: str, code: str, *args: str) -> dict[str, Any]:
    """Run ``code`` (it imports ``benchmarks`` from here, ``miles_core`` at ``rev``, and prints
    ``TAG json`` lines) in a subprocess -> {TAG: value}; its other output is passed through."""
    with miles_core_at(rev) as d:
        prelude = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
                   "import miles_core; assert miles_core.__file__.startswith(sys.argv[1])\n")
        res = subprocess.run([sys.executable, "-c", prelude + code, d, str(ROOT), *args], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": ""})
    tagged = {}
    for line in res.stdout.splitlines():
        tag, _, body = line.partition(" ")
        if tag.isupper() and body.startswith(("[", "{")):
            tagged[tag] = json.loads(body)
        else:
            print(line)
    if res.returncode != 0:
        raise RuntimeError(f"the {rev} arms failed: {res.stderr[-1500:]}")
    return tagged


def measure_before(sizes: dict[str, int], n_latency: int, honest_limit: int | None = None) -> tuple[list[dict], dict]:
    """The bwrap arms at BASELINE_REV: its miles_core from git, this file's measurement, a subprocess."""
    code = ("from benchmarks.sandbox import measure_modes, score_honest\n"
            "print('ROWS ' + json.dumps(measure_modes(['bwrap', 'bwrap_shared'], 'before: ', json.loads(sys.argv[3]), "
            "int(sys.argv[4]))))\n"
            "print('HONEST ' + json.dumps(score_honest(json.loads(sys.argv[5]))))")
    tagged = _run_at(BASELINE_REV, code, json.dumps(sizes), str(n_latency), json.dumps(honest_limit))
    return tagged["ROWS"], tagged["HONEST"]


def score_now(completions: Sequence[str], answers: Sequence[str]) -> list[float | None]:
    """Each completion's code-reward score against its answer (``rewards/code.py::score_completions``,
    bwrap_shared, no result cache), with the ``miles_core`` this interpreter imports."""
    from miles_core.rewards.code import score_completions

    with SandboxPool(usable_cpus(), SandboxLimits(), isolation="bwrap_shared", cache_size=0) as pool:
        return [None if s is None else s.score for s in score_completions(list(completions), list(answers), pool=pool)]


def scores_before(completions: Sequence[str], answers: Sequence[str]) -> list[float | None]:
    """:func:`score_now` with BASELINE_REV's harness: what the same completions scored before the change."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump([list(completions), list(answers)], f)
        f.flush()
        code = ("from benchmarks.sandbox import score_now\n"
                "c, a = json.load(open(sys.argv[3]))\nprint('SCORES ' + json.dumps(score_now(c, a)))")
        return _run_at(BASELINE_REV, code, f.name)["SCORES"]


def rescored(completions: Sequence[str], answers: Sequence[str]) -> dict[str, Any]:
    """The same completions scored now and at BASELINE_REV: how many scored differently, and how."""
    now, before = score_now(completions, answers), scores_before(completions, answers)
    diff = [(b, n) for b, n in zip(before, now) if b != n]
    return {"completions": len(now), "changed": len(diff), "rev": BASELINE_REV,
            "zero_to_one": sum(1 for b, n in diff if not b and n == 1.0),
            "one_to_zero": sum(1 for b, n in diff if b == 1.0 and not n),
            "ones_now": sum(1 for n in now if n == 1.0), "ones_before": sum(1 for b in before if b == 1.0)}


def baseline_present() -> bool:
    """Whether this checkout's git history holds BASELINE_REV (a shallow CI clone may not)."""
    res = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BASELINE_REV}^{{commit}}"], capture_output=True)
    return res.returncode == 0


MODES = ("bwrap", "bwrap_shared", "none")
SMOKE = {"n": 16, "tests_n": 8, "latency_n": 4}  # --smoke: a few completions through every pool


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--n", type=int, default=1000, help="completions for the expressions throughput figure")
    ap.add_argument("--tests-n", type=int, default=400, help="completions for the benchmark-tests figure")
    ap.add_argument("--latency-n", type=int, default=200, help="completions scored one at a time for p50/p99")
    ap.add_argument("--no-before", action="store_true", help=f"skip the {BASELINE_REV} arms")
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/sandbox.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    sizes = {"expressions": args.n, "benchmark tests": args.tests_n}
    print(f"sandbox throughput: {sizes}, {usable_cpus()} workers, uid {os.geteuid()}", flush=True)
    before, note = not args.no_before, "ran" if not args.no_before else "skipped: --no-before"
    if before and args.smoke and not baseline_present():  # full size fails instead: its figure needs them
        before, note = False, f"skipped: {BASELINE_REV} is not in this clone's history (shallow clone?)"
        print(f"  before arms {note}", flush=True)
    honest_limit = 12 if args.smoke else None
    rows, honest_before = measure_before(sizes, args.latency_n, honest_limit) if before else ([], {})
    rows += measure_modes(list(MODES), "", sizes, args.latency_n)
    honest = score_honest(honest_limit)
    changed = sorted(k for k in honest_before if honest_before[k] != honest[k])
    print(f"honest corpus ({len(honest)} correct solutions, bwrap_shared): {sum(v == 1.0 for v in honest.values())} "
          f"score 1.0 now" + (f", {sum(v == 1.0 for v in honest_before.values())} at {BASELINE_REV}; "
                              f"{len(changed)} scored differently" if honest_before else ""))
    for r in rows:
        ref = next((b for b in rows if b["workload"] == r["workload"] and b["name"] == "before: " + r["name"]), None)
        r["vs_before"] = r["per_s"] / ref["per_s"] if ref else None
    print(table([[r["workload"], r["name"], r["per_s"], "-" if r["vs_before"] is None else r["vs_before"],
                  r["p50_ms"], r["p99_ms"], r["not_ok"]] for r in rows],
                ["workload", "isolation", "completions/s", "vs before", "p50 ms", "p99 ms", "not ok"]))
    # per arm, what was measured: an arm that never ran, or scored no completion right, fails the run
    arms = {f"{r['workload']}: {r['name']}": {"per_s": r["per_s"], "ok": r["completions"] - r["not_ok"],
                                               "p50_ms": r["p50_ms"]} for r in rows}
    names = [*(("before: " + m for m in MODES[:2]) if before else ()), *MODES]
    path = write_result("sandbox", {"workers": usable_cpus(), "uid": os.geteuid(), "baseline_rev": BASELINE_REV,
                                    "before": note, "limits": asdict(SandboxLimits()), "rows": rows, "arms": arms,
                                    "honest": {"items": len(honest), "ones": sum(v == 1.0 for v in honest.values()),
                                               "ones_before": sum(v == 1.0 for v in honest_before.values()),
                                               "changed": changed}, "smoke": args.smoke}, args.out,
                        positive=["arms.*.per_s", "arms.*.ok", "arms.*.p50_ms", "honest.items"],
                        present=[f"arms.{w}: {n}" for w in sizes for n in names])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
