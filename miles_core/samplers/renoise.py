"""The renoising sampler: DiffusionGemma's entropy-bound chain as a Miles behaviour policy.

It is ``DiffusionGemmaGenerationMixin.generate`` (transformers 5.24,
``models/diffusion_gemma/generation_diffusion_gemma.py``) step for step, recording the trajectory:

  x_0 ~ U(V)^L; for step k (``cur`` = N - k, counting down as generate does):
    z_k   = decoder(x_k, self-conditioning s_k) / T_k,  T_k = t_min + (t_max - t_min) cur / N
    y_k   ~ softmax(z_k) per position (generate's multinomial: argmax(p / Exp(1)))
    A_k   = the k lowest-entropy positions with sum(H) - max(H) <= entropy_bound (Zheng et al.,
            arXiv:2505.24857, ``EntropyBoundSampler.accept_canvas``)
    x_k+1 = y_k on A_k, fresh uniform tokens r_k elsewhere (``renoise_canvas``)
    s_k+1 = soft embedding of z_k
    stop when the argmax canvas is stable for ``stability_threshold`` steps and the mean entropy
    is below ``confidence_threshold`` (``StableAndConfidentStoppingCriteria``), or after N steps;
  the output is the last step's argmax, pad after its first EOS (``_finalize_canvas``); with
  ``output="sample"`` it is the last step's sample y_K instead (not generate's), so that every token
  the reward reads is a sampled action (algo/renoise_rows.py's output row scores it).

Why per-row generators. ``generate`` draws from the global stream for the whole batch, so a row's
noise depends on its neighbours. Here each row owns a generator consuming exactly what generate
consumes for a batch of one (init canvas, then per step one Exp(1) draw of [L, V] and one renoise
draw of [L]), so a row with seed s equals ``torch.manual_seed(s); model.generate(row)`` token for
token, is independent of its batch, and its renoise r_k is rebuilt from s alone
(:func:`replay_states`): the record stays O(K * |A|), the renoise never stored.

One canvas: the completion is ``canvas_length`` tokens (generate's default 256 for the 26B);
longer outputs (several canvases, each encoded into the cache in turn) are not recorded yet.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from miles_core.config import RenoiseConfig
from miles_core.models import canvas
from miles_core.samplers.step import left_pad
from miles_core.types import RenoiseBatch


RNG_DEVICE = "rng_device"  # where the rows' generators drew: a CUDA stream differs from a CPU one


def settings(batch: RenoiseBatch) -> RenoiseConfig:
    """The sampler settings a batch was drawn with (its record carries them)."""
    return RenoiseConfig(**{k: v for k, v in batch.sampler.items() if k != RNG_DEVICE})


def temperature(cfg: RenoiseConfig, k: int | Tensor, device: torch.device) -> Tensor:
    """T at step k (an int, or [R] steps), in generate's float32 arithmetic (``cur_step`` is an
    int32 tensor there), so the learner's tempered logits are the sampler's bit for bit."""
    cur = (cfg.max_steps - torch.as_tensor(k, device=device)).to(torch.int32)
    return cfg.t_min + ((cfg.t_max - cfg.t_min) * (cur / cfg.max_steps))


def token_logp(z: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(z)[tokens]: [..., V], [...] -> [...]; the one arithmetic of sampling and scoring."""
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy(z: Tensor) -> Tensor:
    """[..., V] -> [...] entropy of softmax(z), as generate computes it (``Categorical.entropy``)."""
    return torch.distributions.Categorical(logits=z).entropy()


def entropy_accept(ent: Tensor, bound: float) -> Tensor:
    """[B, L] entropies -> [B, L] accepted: lowest-entropy first while sum - max <= bound."""
    sorted_ent, order = torch.sort(ent, dim=-1, descending=False)
    keep = torch.cumsum(sorted_ent, dim=-1) - sorted_ent <= bound
    return torch.scatter(torch.zeros_like(keep), dim=-1, index=order, src=keep)


def _generators(seeds: Tensor, device: torch.device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds.tolist()]


@torch.no_grad()
def sample(model, tok, prompt_ids: list[list[int]], cfg: RenoiseConfig, seeds: Tensor,
           group_id: Tensor | None = None, policy_version: int = 0) -> RenoiseBatch:
    """Sample one canvas per prompt and record each trajectory (seeds [B]: one stream per row)."""
    dev = next(model.parameters()).device
    core_cfg = canvas.core(model).config
    length, vocab = int(core_cfg.canvas_length), int(core_cfg.text_config.vocab_size)
    b, n = len(prompt_ids), cfg.max_steps
    prompt, real = left_pad(prompt_ids, tok.pad_id)
    enc = canvas.encode(model, prompt.to(dev), real.to(dev), length)
    gens = _generators(seeds, dev)
    x = torch.stack([torch.randint(0, vocab, (length,), generator=g, device=dev) for g in gens])   # [B, L]
    accepted = torch.zeros(b, n, length, dtype=torch.bool, device=dev)
    tokens = torch.zeros(b, n, length, dtype=torch.long, device=dev)
    logp = torch.zeros(b, n, length, device=dev)
    history = torch.full((cfg.stability_threshold, b, length), -1, dtype=torch.long, device=dev)
    final = torch.zeros(b, length, dtype=torch.long, device=dev)
    steps = torch.zeros(b, dtype=torch.long, device=dev)
    finished = torch.zeros(b, dtype=torch.bool, device=dev)
    soft: Tensor | None = None
    for k in range(n):
        rows = (~finished).nonzero().squeeze(1)          # the step's one host read: rows still denoising
        if rows.numel() == 0:
            break
        part = enc if rows.numel() == b else canvas.select(enc, rows)
        z = canvas.decode(model, part, x[rows], None if soft is None else soft[rows]) / temperature(cfg, k, dev)
        probs = torch.softmax(z, dim=-1, dtype=torch.float32)                      # [A, L, V]
        rl = rows.tolist()
        y = torch.stack([(probs[i] / torch.empty_like(probs[i]).exponential_(1, generator=gens[r])).argmax(-1)
                         for i, r in enumerate(rl)])                                 # [A, L]
        ent = entropy(z)                                                            # [A, L]
        acc = entropy_accept(ent, cfg.entropy_bound)
        noise = torch.stack([torch.randint(0, vocab, (length,), generator=gens[r], device=dev) for r in rl])
        accepted[rows, k] = acc
        tokens[rows, k] = torch.where(acc, y, 0)
        logp[rows, k] = torch.where(acc, token_logp(z, y), 0.0)
        x[rows] = torch.where(acc, y, noise)
        s_new = canvas.soft_embedding(model, z)
        if soft is None:
            soft = torch.zeros(b, *s_new.shape[1:], dtype=s_new.dtype, device=dev)
        soft[rows] = s_new
        amax = z.argmax(-1)
        stable = torch.ones(rows.numel(), dtype=torch.bool, device=dev)
        if cfg.stability_threshold > 0:
            h = history[:, rows]
            stable = (h == amax[None]).all(-1).all(0)
            h = torch.roll(h, shifts=-1, dims=0)
            h[-1] = amax
            history[:, rows] = h
        final[rows] = amax if cfg.output == "argmax" else y
        steps[rows] += 1
        finished[rows] |= stable & (ent.mean(-1) < cfg.confidence_threshold)
    completion = finalize(final, tok.eos_id, tok.pad_id).cpu()
    return RenoiseBatch(
        prompt_ids=[list(p) for p in prompt_ids], completion_ids=completion, accepted=accepted.cpu(),
        tokens=tokens.cpu(), logp=logp.cpu(), num_steps=steps.cpu(), seed=seeds.long().cpu(),
        group_id=(group_id if group_id is not None else torch.arange(b)).long(),
        policy_version=torch.full((b,), policy_version, dtype=torch.long),
        prompts=[tok.decode(p) for p in prompt_ids], completions=[tok.decode(c.tolist()) for c in completion],
        meta=[{} for _ in range(b)], sampler={**dataclasses.asdict(cfg), RNG_DEVICE: dev.type},
        sampler_hash=cfg.hash(length))


def sample_seeded(model, tok, prompt_ids: list[list[int]], cfg: RenoiseConfig, completion_len: int,
                  generator: torch.Generator, group_id: Tensor | None = None, policy_version: int = 0) -> RenoiseBatch:
    """:func:`sample` with row seeds drawn from ``generator`` (how rollouts and evaluation call it:
    the run's seed decides every row's stream). ``completion_len`` must be the canvas."""
    from miles_core.config import ConfigError

    width = int(canvas.core(model).config.canvas_length)
    if completion_len != width:
        raise ConfigError(f"task.completion_len={completion_len}: DiffusionGemma samples one canvas of "
                          f"canvas_length={width} tokens (config.json); set task.completion_len={width}")
    seeds = torch.randint(0, 2**62, (len(prompt_ids),), generator=generator)
    return sample(model, tok, prompt_ids, cfg, seeds, group_id, policy_version)


def finalize(canvas: Tensor, eos_id: int, pad_id: int) -> Tensor:
    """generate's ``_finalize_canvas`` for one canvas: every token after the first EOS becomes pad."""
    return canvas.masked_fill(after_eos(canvas, eos_id), pad_id)


def after_eos(canvas: Tensor, eos_id: int) -> Tensor:
    """[B, L] True at the positions after each row's first EOS (what the output drops)."""
    is_eos = canvas == eos_id
    c = is_eos.cumsum(-1)
    return (c > 0) & ~((c == 1) & is_eos)


def replay_states(batch: RenoiseBatch, vocab: int, device: torch.device) -> Tensor:
    """Every state x_k [B, K, L] of every row, rebuilt exactly from the record and the row's seed:
    the renoise stream is replayed (the Exp(1) draws of each step are skipped by drawing them
    again: [L, V] per step, what the sampler drew, no denoiser call), and x_k+1 = y_k on A_k,
    r_k elsewhere. States past a row's last step repeat its last state."""
    drawn = batch.sampler.get(RNG_DEVICE)
    if drawn is not None and drawn != device.type:
        raise ValueError(f"RenoiseBatch: its renoise was drawn by {drawn} generators; replaying them on "
                         f"{device.type} would rebuild other states. Score it with the model on {drawn}")
    b, n, length = batch.accepted.shape
    out = torch.zeros(b, n, length, dtype=torch.long, device=device)
    acc, tok = batch.accepted.to(device), batch.tokens.to(device)
    for i, g in enumerate(_generators(batch.seed, device)):
        x = torch.randint(0, vocab, (length,), generator=g, device=device)
        k_b = int(batch.num_steps[i])
        for k in range(n):
            out[i, k] = x
            if k + 1 < k_b:
                torch.empty(length, vocab, device=device).exponential_(1, generator=g)
                noise = torch.randint(0, vocab, (length,), generator=g, device=device)
                x = torch.where(acc[i, k], tok[i, k], noise)
    return out
