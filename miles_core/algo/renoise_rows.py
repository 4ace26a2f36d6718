"""ADPO over a renoising chain (DiffusionGemma): the rows, how one is scored, and the update.

A row is (trajectory b, step k) for k < K_b - 1: the steps whose accepted tokens fed a later
forward. The last step's forward only gives the output (its argmax), so its samples never reach
the reward and would add variance without signal. Which positions are accepted, and the renoise
tokens, are environment (as LLaDA's low-confidence ranking is for masked rows, algo/rows.py); the
policy's action at step k is the accepted tokens, with log-prob sum_{i in A_k} log pi(y_i | x_k, s_k).

The self-conditioning input s_k is the previous step's tempered logits, so pi(. | x_k, s_k) depends
on the policy through s_k too.

The output row (``estimators.adpo.renoise_output``). The reward reads only the output, the last step's argmax,
and a sampled token reaches it only as context for later steps, each of which re-predicts every
position: the credit of the chain's K - 1 actions for the reward is diffuse. The output row scores
the output tokens (up to the first EOS) under the last step's distribution at its temperature, as if
they had been sampled there (the argmax is that distribution's limit as T -> 0), so the gradient moves
the tokens the reward reads. With ``renoise.output="sample"`` the output is that step's sample, and
the output row is then the exact log-prob of a sampled action. No behaviour log-prob is recorded for
it, so its ratio is taken against pi_prox: exact on-policy, uncorrected for a stale batch.

Two ways to give the learner s_k were possible:
  * recompute the chain under the current policy, without a graph (:func:`chain_conditioning`):
    one no-grad forward per step, once per update; the ratio pi_theta / mu is then the exact ratio
    of the chain's probabilities under the two policies, and nothing is stored;
  * store a compact form of the behaviour's logits (top-k): no extra forwards, but the learner
    conditions on mu's signal, not its own, and truncation perturbs even the on-policy ratio.
Miles recomputes; ``benchmarks.diffusion_gemma`` measures the ratio bias the top-k alternative
would leave. Gradients never flow through s_k (ADPO never backpropagates through the chain).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from miles_core.algo.rows import FixedRows, Rows
from miles_core.config import RenoiseConfig
from miles_core.models import canvas
from miles_core.samplers.renoise import after_eos, replay_states, settings, temperature, token_logp
from miles_core.samplers.step import left_pad
from miles_core.types import RenoiseBatch


def action_rows(batch: RenoiseBatch, output: bool = False) -> Rows:
    """Every (b, k) with k < K_b - 1, weight 1; with ``output``, also the output row (b, K_b - 1)."""
    steps = (batch.num_steps - (0 if output else 1)).clamp_min(0).tolist()
    traj = torch.cat([torch.full((k,), b) for b, k in enumerate(steps)] or [torch.zeros(0, dtype=torch.long)])
    step = torch.cat([torch.arange(k) for k in steps] or [torch.zeros(0, dtype=torch.long)])
    return Rows(traj.long(), step.long(), torch.ones(traj.numel()))


def _encode(model: Any, batch: RenoiseBatch, traj: Tensor, tok: Any, device: torch.device) -> canvas.Prompt:
    prompt, real = left_pad([batch.prompt_ids[i] for i in traj.tolist()], tok.pad_id)
    return canvas.encode(model, prompt.to(device), real.to(device), batch.completion_len)


@torch.no_grad()
def chain_conditioning(model: Any, batch: RenoiseBatch, states: Tensor, cfg: RenoiseConfig, tok: Any,
                       keep_top: int = 0, encoded: canvas.Prompt | None = None, output: bool = False) -> Tensor:
    """s_k of every row and step [B, K, L, d] under ``model``: the chain's self-conditioning
    rebuilt by running the recorded states through the current policy (s_0 = 0).

    ``keep_top`` = k > 0 is the alternative Miles does not take, kept to measure it: the signal a
    store of the top-k tempered logits would give (the rest at -inf before the softmax).
    ``encoded``: the batch's prompts already encoded (default: encoded here). ``output``: the output
    row reads s_{K_b - 1} too (one more forward per row)."""
    dev = states.device
    b, n, _ = states.shape
    need = (batch.num_steps - (0 if output else 1)).to(dev)   # s_k is read for k < K_b - 1 (K_b with output)
    soft: Tensor | None = None
    enc_all = encoded if encoded is not None else _encode(model, batch, torch.arange(b), tok, dev)
    for k in range(n - 1):
        rows = (need > k + 1).nonzero().squeeze(1)      # rows that read s_{k+1}
        if rows.numel() == 0:
            break
        enc = enc_all if rows.numel() == b else canvas.select(enc_all, rows)
        z = canvas.decode(model, enc, states[rows, k], None if soft is None else soft[rows, k]) / temperature(cfg, k, dev)
        if keep_top > 0:
            top = z.topk(keep_top, dim=-1)
            z = torch.full_like(z, float("-inf")).scatter(-1, top.indices, top.values)
        s = canvas.soft_embedding(model, z)
        if soft is None:
            soft = torch.zeros(b, n, *s.shape[1:], dtype=s.dtype, device=dev)
        soft[rows, k + 1] = s
    if soft is None:   # no row reads any s_k beyond the first step's zeros
        d = canvas.core(model).config.text_config.hidden_size
        soft = torch.zeros(b, n, states.shape[2], d, device=dev)
    return soft


class RenoiseStepRows(FixedRows):
    """The update engine's :class:`~miles_core.algo.rows.RowScorer` for renoising chains."""

    def __init__(self, model: Any, batch: RenoiseBatch, cfg: RenoiseConfig, tok: Any,
                 soft: Tensor | None = None, output: bool = False) -> None:
        """``soft``: the self-conditioning to score with (default: the chain under ``model``);
        ``output``: it will score output rows (their s_{K_b - 1} is rebuilt too)."""
        self.batch, self.cfg, self.tok = batch, cfg, tok
        self.device = next(model.parameters()).device
        vocab = int(canvas.core(model).config.text_config.vocab_size)
        self.states = replay_states(batch, vocab, self.device)                       # [B, K, L]
        # the encoder is the frozen base (LoRA adapts the decoder only): encode every prompt once per
        # update, as the sampler does for its whole batch, and index it for each chunk of rows
        self.encoded = _encode(model, batch, torch.arange(len(batch)), tok, self.device)
        self.soft = (chain_conditioning(model, batch, self.states, cfg, tok, encoded=self.encoded, output=output)
                     if soft is None else soft)                                      # [B, K, L, d]
        self.width = batch.completion_len
        self.last = (batch.num_steps - 1).to(self.device)                                # [B]
        # the output row's action: the output up to its first EOS (what the reward reads)
        self.out_commit = (~after_eos(batch.completion_ids, tok.eos_id)).to(self.device)  # [B, L]

    def score(self, model: Any, traj: Tensor, step: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """log pi(y_k | x_k, s_k) [R, L] at the accepted positions (commit [R, L]) of rows (b, k)."""
        t, s = traj.to(self.device), step.to(self.device)
        enc = canvas.select(self.encoded, t)
        temp = temperature(self.cfg, s, self.device)                                         # [R]
        z = canvas.decode(model, enc, self.states[t, s], self.soft[t, s]) / temp[:, None, None]
        out = (s == self.last[t])[:, None]                           # [R, 1] output rows (renoise_output)
        commit = torch.where(out, self.out_commit[t], self.batch.accepted[traj, step].to(self.device))
        tokens = torch.where(out, self.batch.completion_ids[traj].to(self.device),
                             self.batch.tokens[traj, step].to(self.device))
        logp = torch.where(commit, token_logp(z, tokens), 0.0)
        return logp, None, commit

    def behaviour(self, traj: Tensor, step: Tensor) -> Tensor:
        """The recorded log-probs; NaN on output rows (no draw was taken: the update uses pi_prox)."""
        out = (step == self.batch.num_steps[traj] - 1)[:, None]
        return torch.where(out, float("nan"), self.batch.logp[traj, step])


def renoise_rows(model: Any, sub: RenoiseBatch, tok: Any, output: bool = False) -> tuple[Rows, RenoiseStepRows]:
    """The rows of a renoising batch and their scorer, for the one update (the ``adpo`` estimator
    builds these for a ``"renoise"`` batch; the others have no rows for it, a chain having no masked
    state to take an ELBO over): the chain's self-conditioning is rebuilt under the current policy
    here, once per update, and the batch's own sampler settings score it."""
    return action_rows(sub, output), RenoiseStepRows(model, sub, settings(sub), tok, output=output)
