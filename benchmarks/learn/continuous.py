"""Does ADPO improve a continuous diffusion policy beyond its imperfect demonstrations?

Per seed, on one thread:
  1. SFT (denoising pretraining) of a prompt-conditioned eps-network on noisy demonstrations of
     the constraint task (exact solutions + noise; most demos miss the tolerance);
  2. ADPO from that checkpoint: LoRA, G samples per prompt from the stochastic DDIM sampler
     (eta = 1, ``--sde-steps`` steps), group-relative advantages, per-step Gaussian log-prob rows;
  3. both policies evaluated on the held-out prompts (disjoint by hash) with the same seeded
     initial noise: the many-step SDE sampler (the one ADPO trains) and the deterministic ODE
     sampler (DDIM eta = 0) with ``--ode-steps`` <= sde_steps / 4 steps.
``--smoke``: the same three stages at toy sizes (hidden 16, 5 SFT steps, 2 ADPO iterations of
2 prompts x 2 samples, 8 SDE steps, one evaluation sample per prompt): the path, not the figure.
Writes benchmarks/results/continuous.json. Run: python -m benchmarks.continuous [--seeds 0] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.harness import add_smoke, table, write_result

# --smoke: every stage once or twice at toy sizes (ode_steps * 4 <= sde_steps still holds)
SMOKE = {"seeds": [0], "hidden": 16, "demos_per_prompt": 1, "sft_steps": 5, "sft_batch": 16, "iterations": 2,
         "prompts_per_iter": 2, "group_size": 2, "minibatches": 1, "row_chunk": 64, "sde_steps": 8, "ode_steps": 2,
         "ode_few_steps": 1, "eval_samples": 1}


def run_seed(seed: int, args: argparse.Namespace) -> dict:
    """One seed's SFT, ADPO and held-out evaluations (module docstring), with their seconds."""
    import torch

    torch.set_num_threads(1)
    from miles_core.config import AdpoSettings, UpdateConfig
    from miles_core.continuous.policy import LORA_TARGETS, ContinuousDenoiser, DenoiserConfig, encode_prompts
    from miles_core.continuous.sde import NoiseSchedule
    from miles_core.continuous.task import LATENT_DIM, ConstraintTask
    from miles_core.continuous.train import update_policy, evaluate, rollout, train_denoiser
    from miles_core.models.lora import add_lora, trainable_parameters
    from miles_core.tokenizer import CharTokenizer

    tok, task, sched = CharTokenizer(), ConstraintTask(), NoiseSchedule()
    train_prompts, test_prompts = task.split("train"), task.split("test")
    test_ids = encode_prompts(tok, test_prompts, args.prompt_len)
    t0 = time.perf_counter()
    rep, demos = task.demonstrations(train_prompts, args.demos_per_prompt, seed=seed)
    demo_success = float(task.success(rep, demos).float().mean())
    torch.manual_seed(seed)
    model = ContinuousDenoiser(DenoiserConfig(LATENT_DIM, tok.vocab_size, prompt_len=args.prompt_len, hidden=args.hidden))
    losses = train_denoiser(model, encode_prompts(tok, rep, args.prompt_len), demos, args.sft_steps, args.sft_batch,
                            args.sft_lr, seed, sched)
    sft_seconds = time.perf_counter() - t0
    final_loss = sum(losses[-100:]) / len(losses[-100:])  # the last 100 steps' mean (all of them when fewer)
    print(f"[seed {seed}] SFT {args.sft_steps} steps in {sft_seconds:.0f}s, final loss {final_loss:.4f}; "
          f"demo success {demo_success:.3f}", flush=True)

    samplers = {"sde": (args.sde_steps, 1.0, 1), "ode": (args.ode_steps, 0.0, 1), "ode_dpm2": (args.ode_steps, 0.0, 2),
                "ode_few": (args.ode_few_steps, 0.0, 1), "ode_many": (args.sde_steps, 0.0, 1)}

    def eval_all(policy) -> dict[str, dict[str, float]]:
        return {name: evaluate(policy, task, test_prompts, test_ids, args.eval_samples, steps, eta, seed + 777,
                               schedule=sched, order=order) for name, (steps, eta, order) in samplers.items()}

    sft_eval = eval_all(model)
    print(f"[seed {seed}] SFT held-out success: " + ", ".join(f"{k} {v['success']:.3f}" for k, v in sft_eval.items()), flush=True)

    policy = add_lora(model, r=args.lora_r, alpha=2 * args.lora_r, targets=LORA_TARGETS)
    opt = torch.optim.Adam(trainable_parameters(policy), lr=args.lr)
    cfg = UpdateConfig(clip_eps=args.clip_eps, is_cap=2.0, num_minibatches=args.minibatches, row_chunk=args.row_chunk,
                       std_normalize=True)
    own = AdpoSettings(step_fraction=args.step_fraction)
    g = torch.Generator().manual_seed(seed + 1)
    rng = random.Random(seed)
    curve = []
    t1 = time.perf_counter()
    for it in range(args.iterations):
        prompts = rng.sample(train_prompts, args.prompts_per_iter)
        batch = rollout(policy, task, prompts, encode_prompts(tok, prompts, args.prompt_len), args.group_size,
                        args.sde_steps, 1.0, g, policy_version=it, schedule=sched)
        stats = update_policy(policy, opt, batch, cfg, g, sched, max_timestep=args.max_train_timestep, own=own)
        point = {"iteration": it + 1, "reward": float(batch.reward.mean()),
                 "success": float(task.success(batch.prompts, batch.samples).float().mean()),
                 "clip_frac": stats.get("clip_frac", 0.0), "approx_kl": stats.get("approx_kl", 0.0),
                 "rows": stats.get("rows", 0.0)}
        curve.append(point)
        if (it + 1) % 10 == 0:
            print(f"[seed {seed}] adpo it {it + 1} train reward {point['reward']:.4f} success {point['success']:.3f} "
                  f"clip {point['clip_frac']:.3f} kl {point['approx_kl']:.4f} ({time.perf_counter() - t1:.0f}s)", flush=True)
    adpo_seconds = time.perf_counter() - t1
    adpo_eval = eval_all(policy)
    print(f"[seed {seed}] ADPO held-out success: " + ", ".join(f"{k} {v['success']:.3f}" for k, v in adpo_eval.items()),
          flush=True)
    return {"seed": seed, "demo_success": demo_success, "sft": sft_eval, "adpo": adpo_eval, "curve": curve,
            "sft_seconds": sft_seconds, "adpo_seconds": adpo_seconds, "sft_final_loss": final_loss,
            "samples_trained": args.iterations * args.prompts_per_iter * args.group_size,
            "updates": len(curve), "rows_trained": sum(p["rows"] for p in curve)}


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--demos-per-prompt", type=int, default=64)
    ap.add_argument("--sft-steps", type=int, default=6000)
    ap.add_argument("--sft-batch", type=int, default=256)
    ap.add_argument("--sft-lr", type=float, default=2e-3)
    ap.add_argument("--iterations", type=int, default=80)
    ap.add_argument("--prompts-per-iter", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--clip-eps", type=float, default=0.1)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--step-fraction", type=float, default=1.0)
    ap.add_argument("--max-train-timestep", type=int, default=200,
                    help="train only steps starting at t <= this (low-noise end; see update_policy)")
    ap.add_argument("--row-chunk", type=int, default=4096)
    ap.add_argument("--sde-steps", type=int, default=100)
    ap.add_argument("--ode-steps", type=int, default=25)
    ap.add_argument("--ode-few-steps", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=32, help="samples per held-out prompt")
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.ode_steps * 4 > args.sde_steps:
        ap.error(f"--ode-steps ({args.ode_steps}) must be <= --sde-steps / 4 ({args.sde_steps / 4:g})")
    t0 = time.perf_counter()
    per_seed = [run_seed(s, args) for s in args.seeds]
    n = len(per_seed)
    mean = lambda arm, sampler, key: sum(p[arm][sampler][key] for p in per_seed) / n  # noqa: E731
    rows = [[arm, f"{name} ({steps} steps{', eta=1' if name == 'sde' else ''}{', 2M' if name == 'ode_dpm2' else ''})",
             mean(arm, name, "success"), mean(arm, name, "mean_reward")]
            for arm in ("sft", "adpo")
            for name, steps in (("sde", args.sde_steps), ("ode", args.ode_steps), ("ode_dpm2", args.ode_steps),
                                ("ode_few", args.ode_few_steps), ("ode_many", args.sde_steps))]
    print(table(rows, ["policy", "sampler", "success", "mean_reward"]))
    sft, adpo, ode = mean("sft", "sde", "success"), mean("adpo", "sde", "success"), mean("adpo", "ode", "success")
    print(f"ADPO - SFT (SDE {args.sde_steps} steps) = {adpo - sft:+.4f}; ADPO ODE {args.ode_steps} steps - SDE "
          f"{args.sde_steps} steps = {ode - adpo:+.4f}; ODE {args.ode_steps} - ODE {args.sde_steps} steps = "
          f"{ode - mean('adpo', 'ode_many', 'success'):+.4f}; demo success {sum(p['demo_success'] for p in per_seed) / n:.3f}")
    payload = {
        "sft_success": sft, "adpo_success": adpo, "adpo_minus_sft": adpo - sft,
        "sft_mean_reward": mean("sft", "sde", "mean_reward"), "adpo_mean_reward": mean("adpo", "sde", "mean_reward"),
        "ode_steps": args.ode_steps, "sde_steps": args.sde_steps,
        "ode_success": ode, "ode_mean_reward": mean("adpo", "ode", "mean_reward"), "ode_minus_sde": ode - adpo,
        "ode_dpm2_success": mean("adpo", "ode_dpm2", "success"),
        "ode_few_steps": args.ode_few_steps, "ode_few_success": mean("adpo", "ode_few", "success"),
        "ode_many_success": mean("adpo", "ode_many", "success"),
        "ode_minus_ode_many": ode - mean("adpo", "ode_many", "success"),
        "sft_ode_success": mean("sft", "ode", "success"), "sft_ode_minus_sde": mean("sft", "ode", "success") - sft,
        "demo_success": sum(p["demo_success"] for p in per_seed) / n,
        "eval_samples": per_seed[0]["sft"]["sde"]["samples"],
        "seeds": args.seeds, "seconds": time.perf_counter() - t0, "config": vars(args), "per_seed": per_seed,
        "smoke": args.smoke,
    }
    # every seed must have trained (SFT and ADPO seconds, updates, rows) before its success rates mean anything
    path = write_result("continuous", payload, args.out,
                        positive=["seconds", "eval_samples", *(f"per_seed.*.{k}" for k in (
                            "sft_seconds", "adpo_seconds", "updates", "rows_trained", "samples_trained"))],
                        present=["sft_success", "adpo_success", "ode_success", "ode_dpm2_success", "ode_few_success",
                                 "ode_many_success", "demo_success"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
