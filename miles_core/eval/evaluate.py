"""Evaluate a policy on held-out problems: pass@1 (greedy) or unbiased pass@k from n samples.

Every number carries the EvalConfig that produced it (length, steps, block size, temperature,
remasking, sampler, seed), because scores move with sampling settings (ANCHORS: evaluation
mismatches are users' most common complaint)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from miles_core.config import ConfigError, RecipeConfig, RenoiseConfig, SamplerConfig
from miles_core.data.registry import TaskData, check_reward
from miles_core.eval.passk import EvalConfig, EvalResult, aggregate_pass_at_k, problems_digest
from miles_core.eval.presets import preset_values
from miles_core.rewards.registry import call_reward
from miles_core.progress import track
from miles_core.rewards.registry import reward_for_recipe
from miles_core.samplers.registry import sample_for
from miles_core.tokenizer import PROMPT_PREFILL, CharTokenizer


def sampler_for(ec: EvalConfig) -> SamplerConfig:
    return SamplerConfig(kind=ec.sampler, steps=ec.steps,  # type: ignore[arg-type]
                         block_size=0 if ec.block_size in (0, ec.completion_len) else ec.block_size,
                         temperature=ec.temperature, remasking=ec.remasking,  # type: ignore[arg-type]
                         threshold=ec.threshold if ec.threshold is not None else 0.9)


@torch.no_grad()
def evaluate(model, tok: CharTokenizer, prompts: Sequence[str], answers: Sequence[str], ec: EvalConfig,
             reward_fn: Callable[..., list], batch_size: int = 250, progress: bool = False,
             sampler: SamplerConfig | None = None, renoise: RenoiseConfig | None = None) -> EvalResult:
    """Sample ``ec.n_samples`` completions per problem; correct = reward >= 1. The model's family
    picks the sampler (samplers/registry.py): a renoising one (DiffusionGemma) samples with
    ``renoise`` (its row seeds drawn from ``ec.seed``'s stream)."""
    if len(prompts) != len(answers):
        raise ValueError(f"evaluate: {len(prompts)} prompts but {len(answers)} answers")
    scfg = sampler or sampler_for(ec)
    model.eval()
    gen = torch.Generator().manual_seed(ec.seed)
    correct: list[list[bool]] = [[] for _ in prompts]
    texts: list[list[str]] = [[] for _ in prompts]
    samples: list[dict] = []
    nfe_total, tokens, reward_sum, t0 = 0, 0, 0.0, time.perf_counter()
    order = [(i, s) for s in range(ec.n_samples) for i in range(len(prompts))]
    chunks = track(range(0, len(order), batch_size), -(-len(order) // batch_size), "eval", enabled=progress)
    for start in chunks:
        part = order[start:start + batch_size]
        ids = [tok.encode_prompt(prompts[i]) for i, _ in part]
        batch = sample_for(model, tok, ids, scfg, ec.completion_len, gen, renoise_cfg=renoise)
        rewards = call_reward(reward_fn, [prompts[i] for i, _ in part], batch.completions,
                              answer=[answers[i] for i, _ in part])
        for (i, s), c, r in zip(part, batch.completions, rewards):
            ok = r is not None and r >= 1.0
            reward_sum += float(r or 0.0)  # d1's Sudoku metric is this mean (cells), not pass@1 (grids)
            correct[i].append(ok)
            texts[i].append(c)
            if len(samples) < 20 and s == 0:
                samples.append({"prompt": prompts[i], "completion": c, "answer": answers[i], "correct": ok})
        nfe_total += int(batch.nfe.sum())
        tokens += batch.completion_ids.numel()
    seconds = time.perf_counter() - t0
    pass_at = aggregate_pass_at_k(correct, ec.ks)
    metrics = {"nfe_mean": nfe_total / max(len(order), 1), "tokens_per_s": tokens / max(seconds, 1e-9),
               "seconds": seconds, "reward_mean": reward_sum / max(len(order), 1)}
    return EvalResult(pass_at=pass_at, num_problems=len(prompts), config=ec, samples=samples, metrics=metrics,
                      correct=correct, problems_digest=problems_digest(prompts, answers), completions=texts,
                      runtime=runtime_of(model, batch_size))


def runtime_of(model, batch_size: int) -> dict[str, str | int]:
    """Batch size, dtype and device of an evaluation: recorded beside its number."""
    p = next(model.parameters())
    return {"batch_size": int(batch_size), "dtype": str(p.dtype).replace("torch.", ""), "device": str(p.device),
            "torch_threads": torch.get_num_threads()}


def eval_config(cfg: RecipeConfig, num_problems: int | None = None, sampler: SamplerConfig | None = None,
                split: str = "test") -> EvalConfig:
    """The recipe's eval settings (or ``sampler``'s, to evaluate the way a run samples) as an EvalConfig."""
    e = cfg.eval
    s = sampler
    length = cfg.task.completion_len
    values = dict(steps=s.steps if s else e.steps, block_size=(s.block_size if s else e.block_size) or length,
                  temperature=s.temperature if s else e.temperature, remasking=s.remasking if s else e.remasking)
    if e.preset and not s:
        try:
            p = preset_values(e.preset, cfg.task.name)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        length = p.pop("completion_len")
        values.update(p)
    return EvalConfig(num_problems=num_problems or e.num_problems, completion_len=length, **values,
                      sampler=s.kind if s else "static", threshold=s.threshold if s and s.kind == "nsd" else None,
                      n_samples=e.n_samples, ks=(1,) if e.n_samples == 1 else (1, e.n_samples), seed=e.seed,
                      split=split, task=cfg.task.name, prompt_template=cfg.task.prompt_template,
                      prompt_prefill=PROMPT_PREFILL.get(cfg.task.name, "") if cfg.task.prompt_template == "chat" else "",
                      preset="" if s else e.preset)


def run_eval(model, tok: CharTokenizer, cfg: RecipeConfig, data: TaskData, num_problems: int | None = None,
             sampler: SamplerConfig | None = None, progress: bool = False, split: str = "test") -> EvalResult:
    """pass@k on the first ``num_problems`` of ``split`` ("test": reported results; "val": selection)."""
    if split not in ("test", "val"):
        raise ValueError(f"run_eval: split must be 'test' or 'val', got {split!r}")
    pool = data.test if split == "test" else data.val
    if not pool:
        raise ConfigError(f"run_eval: the {split!r} split is empty; set task.num_{split} > 0")
    ec = eval_config(cfg, min(num_problems or cfg.eval.num_problems, len(pool)), sampler, split)
    probs = pool[:ec.num_problems]
    reward = reward_for_recipe(cfg, check_reward(cfg.task))
    return evaluate(model, tok, [p.prompt for p in probs], [p.answer for p in probs], ec, reward,
                    batch_size=cfg.eval.batch_size, progress=progress, sampler=sampler,
                    renoise=dataclasses.replace(cfg.renoise, output="argmax"))  # decoded as generate decodes
