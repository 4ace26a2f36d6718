"""A Miles policy as an lm-evaluation-harness model (``lm_eval`` 0.4, an optional extra).

Why: labs report diffusion LMs through lm-eval (LLaDA's ``evaluation/eval_llada.py``, Fast-dLLM's
and Dream's evaluations register an ``LM`` the same way), so a Miles policy must sit in that table
and mean there what ``miles eval`` means here. :class:`MilesLM` (registered as ``miles``):

* ``generate_until``: the policy's own sampler (the family's, with the recipe's eval settings:
  greedy by default) over batches of prompts encoded as ``miles eval`` encodes them
  (``tok.encode_prompt``: the recipe's template), each output cut at its first stop string. A
  row's output does not depend on its batch (tests/test_engine.py), so the batch size is recorded
  but does not move a score.
* ``loglikelihood``: the masked-diffusion ELBO of the continuation given the context, estimated by
  Monte Carlo as LLaDA's ``get_loglikelihood`` does: ``mc_num`` draws, the number of masked
  continuation tokens l stratified over the draws from one uniform start, l random positions masked,
  sum of log p over them times L / l. The draws come from a generator seeded by ``seed`` and the
  request's text, so a score is reproducible and independent of order and batching. A one-token
  continuation is exact (l = 1 always). A Miles policy decodes into a fixed window of
  ``completion_len`` positions, EOS after the answer, so a continuation that fits is scored as that
  window (the text, then EOS to the end): the probability that the policy answers exactly this and
  stops, which is what its pass@1 counts (``window=False`` scores the bare tokens, as LLaDA's
  pretrained-model evaluation does). ``is_greedy``: the policy's greedy output (its eval sampler)
  is the continuation.
* ``loglikelihood_rolling``: the same ELBO of the whole text with an empty context, where the
  text fits the model's window (a longer one is refused by name; a diffusion LM has no
  left-to-right chain rule to roll a window with).

:func:`settings` is what is recorded beside every number: the sampler, length, batch size, dtype,
device, ``mc_num`` and seed. Model-written code is never run here: code tasks score in Miles'
sandbox (eval/lm_tasks.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any, Sequence

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from miles_core.config import RecipeConfig, SamplerConfig, load_recipe
from miles_core.eval.evaluate import eval_config, runtime_of, sampler_for
from miles_core.models.base import load_base, max_positions
from miles_core.models.window import model_device, window_logits
from miles_core.samplers.registry import sample_for
from miles_core.samplers.step import step_from_logits


def request_seed(seed: int, *texts: str) -> int:
    """A seed from ``seed`` and a request's text: the same request draws the same masks in any
    order, batch or process."""
    h = hashlib.sha256("\x1f".join((str(seed), *texts)).encode()).digest()
    return int.from_bytes(h[:8], "big") % (2**62)


def masked_counts(length: int, draws: int, generator: torch.Generator) -> torch.Tensor:
    """[draws] masked-token counts in 1..length, stratified from one uniform start k (LLaDA's
    ``_forward_process``: round(linspace(k, k + (n - 1) L / n)) wrapped into 1..L), so n draws
    cover the counts evenly instead of n independent ones."""
    k = int(torch.randint(1, length + 1, (), generator=generator))
    x = torch.round(torch.linspace(float(k), k + (draws - 1) * (length / draws), steps=draws)).long()
    return (x - 1) % length + 1


@torch.no_grad()
def elbo_loglikelihood(model: Any, tok: Any, context: list[int], target: list[int], mc_num: int,
                       generator: torch.Generator, batch: int = 32) -> tuple[float, float]:
    """(ELBO estimate of log p(target | context), its standard error over the ``mc_num`` draws).

    Draw j masks l_j of the L target positions (:func:`masked_counts`, positions by a random
    permutation) and scores sum_{masked} log p(x_i | masked sequence) * L / l_j; the estimate is
    the mean. Scoring is ``step_from_logits`` at temperature 1 with the tokenizer's forbidden ids
    (what the learner scores with)."""
    n_t = len(target)
    if n_t == 0:
        raise ValueError("loglikelihood: an empty continuation has no tokens to score")
    counts = masked_counts(n_t, mc_num, generator)                                      # [n]
    order = torch.stack([torch.randperm(n_t, generator=generator) for _ in range(mc_num)])   # [n, L]
    masked = order < counts[:, None]                                                    # [n, L]: l_j positions each
    dev = model_device(model)
    ctx, tgt = torch.tensor(context, dtype=torch.long), torch.tensor(target, dtype=torch.long)
    values = []
    for s in range(0, mc_num, batch):
        m = masked[s:s + batch]
        comp = torch.where(m, torch.full_like(m, tok.mask_id, dtype=torch.long), tgt.expand_as(m))   # [b, L]
        x = torch.cat([ctx.expand(m.shape[0], -1), comp], dim=1).to(dev)                           # [b, P + L]
        attn = torch.ones_like(x, dtype=torch.bool)
        logits, _ = window_logits(model, x, attn, (0, x.shape[1]), (len(context), x.shape[1]))    # [b, L, V]
        logp = step_from_logits(logits, temperature=1.0, forbidden=tok.forbidden_ids,
                                tokens=tgt.expand_as(m).to(dev), entropy=False).logp.cpu()         # [b, L]
        values.append((logp * m).sum(1) * n_t / counts[s:s + batch])
    v = torch.cat(values).double()
    se = float(v.std(unbiased=True) / math.sqrt(mc_num)) if mc_num > 1 else float("nan")
    return float(v.mean()), se


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string (lm-eval's ``until``)."""
    cut = len(text)
    for s in until:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


@register_model("miles")
class MilesLM(LM):
    """A Miles policy for lm-eval: ``pretrained`` (a base or exported folder), optionally ``adapter``
    (a peft folder Miles trained), and the ``recipe`` it was trained with (a built-in name, a YAML
    path, or the resolved mapping a registered model carries), which gives the prompt template and
    the evaluation sampler. ``mc_num``: Monte-Carlo draws of the ELBO per log-likelihood request.
    A misspelt model argument fails naming itself (no catch-all keyword); ``max_batch_size`` is
    lm-eval's and unused (batches are ``batch_size``)."""

    def __init__(self, pretrained: str, recipe: str | dict = "arith", adapter: str | None = None,
                 batch_size: int | str = 8, mc_num: int = 64, seed: int = 1234, greedy_check: bool = True,
                 window: bool = True, max_batch_size: int | None = None, device: str | None = None) -> None:
        super().__init__()
        from miles_core.models.lora import load_adapter

        self.cfg: RecipeConfig = load_recipe(recipe) if isinstance(recipe, (dict, str)) else recipe
        base, self.tok = load_base(self.cfg, pretrained)
        self.model = (load_adapter(base, adapter) if adapter else base).eval()
        if device is not None:  # lm-eval's --device; by default the recipe's model.device placed it
            self.model.to(device)
        self.ec = eval_config(self.cfg)
        self.sampler: SamplerConfig = sampler_for(self.ec)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.mc_num, self.seed = int(mc_num), int(seed)
        self.greedy_check, self.window = (str(v) not in ("False", "false", "0") for v in (greedy_check, window))
        self.source = {"pretrained": str(pretrained), "adapter": str(adapter) if adapter else None}
        if self.mc_num < 1 or self.batch_size < 1:
            raise ValueError(f"MilesLM: mc_num ({mc_num}) and batch_size ({batch_size}) must be >= 1")

    def settings(self) -> dict[str, Any]:
        """What is recorded beside every lm-eval number this model produces."""
        return {"model": "miles", **self.source, "recipe": self.cfg.name, "task": self.cfg.task.name,
                "sampler": dataclasses.asdict(self.sampler), "completion_len": self.ec.completion_len,
                "eval_fingerprint": self.ec.fingerprint(), **runtime_of(self.model, self.batch_size),
                "mc_num": self.mc_num, "seed": self.seed, "greedy_check": self.greedy_check, "window": self.window}

    # ---- generation ---------------------------------------------------------------------------
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out: list[str] = []
        for s in range(0, len(requests), self.batch_size):
            part = requests[s:s + self.batch_size]
            ids = [self.tok.encode_prompt(r.args[0]) for r in part]
            batch = sample_for(self.model, self.tok, ids, self.sampler, self.ec.completion_len,
                               torch.Generator().manual_seed(self.ec.seed),
                               renoise_cfg=dataclasses.replace(self.cfg.renoise, output="argmax"))
            for r, text in zip(part, batch.completions):
                kw = r.args[1] if len(r.args) > 1 and isinstance(r.args[1], dict) else {}
                until = kw.get("until") or []
                out.append(cut_at_stops(text, [until] if isinstance(until, str) else until))
        return out

    # ---- likelihood ---------------------------------------------------------------------------
    def _fits(self, n: int, what: str) -> None:
        limit = max_positions(self.model)
        if n > limit:
            raise ValueError(f"{what}: {n} tokens do not fit the model's {limit} positions")

    def _greedy(self, context: list[int], target: list[int], windowed: bool) -> bool:
        """Does greedy decoding give ``target``: the eval sampler over the window (compared as text,
        up to EOS), or, for bare tokens, one token a step over exactly them."""
        if windowed:
            b = sample_for(self.model, self.tok, [context], self.sampler, len(target),
                           torch.Generator().manual_seed(self.ec.seed))
            return self.tok.decode(b.completion_ids[0].tolist()) == self.tok.decode(target)
        greedy = SamplerConfig(kind="static", steps=len(target), temperature=0.0)
        b = sample_for(self.model, self.tok, [context], greedy, len(target), torch.Generator().manual_seed(0))
        return b.completion_ids[0].tolist() == target

    def score(self, context: str, continuation: str) -> tuple[float, float, bool]:
        """(log-likelihood estimate, its standard error, is_greedy) of one request."""
        ctx, tgt = self.tok.encode_prompt(context) if context else [], self.tok.encode(continuation)
        windowed = self.window and len(tgt) <= self.ec.completion_len
        if windowed:
            tgt = self.tok.encode_completion(continuation, self.ec.completion_len)
        self._fits(len(ctx) + len(tgt), f"loglikelihood of {continuation[:40]!r}")
        g = torch.Generator().manual_seed(request_seed(self.seed, context, continuation))
        ll, se = elbo_loglikelihood(self.model, self.tok, ctx, tgt, self.mc_num, g, max(self.batch_size, 1))
        return ll, se, (self._greedy(ctx, tgt, windowed) if self.greedy_check and ctx else False)

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return [(ll, greedy) for ll, _, greedy in (self.score(*r.args[:2]) for r in requests)]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        return [self.score("", r.args[0])[0] for r in requests]

    @property
    def tokenizer_name(self) -> str:
        return Path(self.source["pretrained"]).name
