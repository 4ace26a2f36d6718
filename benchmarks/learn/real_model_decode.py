"""benchmarks.real_model's decoding measurements: the AR original through transformers' own
``generate``, Miles' decoder against it at batch 1 and 16, and NSD's FLOPs against static.

Kept apart from the protocol (benchmarks/learn/real_model.py) so each file reads on its own; every
function here runs on the user's path (``sample_for``, ``run_eval``) or on transformers' own.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.harness import usable_cpus


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started (``VmHWM``, in MiB). Not getrusage's
    ``ru_maxrss``: Linux carries that across fork and exec, so a spawned child would report its
    parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: the best there is


def eval_sampler(cfg, kind: str = "static", cache: str = "prefix", steps: int | None = None):
    """The pinned evaluation decoder: greedy, the recipe's eval steps (static) or threshold (NSD)."""
    from miles_core.config import SamplerConfig

    return SamplerConfig(kind=kind, steps=steps or cfg.eval.steps, temperature=0.0, remasking=cfg.eval.remasking,
                         threshold=cfg.sampler.threshold, max_per_step=cfg.sampler.max_per_step, cache=cache)


# ---- the AR original ------------------------------------------------------------------------------

def ar_generate(lm, tok, prompts: list[list[int]], max_new: int) -> tuple[list[str], int]:
    """Greedy ``generate`` (KV cache) on left-padded prompt ids -> (answer texts, answer tokens up
    to and including the first EOS)."""
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                          pad_token_id=pad, eos_token_id=tok.eos_token_id)
    new = out[:, width:]
    texts, tokens = [], 0
    for row in new.tolist():
        n = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        tokens += n
        texts.append(tok.decode(row[:n], skip_special_tokens=True))
    return texts, tokens


def ar_stage(cfg, source: Path, data, miles_tok, reward_name: str) -> dict:
    """The AR original's pass@1 on the test problems, with the diffusion model's own prompt ids,
    scored by the reward ``reward_name`` the diffusion model's evaluation uses."""
    from miles_core.models.importer import load_source
    from miles_core.rewards.registry import call_reward, get_reward

    torch.set_num_threads(usable_cpus())
    lm, tok = load_source(source)
    probs = data.test[:cfg.eval.num_problems]
    reward = get_reward(reward_name)
    correct, texts, t0 = [], [], time.perf_counter()
    for i in range(0, len(probs), 16):
        part = probs[i:i + 16]
        out, _ = ar_generate(lm, tok, [miles_tok.encode_prompt(p.prompt) for p in part], 2 * cfg.task.completion_len)
        r = call_reward(reward, [p.prompt for p in part], out, answer=[p.answer for p in part])
        correct += [x is not None and x >= 1 for x in r]
        texts += out
    return {"pass1": sum(correct) / len(correct), "correct": correct, "seconds": time.perf_counter() - t0,
            "max_new_tokens": 2 * cfg.task.completion_len,
            "samples": [{"prompt": p.prompt, "answer": p.answer, "completion": t} for p, t in zip(probs[:5], texts)]}


# ---- latency and NSD ----------------------------------------------------------------------------

def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def latency_child(cfg_dict: dict, sft: str, adapter: str, source: str, n: int) -> dict:
    """Batch-1 seconds per answer and batch-16 answer tokens per second of Miles' decoder (three
    modes, on the ADPO model) and of transformers' ``generate`` (the AR original), same prompts,
    all cores; answer tokens: up to and including the first EOS. Miles runs first, so the peak RSS
    read before the AR model loads is the sampler's."""
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.models.base import load_base
    from miles_core.models.importer import load_source
    from miles_core.models.lora import load_adapter
    from miles_core.rewards.registry import call_reward, get_reward
    from miles_core.samplers.registry import sample_for

    torch.set_num_threads(usable_cpus())
    cfg = load_recipe(cfg_dict)
    probs = build_task(cfg).test[:n]
    base, tok = load_base(cfg, sft)
    model = load_adapter(base, adapter).eval()
    ids = [tok.encode_prompt(p.prompt) for p in probs]
    reward = get_reward("math_exact")
    L = cfg.task.completion_len

    def score(texts: list[str]) -> float:
        r = call_reward(reward, [p.prompt for p in probs], texts, answer=[p.answer for p in probs])
        return sum(x is not None and x >= 1 for x in r) / len(probs)

    def miles(kind: str, cache: str, steps: int | None = None) -> Callable[[list[list[int]]], tuple[list[str], int]]:
        s = eval_sampler(cfg, kind, cache, steps)

        def run(part: list[list[int]]) -> tuple[list[str], int]:
            with torch.no_grad():
                b = sample_for(model, tok, part, s, L, torch.Generator().manual_seed(0))
            eos = (b.completion_ids == tok.eos_id).int()
            first = torch.where(eos.any(1), eos.argmax(1) + 1, torch.full_like(eos[:, 0], L))
            return list(b.completions), int(first.sum())
        return run

    modes: list[tuple[str, Callable]] = [("miles_static", miles("static", "none")),
                                         ("miles_static_prefix", miles("static", "prefix")),
                                         # half the steps: the latency a fixed schedule buys, at its pass@1
                                         (f"miles_static_k{cfg.eval.steps // 2}_prefix",
                                          miles("static", "prefix", max(1, cfg.eval.steps // 2))),
                                         ("miles_nsd_prefix", miles("nsd", "prefix"))]
    rows: dict[str, dict] = {}
    sampler_rss = 0.0

    def measure(name: str, run: Callable) -> None:
        run(ids[:1])  # warm-up: first-call allocations are not latency
        one, t1 = [], 0.0
        for p in ids:
            (texts, _), sec = _timed(lambda: run([p]))
            one += texts
            t1 += sec
        toks = secs = 0.0
        for i in range(0, len(ids), 16):
            (_, k), sec = _timed(lambda: run(ids[i:i + 16]))
            toks, secs = toks + k, secs + sec
        rows[name] = {"seconds_per_answer": t1 / len(ids), "tokens_per_s": toks / secs, "pass1": score(one)}
        print(f"  {name}: {rows[name]['seconds_per_answer']:.3f} s/answer at batch 1, "
              f"{rows[name]['tokens_per_s']:.1f} tokens/s at batch 16, pass@1 {rows[name]['pass1']:.3f}", flush=True)

    for name, run in modes:
        measure(name, run)
    sampler_rss = peak_rss_mb()
    model = base = None  # the Miles weights go before the AR model loads
    lm, hf_tok = load_source(source)
    measure("ar_generate", lambda part: ar_generate(lm, hf_tok, part, 2 * L))
    return {"rows": rows, "prompts": len(ids), "sampler_peak_rss_mb": sampler_rss, "threads": usable_cpus()}


def nsd_stage(cfg, sft: str, adapter: str, data) -> dict:
    """Denoiser FLOPs and pass@1 of NSD against static on the test problems (ADPO model)."""
    from miles_core.eval.evaluate import run_eval
    from miles_core.flops import FlopMeter
    from miles_core.models.base import load_base
    from miles_core.models.lora import load_adapter

    torch.set_num_threads(usable_cpus())
    base, tok = load_base(cfg, sft)
    model = load_adapter(base, adapter).eval()
    out = {}
    for kind in ("static", "nsd"):
        meter = FlopMeter()
        with meter.measure("sample"):
            r = run_eval(model, tok, cfg, data, sampler=eval_sampler(cfg, kind))
        out[kind] = {"pass1": r.pass_at["pass@1"], "flops": meter.total, "nfe": r.metrics["nfe_mean"],
                     "correct": [c[0] for c in r.correct]}
        print(f"  {kind}: pass@1 {out[kind]['pass1']:.3f} NFE {out[kind]['nfe']:.2f} "
              f"GFLOP {meter.total / 1e9:.1f}", flush=True)
    return out
