"""The benchmark harness: the shape every benchmark shares, written once.

A benchmark here is: standard arguments (``bench_args``), an SFT checkpoint per seed, trained or
reused by one rule (``sft_checkpoint``), arms run over seeds in a process pool with one torch
thread each (``over_seeds``), a paired comparison of two arms on the same problems (``paired``),
and a printed table plus ``benchmarks/results/NAME.json`` (``finish``). Each benchmark keeps only
its arms and its table. Also here: settings and pieces more than one benchmark measures with
(``ASYNC_OVERRIDES``, ``SPEED_SIZE``, ``synthetic_batch``, ``train_arm``), and the run every arm
that trains goes through, the one a user's ``miles train`` runs (``local_run``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

RESULTS = Path(__file__).parent / "results"

# The asynchronous benchmark's settings (benchmarks/learn/async_vs_sync.py explains each); components.py
# measures the parts of that same run.
ASYNC_OVERRIDES = ["async_rl.num_samplers=1", "async_rl.batches_per_sampler=150",
                   "async_rl.shared_budget=true", "async_rl.learner_samples=true", "async_rl.sync_dtype=bfloat16",
                   "lora.r=4", "lora.targets=q_proj,v_proj", "async_rl.checkpoint_every=10",
                   "async_rl.max_staleness=5", "sft.steps=2500"]

# A bidirectional Qwen3 of ~41M parameters with the real 151,936-row vocabulary: the size rollout.py
# and update.py time the engine at (the logits cost is real).
SPEED_SIZE = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024}


# ---- arguments --------------------------------------------------------------------------------

def add_smoke(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--smoke``: seconds at tiny sizes through the same code path, writing ``NAME_smoke.json``
    (benchmarks/tests/test_smoke.py runs every benchmark this way in CI)."""
    ap.add_argument("--smoke", action="store_true",
                    help="seconds at tiny sizes on the same code path (CI); writes NAME_smoke.json")
    return ap


def bench_args(description: str, seeds: Sequence[int] | None = None, checkpoint: bool = False,
               workdir: bool = False, sets: bool = True, out: bool = True) -> argparse.ArgumentParser:
    """A parser with the standard flags, one spelling each: ``--smoke`` (``add_smoke``), ``--seeds``
    (when ``seeds`` gives the default), ``--set KEY=VALUE`` (recipe overrides), ``--checkpoint DIR``
    (see ``sft_checkpoint``), ``--workdir DIR`` (default: a fresh temporary folder) and ``--out FILE``
    (the result JSON, default ``benchmarks/results/NAME.json``). The benchmark adds its own flags after."""
    ap = add_smoke(argparse.ArgumentParser(description=description.strip().splitlines()[0]))
    if seeds is not None:
        ap.add_argument("--seeds", type=int, nargs="+", default=list(seeds), help="seeds (one process each)")
    if sets:
        ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    if checkpoint:
        ap.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="SFT checkpoint: a checkpoint folder, or one holding seed{N}/sft; trained there "
                             "when absent, reused when present (its recorded settings must match)")
    if workdir:
        ap.add_argument("--workdir", default=None, metavar="DIR", help="working folder (default: a temporary one)")
    if out:
        ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/NAME.json)")
    return ap


def workdir(args: argparse.Namespace, name: str) -> Path:
    """``--workdir``, or a fresh temporary folder named after the benchmark (removed at exit after
    a smoke run: its checkpoints are of no use after)."""
    if getattr(args, "workdir", None):
        return Path(args.workdir)
    path = tempfile.mkdtemp(prefix=f"miles-{name}-")
    if getattr(args, "smoke", False):
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return Path(path)


# ---- SFT checkpoints --------------------------------------------------------------------------

def _as_stored(d: dict) -> dict:  # JSON's view: lists, not tuples
    return json.loads(json.dumps(d))


def checkpoint_path(seed: int, work: str | Path, checkpoint: str | Path | None = None) -> Path:
    """Where seed ``seed``'s SFT checkpoint lives: ``checkpoint`` itself when it is a checkpoint
    folder (one for every seed), else ``checkpoint/seed{N}/sft``, else ``work/seed{N}/sft``."""
    if checkpoint is not None and (Path(checkpoint) / "config.json").exists():
        return Path(checkpoint)
    return Path(checkpoint if checkpoint is not None else work) / f"seed{seed}" / "sft"


def sft_checkpoint(cfg, seed: int, work: str | Path, checkpoint: str | Path | None = None, data=None,
                   validate: bool = True, on_eval: Callable[[int, float, dict], Any] | None = None,
                   **train_kw) -> dict[str, Any]:
    """Seed ``seed``'s SFT checkpoint (``checkpoint_path``), trained or reused by one rule: a
    checkpoint already there is reused, one that is not is trained there (``train_baseline``,
    ``train_kw`` passed on; with ``validate``, validation every ``sft.eval_every`` steps is printed
    and recorded, and the best-validation weights are kept, else the last). Training records the model, task and sft
    settings and ``train_kw`` beside it (``sft_run.json``); a reused checkpoint's record must match
    this run's, so arms compared on one baseline really share it (a setting the record lacks was
    added after it was trained: it counts as its default). A checkpoint with no record (made
    elsewhere) is taken as it is. Returns what the result should say: ``path``, ``trained``,
    ``seconds`` (training's, also when reused) and the validation ``curve``."""
    from miles_core.learner.baseline import train_baseline

    ckpt = checkpoint_path(seed, work, checkpoint)
    train_kw = {**train_kw, "validate": validate}
    how = {k: v for k, v in train_kw.items() if k != "progress"}  # what shapes the weights
    key = _as_stored({k: cfg.to_dict()[k] for k in ("model", "task", "sft")} | {"train_baseline": how})
    meta = ckpt.parent / "sft_run.json" if ckpt.name == "sft" else ckpt / "sft_run.json"
    if (ckpt / "config.json").exists():
        prev = json.loads(meta.read_text()) if meta.exists() else {"key": key, "curve": [], "seconds": 0.0}
        stored = prev.get("key", {})
        old = {sec: {**_as_stored(dataclasses.asdict(type(getattr(cfg, sec))())), **stored.get(sec, {})}
               for sec in ("model", "task", "sft")} | {"train_baseline": stored.get("train_baseline", how)}
        diff = [f"{sec}.{f}" for sec in key for f in sorted(set(key[sec]) | set(old[sec]))
                if key[sec].get(f) != old[sec].get(f)]
        if diff:
            raise ValueError(f"{meta} was trained with other settings ({', '.join(diff)}); "
                             f"remove {ckpt} or point --checkpoint elsewhere")
        print(f"[seed {seed}] reusing the SFT checkpoint {ckpt} ({prev['seconds']:.0f}s when trained)", flush=True)
        return {"path": str(ckpt), "trained": False, "seconds": prev["seconds"], "curve": prev["curve"]}
    curve: list[dict] = []

    def record(step: int, pass1: float, stats: dict) -> None:
        curve.append({"step": step, "val_pass1": pass1, "loss": stats["loss"]})
        print(f"[seed {seed}] sft step {step} val pass@1 {pass1:.3f} loss {stats['loss']:.3f}", flush=True)
        if on_eval is not None:
            on_eval(step, pass1, stats)

    if data is None:
        from miles_core.data.registry import build_task

        data = build_task(cfg)
    t0 = time.perf_counter()
    train_baseline(cfg, data, ckpt, seed=seed, on_eval=record if validate else None,
                   **{k: v for k, v in train_kw.items() if k != "validate"})
    seconds = time.perf_counter() - t0
    meta.write_text(json.dumps({"key": key, "curve": curve, "seconds": seconds}))
    return {"path": str(ckpt), "trained": True, "seconds": seconds, "curve": curve}


# ---- arms over seeds ----------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    """Linux: the kernel sends this pool worker SIGTERM when the benchmark that spawned it dies, so a
    killed benchmark leaves no worker holding a core (prctl PR_SET_PDEATHSIG; elsewhere a no-op).
    A parent that died before the prctl sends nothing, hence the check after it."""
    if platform.system() == "Linux":
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)


def _one_thread(fn: Callable, item: Any, args: tuple) -> Any:
    import torch

    torch.set_num_threads(1)
    return fn(item, *args)


def over_seeds(fn: Callable, items: Sequence[Any], *args: Any, processes: int = 2) -> list[Any]:
    """``[fn(item, *args) for item in items]``, each call in a fresh (spawned) process with one torch
    thread, ``processes`` at a time (two: one per core of the 2-core machine the figures come from).
    An item is a seed, or whatever one run is keyed by (an (arm, seed) pair). ``fn`` must be a
    module-level function."""
    with mp.get_context("spawn").Pool(max(1, min(len(items), processes)), initializer=_die_with_parent,
                                     initargs=(os.getpid(),)) as pool:
        return pool.starmap(_one_thread, [(fn, item, args) for item in items], chunksize=1)


def seed_mean(per_seed: Sequence[dict], get: Callable[[dict], float]) -> float:
    """The mean over seeds of ``get(seed's result)``."""
    return sum(get(p) for p in per_seed) / len(per_seed)


def paired(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict[str, float]:
    """Arm a against arm b on the same problems (same order): ``gain`` (a's pass rate minus b's),
    the paired sign test's ``wins`` (a right, b wrong), ``losses`` and two-sided ``p``."""
    from miles_core.eval.passk import paired_sign_test

    st = paired_sign_test(list(a_correct), list(b_correct))
    n = max(len(a_correct), 1)
    return {"gain": (sum(map(bool, a_correct)) - sum(map(bool, b_correct))) / n,
            "wins": st.wins, "losses": st.losses, "p": st.p}


def problems_needed(discordance: float, gain: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Paired problems a two-sided sign (McNemar) test needs to see a pass-rate ``gain`` at level
    ``alpha`` with probability ``power``, when a fraction ``discordance`` of problems differ between
    the arms (Connor, 1987): n = (z_a sqrt(d) + z_b sqrt(d - g^2))^2 / g^2."""
    from statistics import NormalDist

    if not 0 < gain <= discordance <= 1:
        raise ValueError(f"problems_needed: need 0 < gain ({gain}) <= discordance ({discordance}) <= 1")
    z_a, z_b = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    return math.ceil((z_a * math.sqrt(discordance) + z_b * math.sqrt(discordance - gain ** 2)) ** 2 / gain ** 2)


def evaluate_adapter(cfg, base: str | Path, adapter: str | Path) -> tuple[float, list[bool]]:
    """pass@1 of ``adapter`` on ``base`` over the recipe's held-out problems with its pinned eval
    settings (all usable cores), and each problem's first-sample correctness for :func:`paired`."""
    import torch

    torch.set_num_threads(usable_cpus())
    from miles_core.data.registry import build_task
    from miles_core.eval.evaluate import run_eval
    from miles_core.models.base import load_checkpoint
    from miles_core.models.lora import load_adapter

    model, tok = load_checkpoint(str(base))
    r = run_eval(load_adapter(model, str(adapter)), tok, cfg, build_task(cfg))
    return r.pass_at["pass@1"], [c[0] for c in r.correct]


# ---- results ------------------------------------------------------------------------------------

def seaweed() -> Any:
    """``infra/s3server.py`` (not a package: the operators' launcher of a local SeaweedFS), loaded as a
    module: ``seaweed().start(folder)`` runs a real S3 server for a benchmark's store."""
    spec = importlib.util.spec_from_file_location("miles_s3server", Path(__file__).resolve().parents[1] / "infra" / "s3server.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, a cgroup's cpuset), not every CPU
    the machine has, so a benchmark confined to 4 of 16 cores sizes its threads for 4."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class MeasuredNothing(AssertionError):
    """A benchmark's result lacks what it exists to measure (a count of 0, a missing key, a ratio
    that is not a finite positive number): the run fails instead of writing a figure."""


def _at(payload: Any, key: str) -> Any:
    """``payload``'s value at a dotted path (``modes.static.denoiser_calls``); ``*`` matches every
    value of a dict or item of a list, giving a flat list (``curve.*.steady``)."""
    head, _, rest = key.partition(".")
    if head == "*":
        items = list(payload.values()) if isinstance(payload, dict) else payload if isinstance(payload, list) else None
        if not items:
            raise KeyError(key)
        out: list[Any] = []
        for v in items:
            got = _at(v, rest) if rest else v
            out += got if rest and "*" in rest else [got]
        return out
    if not isinstance(payload, dict) or head not in payload:
        raise KeyError(key)
    return _at(payload[head], rest) if rest else payload[head]


def check_measured(name: str, payload: dict[str, Any], positive: Sequence[str] = (),
                   present: Sequence[str] = ()) -> None:
    """Raise :class:`MeasuredNothing` unless every dotted path in ``present`` exists and every one in
    ``positive`` is a finite number > 0 (or a non-empty list of them, for a ``*`` path). Every
    benchmark states these at its one write, so a benchmark whose measurement stops happening
    (a bypassed wrapper, an arm that never ran) fails instead of publishing."""
    for key in (*present, *positive):
        try:
            value = _at(payload, key)
        except KeyError:
            raise MeasuredNothing(f"benchmarks.{name}: the result has no {key!r}") from None
        if key not in positive:
            continue
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))
               or not math.isfinite(v) or v <= 0]
        if bad or not values:
            raise MeasuredNothing(f"benchmarks.{name}: {key} = {value!r}, expected a finite number > 0")


def results_dir() -> Path:
    """Where result files go: ``$MILES_BENCH_RESULTS`` (the smoke test's temporary folder) or
    ``benchmarks/results``."""
    return Path(os.environ.get("MILES_BENCH_RESULTS") or RESULTS)


def write_result(name: str, payload: dict[str, Any], path: str | Path | None = None,
                 positive: Sequence[str] = (), present: Sequence[str] = ()) -> Path:
    """``payload`` with run metadata, to ``path`` or ``results_dir()/NAME.json`` (``NAME_smoke.json``
    when ``payload["smoke"]``, so a smoke run never replaces a figure), after ``check_measured``."""
    check_measured(name, payload, positive, present)
    stem = f"{name}_smoke" if payload.get("smoke") else name
    path = Path(path) if path is not None else results_dir() / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "_meta": {"benchmark": name, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "python": platform.python_version(), "machine": platform.machine()}}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Aligned text columns; floats with four decimals."""
    cells = [[str(h) for h in header]] + [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def finish(name: str, payload: dict[str, Any], rows: Sequence[Sequence[Any]] | None = None,
           header: Sequence[str] | None = None, out: str | Path | None = None,
           positive: Sequence[str] = (), present: Sequence[str] = ()) -> Path:
    """Print the table (when ``rows``), check and write the result file (``write_result``), say where."""
    if rows is not None:
        print(table(rows, header or []))
    path = write_result(name, payload, out, positive, present)
    print(f"wrote {path}")
    return path


# ---- pieces several benchmarks measure with ------------------------------------------------------

@contextlib.contextmanager
def local_run(cfg, ckpt: str | Path) -> Iterator[Any]:
    """The synchronous run ``miles train`` trains, on a local store in a temporary folder: started
    as the flow starts it (``learner/run_folder.py::start_step_run``: ``run.json``, adapter v0), then
    each ``collect`` commits its batch and each ``consume`` judges its staleness, updates,
    checkpoints and publishes. An arm that trains through it pays what a user's run pays."""
    from miles_core.learner.run_folder import start_step_run

    with tempfile.TemporaryDirectory(prefix="miles-arm-") as tmp:
        run, _ = start_step_run(str(Path(tmp) / "run"), cfg, str(ckpt), str(Path(tmp) / "run" / "store"))
        yield run


def rl_iteration(run, it: int, meter=None) -> tuple[Any, dict[str, float]]:
    """Iteration ``it`` of a :func:`local_run`: collect, then consume -> (batch, update stats);
    with ``meter`` (a FlopMeter), the two phases counted as ``sample`` and ``update``."""
    with meter.measure("sample") if meter else contextlib.nullcontext():
        bid, batch, _ = run.collect(it)
    with meter.measure("update") if meter else contextlib.nullcontext():
        _, stats = run.consume(bid)
    return batch, stats


def train_arm(cfg, ckpt: Path, sampler=None, after: Callable[[Any], dict] | None = None) -> dict:
    """ADPO from ``ckpt`` for ``train.iterations`` updates through :func:`local_run`, with the
    recipe's rollouts (NSD's threshold schedule, ``sampler.threshold_start``, included), FLOPs of
    sampling and of updates counted, then pass@1 on the held-out problems (decoded by ``sampler``
    when given, else the recipe's eval settings). ``after(run)``, called between training and
    evaluation, adds what it returns to the result (a peak memory, a saved adapter)."""
    from miles_core.eval.evaluate import run_eval
    from miles_core.flops import FlopMeter

    meter = FlopMeter()
    n = 0
    t0 = time.perf_counter()
    with local_run(cfg, ckpt) as run:
        for it in range(cfg.train.iterations):
            batch, _ = rl_iteration(run, it, meter)
            n += len(batch)
        seconds = time.perf_counter() - t0
        extra = after(run) if after is not None else {}
        r = run_eval(run.learner.model, run.learner.tok, cfg, run.data, sampler=sampler)
    return {"pass1": r.pass_at["pass@1"], "flops": meter.total, "sample_flops": meter.totals.get("sample", 0),
            "update_flops": meter.totals.get("update", 0), "completions": n, "seconds": seconds,
            "correct": [c[0] for c in r.correct], **extra}


def synthetic_batch(tok, batch: int, prompt_len: int, length: int, k: int, seed: int):
    """B trajectories of L tokens committed over K steps (L/K per step, random order), advantages
    +1/-1 so every row carries signal: an update's work without sampling first."""
    import torch

    from miles_core.types import TrajectoryBatch

    g = torch.Generator().manual_seed(seed)
    comp = torch.randint(200, 100_000, (batch, length), generator=g)
    step_map = torch.stack([torch.randperm(length, generator=g) * k // length for _ in range(batch)])   # [B, L]
    b = TrajectoryBatch(prompt_ids=[torch.randint(200, 100_000, (prompt_len,), generator=g).tolist()
                                    for _ in range(batch)],
                        completion_ids=comp, step_map=step_map, logp=-12.0 + 0.1 * torch.randn(batch, length, generator=g),
                        nfe=torch.full((batch,), k), group_id=torch.zeros(batch, dtype=torch.long),
                        policy_version=torch.zeros(batch, dtype=torch.long))
    b.advantage = torch.tensor([1.0, -1.0] * (batch // 2) + [1.0] * (batch % 2))
    return b
