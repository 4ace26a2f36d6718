"""How much of one ADPO update is signal: the masked tiny model against the tiny DiffusionGemma.

At the SFT policy, each model's RL gradient is taken on ``--batches`` independent batches (16 prompts
x 8 samples, the same ADPO settings, one minibatch, no clipping of the gradient norm, no step
taken), through the engine users run (``update_policy``; the masked model's batches from
``Learner.sample``, DiffusionGemma's from ``benchmarks.diffusion_gemma.rl_batch``). From the
per-batch LoRA gradients g_1..g_M:
  * mean pairwise cosine E[cos(g_i, g_j)]: near 0 when one batch's update is mostly noise;
  * SNR = (|mean g|^2 - V / M) / V with V = sum_i |g_i - mean g|^2 / (M - 1): the squared norm of
    the expected update over the variance of one batch's (the first term corrected for the noise
    left in the mean of M).
The two models are trained by the same ADPO on the same task (arith), so the ratio of their SNRs
says how much weaker the renoising chain's signal is per batch, if it is.

Then whether the mean gradient is an ascent direction of the reward the run optimizes: the
adapter is moved along mean g / |mean g| by ``STEPS`` x (the length of one Adam step at lr 1e-3,
1e-3 sqrt(P)), and the training reward is measured on ``--eval-batches`` batches drawn with the
same prompts and seeds at every step length (common random numbers), so the differences are the
policy's alone.

The arms: the masked model's ADPO; DiffusionGemma's ADPO over its sampled steps; with the output row
(the argmax output scored as if sampled at the last step's temperature); and with chains that output
their last step's sample (``renoise.output="sample"``), which the output row then scores exactly, so
that every path from the policy to what the reward reads is a sampled action but the
self-conditioning and the entropy-ranked acceptance. That arm's reward is measured on the chain it
optimizes and, along the same direction, on generate's argmax output. The last arm is REINFORCE with
the chain's total log-likelihood gradient (:func:`chain_gradient`): the self-conditioning input of
each step built with its graph, so the policy's effect on later steps through it is credited too
(a diagnostic; ADPO never backpropagates through the chain). The last arm takes that gradient on a
chain with no policy-dependent choice left (``EVERY_PATH_SAMPLED``: every position accepted at every
step, no early stop, the output the last step's sample, scored): the exact score-function gradient
of that chain's expected reward, measured on that chain.

Needs the SFT checkpoints the other benchmarks keep: ``--masked DIR`` (``benchmarks.estimators
--checkpoint DIR``, seed{N}/sft) and ``--dgemma DIR`` (``benchmarks.diffusion_gemma --workdir DIR``,
seed{N}/sft). Writes benchmarks/results/grad_snr.json.

``--smoke``: the masked arm on seed 0, 2 batches, the reward along the mean on 1 batch, from a 3-step
SFT trained in a temporary folder unless ``--masked DIR`` (not a figure). The DiffusionGemma arms
are left out unless named with ``--arms`` and ``--dgemma DIR``: an untrained DiffusionGemma's batches
rarely hold a reward spread (so its gradients are mostly 0), and the ~200 SFT steps that make one
likely take longer than the whole smoke run.
Run: python -m benchmarks.grad_snr --masked /tmp/est43 --dgemma /tmp/dg43 [--seeds 0 1] [--batches 24] [--arms ...] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from benchmarks.harness import MeasuredNothing, bench_args, finish, over_seeds, sft_checkpoint

STEPS = (0.0, 0.25, 0.5, 1.0, 2.0)   # in lengths of one Adam step at lr 1e-3 (1e-3 sqrt(P))
# every position accepted at every step and no early stop: acceptance and the step count no longer
# depend on the policy, and the output is the last step's sample
EVERY_PATH_SAMPLED = dict(entropy_bound=1e9, stability_threshold=0, confidence_threshold=1e-9)
# DiffusionGemma's arms, as dgemma()'s settings: output (score the output row), sampled (the chains
# output their last step's sample), chain (REINFORCE through the self-conditioning, chain_gradient),
# every_path (that gradient on a chain whose every path to the reward is a sampled action)
DGEMMA_ARMS = {"DiffusionGemma ADPO": {},
               "DiffusionGemma ADPO + output row": {"output": True},
               "DiffusionGemma ADPO + sampled output": {"output": True, "sampled": True},
               "DiffusionGemma REINFORCE through the self-conditioning": {"chain": True},
               "DiffusionGemma REINFORCE, every path sampled": {"chain": True, "every_path": True}}
ARMS = ("masked ADPO", *DGEMMA_ARMS)
MASKED_OVERRIDES = ["sft.steps=6000", "train.iterations=300", "update.num_minibatches=1", "update.max_grad_norm=1e9"]
# --smoke: the masked arm at tiny sizes; its SFT checkpoint (3 steps) trained in a temporary folder
SMOKE = {"seeds": [0], "batches": 2, "eval_batches": 1}
SMOKE_ARMS = ["masked ADPO"]   # unless --arms names others
SMOKE_SFT = ["sft.steps=3", "task.num_val=8", "task.num_test=8"]


def _tap(params: list):
    """An optimizer that keeps each step's gradient (flattened, in ``params`` order) and moves nothing."""
    import torch

    class Tap(torch.optim.SGD):
        grads: list = []

        def step(self, closure=None):  # noqa: ARG002 - the engine's call
            self.grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double()
                                         for p in params]))

    tap = Tap(params, lr=0.0)
    tap.grads = []
    return tap


def snr(grads: list) -> dict[str, float]:
    """Mean pairwise cosine and the per-batch SNR of M gradients (see the module docstring)."""
    import torch

    g = torch.stack(grads)                                              # [M, P]
    m = g.shape[0]
    mean = g.mean(0)
    var = float(((g - mean) ** 2).sum(1).sum() / (m - 1))
    if not var > 0:  # every batch's gradient the same (all zero: no batch had a reward spread)
        raise MeasuredNothing(f"benchmarks.grad_snr: the {m} batch gradients are identical (norm "
                              f"{float(g.norm(dim=1).mean()):.3g}): no gradient noise to measure")
    unit = g / g.norm(dim=1, keepdim=True).clamp_min(1e-30)
    cos = unit @ unit.T
    pairs = float((cos.sum() - cos.diagonal().sum()) / (m * (m - 1)))
    return {"cosine": pairs, "snr": (float(mean @ mean) - var / m) / var, "batches": m,
            "grad_norm": float(g.norm(dim=1).mean()), "variance": var}


def along(params: list, direction, reward_at) -> list[dict]:
    """Mean reward (``reward_at()``) with the parameters moved along ``direction`` by each of STEPS."""
    import torch

    start = [p.detach().clone() for p in params]
    unit = direction / direction.norm()
    scale = 1e-3 * direction.numel() ** 0.5
    out = []
    for k in STEPS:
        with torch.no_grad():
            i = 0
            for p, p0 in zip(params, start):
                p.copy_(p0 + (k * scale * unit[i:i + p.numel()]).view_as(p).to(p.dtype))
                i += p.numel()
        out.append({"adam_steps": k, "reward": reward_at()})
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)
    return out


def masked(seed: int, folder: str, batches: int, eval_batches: int) -> dict:
    from miles_core.algo.update import update_policy
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.learner.policy import Learner

    ckpt = Path(folder) / f"seed{seed}" / "sft"
    if not (ckpt / "config.json").exists():
        raise SystemExit(f"--masked: no SFT checkpoint at {ckpt}; run benchmarks.estimators --checkpoint {folder} first")
    cfg = load_recipe("arith", MASKED_OVERRIDES + [f"train.seed={seed}"])
    learner = Learner(cfg, ckpt)
    tap, data = _tap(learner.params), build_task(cfg)
    for it in range(batches):
        update_policy(learner.model, tap, learner.sample(data, it), cfg.update, learner.tok, cfg.sampler.temperature,
                      learner.gen, own=cfg.own())
    mean = sum(tap.grads) / len(tap.grads)
    reward = lambda: sum(float(learner.sample(data, 10_000 + j).reward.nan_to_num(0).mean())  # noqa: E731
                         for j in range(eval_batches)) / eval_batches
    return snr(tap.grads) | {"along": along(learner.params, -mean, reward)}


def chain_gradient(policy, tap, batch, rcfg, tok, through_soft: bool = True, last: bool = False) -> None:
    """The on-policy REINFORCE gradient of a renoising batch, -sum_b A_b grad log p(tau_b) / tokens,
    with log p(tau_b) = sum over steps k < K_b - 1 of log pi(y_k | x_k, s_k) at the accepted
    positions (ADPO's action rows), into ``tap``. ``through_soft``: s_k = soft(z_{k-1} / T) is built
    with its graph, so the gradient is the total derivative of the chain's log-likelihood, the
    self-conditioning path included; else s_k is detached (what ADPO's rows score, at ratio 1).
    ``last``: the last step's accepted tokens too (with ``output="sample"`` and every position
    accepted, they are the output). A diagnostic only: ADPO never backpropagates through the chain."""
    import torch

    from miles_core.algo.renoise_rows import _encode
    from miles_core.models import canvas
    from miles_core.samplers import renoise as rn

    dev = next(policy.parameters()).device
    vocab = int(canvas.core(policy).config.text_config.vocab_size)
    states = rn.replay_states(batch, vocab, dev)                                  # [B, K, L]
    enc_all = _encode(policy, batch, torch.arange(len(batch)), tok, dev)
    acts = (batch.num_steps - (0 if last else 1)).to(dev)                         # action steps per row
    b = len(batch)
    logp = torch.zeros(b, device=dev)
    soft = None
    policy.train()
    tap.zero_grad(set_to_none=True)
    for k in range(int(acts.max()) if b else 0):
        rows = (acts > k).nonzero().squeeze(1)
        enc = enc_all if rows.numel() == b else canvas.select(enc_all, rows)
        z = canvas.decode(policy, enc, states[rows, k], None if soft is None else soft[rows]) / rn.temperature(rcfg, k, dev)
        acc = batch.accepted[rows.cpu(), k].to(dev)
        lp = torch.where(acc, rn.token_logp(z, batch.tokens[rows.cpu(), k].to(dev)), 0.0).sum(-1)
        logp = logp.index_add(0, rows, lp)
        s_new = canvas.soft_embedding(policy, z)
        s_new = s_new if through_soft else s_new.detach()
        soft = (torch.zeros(b, *s_new.shape[1:], dtype=s_new.dtype, device=dev) if soft is None else soft)
        soft = soft.index_copy(0, rows, s_new)
    tokens = max(1.0, float(batch.accepted.sum()))
    adv = batch.advantage.to(dev).nan_to_num(0.0)
    (-(adv * logp).sum() / tokens).backward()
    tap.step()


def dgemma(seed: int, folder: str, batches: int, eval_batches: int, output: bool = False, sampled: bool = False,
           chain: bool = False, every_path: bool = False) -> dict:
    """DiffusionGemma's gradients and the reward along their mean; ``output``: ADPO with the output
    row; ``sampled``: the chains output their last step's sample (``renoise.output``), and the reward
    of generate's argmax output is measured along the same direction too (``along_argmax``);
    ``chain``: REINFORCE through the self-conditioning (:func:`chain_gradient`) instead of ADPO;
    ``every_path``: on the ``EVERY_PATH_SAMPLED`` chain, its output scored."""
    import torch

    from benchmarks.diffusion_gemma import RENOISE, rl_batch
    from miles_core.algo.update import update_policy
    from miles_core.config import AdpoSettings, RenoiseConfig, UpdateConfig, load_recipe
    from miles_core.data.registry import build_task
    from miles_core.models import diffusion_gemma as dg
    from miles_core.models.lora import add_lora
    from miles_core.rewards.registry import reward_for_recipe
    from miles_core.tokenizer import CharTokenizer

    ckpt = Path(folder) / f"seed{seed}" / "sft"
    if not (ckpt / "config.json").exists():
        raise SystemExit(f"--dgemma: no SFT checkpoint at {ckpt}; run benchmarks.diffusion_gemma --workdir {folder} first")
    cfg = load_recipe("arith", ["task.num_val=200"])
    data, tok, reward = build_task(cfg), CharTokenizer(), reward_for_recipe(cfg)
    argmax_cfg = RenoiseConfig(**RENOISE)
    rcfg = RenoiseConfig(**RENOISE, output="sample" if sampled or every_path else "argmax",
                         **(EVERY_PATH_SAMPLED if every_path else {}))
    model, _ = dg.load_diffusion_gemma(ckpt)
    torch.manual_seed(seed)                                         # LoRA's A: the same in whichever worker
    policy = add_lora(model, r=16, alpha=32)                        # the diffusion_gemma benchmark's RL settings
    acfg = UpdateConfig(num_minibatches=1, epochs=1, clip_eps=0.2, is_cap=2.0, max_grad_norm=1e9)
    own = AdpoSettings(renoise_output=output)
    params = [p for p in policy.parameters() if p.requires_grad]
    tap = _tap(params)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    a = argparse.Namespace(prompts=16, group=8, std_normalize=False)
    for it in range(1, batches + 1):
        batch = rl_batch(policy, tok, data, rcfg, reward, rng, gen, a, it)
        if chain:
            chain_gradient(policy, tap, batch, rcfg, tok, last=every_path)
        else:
            update_policy(policy, tap, batch, acfg, tok, 1.0, gen, own=own)

    def mean_reward(chain: RenoiseConfig) -> float:   # the same prompts and chain seeds at every step length
        r, g = random.Random(10_000 + seed), torch.Generator().manual_seed(10_000 + seed)
        return sum(float(rl_batch(policy, tok, data, chain, reward, r, g, a, j).reward.nan_to_num(0).mean())
                   for j in range(eval_batches)) / eval_batches

    mean = sum(tap.grads) / len(tap.grads)
    out = snr(tap.grads) | {"along": along(params, -mean, lambda: mean_reward(rcfg))}
    if sampled:
        out["along_argmax"] = along(params, -mean, lambda: mean_reward(argmax_cfg))
    return out


def run(job: tuple[str, int], args: dict) -> dict:
    arm, seed = job
    t0 = time.perf_counter()
    out = (masked(seed, args["masked"], args["batches"], args["eval_batches"]) if arm == "masked ADPO" else
           dgemma(seed, args["dgemma"], args["batches"], args["eval_batches"], **DGEMMA_ARMS[arm]))
    print(f"[seed {seed}] {arm}: cosine {out['cosine']:.4f} snr {out['snr']:.4f} reward along the mean update "
          + " ".join(f"{a['adam_steps']:g}:{a['reward']:.4f}" for a in out["along"])
          + ("; argmax output " + " ".join(f"{a['adam_steps']:g}:{a['reward']:.4f}" for a in out["along_argmax"])
             if "along_argmax" in out else ""), flush=True)
    return {"arm": arm, "seed": seed, **out, "seconds": time.perf_counter() - t0}


def smoke_masked(folder: Path, seeds: list[int]) -> str:
    """``--smoke`` without ``--masked``: each seed's masked SFT checkpoint, 3 steps, trained in
    ``folder/seed{N}/sft`` the way ``benchmarks.estimators`` trains its own (``sft_checkpoint``)."""
    from miles_core.config import load_recipe

    for seed in seeds:
        cfg = load_recipe("arith", MASKED_OVERRIDES + SMOKE_SFT + [f"sft.seed={seed}", f"train.seed={seed}"])
        sft_checkpoint(cfg, seed, folder, validate=False)
    return str(folder)


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0, 1), sets=False)
    ap.add_argument("--masked", metavar="DIR", help="benchmarks.estimators' --checkpoint folder (the masked arm)")
    ap.add_argument("--dgemma", metavar="DIR", help="benchmarks.diffusion_gemma's --workdir folder (its arms)")
    ap.add_argument("--batches", type=int, default=24, help="independent batches per model and seed")
    ap.add_argument("--eval-batches", type=int, default=8, help="batches (of 128) the reward is measured on")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="which gradients (default: all)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE, arms=SMOKE_ARMS if args.arms == list(ARMS) else args.arms)
    arms = args.arms
    for flag, needed in (("masked", "masked ADPO" in arms and not args.smoke),   # smoke: trained here
                         ("dgemma", any(a != "masked ADPO" for a in arms))):
        if needed and getattr(args, flag) is None:
            ap.error(f"--{flag} DIR is needed for the arms {arms}")
    jobs = [(arm, seed) for arm in arms for seed in args.seeds]
    with tempfile.TemporaryDirectory(prefix="miles-grad_snr-") as tmp:
        if args.smoke and args.masked is None and "masked ADPO" in arms:
            args.masked = smoke_masked(Path(tmp) / "masked", args.seeds)
        runs = over_seeds(run, jobs, vars(args))
    rows, out = [], []
    for arm in arms:
        got = [r for r in runs if r["arm"] == arm]
        entry = {"arm": arm, **{k: sum(r[k] for r in got) / len(got) for k in ("cosine", "snr", "grad_norm", "variance")},
                 "per_seed": got}
        # reward change along the mean update, averaged over seeds, at each step length
        gain = [sum(r["along"][i]["reward"] - r["along"][0]["reward"] for r in got) / len(got) for i in range(len(STEPS))]
        entry["reward_gain_along_mean_update"] = dict(zip([str(k) for k in STEPS], gain))
        out.append(entry)
        rows.append([arm, " / ".join(f"{r['cosine']:.4f}" for r in got), f"{entry['cosine']:.4f}",
                     " / ".join(f"{r['snr']:.4f}" for r in got), f"{entry['snr']:.4f}",
                     f"{sum(r['along'][0]['reward'] for r in got) / len(got):.4f}",
                     " ".join(f"{g:+.4f}" for g in gain[1:])])
        if all("along_argmax" in r for r in got):   # the same direction, generate's argmax output rewarded
            ga = [sum(r["along_argmax"][i]["reward"] - r["along_argmax"][0]["reward"] for r in got) / len(got)
                  for i in range(len(STEPS))]
            entry["argmax_reward_gain_along_mean_update"] = dict(zip([str(k) for k in STEPS], ga))
            rows.append(["  (its argmax output)", "", "", "", "",
                         f"{sum(r['along_argmax'][0]['reward'] for r in got) / len(got):.4f}",
                         " ".join(f"{g:+.4f}" for g in ga[1:])])
    # what each arm measured, keyed by arm (the checks below name them; arms is a list)
    measured = {e["arm"]: {"gradients": sum(r["batches"] for r in e["per_seed"]), "grad_norm": e["grad_norm"],
                           "variance": e["variance"], "cosine": e["cosine"], "snr": e["snr"],
                           "reward_gain": e["reward_gain_along_mean_update"]} for e in out}
    finish("grad_snr", {"arms": out, "measured": measured, "seeds": args.seeds, "batches": args.batches,
                        "eval_batches": args.eval_batches, "steps": STEPS, "smoke": args.smoke}, rows,
           ["gradient", "cosine per seed", "cosine", "SNR per seed", "SNR", "reward at SFT",
            f"reward change at {', '.join(f'{k:g}' for k in STEPS[1:])} Adam steps"], args.out,
           positive=["measured.*.gradients", "measured.*.grad_norm", "measured.*.variance"],
           present=["measured.*.cosine", "measured.*.snr", "measured.*.reward_gain"])


if __name__ == "__main__":
    main()
