"""Native Speculative Denoising vs static schedules: FLOPs, NFE, speed and accuracy.

Part 1, sampling: on >= 500 held-out problems (greedy), the static schedule with one token per
step and the LLaDA-style fixed K, against NSD at several confidence thresholds; FLOPs per forward
(per NFE: one sequence through the denoiser for one step) per mode, so a schedule that spent
forwards on finished rows would show it.
Part 2, training: ADPO from the same SFT checkpoint, for the same number of sampled completions:
static rollouts with the recipe's update (covering rows, rho = estimators.adpo.step_fraction) against NSD's
both halves: NSD rollouts, and an update whose rows are drawn where the behaviour policy had a
choice (``estimators.adpo.step_sampling=uncertainty`` at rho = ``--train-step-fraction``, reweighted so the
objective is unchanged). Total denoiser FLOPs (sampling + update) and final pass@1 under one pinned
eval config, over ``--seeds`` (one run is within its own noise of 2 points: a binomial SE of 2.1
points on 500 problems alone), with the paired sign test over every (seed, problem) pair. FLOPs are
measured with torch.utils.flop_counter. The SFT checkpoint (seed ``sft.seed``) is ``--checkpoint
DIR``'s, trained there when absent. ``--smoke``: a 3-step SFT, one NSD threshold, 8 problems, the three
training arms for 2 iterations of 4 x 4 completions on seed 0 (seconds; not a figure).
Run: python -m benchmarks.nsd [--checkpoint DIR] [--seeds 0 1 2 3] [--set key=value ...] [--smoke]
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.harness import bench_args, finish, over_seeds, paired, sft_checkpoint, table, train_arm, workdir
from miles_core.config import SamplerConfig, load_recipe
from miles_core.eval.evaluate import evaluate
from miles_core.flops import FlopMeter
from miles_core.models.base import load_checkpoint
from miles_core.rewards.registry import get_reward
from miles_core.data.registry import build_task
from miles_core.eval.evaluate import eval_config

# --smoke: both parts at tiny sizes. Every row is kept in the update, so each arm of a 3-step SFT
# policy (no reward spread needed) is updated and its update FLOPs measured.
SMOKE_SET = ["sft.steps=3", "task.num_test=8", "eval.num_problems=8", "train.prompts_per_iter=4", "train.group_size=4",
             "update.skip_zero_variance=false"]
SMOKE = {"thresholds": [0.9], "problems": 8, "iterations": 2, "seeds": [0], "threads": 1}


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
                     "flops_per_forward": meter.total / (r.metrics["nfe_mean"] * len(probs)),
                     "tokens_per_s": n * L / sec, "seconds": sec})
        print(f"  {name}: pass@1 {rows[-1]['pass1']:.3f} NFE {rows[-1]['nfe']:.2f} GFLOP {meter.total / 1e9:.2f}", flush=True)
    return rows


def _mean_runs(runs: list[dict], seeds: list[int]) -> dict:
    """Seed-averaged pass@1 and FLOPs; the per-seed runs kept alongside."""
    keys = ("pass1", "flops", "sample_flops", "update_flops", "completions", "seconds")
    return {**{k: sum(r[k] for r in runs) / len(runs) for k in keys}, "seeds": seeds,
            "per_seed": [{k: v for k, v in r.items() if k != "correct"} for r in runs]}


def _train_job(job: tuple, overrides: list[str], ckpt: str, iterations: int) -> dict:
    """One (rollout sampler's settings, the arm's own update settings, seed) training run
    (``over_seeds`` runs them in parallel)."""
    sampler, arm, seed = job
    cfg = load_recipe("arith", [*overrides, *sampler, *arm, f"train.seed={seed}", f"train.iterations={iterations}"])
    return train_arm(cfg, Path(ckpt))


def nsd_update(step_fraction: float) -> list[str]:
    """NSD's update: rows where the behaviour policy had a choice, rho K_b of them expected."""
    return ["estimators.adpo.step_cover=false", "estimators.adpo.step_sampling=uncertainty", f"estimators.adpo.step_fraction={step_fraction}"]


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0, 1, 2, 3), checkpoint=True, workdir=True)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9, 0.95])
    ap.add_argument("--train-threshold", type=float, default=0.9)
    ap.add_argument("--train-step-fraction", type=float, default=0.3,
                    help="rho of NSD's update: expected rows per trajectory / its steps (static: the recipe's)")
    ap.add_argument("--problems", type=int, default=500)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of part 1 (state it with the figures)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE, set=SMOKE_SET + args.set)
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    cfg = load_recipe("arith", args.set)
    data = build_task(cfg)
    sft = sft_checkpoint(cfg, cfg.sft.seed, workdir(args, "nsd"), args.checkpoint, data, validate=False)
    ckpt = Path(sft["path"])
    print("part 1: sampling", flush=True)
    rows = sampling_part(cfg, data, ckpt, args.thresholds, args.problems)
    static1 = rows[0]
    nsd_rows = [r for r in rows if r["kind"] == "nsd"]
    ok = [r for r in nsd_rows if r["pass1"] >= static1["pass1"] - 0.01]
    chosen = min(ok, key=lambda r: r["flops"]) if ok else max(nsd_rows, key=lambda r: r["pass1"])
    print(table([[r["name"], r["pass1"], r["nfe"], r["flops"] / 1e9, r["flops_per_forward"] / 1e6, r["tokens_per_s"]]
                 for r in rows], ["sampler", "pass@1", "NFE", "GFLOP", "MFLOP per forward", "tokens/s"]))
    print("part 2: ADPO training with static vs NSD rollouts", flush=True)
    iters = args.iterations or cfg.train.iterations
    # NSD's rollouts start stricter (threshold + 0.05) and reach the threshold by half the run
    static_s = ["sampler.kind=static"]
    nsd_s = ["sampler.kind=nsd", f"sampler.threshold={args.train_threshold}",
             f"sampler.threshold_start={min(0.99, args.train_threshold + 0.05)}"]
    nsd_arm = nsd_update(args.train_step_fraction)
    # the control: NSD rollouts and the same expected rows, drawn uniformly (what the allocation adds)
    uniform_arm = ["estimators.adpo.step_cover=false", f"estimators.adpo.step_fraction={args.train_step_fraction}"]
    arms = ((static_s, []), (nsd_s, nsd_arm), (nsd_s, uniform_arm))
    jobs = [(sm, arm, sd) for sm, arm in arms for sd in args.seeds]
    runs = over_seeds(_train_job, jobs, args.set, str(ckpt), iters)
    k = len(args.seeds)
    by_arm = [runs[i * k:(i + 1) * k] for i in range(len(arms))]
    tr_static, tr_nsd, tr_uniform = (_mean_runs(r, args.seeds) for r in by_arm)

    def against_static(arm_runs: list[dict]) -> dict:
        """Every (seed, problem) pair: the arm's run against the static run of the same seed."""
        return paired([c for r in arm_runs for c in r["correct"]], [c for r in by_arm[0] for c in r["correct"]])

    test, test_uniform = against_static(by_arm[1]), against_static(by_arm[2])
    payload = {
        "static_flops": static1["flops"], "nsd_flops": chosen["flops"],
        "flops_reduction": 1 - chosen["flops"] / static1["flops"], "static_pass1": static1["pass1"],
        "nsd_pass1": chosen["pass1"], "nsd_threshold": chosen["threshold"],
        "train_flops_reduction": 1 - tr_nsd["flops"] / tr_static["flops"], "train_static_pass1": tr_static["pass1"],
        "train_nsd_pass1": tr_nsd["pass1"], "train_paired": test, "train_p": test["p"],
        "train_static": tr_static, "train_nsd": tr_nsd, "train_nsd_overrides": nsd_arm,
        "train_nsd_uniform": {**tr_uniform, "overrides": uniform_arm, "paired_vs_static": test_uniform},
        "flops_per_forward": {r["name"]: r["flops_per_forward"] for r in rows},
        "train_static_sampler": load_recipe("arith", [*args.set, *static_s]).sampler.__dict__,
        "train_nsd_sampler": load_recipe("arith", [*args.set, *nsd_s]).sampler.__dict__, "sampling_rows": rows,
        "problems": args.problems, "overrides": args.set, "threads": args.threads, "seconds": time.perf_counter() - t_all,
        "smoke": args.smoke,
        "eval_config": eval_config(cfg).to_dict(), "sft_checkpoint": {k: v for k, v in sft.items() if k != "curve"},
    }
    print(f"flops_reduction {payload['flops_reduction']:.3f} (pass@1 {chosen['pass1']:.3f} vs {static1['pass1']:.3f}); "
          f"train_flops_reduction {payload['train_flops_reduction']:.3f} "
          f"(pass@1 {tr_nsd['pass1']:.3f} vs {tr_static['pass1']:.3f}, paired over {k} seeds: "
          f"{test['wins']:.0f} won, {test['losses']:.0f} lost, p = {test['p']:.3g})")
    finish("nsd", payload, [[name, r["pass1"], r["sample_flops"] / 1e9, r["update_flops"] / 1e9, r["flops"] / 1e9,
                             "" if t is None else f"{t['wins']:.0f} / {t['losses']:.0f}, p = {t['p']:.3g}"]
                            for name, r, t in (("static K=8, covering rows", tr_static, None),
                                               ("NSD, rows by uncertainty", tr_nsd, test),
                                               ("NSD, rows uniform (control)", tr_uniform, test_uniform))],
           ["rollouts, update", "final pass@1", "sample GFLOP", "update GFLOP", "total GFLOP", "vs static"], args.out,
           positive=["static_flops", "nsd_flops", "flops_per_forward.*"]
           + [f"{arm}.{k}" for arm in ("train_static", "train_nsd", "train_nsd_uniform")
              for k in ("sample_flops", "update_flops", "completions", "seconds")],
           present=["static_pass1", "nsd_pass1", "flops_reduction", "train_flops_reduction", "train_static_pass1",
                    "train_nsd_pass1", "train_nsd_uniform.pass1", "train_p"])


if __name__ == "__main__":
    main()
