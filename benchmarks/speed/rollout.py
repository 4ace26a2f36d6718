"""Rollout engine: Miles' sampler against a plain LLaDA-style reference, side by side in one run.

Part 1, speed (random weights, real-size vocabulary): a bidirectional Qwen3 of ~41M parameters
(hidden 128, 8 layers, vocab 151,936: the logits cost is real), batch 32, completion 256, block 32.
The reference is written here the way ML-GSAI/LLaDA ``generate.py`` works: a full forward every
step, logits for the whole sequence, a fixed number of tokens per step (``steps`` = completion
length, LLaDA's and Fast-dLLM's baseline at length 256), the top-k per row picked in a Python loop.
Miles runs four modes: static (same schedule), NSD, NSD + prefix cache, NSD + dual cache. On this
CPU a whole reference rollout at that size takes over an hour, so every mode is timed on its first
``--timed-blocks`` block(s) (each reference step costs the same, so its rate over ``--ref-steps``
steps is its rate; cached modes are cheapest in later blocks, so the first block is their worst).
Random weights are never confident, so NSD commits ``min_per_step`` per step there: its NFE gain
is measured in part 2. ``greedy_matches_reference``: the reference and Miles' static sampler at
temperature 0 with no cache, run to the end at ``--check-batch`` rows, token for token.

Part 2, accuracy (the arith recipe's SFT model, trained here unless ``--checkpoint``): pass@1 and
NFE of each mode on ``--problems`` held-out problems (greedy, block 8 of 16), and the log-prob gap each
cache introduces: |log mu - log pi| between what the cached sampler recorded (temperature 1) and
the learner's uncached score of the same step, mean and p99 over committed tokens.

Run: python -m benchmarks.rollout [--timed-blocks 1] [--ref-steps 4] [--problems 500] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.harness import SPEED_SIZE, MeasuredNothing, add_smoke, table, write_result
from miles_core.config import SamplerConfig, load_recipe
from miles_core.data.registry import build_task
from miles_core.eval.evaluate import eval_config, evaluate
from miles_core.learner.baseline import train_baseline
from miles_core.models.base import load_checkpoint
from miles_core.models.hf import init_tiny
from miles_core.rewards.registry import get_reward
from miles_core.samplers.hostreads import HostReads
from miles_core.samplers.sampler import sample
from miles_core.models.window import Capabilities, WindowDenoiser, attention_grid, capabilities
from tools.llada_reference import logp_gap, reference_generate

class StopTiming(Exception):
    pass


class FirstBlocks(WindowDenoiser):
    """Wraps a denoiser, states its capabilities (so the sampler takes the same path, caches
    included, as on the bare model) and stops a rollout when it asks for block ``blocks``
    (timing only). Counts the window calls and those that read a cache: the benchmark fails when
    a mode's calls did not go through the path it names."""

    def __init__(self, model: WindowDenoiser, width: int, block: int, blocks: int) -> None:
        super().__init__()
        self.model, self.stop_at, self.calls, self.cache_calls = model, width + block * blocks, 0, 0

    def capabilities(self) -> Capabilities:
        return capabilities(self.model)

    def window(self, ids, mask, query, out, cache=None, keep=()):
        if out[0] >= self.stop_at:
            raise StopTiming
        self.calls += 1
        self.cache_calls += cache is not None
        return self.model.window(ids, mask, query, out, cache, keep)

    def forward(self, ids, mask=None):
        return self.model(ids, mask)


def speed_modes(block: int, completion: int) -> dict[str, SamplerConfig]:
    """The four modes both parts compare: static with one token per step, NSD, NSD + each cache."""
    nsd = SamplerConfig(kind="nsd", threshold=0.9, max_per_step=block, block_size=block, temperature=0.0)
    return {"static": SamplerConfig(kind="static", steps=completion, block_size=block, temperature=0.0),
            "nsd": nsd, "nsd+prefix": replace(nsd, cache="prefix"), "nsd+dual": replace(nsd, cache="dual")}


def speed_part(args, folder: Path) -> dict:
    model, tok = load_checkpoint(folder)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(200, 100_000, (args.batch, args.prompt_len), generator=gen)   # ordinary token ids
    L, blk = args.completion, attention_grid(model) or args.block  # SDAR decodes on its attention blocks
    t0 = time.perf_counter()
    with HostReads() as ref_reads:
        _, ran = reference_generate(model, prompt, tok.mask_id, tok.forbidden_ids, L, blk, L, max_steps=args.ref_steps,
                                    grid=attention_grid(model))
    ref_s = time.perf_counter() - t0
    ref_tps = args.batch * ran / ref_s                 # one token per row per step
    print(f"  reference: {ran} steps in {ref_s:.1f}s, {ref_tps:.2f} tokens/s", flush=True)
    modes = {}
    for name, cfg in speed_modes(blk, L).items():
        wrapped = FirstBlocks(model, args.prompt_len, blk, args.timed_blocks)
        t0 = time.perf_counter()
        with HostReads() as reads:
            try:
                sample(wrapped, tok, prompt.tolist(), cfg, L, torch.Generator().manual_seed(0))
            except StopTiming:
                pass
        sec = time.perf_counter() - t0
        calls = wrapped.calls
        tokens = args.batch * blk * args.timed_blocks
        modes[name] = {"tokens_per_s": tokens / sec, "seconds": sec, "denoiser_calls": calls,
                       "cache_calls": wrapped.cache_calls, "cache": cfg.cache,
                       "host_reads": reads.count, "host_bytes_per_step": reads.bytes / max(calls, 1)}
        print(f"  {name}: {tokens / sec:.2f} tokens/s ({calls} calls, {wrapped.cache_calls} from a cache, "
              f"{reads.count} host reads)", flush=True)
        if calls == 0 or (wrapped.cache_calls > 0) != (cfg.cache != "none"):
            raise MeasuredNothing(f"benchmarks.rollout: mode {name} (cache {cfg.cache}) made {wrapped.cache_calls} "
                                  f"cached calls of {calls}: its calls did not take the path it names")
    check = greedy_check(model, tok, args)
    return {"reference_tokens_per_s": ref_tps, "reference_seconds": ref_s, "reference_steps": ran,
            "reference_host_reads_per_step": ref_reads.count / max(ran, 1),
            "reference_host_bytes_per_step": ref_reads.bytes / max(ran, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "vocab": model.lm.config.vocab_size,
            "modes": modes, "greedy_matches_reference": check}


def greedy_check(model, tok, args) -> bool:
    """Reference and Miles' static sampler (temperature 0, no cache) to the end, token for token."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(200, 100_000, (args.check_batch, args.prompt_len), generator=gen)
    L, blk = args.check_completion, attention_grid(model) or args.block
    ref, _ = reference_generate(model, prompt, tok.mask_id, tok.forbidden_ids, L, blk, L, grid=attention_grid(model))
    cfg = SamplerConfig(kind="static", steps=L, block_size=blk, temperature=0.0)
    got = sample(model, tok, prompt.tolist(), cfg, L, torch.Generator().manual_seed(0))
    same = bool(torch.equal(ref[:, args.prompt_len:], got.completion_ids))
    print(f"  greedy check ({args.check_batch} x {L}): Miles == reference: {same}", flush=True)
    return same


def accuracy_part(args) -> dict:
    cfg = load_recipe("arith", SMOKE_SFT if args.smoke else [])
    data = build_task(cfg)
    ckpt = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="miles-rollout-")) / "sft"
    if not (ckpt / "config.json").exists():
        print("  training the arith SFT checkpoint ...", flush=True)
        train_baseline(cfg, data, ckpt, seed=0)
    model, tok = load_checkpoint(ckpt)
    model.eval()
    L, blk = cfg.task.completion_len, 8
    probs = data.test[:args.problems]
    modes = speed_modes(blk, L)
    rl_prompts = [tok.encode(p.prompt) for p in data.test[:min(64, args.problems)]]
    out = {}
    for name, s in modes.items():
        r = evaluate(model, tok, [p.prompt for p in probs], [p.answer for p in probs], eval_config(cfg, len(probs), s),
                     get_reward("math_exact"), batch_size=250, sampler=s)
        mean, p99 = logp_gap(model, tok, rl_prompts, replace(s, temperature=1.0), L)
        out[name] = {"pass1": r.pass_at["pass@1"], "nfe": r.metrics["nfe_mean"], "logp_gap_mean": mean,
                     "logp_gap_p99": p99}
        print(f"  {name}: pass@1 {out[name]['pass1']:.3f} NFE {out[name]['nfe']:.2f} "
              f"gap mean {mean:.2e} p99 {p99:.2e}", flush=True)
    return {"problems": len(probs), "completion_len": L, "block": blk, "modes": out}


# --smoke: the same two parts at sizes that run in seconds (an SFT of a few steps, a 2-layer speed model).
SMOKE = {"batch": 2, "completion": 16, "block": 8, "prompt_len": 8, "ref_steps": 2, "check_batch": 1,
         "check_completion": 8, "problems": 4}
SMOKE_SIZE = {**SPEED_SIZE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8}
SMOKE_SFT = ["sft.steps=3"]


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--timed-blocks", type=int, default=1, help="blocks each Miles mode is timed on")
    ap.add_argument("--ref-steps", type=int, default=4, help="steps the reference is timed on (each costs the same)")
    ap.add_argument("--check-batch", type=int, default=2)
    ap.add_argument("--check-completion", type=int, default=64)
    ap.add_argument("--problems", type=int, default=500)
    ap.add_argument("--checkpoint", default=None, help="arith SFT checkpoint (trained here when absent)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miles-rollout-") as d:
        folder = init_tiny("bidir_qwen3", Path(d) / "speed", seed=0, size=SMOKE_SIZE if args.smoke else SPEED_SIZE)
        print(f"part 1: speed, batch {args.batch}, completion {args.completion}, block {args.block}", flush=True)
        speed = speed_part(args, folder)
    print("part 2: accuracy on the arith SFT model", flush=True)
    acc = accuracy_part(args)
    ref = speed["reference_tokens_per_s"]
    rows = []
    for name, m in speed["modes"].items():
        a = acc["modes"][name]
        m.update(speedup=m["tokens_per_s"] / ref, pass1=a["pass1"], nfe=a["nfe"], logp_gap_mean=a["logp_gap_mean"],
                 logp_gap_p99=a["logp_gap_p99"],
                 pass1_minus_static=a["pass1"] - acc["modes"]["static"]["pass1"])
        rows.append([name, m["tokens_per_s"], m["speedup"], m["host_bytes_per_step"], a["pass1"], a["nfe"],
                     a["logp_gap_mean"], a["logp_gap_p99"]])
    rows.insert(0, ["reference", ref, 1.0, speed["reference_host_bytes_per_step"], "-", "-", "-", "-"])
    print(table(rows, ["mode", "tokens/s", "x ref", "host B/step", "pass@1 (arith)", "NFE (arith)",
                       "|dlogp| mean", "|dlogp| p99"]))
    print(f"greedy output equals the reference: {speed['greedy_matches_reference']}")
    best = max(speed["modes"].values(), key=lambda m: m["speedup"])
    payload = {**speed, "accuracy": acc, "settings": vars(args), "best_speedup": best["speedup"],
               "host_bytes_per_step": {k: m["host_bytes_per_step"] for k, m in speed["modes"].items()},
               "seconds": time.perf_counter() - t_all, "smoke": args.smoke}
    path = write_result("rollout", payload, positive=["reference_tokens_per_s", "modes.*.denoiser_calls",
                                                      "modes.*.tokens_per_s", "modes.nsd+prefix.cache_calls",
                                                      "modes.nsd+dual.cache_calls", "accuracy.modes.*.nfe"],
                        present=["greedy_matches_reference", "accuracy.modes.static.pass1"])
    print(f"wrote {path} in {payload['seconds']:.0f}s")


if __name__ == "__main__":
    main()
