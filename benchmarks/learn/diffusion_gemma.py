"""RL for DiffusionGemma through transformers' own class: a tiny model SFT'd on arith, then ADPO.

Per seed (each in its own process, one torch thread, so two seeds use the two cores):
  1. a random-init text-only DiffusionGemma (the real config fields, sliding + full layers, MoE,
     self-conditioning) is SFT'd on the arith demonstrations (algo/renoise_sft.py), keeping the
     checkpoint with the best validation pass@1;
  2. the renoising sampler is checked against ``model.generate`` on test prompts (``generate_match``);
  3. ADPO with LoRA on the decoder from that checkpoint (algo/renoise_rows.py), seconds per iteration;
  4. SFT and ADPO evaluated on the same held-out problems with pinned sampler seeds, paired sign test;
  5. on a batch the SFT policy sampled, scored by the trained policy: the log-prob error a stored
     top-k of the behaviour's logits would leave in place of rebuilding the self-conditioning.
With ``--workdir DIR``, a seed's SFT checkpoint there is reused when its recorded settings match.
``--smoke`` (CI): seed 0 alone, every step at toy sizes (SMOKE: a few SFT steps, 2 RL iterations
of 2 x 2 chains, 8 test and 8 validation problems): seconds, and no figure.
Writes benchmarks/results/diffusion_gemma.json. Run: python -m benchmarks.diffusion_gemma [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

from benchmarks.harness import bench_args, finish, over_seeds, paired, table, workdir

SIZES = dict(hidden=64, layers=2, heads=4, experts=4)
RENOISE = dict(max_steps=16)      # generate's defaults otherwise (entropy bound 0.1, T 0.8 -> 0.4)
EVAL_SEED = 10_000_000            # problem i is sampled with seed EVAL_SEED + i, for every arm
# RL arms from one SFT checkpoint per seed (--arms): what might make the renoising chain's signal
# strong enough to learn from; each overrides the RL settings of the command line
ARMS: dict[str, dict] = {
    "adpo": {},                                   # the defaults: lr 1e-3, 16 prompts x 8, 300 iterations
    "lr3x": {"rl_lr": 3e-3},                      # a higher learning rate
    "lr_third": {"rl_lr": 3e-4},                  # a lower one: grad_snr's ascent lasts < 1 Adam step at 1e-3
    "group16": {"group": 16},                     # more samples per prompt: a less noisy group baseline
    "std": {"std_normalize": True},               # advantages / the group's std: full-size steps on small spreads
    "long": {"iterations": 900},                  # three times the iterations
    "output": {"renoise_output": True},           # also score the output (last argmax) at the last step's T
    "output_std": {"renoise_output": True, "std_normalize": True},
    # RL chains output their last step's sample (renoise.output), scored by the output row: every token
    # the reward reads is then a sampled action; evaluated, like every arm, on generate's argmax output
    "sampled": {"renoise_output": True, "train_output": "sample"},
}
# --smoke: the same steps at toy sizes (one SFT validation, at the last step, keeps the checkpoint)
SMOKE = dict(sft_steps=4, sft_eval_every=4, iterations=2, rl_eval_every=2, prompts=2, group=2, num_test=8,
             num_val=8, generate_checks=2, top_k=[1, 8])


def evaluate(model, tok, problems, rcfg, reward_fn, batch: int = 250) -> list[bool]:
    import torch

    from miles_core.rewards.registry import call_reward
    from miles_core.samplers.renoise import sample

    out: list[bool] = []
    for s in range(0, len(problems), batch):
        part = problems[s:s + batch]
        b = sample(model, tok, [tok.encode_prompt(p.prompt) for p in part], rcfg,
                   torch.arange(s, s + len(part)) + EVAL_SEED)
        r = call_reward(reward_fn, [p.prompt for p in part], b.completions, answer=[p.answer for p in part])
        out += [v is not None and v >= 1.0 for v in r]
    return out


def run_seed(seed: int, args: argparse.Namespace, out: str) -> dict:
    import torch

    from miles_core.algo.renoise_sft import canvases, sft_loss
    from miles_core.config import RenoiseConfig, load_recipe
    from miles_core.data.registry import build_task
    from miles_core.models import diffusion_gemma as dg
    from miles_core.rewards.registry import reward_for_recipe
    from miles_core.tokenizer import CharTokenizer

    cfg = load_recipe("arith", [f"task.num_test={args.num_test}", f"task.num_val={args.num_val}"])
    data, tok, rcfg = build_task(cfg), CharTokenizer(), RenoiseConfig(**RENOISE)
    reward = reward_for_recipe(cfg)
    length = cfg.task.completion_len
    work = Path(out) / f"seed{seed}"
    dg.write_tiny_checkpoint(work / "init", tok, canvas_length=length, seed=seed, **SIZES)
    model, _ = dg.load_diffusion_gemma(work / "init")
    n_params = sum(p.numel() for p in model.parameters())

    # 1. SFT, best validation checkpoint (reused from --workdir when its record matches these settings)
    record = {"sizes": SIZES, "renoise": RENOISE, "steps": args.sft_steps, "lr": args.sft_lr,
              "eval_every": args.sft_eval_every, "num_test": args.num_test, "seed": seed,
              **({"num_val": args.num_val} if args.num_val != 200 else {})}  # records made before --num-val: 200
    kept = json.loads((work / "sft_run.json").read_text()) if (work / "sft_run.json").exists() else {}
    if kept.get("record") == record:
        print(f"[seed {seed}] reusing the SFT checkpoint {work / 'sft'}", flush=True)
        return _rl(seed, args, work, kept["curve"], kept["seconds"], n_params)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    best, curve, t0 = -1.0, [], time.perf_counter()
    for step in range(1, args.sft_steps + 1):
        idx = torch.randint(0, len(data.train), (64,), generator=gen).tolist()
        prompt, real, clean = canvases(tok, [data.train[i].prompt for i in idx], [data.train[i].target for i in idx], length)
        model.train()
        loss = sft_loss(model, prompt, real, clean, rcfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.sft_eval_every == 0:
            model.eval()
            v = sum(evaluate(model, tok, data.val, rcfg, reward)) / len(data.val)
            curve.append({"step": step, "val_pass1": v, "loss": loss.item()})
            print(f"[seed {seed}] sft step {step} loss {loss.item():.3f} val pass@1({len(data.val)}) {v:.3f}", flush=True)
            if v > best:
                best = v
                model.save_pretrained(work / "sft")
    sft_seconds = time.perf_counter() - t0
    (work / "sft_run.json").write_text(json.dumps({"record": record, "curve": curve, "seconds": sft_seconds}))
    return _rl(seed, args, work, curve, sft_seconds, n_params)


def rl_batch(policy, tok, data, rcfg, reward, rng: random.Random, gen, a: argparse.Namespace, it: int):
    """One RL batch: ``a.prompts`` problems x ``a.group`` chains sampled by ``policy``, scored, with
    group advantages (divided by the group's std with ``a.std_normalize``)."""
    import torch

    from miles_core.algo.advantages import group_advantages
    from miles_core.algo.rl import score_rewards
    from miles_core.samplers import renoise as rn

    problems = data.draw_rl(rng, a.prompts)
    ids = [tok.encode_prompt(p.prompt) for p in problems for _ in range(a.group)]
    seeds = torch.randint(0, 2**62, (len(ids),), generator=gen)
    policy.eval()
    batch = rn.sample(policy, tok, ids, rcfg, seeds, torch.arange(len(problems)).repeat_interleave(a.group), it)
    batch.meta = [{"answer": p.answer} for p in problems for _ in range(a.group)]
    score_rewards(batch, reward)
    batch.advantage = group_advantages(batch.reward, batch.group_id, std_normalize=a.std_normalize)
    return batch


def _rl(seed: int, args: argparse.Namespace, work: Path, curve: list, sft_seconds: float, n_params: int) -> dict:
    """Steps 2 to 5 from seed ``seed``'s SFT checkpoint in ``work/sft``."""
    import torch

    from miles_core.algo.renoise_rows import RenoiseStepRows, action_rows, chain_conditioning
    from miles_core.algo.update import update_policy
    from miles_core.config import AdpoSettings, RenoiseConfig, UpdateConfig, load_recipe
    from miles_core.data.registry import build_task
    from miles_core.models import diffusion_gemma as dg
    from miles_core.models.lora import add_lora, reference_policy
    from miles_core.rewards.registry import reward_for_recipe
    from miles_core.samplers import renoise as rn
    from miles_core.tokenizer import CharTokenizer

    cfg = load_recipe("arith", [f"task.num_test={args.num_test}", f"task.num_val={args.num_val}"])
    data, tok, rcfg = build_task(cfg), CharTokenizer(), RenoiseConfig(**RENOISE)
    reward = reward_for_recipe(cfg)
    length = cfg.task.completion_len
    model, _ = dg.load_diffusion_gemma(work / "sft")
    sft_correct = evaluate(model, tok, data.test, rcfg, reward)
    print(f"[seed {seed}] SFT pass@1 {sum(sft_correct) / len(sft_correct):.3f}", flush=True)

    # 2. the sampler against model.generate, one prompt at a time
    match = 0
    for i, p in enumerate(data.test[:args.generate_checks]):
        ids = tok.encode_prompt(p.prompt)
        torch.manual_seed(EVAL_SEED + i)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=length, eos_token_id=tok.eos_id,
                             pad_token_id=tok.pad_id, **rcfg.generate_kwargs()).sequences[0, len(ids):]
        mine = rn.sample(model, tok, [ids], rcfg, torch.tensor([EVAL_SEED + i])).completion_ids[0]
        match += int(torch.equal(ref, mine))

    # 3. ADPO with LoRA on the decoder, once per arm, each from the SFT checkpoint
    arms = {}
    for name in args.arms:
        a = argparse.Namespace(**{**vars(args), **ARMS[name]})
        sft_model, _ = dg.load_diffusion_gemma(work / "sft")
        policy = add_lora(sft_model, r=16, alpha=32)
        acfg = UpdateConfig(num_minibatches=1, epochs=1, clip_eps=0.2, is_cap=2.0)
        own = AdpoSettings(renoise_output=a.renoise_output)
        opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=a.rl_lr)
        rng, rl_gen, rl_curve = random.Random(seed), torch.Generator().manual_seed(seed), []
        t1, eval_s, steps_mean = time.perf_counter(), 0.0, []
        mu_batch = None
        train_cfg = dataclasses.replace(rcfg, output=a.train_output)
        for it in range(1, a.iterations + 1):
            batch = rl_batch(policy, tok, data, train_cfg, reward, rng, rl_gen, a, it)
            ids, seeds = batch.prompt_ids, batch.seed
            mu_batch = batch if mu_batch is None else mu_batch   # sampled by the SFT policy (LoRA B = 0)
            st = update_policy(policy, opt, batch, acfg, tok, 1.0, rl_gen, own=own)
            steps_mean.append(float(batch.num_steps.float().mean()))
            if it % 10 == 0:
                print(f"[seed {seed}] {name} it {it} reward {float(batch.reward.nan_to_num(0).mean()):.3f} "
                      f"steps {steps_mean[-1]:.1f} clip {st.get('clip_frac', 0):.3f}", flush=True)
            if it % args.rl_eval_every == 0:
                te = time.perf_counter()
                policy.eval()
                v = sum(evaluate(policy, tok, data.val, rcfg, reward)) / len(data.val)
                rl_curve.append({"iteration": it, "val_pass1": v})
                eval_s += time.perf_counter() - te
        rl_seconds = time.perf_counter() - t1 - eval_s
        policy.eval()
        correct = evaluate(policy, tok, data.test, rcfg, reward)
        print(f"[seed {seed}] {name} pass@1 {sum(correct) / len(correct):.3f} ({rl_seconds:.0f}s)", flush=True)
        arms[name] = {"correct": correct, "rl_curve": rl_curve, "rl_seconds": rl_seconds,
                      "seconds_per_iteration": rl_seconds / a.iterations, "steps_mean": sum(steps_mean) / len(steps_mean),
                      "settings": ARMS[name]}
        if name == args.arms[0]:  # the analysis below is of the first arm's policy
            first = (policy, ids, seeds, mu_batch)
    policy, ids, seeds, mu_batch = first
    adpo_correct = arms[args.arms[0]]["correct"]

    # 4. logp reproduced by the learner, and the bias of a top-k store of mu's logits
    with torch.no_grad():
        fresh = rn.sample(policy, tok, ids[:32], rcfg, seeds[:32])
        rows = action_rows(fresh)
        sc = RenoiseStepRows(policy, fresh, rcfg, tok)
        logp_gap = float((sc.score(policy, rows.traj, rows.step)[0] - sc.behaviour(rows.traj, rows.step)).abs().max())
        rows = action_rows(mu_batch)
        m = mu_batch.accepted[rows.traj, rows.step]
        with reference_policy(policy) as mu_net:       # mu = the SFT policy = the adapter off
            exact = {"mu": RenoiseStepRows(mu_net, mu_batch, rcfg, tok).score(mu_net, rows.traj, rows.step)[0]}
        sc = RenoiseStepRows(policy, mu_batch, rcfg, tok)
        exact["theta"] = sc.score(policy, rows.traj, rows.step)[0]
        bias = []
        for k in args.top_k:
            with reference_policy(policy) as mu_net:
                soft_k = chain_conditioning(mu_net, mu_batch, sc.states, rcfg, tok, keep_top=k)
                lp_mu = RenoiseStepRows(mu_net, mu_batch, rcfg, tok, soft=soft_k).score(mu_net, rows.traj, rows.step)[0]
            lp_th = RenoiseStepRows(policy, mu_batch, rcfg, tok, soft=soft_k).score(policy, rows.traj, rows.step)[0]
            on, off = (lp_mu - exact["mu"]).abs()[m], (lp_th - exact["theta"]).abs()[m]
            bias.append({"top_k": k, "on_policy_mean": float(on.mean()), "on_policy_p99": float(on.quantile(0.99)),
                         "off_policy_mean": float(off.mean()), "off_policy_p99": float(off.quantile(0.99))})
        drift = (exact["theta"] - exact["mu"]).abs()[m]
    head = arms[args.arms[0]]
    return {"seed": seed, "params": n_params, "sft_curve": curve, "sft_seconds": sft_seconds, "rl_curve": head["rl_curve"],
            "sft_correct": sft_correct, "adpo_correct": adpo_correct, "rl_seconds": head["rl_seconds"],
            "seconds_per_iteration": head["seconds_per_iteration"], "steps_mean": head["steps_mean"], "arms": arms,
            "generate_match": match / args.generate_checks, "logp_gap_max": logp_gap, "topk_bias": bias,
            "policy_drift_mean": float(drift.mean())}


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0, 1), workdir=True, sets=False)
    ap.add_argument("--sft-steps", type=int, default=3000)
    ap.add_argument("--sft-eval-every", type=int, default=500)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--rl-eval-every", type=int, default=100)
    ap.add_argument("--rl-lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--num-test", type=int, default=500)
    ap.add_argument("--num-val", type=int, default=200, help="validation problems (SFT checkpoint choice, RL curve)")
    ap.add_argument("--generate-checks", type=int, default=20)
    ap.add_argument("--top-k", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--arms", nargs="+", default=["adpo"], choices=list(ARMS),
                    help="RL settings to run from each seed's SFT checkpoint (the first is analysed); "
                         "e.g. --arms adpo output group16 std long")
    ap.add_argument("--std-normalize", action="store_true", help="group advantages divided by their std")
    ap.add_argument("--renoise-output", action="store_true",
                    help="also score the output, the last step's argmax, as if sampled at its temperature")
    ap.add_argument("--train-output", choices=["argmax", "sample"], default="argmax",
                    help="the RL chains' output: generate's argmax, or the last step's sample (evaluation: argmax)")
    args = ap.parse_args(argv)
    if args.smoke:
        seeds = args.seeds if args.seeds != ap.get_default("seeds") else [0]
        vars(args).update(SMOKE, seeds=seeds)
    for name in args.arms:  # a sampled output that no row scores is a path the estimator cannot credit
        a = {**vars(args), **ARMS[name]}
        if a["train_output"] == "sample" and not a["renoise_output"]:
            ap.error(f"arm {name!r}: --train-output sample needs --renoise-output (the output row scores it)")
    t0 = time.perf_counter()
    per_seed = over_seeds(run_seed, args.seeds, args, str(workdir(args, "dgemma")))
    rows, tests = [], []
    for p in per_seed:
        t = paired(p["adpo_correct"], p["sft_correct"])
        tests.append(t)
        n = len(p["sft_correct"])
        rows.append([p["seed"], sum(p["sft_correct"]) / n, sum(p["adpo_correct"]) / n, f"{t['wins']}/{t['losses']}", t["p"],
                     p["seconds_per_iteration"], p["steps_mean"], p["generate_match"], p["logp_gap_max"]])
    print(table(rows, ["seed", "SFT pass@1", "ADPO pass@1", "gained/lost", "p", "s/iter", "NFE", "generate_match",
                       "max |logp gap|"]))
    bias_rows = [[p["seed"], b["top_k"], b["on_policy_mean"], b["on_policy_p99"], b["off_policy_mean"], b["off_policy_p99"],
                  p["policy_drift_mean"]] for p in per_seed for b in p["topk_bias"]]
    print("\nself-conditioning from a top-k store of mu's logits instead of the chain rebuilt (|d log pi| per token):")
    print(table(bias_rows, ["seed", "top-k", "on-policy mean", "on p99", "off-policy mean", "off p99",
                            "|log pi_theta - log mu| mean"]))
    n_all = sum(len(p["sft_correct"]) for p in per_seed)
    pooled = paired([c for p in per_seed for c in p["adpo_correct"]], [c for p in per_seed for c in p["sft_correct"]])
    arm_rows, arm_out = [], []
    for name in args.arms:  # every arm against SFT, pooled over seeds
        got = [c for p in per_seed for c in p["arms"][name]["correct"]]
        t = paired(got, [c for p in per_seed for c in p["sft_correct"]])
        arm_out.append({"arm": name, "settings": ARMS[name], "pass1": sum(got) / len(got), "gain_vs_sft": t["gain"],
                        "gained": t["wins"], "lost": t["losses"], "p": t["p"],
                        "per_seed_pass1": [sum(p["arms"][name]["correct"]) / len(p["sft_correct"]) for p in per_seed],
                        "seconds_per_iteration": sum(p["arms"][name]["seconds_per_iteration"] for p in per_seed) / len(per_seed)})
        arm_rows.append([name, str(ARMS[name] or "defaults"), arm_out[-1]["pass1"], t["gain"], f"{t['wins']}/{t['losses']}",
                         t["p"], arm_out[-1]["seconds_per_iteration"]])
    print(f"\nRL arms against SFT (pooled over seeds, {n_all} paired problems):")
    print(table(arm_rows, ["arm", "settings", "pass@1", "gain", "gained/lost", "p", "s/iter"]))
    payload = {
        "arms": arm_out,
        "generate_match": min(p["generate_match"] for p in per_seed),
        "logp_reproduced": max(p["logp_gap_max"] for p in per_seed) <= 1e-5,
        "logp_gap_max": max(p["logp_gap_max"] for p in per_seed),
        "sft_pass1": sum(sum(p["sft_correct"]) for p in per_seed) / n_all,
        "adpo_pass1": sum(sum(p["adpo_correct"]) for p in per_seed) / n_all,
        "pooled_sign_test": {"gained": pooled["wins"], "lost": pooled["losses"], "p": pooled["p"]},
        "seconds_per_iteration": sum(p["seconds_per_iteration"] for p in per_seed) / len(per_seed),
        "seconds_per_iteration_by_arm": {a["arm"]: a["seconds_per_iteration"] for a in arm_out},
        "problems_scored": n_all, "smoke": args.smoke,
        "per_seed": [{k: v for k, v in p.items() if not k.endswith("_correct") and k != "arms"} | {
            "sft_pass1": sum(p["sft_correct"]) / len(p["sft_correct"]),
            "adpo_pass1": sum(p["adpo_correct"]) / len(p["adpo_correct"]),
            "sign_test": {"gained": t["wins"], "lost": t["losses"], "p": t["p"]}} for p, t in zip(per_seed, tests)],
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "out")} | {"sizes": SIZES, "renoise": RENOISE},
        "wall_seconds": time.perf_counter() - t0,
    }
    print(f"\npooled: SFT {payload['sft_pass1']:.3f} -> ADPO {payload['adpo_pass1']:.3f} "
          f"({pooled['wins']} gained, {pooled['losses']} lost, p = {pooled['p']:.3g})")
    # every arm trained (seconds per iteration) and SFT and RL were scored on the test problems; the
    # sampler/generate agreement and the logp gap are results, present whatever they are
    finish("diffusion_gemma", payload, out=args.out,
           positive=["problems_scored", "seconds_per_iteration", "seconds_per_iteration_by_arm.*", "wall_seconds"],
           present=["generate_match", "logp_gap_max", "sft_pass1", "adpo_pass1", "pooled_sign_test.p"])


if __name__ == "__main__":
    main()
