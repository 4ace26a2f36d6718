"""The pieces of one RL iteration, shared by the synchronous flow, async workers and benchmarks:
rollout (G samples per prompt, recorded) -> reward -> group advantages -> ``update_policy``, and
the seeded batch every learner and sampler commits (:func:`sample_batch`)."""

from __future__ import annotations

import hashlib
import math
import random
from typing import Callable, Sequence

import torch

from miles_core.algo.advantages import group_advantages, zero_variance_groups
from miles_core.config import RecipeConfig, RenoiseConfig, SamplerConfig
from miles_core.data.registry import TaskData
from miles_core.rewards.registry import call_reward
from miles_core.samplers.registry import sample_for
from miles_core.samplers.sampler import Refresh
from miles_core.tokenizer import CharTokenizer
from miles_core.types import Batch, RenoiseBatch, TrajectoryBatch

RewardFn = Callable[..., list]


def rollout(model, tok: CharTokenizer, prompts: Sequence[str], answers: Sequence[str], cfg: SamplerConfig,
            completion_len: int, group_size: int, generator: torch.Generator, policy_version: int = 0,
            group_offset: int = 0, threshold: float | None = None,
            renoise: RenoiseConfig | None = None, refresh: Refresh | None = None) -> TrajectoryBatch | RenoiseBatch:
    """Sample ``group_size`` completions per prompt; rows of one prompt share a group id. The
    model's family picks the sampler (samplers/registry.py): a renoising one (DiffusionGemma)
    samples with ``renoise`` (the recipe's ``renoise`` section), the masked ones with ``cfg``;
    ``refresh``: a newer adapter may be swapped in between steps (samplers/sampler.py)."""
    model.eval()
    ids = [tok.encode_prompt(p) for p in prompts for _ in range(group_size)]
    gid = torch.arange(len(prompts)).repeat_interleave(group_size) + group_offset
    batch: TrajectoryBatch | RenoiseBatch = sample_for(model, tok, ids, cfg, completion_len, generator, gid,
                                                       policy_version, threshold, renoise, refresh)
    batch.meta = [{"answer": a} for a in answers for _ in range(group_size)]
    return batch


def score_rewards(batch: Batch, reward_fn: RewardFn) -> Batch:
    """Apply a reward function with the TRL contract ``fn(prompts=..., completions=..., **meta)``.

    A reward of None (unscorable reference) becomes NaN and is treated as 0 for advantages.
    A reward function that raises is a bug in the reward, so the error names it.
    """
    keys = batch.meta[0].keys() if batch.meta else []
    meta = {k: [m.get(k) for m in batch.meta] for k in keys}
    try:
        r = call_reward(reward_fn, batch.prompts, batch.completions, **meta)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise RuntimeError(f"reward function {getattr(reward_fn, '__name__', reward_fn)!r} failed: {e}") from e
    if len(r) != len(batch):
        raise ValueError(f"reward function returned {len(r)} values for {len(batch)} completions")
    batch.reward = torch.tensor([math.nan if v is None else float(v) for v in r], dtype=torch.float32)
    return batch


def assign_advantages(batch: Batch, std_normalize: bool = False) -> Batch:
    assert batch.reward is not None
    batch.advantage = group_advantages(batch.reward, batch.group_id, std_normalize)
    return batch


def rollout_stats(batch: Batch) -> dict[str, float]:
    """Reward mean/std, NFE, fraction of groups with no signal: what to watch for collapse."""
    assert batch.reward is not None and batch.advantage is not None
    r = torch.nan_to_num(batch.reward, nan=0.0)
    groups = torch.unique(batch.group_id)
    zero_groups = torch.unique(batch.group_id[zero_variance_groups(batch.reward, batch.group_id)]).numel()
    distinct = len(set(batch.completions)) / max(len(batch), 1)
    return {
        "reward_mean": float(r.mean()), "reward_std": float(r.std()) if len(r) > 1 else 0.0,
        "nfe_mean": float(batch.nfe.float().mean()), "steps_mean": float(batch.num_steps.float().mean()),
        "zero_variance_frac": zero_groups / max(len(groups), 1), "distinct_frac": distinct,
        "completions": float(len(batch)),
    }


SELF_WORKER = "learner"  # the worker name of the batches the learner samples itself


def batch_id(seq: int, worker: str) -> str:
    """Sorts by sequence number first, so the learner takes batches roughly in sampling order."""
    return f"{seq:06d}-{worker}"


def batch_seq(bid: str) -> int:
    """The sequence number of a :func:`batch_id`."""
    return int(bid.split("-", 1)[0])


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


def sample_batch(cfg: RecipeConfig, model, tok, data: TaskData, reward_fn: RewardFn | None, worker: str, index: int,
                 seq: int, version: int, refresh: Refresh | None = None) -> Batch:
    """Batch ``seq`` of ``worker``: prompts and noise seeded from (run seed, worker, seq), so a
    restarted sampler redoes the batch it lost with the same prompts and noise (with the adapter
    version it holds then). Used by samplers and by a learner that samples while it would
    otherwise wait (``async_rl.learner_samples``), and by the synchronous flow (worker "learner",
    ``reward_fn`` None: the raw batch, scored by its own task). NSD's threshold follows the
    recipe's schedule by the policy ``version`` sampling (``sampler.threshold_start``); ``refresh``:
    a sampler's in-flight refresh (``async_rl.refresh_every``), which may swap newer adapters in
    between steps (the batch's ``step_version`` then says which step took which)."""
    rng = random.Random(_seed(cfg.train.seed, worker, seq, "prompts"))
    gen = torch.Generator().manual_seed(_seed(cfg.train.seed, worker, seq, "noise"))
    problems = data.draw_rl(rng, cfg.train.prompts_per_iter)
    # distinct group ids per worker (advantages are group-relative within a batch; ids only need to be
    # unique there, distinct across workers keeps logs readable): the learner is worker num_samplers
    stride = cfg.async_rl.num_samplers + int(cfg.async_rl.learner_samples)
    offset = (seq * stride + index) * cfg.train.prompts_per_iter
    batch = rollout(model, tok, [p.prompt for p in problems], [p.answer for p in problems], cfg.sampler,
                    cfg.task.completion_len, cfg.train.group_size, gen, version, group_offset=offset,
                    threshold=cfg.sampler.threshold_at(version, cfg.train.iterations), renoise=cfg.renoise,
                    refresh=refresh)
    if reward_fn is None:
        return batch
    score_rewards(batch, reward_fn)
    return assign_advantages(batch, cfg.update.std_normalize)
