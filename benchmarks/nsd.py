"""Native Speculative Denoising vs static schedules: FLOPs, NFE, speed and accuracy.

Part 1, sampling: on >= 500 held-out problems (greedy), the static schedule with one token per
step and the LLaDA-style fixed K, against NSD at several confidence thresholds.
Part 2, training: ADPO from the same SFT checkpoint with static versus NSD rollouts for the same
number of sampled completions; total denoiser FLOPs (sampling + update) and final pass@1 under
one pinned eval config, averaged over ``--train-seeds`` (one run is within its own noise of 2 points:
a binomial SE of 2.1 points on 500 problems alone). FLOPs are measured with torch.utils.flop_counter.
Run: python -m benchmarks.nsd [--checkpoint DIR] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import table, write_result
from miles_core.config import SamplerConfig, load_recipe
from miles_core.eval.evaluate import evaluate
from miles_core.flops import FlopMeter
from miles_core.models.base import load_checkpoint
from miles_core.rewards.registry import get_reward
from miles_core.data.registry import build_task
from miles_core.eval.evaluate import eval_config, run_eval
from miles_core.learner.baseline import train_baseline
from miles_core.learner.policy import Learner


def sampling_part(cfg, data, ckpt: Path, thresholds: list[float], n: int) -> list[dict]:
    model, tok = load_checkpoint(ckpt)
    L = cfg.task.completion_len
    probs = data.test[:n]
    settings = [("static K=L (1 tok/step)", SamplerConfig(kind="static", steps=L, temperature=0.0)),
                (f"static K={cfg.eval.steps} (LLaDA)", SamplerConfig(kind="static", steps=cfg.eval.steps, temperature=0.0))]
    settings += [(f"nsd thr={t}", SamplerConfig(kind="nsd", threshold=t, max_per_step=cfg.sampler.max_per_step,
                                                temperature=0.0)) for t in thresholds]
    rows = []
    for name, s in settings:
        meter = FlopMeter()
        t0 = time.perf_counter()
        with meter.measure("sample"):
            r = evaluate(model, tok, [p.prompt for p in probs], [p.answer for p in probs],
                         eval_config(cfg, n, s), get_reward("math_exact"), batch_size=cfg.eval.batch_size, sampler=s)
        sec = time.perf_counter() - t0
        rows.append({"name": name, "kind": s.kind, "threshold": s.threshold if s.kind == "nsd" else None,
                     "pass1": r.pass_at["pass@1"], "nfe": r.metrics["nfe_mean"], "flops": meter.total,
                     "tokens_per_s": n * L / sec, "seconds": sec})
        print(f"  {name}: pass@1 {rows[-1]['pass1']:.3f} NFE {rows[-1]['nfe']:.2f} GFLOP {meter.total / 1e9:.2f}", flush=True)
    return rows


def training_part(cfg, data, ckpt: Path, sampler: SamplerConfig, iterations: int, seed: int,
                  thr_start: float | None = None) -> dict:
    learner = Learner(cfg, ckpt)
    meter = FlopMeter()
    n = 0
    t0 = time.perf_counter()
    for it in range(iterations):
        s = sampler
        if sampler.kind == "nsd" and thr_start is not None:  # threshold schedule: strict early, target later
            frac = it / max(iterations - 1, 1)
            s = dataclasses.replace(s, threshold=thr_start + (sampler.threshold - thr_start) * min(1.0, 2 * frac))
        with meter.measure("sample"):
            batch = learner.sample(data, it, cfg=dataclasses.replace(cfg, sampler=s))
        n += len(batch)
        with meter.measure("update"):
            learner.update(batch, temperature=sampler.temperature)
    seconds = time.perf_counter() - t0
    r = run_eval(learner.model, learner.tok, cfg, data)
    return {"pass1": r.pass_at["pass@1"], "flops": meter.total, "sample_flops": meter.totals.get("sample", 0),
            "update_flops": meter.totals.get("update", 0), "completions": n, "seconds": seconds}


def _mean_runs(runs: list[dict], seeds: list[int]) -> dict:
    """Seed-averaged pass@1 and FLOPs; the per-seed runs kept alongside."""
    keys = ("pass1", "flops", "sample_flops", "update_flops", "completions", "seconds")
    return {**{k: sum(r[k] for r in runs) / len(runs) for k in keys}, "seeds": seeds, "per_seed": runs}


def _train_job(job: tuple) -> dict:
    """One (arm, seed) training run in its own process with one torch thread (runs in parallel)."""
    overrides, ckpt, sampler, iterations, seed, thr_start = job
    torch.set_num_threads(1)
    cfg = load_recipe("arith", [*overrides, f"train.seed={seed}"])
    return training_part(cfg, build_task(cfg), Path(ckpt), sampler, iterations, seed, thr_start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="SFT checkpoint folder (trained here when absent)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9, 0.95])
    ap.add_argument("--train-threshold", type=float, default=0.9)
    ap.add_argument("--problems", type=int, default=500)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1],
                    help="ADPO seeds per arm (part 2 runs them two at a time, one thread each)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (state it with the figures)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    cfg = load_recipe("arith", args.set)
    data = build_task(cfg)
    ckpt = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="miles-nsd-")) / "sft"
    if not (ckpt / "config.json").exists():
        print("training the SFT checkpoint ...", flush=True)
        train_baseline(cfg, data, ckpt, seed=args.seed)
    print("part 1: sampling", flush=True)
    rows = sampling_part(cfg, data, ckpt, args.thresholds, args.problems)
    static1 = rows[0]
    nsd_rows = [r for r in rows if r["kind"] == "nsd"]
    ok = [r for r in nsd_rows if r["pass1"] >= static1["pass1"] - 0.01]
    chosen = min(ok, key=lambda r: r["flops"]) if ok else max(nsd_rows, key=lambda r: r["pass1"])
    print(table([[r["name"], r["pass1"], r["nfe"], r["flops"] / 1e9, r["tokens_per_s"]] for r in rows],
                ["sampler", "pass@1", "NFE", "GFLOP", "tokens/s"]))
    print("part 2: ADPO training with static vs NSD rollouts", flush=True)
    iters = args.iterations or cfg.train.iterations
    static_s = replace(cfg.sampler, kind="static")
    nsd_s = replace(cfg.sampler, kind="nsd", threshold=args.train_threshold)
    thr0 = min(0.99, args.train_threshold + 0.05)
    jobs = [(args.set, str(ckpt), sm, iters, sd, ts) for sm, ts in ((static_s, None), (nsd_s, thr0))
            for sd in args.train_seeds]
    with mp.get_context("spawn").Pool(2) as pool:
        runs = pool.map(_train_job, jobs)
    k = len(args.train_seeds)
    tr_static, tr_nsd = (_mean_runs(runs[:k], args.train_seeds), _mean_runs(runs[k:], args.train_seeds))
    print(table([["static", tr_static["pass1"], tr_static["sample_flops"] / 1e9, tr_static["update_flops"] / 1e9,
                  tr_static["flops"] / 1e9],
                 ["nsd", tr_nsd["pass1"], tr_nsd["sample_flops"] / 1e9, tr_nsd["update_flops"] / 1e9,
                  tr_nsd["flops"] / 1e9]], ["rollouts", "final pass@1", "sample GFLOP", "update GFLOP", "total GFLOP"]))
    payload = {
        "static_flops": static1["flops"], "nsd_flops": chosen["flops"],
        "flops_reduction": 1 - chosen["flops"] / static1["flops"], "static_pass1": static1["pass1"],
        "nsd_pass1": chosen["pass1"], "nsd_threshold": chosen["threshold"],
        "train_flops_reduction": 1 - tr_nsd["flops"] / tr_static["flops"], "train_static_pass1": tr_static["pass1"],
        "train_nsd_pass1": tr_nsd["pass1"], "train_static": tr_static, "train_nsd": tr_nsd,
        "train_static_sampler": static_s.__dict__, "train_nsd_sampler": nsd_s.__dict__, "sampling_rows": rows,
        "problems": args.problems, "overrides": args.set, "threads": args.threads, "seconds": time.perf_counter() - t_all,
        "eval_config": eval_config(cfg).to_dict(),
    }
    print(f"flops_reduction {payload['flops_reduction']:.3f} (pass@1 {chosen['pass1']:.3f} vs {static1['pass1']:.3f}); "
          f"train_flops_reduction {payload['train_flops_reduction']:.3f} "
          f"(pass@1 {tr_nsd['pass1']:.3f} vs {tr_static['pass1']:.3f})")
    print(f"wrote {write_result('nsd', payload)}")


if __name__ == "__main__":
    main()
