"""Code generation with a sandboxed execution reward: does ADPO beat its SFT starting point?

Per seed (each seed in its own process, one torch thread, so two seeds use the two cores):
  1. SFT on the scarce labelled demonstrations of the ``code`` recipe (learner/baseline.py's train_baseline),
     all ``sft.steps``, keeping the weights of the best validation pass@1;
  2. ADPO from that checkpoint (the run ``miles train`` trains, benchmarks/harness.py::local_run) on
     fresh generator prompts, rewarded by the recipe's ``train.reward`` (``code_pass``: 1 when the
     completion, executed in the sandbox, passes every hidden test; ``code_tests``: the fraction it
     passes);
  3. both evaluated on the same held-out functions (>= 200, disjoint from training) with one
     pinned greedy eval config; pass@1 = the completion passes every test in the sandbox. Beside it,
     per arm and seed, the fraction passing every visible example (the outputs the prompt shows)
     and the hard-coding rate: the fraction passing those but failing a hidden input, i.e. fitting
     the prompt without being the function (code_eval's ``hardcoding``, scored in the sandbox).
Beside them, what the sandbox change since BASELINE_REV did to these scores: every held-out completion of
both arms (greedy and the T = 1 samples) is scored again with the sandbox of
``benchmarks/speed/sandbox.py::BASELINE_REV`` (its ``miles_core`` from git, in a subprocess), and the run
reports how many scored differently and which way (skipped in ``--smoke`` where a shallow clone
lacks that commit).
``--sft-continued`` adds a control: SFT continued on the labelled data for the wall-clock ADPO took
(it adds RL's wall-clock again, so it is off by default).
``--checkpoint DIR`` keeps the SFT checkpoints in DIR (``seed{N}/sft``): trained there when absent,
and a later run with the same model, task and sft settings (RL settings may differ) starts from
them instead of training again (benchmarks/harness.py's ``sft_checkpoint``).
``--smoke`` (CI): seed 0 alone, through the same steps at toy sizes (SMOKE_OVERRIDES: a few SFT
steps, 2 ADPO iterations of 2 x 2 completions, 8 held-out functions): seconds, and no figure.
Writes benchmarks/results/code.json. Run: python -m benchmarks.code [--seeds 0 1] [--set KEY=VALUE] [--checkpoint DIR] [--smoke]
Every measured setting, and why the SFT baseline's length and machine matter: docs/results/code-log.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.harness import (bench_args, finish, local_run, over_seeds, paired, rl_iteration, seed_mean,
                                sft_checkpoint, table, workdir)
from benchmarks.sandbox import baseline_present, rescored

DEFAULT_OVERRIDES: list[str] = []
# SFT runs all sft.steps and keeps its best-validation weights. No plateau stop: on 200 validation
# functions the curve is noisy enough that 3 evaluations without a gain stopped one seed at step
# 2000 (of 6000), val 0.05, while the other kept rising; a baseline stopped by noise is no baseline.
PATIENCE: int | None = None
PASS_K = 8  # side measurement: pass@1 / pass@8 of samples at temperature 1
# --smoke: every step of run_seed at toy sizes (one validation at the last SFT step, no RL curve point)
SMOKE_OVERRIDES = ["sft.steps=4", "sft.eval_every=4", "sft.batch_size=8", "task.num_train=32", "task.num_test=8",
                   "task.num_val=8", "eval.num_problems=8", "train.iterations=2", "train.prompts_per_iter=2",
                   "train.group_size=2"]


def code_eval(model, tok, cfg, data, steps: int | None = None) -> dict:
    """``run_eval`` (eval/evaluate.py) (pass@1 = the code_tests reward in the sandbox) plus per-family
    rates and :func:`hardcoding` of the same greedy completions; ``steps`` overrides the number of
    denoising passes (a side measurement, never the headline)."""
    from miles_core.data.registry import check_reward
    from miles_core.eval.evaluate import run_eval
    from miles_core.rewards.registry import reward_for_recipe

    if steps is not None:
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, steps=steps))
    r = run_eval(model, tok, cfg, data)
    probs = data.test[:r.config.num_problems]
    prompts, answers, seen = [p.prompt for p in probs], [p.answer for p in probs], [c[0] for c in r.completions]
    hc = hardcoding(prompts, seen, answers, data.task.cfg.examples, reward_for_recipe(cfg, check_reward(cfg.task)))
    fam_total = Counter(p.meta["family"] for p in probs)
    fam_ok = Counter(p.meta["family"] for p, c in zip(probs, r.correct) if c[0])
    return {"pass1": r.pass_at["pass@1"], "correct": [c[0] for c in r.correct], "config": r.config.to_dict(),
            "per_family": {f: fam_ok[f] / n for f, n in sorted(fam_total.items())},
            "samples": [{k: s[k] for k in ("prompt", "completion", "correct")} for s in r.samples[:8]],
            "scored": (seen, answers),  # the completions and their tests, for the rescoring at BASELINE_REV
            "visible_pass": hc["visible_pass"], "hardcoded_rate": hc["hardcoded_rate"], "hardcoded": hc["hardcoded"],
            "hardcoded_samples": [{"prompt": p, "completion": c} for p, c, h in zip(prompts, seen, hc["hardcoded"]) if h][:5]}


def hardcoding(prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], examples: int,
               reward: Callable[..., list]) -> dict[str, Any]:
    """Which completions fit the prompt without being the function: each is scored by ``reward``
    (the eval's own sandbox reward; passing = 1.0, as pass@1 counts) on its visible examples alone
    and on its hidden inputs alone (data/code.py's split_answer), in one call. ``hardcoded``: passes
    every visible example but fails a hidden input (a lookup table of the shown outputs, or a shape
    that agrees only on x = 0..examples-1), which pass@1 cannot tell from any other failure.
    Rates are over all problems; ``visible_pass`` is the fraction fitting the prompt at all."""
    from miles_core.data.code import split_answer

    n = len(answers)
    if len(prompts) != n or len(completions) != n:
        raise ValueError(f"hardcoding: {len(prompts)} prompts, {len(completions)} completions, {n} answers")
    parts = [split_answer(a, examples) for a in answers]
    scores = reward(list(prompts) * 2, list(completions) * 2, answer=[v for v, _ in parts] + [h for _, h in parts])
    ok = [s is not None and s >= 1.0 for s in scores]
    visible, hidden = ok[:n], ok[n:]
    flags = [v and not h for v, h in zip(visible, hidden)]
    return {"visible_pass": sum(visible) / max(n, 1), "hardcoded_rate": sum(flags) / max(n, 1),
            "visible": visible, "hidden": hidden, "hardcoded": flags}


def sampled_pass_at(model, tok, cfg, data, k: int = PASS_K) -> dict[str, Any]:
    """pass@1 and pass@k of ``k`` samples at temperature 1 (a side measurement): a policy that only
    sharpens what SFT could already write raises pass@1 toward SFT's pass@k; one that learned to
    write programs SFT could not also raises pass@k. ``scored``: the samples and their tests."""
    from miles_core.eval.evaluate import run_eval

    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, temperature=1.0, n_samples=k))
    r = run_eval(model, tok, cfg, data)
    probs = data.test[:r.config.num_problems]
    return {**r.pass_at, "scored": ([c for cs in r.completions for c in cs],
                                    [p.answer for p, cs in zip(probs, r.completions) for _ in cs])}


def val_pass1(model, tok, cfg, data) -> float:
    """Greedy pass@1 on the validation functions (disjoint from test): the figure to choose RL
    settings by, so that choosing never looks at the reported test functions."""
    from miles_core.eval.evaluate import run_eval

    return run_eval(model, tok, cfg, data, split="val").pass_at["pass@1"]


def run_seed(seed: int, overrides: list[str], out: str, control: bool = False, checkpoint: str | None = None,
             rescore_before: bool = True) -> dict:
    from miles_core.config import load_recipe
    from miles_core.models.base import load_checkpoint
    from miles_core.rewards.pool import shared_pool
    from miles_core.data.registry import build_task
    from miles_core.learner.baseline import continue_sft

    cfg = load_recipe("code", overrides + [f"sft.seed={seed}", f"train.seed={seed}"])
    data = build_task(cfg)
    sft = sft_checkpoint(cfg, seed, out, checkpoint, data, patience=PATIENCE)  # validation: non-test functions
    ckpt, sft_curve, sft_seconds = Path(sft["path"]), sft["curve"], sft["seconds"]
    base, tok = load_checkpoint(ckpt)
    seq = cfg.task.completion_len  # one token per denoising pass: how much is lost to parallel decoding
    results = {"sft": code_eval(base, tok, cfg, data), "sft_sequential": code_eval(base, tok, cfg, data, steps=seq),
               "sft_sampled": sampled_pass_at(base, tok, cfg, data), "sft_val": {"pass1": val_pass1(base, tok, cfg, data)}}
    print(f"[seed {seed}] SFT pass@1 {results['sft']['pass1']:.3f} ({sft_seconds:.0f}s)", flush=True)

    with local_run(cfg, ckpt) as run:  # the run `miles train` trains, on a local store
        learner = run.learner
        reward_seconds, statuses, curve, last_stats = [0.0], Counter(), [], [{"zero_reasons": []}]

        recipe_reward = learner.reward_fn  # train.reward (code_tests or code_pass: both run code_tests)

        def timed_reward(prompts, completions, **meta):  # the Learner's own reward, timed and its stats counted
            t = time.perf_counter()
            out = recipe_reward(prompts, completions, **meta)
            reward_seconds[0] += time.perf_counter() - t
            statuses.update(out.stats["status_counts"])
            last_stats[0] = out.stats
            return out
        learner.reward_fn = timed_reward
        t1, n = time.perf_counter(), 0
        for it in range(cfg.train.iterations):
            batch, st = rl_iteration(run, it)  # LearnerRun.collect, then consume: the path `miles train` runs
            n += len(batch)
            if learner.guard_event:  # the collapse guard skipped this batch (and maybe rolled the policy back)
                print(f"[seed {seed}] adpo it {it + 1} collapse guard: {learner.guard_event}", flush=True)
            if (it + 1) % 10 == 0:
                r = float(batch.reward.nan_to_num(0).mean())
                full = float((batch.reward >= 1).float().mean())
                curve.append({"iteration": it + 1, "reward": r, "solved": full})
                print(f"[seed {seed}] adpo it {it + 1} reward {r:.3f} solved {full:.3f} clip {st.get('clip_frac', 0):.3f} "
                      f"zero-reasons {last_stats[0]['zero_reasons'][:2]}", flush=True)
        adpo_seconds = time.perf_counter() - t1
        results["adpo"] = code_eval(learner.model, learner.tok, cfg, data)
        results["adpo_sequential"] = code_eval(learner.model, learner.tok, cfg, data, steps=seq)
        results["adpo_sampled"] = sampled_pass_at(learner.model, learner.tok, cfg, data)
        results["adpo_val"] = {"pass1": val_pass1(learner.model, learner.tok, cfg, data)}
        print(f"[seed {seed}] ADPO pass@1 {results['adpo']['pass1']:.3f} ({adpo_seconds:.0f}s, reward {reward_seconds[0]:.0f}s)",
              flush=True)
    if control:  # same labelled data, all weights, as long as ADPO ran
        model, tok = continue_sft(cfg, data, ckpt, adpo_seconds, seed)
        results["sft_continued"] = code_eval(model, tok, cfg, data)
        print(f"[seed {seed}] SFT continued pass@1 {results['sft_continued']['pass1']:.3f}", flush=True)
    scored = [results[a]["scored"] for a in ("sft", "adpo", "sft_sampled", "adpo_sampled")]
    completions, answers = [c for s in scored for c in s[0]], [a for s in scored for a in s[1]]
    rescore = rescored(completions, answers) if rescore_before else None  # the harness change, on these completions
    if rescore:
        print(f"[seed {seed}] {rescore['changed']} of {rescore['completions']} completions scored differently "
              f"at {rescore['rev']} ({rescore['zero_to_one']} 0 -> 1, {rescore['one_to_zero']} 1 -> 0)", flush=True)
    return {"seed": seed, "results": results, "rescored": rescore, "sft_seconds": sft_seconds, "adpo_seconds": adpo_seconds, "sft_curve": sft_curve,
            "reward_seconds": reward_seconds[0], "completions": n, "reward_status_counts": dict(statuses),
            "adpo_curve": curve, "sandbox_layers": shared_pool(cfg.sandbox.isolation).layers,
            "guard_rollbacks": learner.guard.rollbacks if learner.guard else 0, "sft_trained": sft["trained"]}


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0, 1), checkpoint=True, workdir=True)
    ap.add_argument("--sft-continued", action="store_true", help="also run the continued-SFT control arm")
    args = ap.parse_args(argv)
    if args.smoke and args.seeds == ap.get_default("seeds"):
        args.seeds = [0]
    overrides = DEFAULT_OVERRIDES + (SMOKE_OVERRIDES if args.smoke else []) + args.set
    t0 = time.perf_counter()
    rescore = baseline_present() or not args.smoke  # a shallow clone lacks BASELINE_REV: the smoke run skips it
    per_seed = over_seeds(run_seed, args.seeds, overrides, str(workdir(args, "code")), args.sft_continued, args.checkpoint,
                          rescore)
    arms = ("sft", "adpo", "sft_continued") if args.sft_continued else ("sft", "adpo")
    mean = {a: seed_mean(per_seed, lambda p: p["results"][a]["pass1"]) for a in arms}
    k = f"pass@{PASS_K}"
    sampled = {a: {m: seed_mean(per_seed, lambda p: p["results"][f"{a}_sampled"][m]) for m in ("pass@1", k)}
               for a in ("sft", "adpo")}
    st = paired([c for p in per_seed for c in p["results"]["adpo"]["correct"]],
                [c for p in per_seed for c in p["results"]["sft"]["correct"]])
    hc_keys = ("visible_pass", "hardcoded_rate")
    hard = {a: {m: seed_mean(per_seed, lambda p: p["results"][a][m]) for m in hc_keys} for a in arms}
    rows = [[p["seed"]] + [p["results"][a][m] for m in ("pass1",) + hc_keys for a in arms] for p in per_seed]
    rows.append(["mean"] + [mean[a] for a in arms] + [hard[a][m] for m in hc_keys for a in arms])
    print(table(rows, ["seed"] + [f"{a}_{m}" for m in ("pass1", "visible", "hardcoded") for a in arms]))
    print("visible = passes every example the prompt shows; hardcoded = passes them but fails a hidden input "
          "(both of all held-out problems)")
    val = {a: seed_mean(per_seed, lambda p: p["results"][f"{a}_val"]["pass1"]) for a in ("sft", "adpo")}
    n_tasks = len(per_seed[0]["results"]["sft"]["correct"])
    print(f"ADPO - SFT = {100 * (mean['adpo'] - mean['sft']):+.1f} points on {n_tasks} "
          f"held-out tasks; sign test wins {st['wins']} losses {st['losses']} p = {st['p']:.3g}")
    payload = {
        "sft_pass1": mean["sft"], "adpo_pass1": mean["adpo"], "adpo_minus_sft": mean["adpo"] - mean["sft"],
        **({"sft_continued_pass1": mean["sft_continued"]} if args.sft_continued else {}),
        "target_gain": 0.10, "paired_sign_test_p": st["p"], "sign_test_wins": st["wins"], "sign_test_losses": st["losses"],
        "seconds": time.perf_counter() - t0, "seeds": args.seeds, "overrides": overrides, "smoke": args.smoke,
        "completions_scored": sum(p["completions"] for p in per_seed),
        "reward_seconds": sum(p["reward_seconds"] for p in per_seed),
        "adpo_seconds": sum(p["adpo_seconds"] for p in per_seed),
        "sft_reused": not any(p["sft_trained"] for p in per_seed), "checkpoint": args.checkpoint,
        "eval_config": per_seed[0]["results"]["sft"]["config"], "num_heldout_tasks": n_tasks,
        "sandbox_layers": per_seed[0]["sandbox_layers"],
        "sequential_decoding_pass1": {a: seed_mean(per_seed, lambda p: p["results"][f"{a}_sequential"]["pass1"])
                                      for a in ("sft", "adpo")},
        "val_pass1": val,
        # the held-out completions (greedy and T = 1, both arms) scored again with the harness of BASELINE_REV
        "rescored": ({k: sum(p["rescored"][k] for p in per_seed) for k in per_seed[0]["rescored"] if k != "rev"}
                     | {"rev": per_seed[0]["rescored"]["rev"]}) if per_seed[0]["rescored"] else "skipped (shallow clone)",
        "hardcoding": hard,  # per arm: visible_pass, hardcoded_rate (code_eval's hardcoding), mean over seeds
        f"sampled_t1_pass_at_{PASS_K}": sampled,
        "per_seed": [{"seed": p["seed"], **{f"{a}_pass1": p["results"][a]["pass1"] for a in arms},
                      **{f"{a}_{m}": p["results"][f"{a}_{r}"]["pass1"] for a in ("sft", "adpo")
                         for m, r in (("sequential_pass1", "sequential"), ("val_pass1", "val"))},
                      **{f"{a}_sampled": {k: v for k, v in p["results"][f"{a}_sampled"].items() if k != "scored"}
                         for a in ("sft", "adpo")}, "rescored": p["rescored"],
                      **{f"{a}_{m}": p["results"][a][m] for a in arms for m in hc_keys + ("hardcoded_samples",)},
                      "sft_per_family": p["results"]["sft"]["per_family"],
                      "adpo_per_family": p["results"]["adpo"]["per_family"],
                      "sft_seconds": p["sft_seconds"], "adpo_seconds": p["adpo_seconds"], "sft_curve": p["sft_curve"],
                      "sft_trained": p["sft_trained"],
                      "reward_seconds": p["reward_seconds"], "completions_scored": p["completions"],
                      "reward_status_counts": p["reward_status_counts"], "adpo_curve": p["adpo_curve"],
                      "guard_rollbacks": p["guard_rollbacks"],
                      "sft_samples": p["results"]["sft"]["samples"], "adpo_samples": p["results"]["adpo"]["samples"]}
                     for p in per_seed],
    }
    finish("code", payload, [[a, v["pass@1"], v[k], val[a]] for a, v in sampled.items()],
           ["arm", "T=1 pass@1", f"T=1 {k}", "val greedy pass@1"], args.out,
           # ADPO ran (completions sampled and scored in the sandbox, time spent) and both arms were scored
           # on held-out functions; pass rates may be 0 but must be there
           positive=["num_heldout_tasks", "completions_scored", "reward_seconds", "adpo_seconds", "seconds"],
           present=["sft_pass1", "adpo_pass1", "paired_sign_test_p", "rescored", "hardcoding.*.visible_pass",
                    "hardcoding.*.hardcoded_rate", "val_pass1.sft", "val_pass1.adpo",
                    f"sampled_t1_pass_at_{PASS_K}.*.pass@{PASS_K}", "sequential_decoding_pass1.adpo"])


if __name__ == "__main__":
    main()
