"""Does ADPO teach a masked-diffusion LM something SFT cannot?

Per seed (each seed in its own process, one torch thread, so two seeds use the two cores):
  1. SFT on the scarce labelled set until validation pass@1 plateaus (curve recorded; the
     validation problems are held out and disjoint from the reported test problems);
  2. from that checkpoint, with the same number of sampled completions:
     (a) ADPO (per-step trajectory likelihood), (b) the d1 mean-field estimator,
     and (c) SFT continued on the labelled data for the wall-clock time (a) took;
  3. every arm evaluated on the same >= 500 held-out problems with one pinned eval config.
``--smoke``: seed 0, a 3-step SFT, 2 RL iterations of 4 x 4 completions per arm, 8 problems (seconds;
not a figure).
Writes benchmarks/results/learning.json. Run: python -m benchmarks.learning [--seeds 0 1] [--checkpoint DIR] [--smoke]
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.harness import (bench_args, finish, local_run, over_seeds, paired, results_dir, rl_iteration, seed_mean,
                                sft_checkpoint, workdir)

# SFT gets up to 6000 steps and stops earlier at its plateau (no validation gain for 3 evals); ADPO
# runs 300 iterations. Sized so that two seeds (one per core) finish within 30 minutes on 2 cores.
DEFAULT_OVERRIDES: list[str] = ["sft.steps=6000", "train.iterations=300"]
VAL_EVERY = 50  # ADPO / mean-field iterations between validation checks (their time is not counted)
# --smoke: the same arms at tiny sizes. One SFT validation (at its last step) gives the curve a point;
# every row is kept in the update, so a 3-step SFT policy (no reward spread needed) is updated.
SMOKE_SET = ["sft.steps=3", "sft.eval_every=3", "task.num_val=8", "task.num_test=8", "eval.num_problems=8",
             "train.iterations=2", "train.prompts_per_iter=4", "train.group_size=4", "update.skip_zero_variance=false"]
SMOKE = {"seeds": [0], "val_every": 2}


def run_seed(seed: int, overrides: list[str], out: str, plateau_patience: int, checkpoint: str | None = None,
             val_every: int = VAL_EVERY) -> dict:
    from miles_core.config import load_recipe
    from miles_core.models.base import load_checkpoint
    from miles_core.data.registry import build_task
    from miles_core.eval.evaluate import run_eval
    from miles_core.learner.baseline import continue_sft

    cfg = load_recipe("arith", overrides + [f"sft.seed={seed}", f"train.seed={seed}"])
    data = build_task(cfg)
    # to the plateau: no gain in validation pass@1 (200 problems) for plateau_patience evaluations
    sft = sft_checkpoint(cfg, seed, out, checkpoint, data, eval_problems=200, patience=plateau_patience)
    ckpt, sft_seconds = Path(sft["path"]), sft["seconds"]
    curve = [{"step": c["step"], "pass1": c["val_pass1"], "loss": c["loss"]} for c in sft["curve"]]

    def final_eval(model, tok) -> dict:
        r = run_eval(model, tok, cfg, data)
        return {"pass1": r.pass_at["pass@1"], "correct": [c[0] for c in r.correct], "config": r.config.to_dict(),
                "nfe_mean": r.metrics["nfe_mean"]}

    base, tok = load_checkpoint(ckpt)
    results = {"sft": final_eval(base, tok)}
    print(f"[seed {seed}] SFT pass@1 {results['sft']['pass1']:.3f}", flush=True)
    arms_time: dict[str, float] = {}
    samples: dict[str, int] = {}
    updates: dict[str, int] = {}   # iterations whose update scored rows (an arm with none never trained)
    rl_curves: dict[str, list[dict]] = {}
    for arm in ("adpo", "meanfield"):
        arm_cfg = load_recipe("arith", overrides + [f"update.estimator={arm}", f"train.seed={seed}"])
        t1 = time.perf_counter()
        n, n_up, eval_s, curve_rl = 0, 0, 0.0, []
        with local_run(arm_cfg, ckpt) as run:  # the run `miles train` trains: commits, checkpoints, publishes
            learner = run.learner
            for it in range(arm_cfg.train.iterations):
                batch, st = rl_iteration(run, it)
                n += len(batch)
                n_up += st.get("rows", 0) > 0
                if (it + 1) % 10 == 0:
                    r = float(batch.reward.nan_to_num(0).mean())
                    print(f"[seed {seed}] {arm} it {it + 1} reward {r:.3f} clip {st.get('clip_frac', 0):.3f} "
                          f"ent {st.get('entropy', 0):.3f}", flush=True)
                if (it + 1) % val_every == 0:
                    te = time.perf_counter()
                    v = run_eval(learner.model, learner.tok, arm_cfg, data, num_problems=200, split="val").pass_at["pass@1"]
                    curve_rl.append({"iteration": it + 1, "val_pass1": v})
                    eval_s += time.perf_counter() - te
            arms_time[arm] = time.perf_counter() - t1 - eval_s
            rl_curves[arm] = curve_rl
            samples[arm] = n
            updates[arm] = n_up
            results[arm] = final_eval(learner.model, learner.tok)
        print(f"[seed {seed}] {arm} pass@1 {results[arm]['pass1']:.3f} ({arms_time[arm]:.0f}s)", flush=True)
    # (c) SFT continued for the same wall-clock as ADPO, on the same labelled data, all weights
    t2 = time.perf_counter()
    model, tok = continue_sft(cfg, data, ckpt, arms_time["adpo"], seed)
    arms_time["sft_continued"] = time.perf_counter() - t2
    results["sft_continued"] = final_eval(model, tok)
    print(f"[seed {seed}] sft_continued pass@1 {results['sft_continued']['pass1']:.3f}", flush=True)
    return {"seed": seed, "results": results, "sft_curve": curve, "sft_seconds": sft_seconds, "sft_trained": sft["trained"],
            "arm_seconds": arms_time, "samples": samples, "updates": updates, "rl_curves": rl_curves}


def plot_curves(per_seed: list[dict], name: str = "learning") -> None:
    """NAME.png beside the result (``results_dir()``): SFT validation curve to its plateau, then the RL arms'."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no learning-curve plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for p in per_seed:
        c = p["sft_curve"]
        axes[0].plot([x["step"] for x in c], [x["pass1"] for x in c], marker="o", label=f"seed {p['seed']}")
        for arm, style in (("adpo", "-"), ("meanfield", "--")):
            rc = p["rl_curves"].get(arm, [])
            axes[1].plot([0] + [x["iteration"] for x in rc], [c[-1]["pass1"]] + [x["val_pass1"] for x in rc],
                         style, marker="o", label=f"{arm} seed {p['seed']}")
    axes[0].set(title="SFT on the labelled set", xlabel="step", ylabel="validation pass@1 (200)")
    axes[1].set(title="RL from the SFT checkpoint", xlabel="iteration", ylabel="validation pass@1 (200)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = results_dir() / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0, 1), checkpoint=True, workdir=True)
    ap.add_argument("--patience", type=int, default=3, help="SFT evals without improvement = plateau")
    ap.add_argument("--val-every", type=int, default=VAL_EVERY, help="RL iterations between validation checks")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE, set=SMOKE_SET + args.set)
    overrides = DEFAULT_OVERRIDES + args.set
    t0 = time.perf_counter()
    per_seed = over_seeds(run_seed, args.seeds, overrides, str(workdir(args, "learning")), args.patience, args.checkpoint,
                          args.val_every)
    arms = ["sft", "adpo", "meanfield", "sft_continued"]
    mean = {a: seed_mean(per_seed, lambda p: p["results"][a]["pass1"]) for a in arms}
    st = paired([c for p in per_seed for c in p["results"]["adpo"]["correct"]],
                [c for p in per_seed for c in p["results"]["sft"]["correct"]])
    rows = [[p["seed"]] + [p["results"][a]["pass1"] for a in arms] for p in per_seed]
    rows.append(["mean"] + [mean[a] for a in arms])
    print(f"ADPO - SFT = {mean['adpo'] - mean['sft']:+.4f}; sign test wins {st['wins']} losses {st['losses']} p = {st['p']:.3g}")
    payload = {
        "sft_pass1": mean["sft"], "adpo_pass1": mean["adpo"], "meanfield_pass1": mean["meanfield"],
        "sft_continued_pass1": mean["sft_continued"], "adpo_minus_sft": mean["adpo"] - mean["sft"],
        "paired_sign_test_p": st["p"], "sign_test_wins": st["wins"], "sign_test_losses": st["losses"],
        "seeds": args.seeds, "samples": {str(p["seed"]): p["samples"] for p in per_seed},
        "updates": {str(p["seed"]): p["updates"] for p in per_seed},
        "arm_seconds": {a: seed_mean(per_seed, lambda p: p["arm_seconds"][a]) for a in per_seed[0]["arm_seconds"]},
        "seconds": time.perf_counter() - t0, "eval_config": per_seed[0]["results"]["sft"]["config"],
        "overrides": overrides, "checkpoint": args.checkpoint, "smoke": args.smoke,
        "per_seed": [{"seed": p["seed"], **{f"{a}_pass1": p["results"][a]["pass1"] for a in arms},
                      "sft_curve": p["sft_curve"], "sft_seconds": p["sft_seconds"], "sft_trained": p["sft_trained"],
                      "rl_curves": p["rl_curves"], "arm_seconds": p["arm_seconds"]} for p in per_seed],
    }
    plot_curves(per_seed, "learning_smoke" if args.smoke else "learning")
    finish("learning", payload, rows, ["seed", "sft", "adpo", "meanfield", "sft_continued"], args.out,
           positive=[f"{what}.*.{arm}" for what in ("samples", "updates") for arm in ("adpo", "meanfield")]
           + [f"arm_seconds.{a}" for a in ("adpo", "meanfield", "sft_continued")],
           present=[f"{a}_pass1" for a in arms] + ["adpo_minus_sft", "paired_sign_test_p"])


if __name__ == "__main__":
    main()
