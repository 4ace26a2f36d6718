"""Every estimator in the update engine on equal samples and (about) equal update compute.

Per seed (each (seed, arm) run in its own process, one torch thread, so two runs use the two cores):
  1. one SFT checkpoint: ``--checkpoint DIR``'s ``seed{N}/sft`` (e.g. the work folder
     ``benchmarks.learning`` used, same settings), trained there to its validation plateau when absent;
  2. from it, one arm per ``update.estimator``, each sampling the same number of completions
     (``train.iterations`` x prompts x group, same seed);
  3. update compute made about equal by Monte-Carlo mask samples: ADPO scores ``step_fraction`` x
     ``sampler.steps`` rows per trajectory; mean-field, wd1 and SPG run one forward per mask draw,
     coupled and ESPO two (a mask and its complement), EBPO one per block (two 8-token blocks), and
     each draws as many masks per trajectory (its own count: d1's and wd1's ``mask_draws``, SPG's
     ``copies``, ESPO's ``pairs``, EBPO's ``timesteps``) as cost ADPO's update FLOPs,
     measured on one batch of the first seed's SFT policy (:func:`table_draws`; which rows need a
     proximal pass is the engine's business, so the match is measured, not modelled), with the same
     optimizer steps per batch as ADPO; TraceRL (ADPO with s = 2 steps per row) scores as many
     merged runs as cost ADPO's update, at most all of them. (Matching by inner iterations instead,
     d1's mu, takes 4x the optimizer steps per batch at the same LR, which over-optimizes the
     one-pass estimators.)
  4. every arm evaluated on the same held-out problems with one pinned eval config.
Per arm: pass@1, measured update FLOPs (every ``FLOP_EVERY``-th update counted, scaled; and per
trajectory an update kept, since how many groups have a reward spread depends on the arm's policy),
peak bytes of autograd-saved tensors in one update, wall-clock of the updates, paired sign test
against ADPO.
Each (seed, arm) result is kept in ``seed{N}/arms/`` beside the SFT checkpoint and reused while the
arm's config and the SFT weights match: a stopped table resumes.
``--smoke``: seed 0, the SFT, ADPO and mean-field arms (every one-pass estimator still measured by
:func:`matched_draws`) from a 3-step SFT, 2 iterations of 4 x 4 completions, 8 problems (not a figure).
Writes benchmarks/results/estimators.json (estimators_RECIPE.json for ``--recipe`` other than arith).
Run: python -m benchmarks.estimators [--checkpoint DIR] [--seeds 0 1 2 3] [--recipe countdown --set ...] [--smoke]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from benchmarks.harness import (bench_args, checkpoint_path, finish, local_run, over_seeds, paired, problems_needed,
                                sft_checkpoint, workdir)
from miles_core.config import SETTINGS

ESTIMATORS = ("adpo", "adpo_sampled", "tracerl", "meanfield", "wd1", "coupled", "spg", "espo", "ebpo")
TRACERL_MERGE = 2  # TraceRL's shrinkage s (it merges s = 8 of 128 steps; the arith recipe samples 8 steps)
# diagnostic arms, not in the default set: not matched in compute
DIAGNOSTIC = ("adpo_full", "adpo_cover50")
# ADPO's other row designs: adpo_sampled, exact steps only (3/4 of them: about the default's update
# FLOPs, an exact row of a fresh batch needing no proximal pass); adpo_cover50, the previous default
# (covering rows at rho 0.5, fewer FLOPs now); adpo_full, every recorded step exactly (rho 1)
ADPO_DESIGNS = {"adpo_sampled": ["estimators.adpo.step_fraction=0.75", "estimators.adpo.step_cover=false"],
                "adpo_cover50": ["estimators.adpo.step_fraction=0.5", "estimators.adpo.step_cover=true"],
                "adpo_full": ["estimators.adpo.step_fraction=1.0"]}
# EBPO's blocks (LLaDA2.1 gives no size for RL): 8 tokens, two blocks of the arith recipe's 16-token completion
EBPO_BLOCK = 8
ARM_SETTINGS = {"ebpo": [f"estimators.ebpo.mask_block={EBPO_BLOCK}"]}
ONE_PASS = ("meanfield", "wd1", "coupled", "spg", "espo", "ebpo")  # the arms whose mask draws are matched
# each one-pass estimator's count of masks per trajectory, as its settings class names it (config/estimators.py)
DRAWS_FIELD = {name: SETTINGS[name].draws_field for name in ONE_PASS}
# 1700 held-out problems (the test bucket holds 1742 distinct ones; the first 500 are the recipe's own):
# with 4 seeds, enough for the paired sign test to see 1.5 points (see ``power`` in the output)
DEFAULT_OVERRIDES: list[str] = ["sft.steps=6000", "train.iterations=300", "task.num_test=1700",
                                 "eval.num_problems=1700"]
DETECT_GAIN = 0.015  # the smallest gap the table must rank
FLOP_EVERY = 10
# --smoke: the same table at tiny sizes, after DEFAULT_OVERRIDES. Two iterations: the first one's update
# is FLOP-counted, the second's peak memory measured; one SFT validation (its last step) picks the
# checkpoint. Every row is kept in the update, so a 3-step SFT policy (no reward spread needed) is
# updated and every probe of matched_draws measures FLOPs.
SMOKE_SET = ["sft.steps=3", "sft.eval_every=3", "task.num_val=8", "task.num_test=8", "eval.num_problems=8",
             "train.iterations=2", "train.prompts_per_iter=4", "train.group_size=4", "update.skip_zero_variance=false"]
SMOKE = {"seeds": [0], "estimators": ["adpo", "meanfield"]}


def arm_overrides(cfg, estimator: str, draws: dict[str, float] | None = None) -> list[str]:
    """``update.estimator`` and what makes the arm cost ADPO's update FLOPs (:func:`matched_draws`):
    for the one-pass estimators, ``draws[estimator]`` mask draws per trajectory; for ``tracerl``
    (ADPO with ``estimators.adpo.step_merge``, TraceRL, arXiv:2509.06949), ``draws["tracerl"]``, the fraction of
    its merged runs it scores. The ``ADPO_DESIGNS`` are ADPO's other row designs, not matched."""
    if estimator in ADPO_DESIGNS:
        return ["update.estimator=adpo", *ADPO_DESIGNS[estimator]]
    out = [f"update.estimator={estimator}", *ARM_SETTINGS.get(estimator, [])]
    if estimator == "adpo":
        return out
    if draws is None or estimator not in draws:
        raise ValueError(f"arm_overrides: no matched mask draws for {estimator!r} (benchmarks.estimators.matched_draws)")
    if estimator == "tracerl":  # ADPO's rows merged s steps at a time (none exact)
        return ["update.estimator=adpo", f"estimators.adpo.step_merge={TRACERL_MERGE}", f"estimators.adpo.step_fraction={draws['tracerl']}"]
    return out + [f"estimators.{estimator}.{DRAWS_FIELD[estimator]}={int(draws[estimator])}"]


def matched_draws(seed: int, overrides: list[str], out: str, sft_dir: str | None, recipe: str = "arith") -> dict:
    """What each arm draws so that its update costs ADPO's, measured rather than modelled: one batch
    sampled by seed ``seed``'s SFT policy, updated once by ADPO, once by each one-pass estimator at
    one mask draw and once by TraceRL over all its merged runs, each from the same weights, under
    ``FlopMeter``. A draw's FLOPs are its rows' forwards, backwards and proximal passes (which rows
    need one is the engine's business: algo/update.py), so the ratio, rounded, is the matched
    number of draws (TraceRL: of merged runs, at most all of them). Kept beside the seed's arms
    (``arms/matched_draws.json``) while ADPO's config and the SFT weights are the same. Returns
    ``draws`` (``tracerl``: a step fraction) and the measured ``flops`` per update."""
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.flops import FlopMeter
    from miles_core.learner.policy import Learner

    cfg = load_recipe(recipe, overrides + [f"sft.seed={seed}", f"train.seed={seed}"])
    ckpt = checkpoint_path(seed, out, sft_dir)
    cache = ckpt.parent / "arms" / "matched_draws.json"
    key = _arm_key("adpo", cfg, ckpt)
    kept = json.loads(cache.read_text()) if cache.exists() else {}
    if kept.get("key") == key:
        return kept["matched"]
    runs = -(-cfg.sampler.steps // TRACERL_MERGE)
    probes = {"adpo": [], "tracerl": arm_overrides(cfg, "tracerl", {"tracerl": 1.0}),
              **{a: arm_overrides(cfg, a, {a: 1}) for a in ONE_PASS}}
    batch, flops = None, {}
    for arm, extra in probes.items():
        learner = Learner(load_recipe(recipe, overrides + [f"train.seed={seed}"] + extra), ckpt)
        batch = learner.sample(build_task(cfg), 0) if batch is None else batch  # sampling is the estimator's no business
        meter = FlopMeter()
        with meter.measure("update"):
            learner.update(batch)
        flops[arm] = meter.totals["update"]
        if not flops[arm]:
            raise ValueError(f"matched_draws: seed {seed}'s first batch has no reward spread, so no update to measure")
    draws: dict[str, float] = {a: max(1, round(flops["adpo"] / flops[a])) for a in ONE_PASS}
    draws["tracerl"] = min(runs, max(1, round(runs * flops["adpo"] / flops["tracerl"]))) / runs
    matched = {"draws": draws, "flops": flops}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "matched": matched}))
    return matched


def table_draws(seeds: list[int], overrides: list[str], out: str, sft_dir: str | None, recipe: str = "arith") -> dict:
    """One set of draws for the whole table, since every seed's arms must run the same settings:
    :func:`matched_draws` of one seed, the table's first. Which seed that is, is kept at the table's
    root (``matched_draws.json`` beside the ``seed{N}`` folders) for this recipe and these overrides,
    so a resume with other seeds or another order measures on the same one (its own kept result,
    measured again when its config or SFT weights change). (Per seed the ratio moves by about 1% with
    the batch, which at arith straddles the rounding at 4.5: seed 2 alone would round mean-field's to 4.)"""
    root = Path(sft_dir) if sft_dir and not (Path(sft_dir) / "config.json").exists() else Path(out)
    cache, key = root / "matched_draws.json", {"recipe": recipe, "overrides": list(overrides)}
    kept = json.loads(cache.read_text()) if cache.exists() else {}
    seed = kept["seed"] if kept.get("key") == key and checkpoint_path(kept["seed"], out, sft_dir).exists() else seeds[0]
    root.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "seed": seed}))
    return {"seed": seed, **over_seeds(matched_draws, [seed], overrides, out, sft_dir, recipe)[0]}


def prepare_seed(seed: int, overrides: list[str], out: str, sft_dir: str | None, recipe: str = "arith") -> str:
    """Seed ``seed``'s SFT checkpoint, trained when absent (before any arm, so no two arms train it)."""
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    cfg = load_recipe(recipe, overrides + [f"sft.seed={seed}", f"train.seed={seed}"])
    return sft_checkpoint(cfg, seed, out, sft_dir, build_task(cfg), eval_problems=200, patience=3)["path"]


def _arm_key(arm: str, arm_cfg, ckpt: Path) -> dict:
    """What an arm's training depends on: its resolved config but the evaluation's and the other
    estimators' settings (which it never reads), and the SFT weights."""
    weights = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    config = {k: v for k, v in arm_cfg.to_dict().items() if k != "eval"}
    own = arm_cfg.update.estimator
    config["estimators"] = {own: config["estimators"][own]}
    return json.loads(json.dumps({"arm": arm, "config": config, "sft_sha256": weights}))


def _eval_key(cfg) -> dict:
    """The EvalConfig ``run_eval`` will use, as a stored result records it."""
    from miles_core.eval.evaluate import eval_config

    return json.loads(json.dumps(eval_config(cfg, min(cfg.eval.num_problems, cfg.task.num_test)).to_dict()))


def run_arm(job: tuple[int, str], overrides: list[str], out: str, sft_dir: str | None, recipe: str = "arith",
            draws: dict[str, float] | None = None) -> dict:
    """One (seed, arm) run from the seed's SFT checkpoint. Its result and trained weights are kept
    beside the checkpoint (``seed{N}/arms/ARM.json``, ``ARM.pt``) and reused when the config and the
    SFT weights match, so a stopped table resumes where it stopped; a changed ``eval`` section
    re-evaluates the kept weights without training again."""
    import torch

    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.eval.evaluate import run_eval
    from miles_core.flops import FlopMeter
    from miles_core.learner.policy import Learner
    from miles_core.memory import SavedTensorMeter
    from miles_core.models.base import load_checkpoint

    seed, arm = job
    cfg = load_recipe(recipe, overrides + [f"sft.seed={seed}", f"train.seed={seed}"])
    ckpt = checkpoint_path(seed, out, sft_dir)
    arm_cfg = cfg if arm == "sft" else load_recipe(recipe, overrides + [f"train.seed={seed}"] + arm_overrides(cfg, arm, draws))
    key, cache = _arm_key(arm, arm_cfg, ckpt), ckpt.parent / "arms" / f"{arm}.json"
    weights = cache.with_suffix(".pt")
    kept = json.loads(cache.read_text()) if cache.exists() else {}
    if kept.get("key") == key:
        result = kept["result"]
        if result.get("eval_config") == _eval_key(arm_cfg):
            print(f"[seed {seed}] {arm} pass@1 {result['pass1']:.3f} (kept from {cache})", flush=True)
            return result
        if arm != "sft" and weights.exists():   # trained already: evaluate again with this eval section
            learner = Learner(arm_cfg, ckpt)
            learner.model.load_state_dict(torch.load(weights))
            r = run_eval(learner.model, learner.tok, arm_cfg, build_task(cfg))
            result |= {"pass1": r.pass_at["pass@1"], "correct": [c[0] for c in r.correct], "eval_config": r.config.to_dict()}
            cache.write_text(json.dumps({"key": key, "result": result}))
            print(f"[seed {seed}] {arm} pass@1 {result['pass1']:.3f} (kept weights, evaluated again)", flush=True)
            return result
    data = build_task(cfg)
    if arm == "sft":
        model, tok = load_checkpoint(ckpt)
        r = run_eval(model, tok, cfg, data)
        result = {"pass1": r.pass_at["pass@1"], "correct": [c[0] for c in r.correct], "eval_config": r.config.to_dict()}
    else:
        meter, update_s, samples, peak, measured, kept = FlopMeter(), 0.0, 0, 0, 0, 0.0
        with local_run(arm_cfg, ckpt) as run:  # the run `miles train` trains: commits, checkpoints, publishes
            learner = run.learner
            for it in range(arm_cfg.train.iterations):
                bid, batch, _ = run.collect(it)
                samples += len(batch)
                t0 = time.perf_counter()
                if it == 1:  # one update's peak autograd memory (iteration 0 may have no signal)
                    peak = SavedTensorMeter(learner.params).measure(lambda: run.consume(bid))
                elif it % FLOP_EVERY == 0:
                    with meter.measure("update"):
                        kept += run.consume(bid)[1].get("trajectories", 0.0)  # groups with a reward spread
                    measured += 1
                else:
                    run.consume(bid)
                update_s += time.perf_counter() - t0
                if (it + 1) % 50 == 0:
                    print(f"[seed {seed}] {arm} it {it + 1} reward {float(batch.reward.nan_to_num(0).mean()):.3f}",
                          flush=True)
            r = run_eval(learner.model, learner.tok, arm_cfg, data)
            weights.parent.mkdir(parents=True, exist_ok=True)
            torch.save(learner.model.state_dict(), weights)
        result = {"pass1": r.pass_at["pass@1"], "correct": [c[0] for c in r.correct], "samples": samples,
                  "update_flops": meter.totals.get("update", 0) / max(measured, 1) * arm_cfg.train.iterations,
                  # per trajectory an update kept (A != 0): the estimator's own cost, apart from how
                  # many groups its policy leaves with a reward spread
                  "flops_per_trajectory": meter.totals.get("update", 0) / max(kept, 1.0),
                  "peak_mem_bytes": peak, "update_seconds": update_s, "settings": dataclasses.asdict(arm_cfg.own()),
                  "estimator": arm_cfg.update.estimator,
                  "eval_config": r.config.to_dict()}
        print(f"[seed {seed}] {arm} pass@1 {result['pass1']:.3f} ({update_s:.0f}s of updates)", flush=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "result": result}))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=(0, 1), checkpoint=True, workdir=True)
    ap.add_argument("--recipe", default="arith", help="a built-in recipe (arith; countdown needs a larger model)")
    ap.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS + DIAGNOSTIC,
                    help=f"arms (default: all but the diagnostic {', '.join(DIAGNOSTIC)}); adpo is always run")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE, set=SMOKE_SET + args.set)
    if "adpo" not in args.estimators:  # every arm is tested against it
        args.estimators = ["adpo", *args.estimators]
    overrides = DEFAULT_OVERRIDES + args.set
    t0 = time.perf_counter()
    out_dir = str(workdir(args, "estimators"))
    over_seeds(prepare_seed, args.seeds, overrides, out_dir, args.checkpoint, args.recipe)
    matched = table_draws(args.seeds, overrides, out_dir, args.checkpoint, args.recipe)
    print(f"matched draws {matched['draws']}, measured on seed {matched['seed']} "
          f"(update FLOPs of one batch: {matched['flops']})")
    arms = ["sft", *args.estimators]
    jobs = [(seed, arm) for arm in arms for seed in args.seeds]  # an arm on every seed before the next arm
    done = dict(zip(jobs, over_seeds(run_arm, jobs, overrides, out_dir, args.checkpoint, args.recipe,
                                     matched["draws"])))
    per_seed = [{"seed": seed, "results": {arm: done[seed, arm] for arm in arms}} for seed in args.seeds]
    rows, out = [], []
    for arm in ["sft", *args.estimators]:
        res = [p["results"][arm] for p in per_seed]
        st = paired([c for p in per_seed for c in p["results"][arm]["correct"]],
                    [c for p in per_seed for c in p["results"]["adpo"]["correct"]])
        entry = {"name": arm, "pass1": sum(r["pass1"] for r in res) / len(res),
                 "p_vs_adpo": None if arm == "adpo" else st["p"],
                 "wins_vs_adpo": st["wins"], "losses_vs_adpo": st["losses"]}
        if arm != "sft":
            for key in ("update_flops", "flops_per_trajectory", "peak_mem_bytes", "update_seconds", "samples"):
                entry[key] = sum(r[key] for r in res) / len(res)
        trained = arm != "sft"
        draws = trained and res[0]["estimator"] in DRAWS_FIELD  # the ADPO arms (tracerl, adpo_full) draw no masks
        if draws:
            entry["mask_draws"] = res[0]["settings"][DRAWS_FIELD[res[0]["estimator"]]]
        out.append(entry)
        rows.append([arm, f"{entry['pass1']:.3f}", int(entry["mask_draws"]) if draws else "-",
                     f"{entry['update_flops']:.3g}" if trained else "-",
                     f"{entry['flops_per_trajectory']:.3g}" if trained else "-",
                     f"{entry['peak_mem_bytes'] / 2**20:.1f}" if trained else "-",
                     f"{entry['update_seconds']:.0f}" if trained else "-",
                     "-" if entry["p_vs_adpo"] is None else f"{st['wins']}/{st['losses']}",
                     "-" if entry["p_vs_adpo"] is None else f"{entry['p_vs_adpo']:.3g}"])
    # the power calculation: the discordance d seen between arms -> problems needed for 1.5 points
    problems = sum(len(p["results"]["adpo"]["correct"]) for p in per_seed)
    disc = [(e["wins_vs_adpo"] + e["losses_vs_adpo"]) / problems for e in out if e["name"] not in ("adpo", "sft")]
    d = max(disc) if disc else 0.2
    # arms that disagree on fewer problems than the gain cannot differ by it: the calculation has no answer
    power = {"gain": DETECT_GAIN, "alpha": 0.05, "power": 0.8, "discordance": d, "problems": problems,
             "problems_needed": problems_needed(d, DETECT_GAIN) if d >= DETECT_GAIN else None}
    print(f"power: discordance up to {d:.3f} -> {power['problems_needed']} paired problems to see "
          f"{DETECT_GAIN:.3f} at p < 0.05 with power 0.8; this run has {problems}")
    payload = {"estimators": out, "power": power, "recipe": args.recipe, "seeds": args.seeds, "overrides": overrides,
               "seconds": time.perf_counter() - t0, "eval_config": per_seed[0]["results"]["adpo"]["eval_config"],
               "sft_dir": args.checkpoint, "matched_draws": matched, "smoke": args.smoke,
               # what each trained arm measured, keyed by name (the checks below name them)
               "measured": {e["name"]: {k: e[k] for k in ("pass1", "samples", "update_flops", "flops_per_trajectory",
                                                          "peak_mem_bytes", "update_seconds")}
                            for e in out if e["name"] != "sft"}}
    finish("estimators" if args.recipe == "arith" else f"estimators_{args.recipe}", payload, rows,
           ["estimator", "pass@1", "mask draws", "update FLOPs", "FLOPs / kept traj", "peak saved MiB",
            "update s", "won/lost vs adpo", "p vs adpo"], args.out,
           positive=["matched_draws.flops.*", "matched_draws.draws.*"]
           + [f"measured.*.{k}" for k in ("samples", "update_flops", "flops_per_trajectory", "peak_mem_bytes", "update_seconds")],
           present=["measured.adpo.pass1", "measured.*.pass1", "power.discordance"])


if __name__ == "__main__":
    main()
