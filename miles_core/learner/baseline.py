"""The SFT baseline a recipe starts from, and the benchmarks' continued-SFT control arm.

Why here and not in algo/sft.py: that module is the training loop on (prompt, target) pairs; this
one is the recipe-level driver around it (which base to start from, validation on the ``val``
split every ``sft.eval_every`` steps, keeping the best-validation weights, saving the checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from miles_core.algo.sft import train_sft
from miles_core.config import ConfigError, RecipeConfig
from miles_core.data.registry import TaskData
from miles_core.eval.evaluate import run_eval
from miles_core.models.base import load_base, resolve_device, save_checkpoint
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.tokenizer import CharTokenizer


def new_model(cfg: RecipeConfig, tok: CharTokenizer, seed: int) -> torch.nn.Module:
    """A randomly initialised base of ``cfg.model``'s backend and sizes (vocab from ``tok``)."""
    torch.manual_seed(seed)
    m = cfg.model
    if m.backend == "llama":
        from miles_core.models.llama import random_llama

        return random_llama(tok.vocab_size, m.d_model, m.n_layers, m.n_heads, None, m.d_ff, m.max_len, seed,
                            pad_id=tok.pad_id, eos_id=tok.eos_id)
    return TinyDenoiser(TinyConfig(tok.vocab_size, m.d_model, m.n_layers, m.n_heads, m.d_ff, m.max_len))


def train_baseline(cfg: RecipeConfig, data: TaskData, out_dir: str | Path, seed: int | None = None,
                   on_eval: Callable[[int, float, dict], bool | None] | None = None, progress: bool = False,
                   eval_problems: int = 200, patience: int | None = None) -> tuple[torch.nn.Module, CharTokenizer]:
    """SFT on the labelled set; ``on_eval(step, pass1, stats)`` every ``sft.eval_every`` steps, with
    pass@1 measured on the validation split (never on the test problems results are reported on).
    ``patience``: stop at the plateau, once ``patience`` evaluations in a row bring no strict gain;
    ``on_eval`` may also stop training by returning True. Whenever validation runs (``on_eval`` or
    ``patience`` given) the saved checkpoint is the weights of the best validation pass@1 (ties go
    to the later evaluation): on a scarce labelled set, the steps after the best one only memorise.
    Steps after the last evaluation are kept only if ``sft.steps`` is a multiple of
    ``sft.eval_every`` (the last evaluation is then the final step).

    The tokenizer is a CharTokenizer, or for ``model.backend: llama`` an HFTokenizer with the
    same interface (models/hf_tokenizer.py)."""
    s = cfg.sft
    seed = s.seed if seed is None else seed
    if not data.train:
        raise ConfigError(f"task: the {cfg.task.name} task has no SFT demonstrations (rows with a worked "
                          "solution in task.path); start RL from a model that already follows the prompt "
                          "(an instruct checkpoint) with --base-checkpoint DIR")
    if cfg.model.path:  # a local checkpoint to start from: a Llama, or a published family's folder
        model, tok = load_base(cfg, cfg.model.path)
    elif cfg.model.backend == "llama":  # toy Llama-Diffusion: character tokenizer, random weights
        from miles_core.models.hf_tokenizer import HFTokenizer, char_tokenizer

        tok = HFTokenizer(char_tokenizer())
        model = new_model(cfg, tok, seed)
    else:
        tok = CharTokenizer()
        model = new_model(cfg, tok, seed)
    model.to(resolve_device(cfg.model.device))

    best: dict = {"pass1": -1.0, "state": None, "gain_step": 0}
    validate = on_eval is not None or patience is not None

    def cb(step: int, stats: dict) -> bool:
        pass1 = run_eval(model, tok, cfg, data, num_problems=eval_problems, split="val").pass_at["pass@1"]
        if pass1 > best["pass1"]:
            best["gain_step"] = step
        if pass1 >= best["pass1"]:  # a tie goes to the later, longer-trained weights
            best.update(pass1=pass1, state={k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        stop = bool(on_eval(step, pass1, stats)) if on_eval is not None else False
        return stop or (patience is not None and step - best["gain_step"] >= patience * s.eval_every)
    train_sft(model, tok, [p.prompt for p in data.train], [p.target for p in data.train],
              completion_len=cfg.task.completion_len, steps=s.steps, batch_size=s.batch_size, lr=s.lr,
              weight_decay=s.weight_decay, warmup=s.warmup, seed=seed, lr_schedule=s.lr_schedule,
              callback=cb if validate else None,
              callback_every=s.eval_every if validate else 0, progress=progress)
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    save_checkpoint(model, tok, out_dir)
    return model, tok


def continue_sft(cfg: RecipeConfig, data: TaskData, checkpoint: str | Path, seconds: float,
                 seed: int) -> tuple[torch.nn.Module, CharTokenizer]:
    """The control arm of the RL benchmarks: SFT resumed from ``checkpoint`` on the same labelled
    data, all weights, for ``seconds`` of wall clock (what the RL arm took), with a fresh data order.
    Its LR is ``sft.lr`` held constant: a time budget has no step count for a decay to end at."""
    model, tok = load_base(cfg, checkpoint)
    model.to(resolve_device(cfg.model.device))
    s = cfg.sft
    train_sft(model, tok, [p.prompt for p in data.train], [p.target for p in data.train],
              completion_len=cfg.task.completion_len, steps=10**9, batch_size=s.batch_size, lr=s.lr,
              weight_decay=s.weight_decay, warmup=1, seed=seed + 1000, time_budget_s=seconds)
    return model, tok
