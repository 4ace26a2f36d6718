"""High-level building blocks a recipe runs: build the task, train the SFT baseline, and an RL
learner/sampler state that can be checkpointed and resumed. Flows, the CLI and benchmarks all
use these, so what a benchmark measures is what a user runs."""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from miles_core.algo.guard import CollapseGuard, batch_health
from miles_core.algo.rl import assign_advantages, rollout, score_rewards
from miles_core.algo.sft import train_sft
from miles_core.algo.schedule import lr_factor
from miles_core.algo.update import adpo_update
from miles_core.config import ConfigError, RecipeConfig, SamplerConfig
from miles_core.data import code, countdown
from miles_core.data.arith import ArithConfig, ArithTask, Problem, max_target_len
from miles_core.eval.evaluate import evaluate
from miles_core.eval.passk import EvalConfig, EvalResult
from miles_core.models.base import base_identity, load_base, resolve_device, save_checkpoint
from miles_core.models.lora import add_lora_from, load_adapter, save_adapter
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.rewards.pool import set_isolation
from miles_core.rewards.math import get_reward
from miles_core.tokenizer import CharTokenizer
from miles_core.types import TrajectoryBatch


# pass@1 counts what the task's own verifier accepts: the exact answer, any valid countdown
# solution, or a program that passes every hidden test.
TASK_CHECK = {"arith": "math_exact", "countdown": "countdown", "code": "code_tests"}
TASK_CLASSES = {"arith": ArithTask, "countdown": countdown.CountdownTask, "code": code.CodeTask}


def canonical_prompt(task: str, prompt: str) -> str:
    """A user's prompt in the form ``task``'s models were trained on (what a served model applies)."""
    return TASK_CLASSES[task].canonical_prompt(prompt)


@dataclass
class TaskData:
    task: ArithTask | countdown.CountdownTask | code.CodeTask
    train: list[Problem]      # scarce labelled demonstrations (SFT)
    test: list[Problem]       # held-out, provably disjoint (hash bucket): what results are reported on
    val: list[Problem]        # also from the held-out bucket, disjoint from test: for plateau / selection
    rl_exclude: frozenset[str] = frozenset()  # prompts RL never draws (train.rl_exclude_demos: the SFT demos)

    def draw_rl(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` RL prompts from the verifier's supply: never the test bucket, never ``rl_exclude``."""
        out: list[Problem] = []
        for _ in range(n):
            for _ in range(10_000):
                p = self.task.sample(rng, split="rl")
                if self.task.canonical_prompt(p.prompt) not in self.rl_exclude:
                    break
            else:
                raise ConfigError("train.rl_exclude_demos: every RL prompt tried was an SFT demonstration; "
                                  "lower task.num_train or turn rl_exclude_demos off")
            out.append(p)
        return out


def build_task(cfg: RecipeConfig) -> TaskData:
    """The recipe's task and its train / test / val splits; bad task settings raise ConfigError."""
    t = cfg.task
    task: ArithTask | countdown.CountdownTask | code.CodeTask
    try:
        if t.name == "code":  # completions are checked by the code_tests reward, in the sandbox
            set_isolation(cfg.sandbox.isolation)
            ccfg = code.CodeConfig(examples=t.num_examples, b_max=t.const_max)
            task, need = code.CodeTask(ccfg), code.max_target_len(ccfg)
        elif t.name == "countdown":
            dcfg = countdown.CountdownConfig(numbers=t.numbers, max_value=t.max_value)
            task, need = countdown.CountdownTask(dcfg), countdown.max_target_len(dcfg)
        else:
            acfg = ArithConfig(min_ops=t.min_ops, max_ops=t.max_ops, max_digits=t.max_digits,
                               mul_max_digits=t.mul_max_digits)
            task, need = ArithTask(acfg), max_target_len(acfg)
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    _check_completion_len(cfg, need)
    try:
        return _task_data(task, cfg)
    except ValueError as e:
        raise ConfigError(f"task.num_train/num_test/num_val: {e}") from None


def _check_completion_len(cfg: RecipeConfig, need: int) -> None:
    if cfg.task.completion_len < need:
        raise ConfigError(f"task.completion_len: {cfg.task.completion_len} is shorter than the longest target "
                          f"({need} tokens) for these task settings; set task.completion_len>={need}")


def _task_data(task: ArithTask | countdown.CountdownTask | code.CodeTask, cfg: RecipeConfig) -> TaskData:
    """train / test / val splits. val comes from the held-out bucket with the test prompts excluded
    (or, where the test split uses the whole bucket, from non-test prompts outside the SFT
    demonstrations), so choosing a checkpoint on val never looks at a problem results are reported on."""
    t = cfg.task
    test = task.split("test", t.num_test, seed=0)
    train = task.split("train", t.num_train, seed=0)
    val: list[Problem] = []
    if t.num_val:
        try:
            val = task.split("test", t.num_val, seed=1, exclude=[p.prompt for p in test])
        except ValueError:  # the held-out bucket is all test (code recipe): unlabelled non-test prompts
            val = task.split("rl", t.num_val, seed=1, exclude=[p.prompt for p in train])
    skip = frozenset(task.canonical_prompt(p.prompt) for p in train) if cfg.train.rl_exclude_demos else frozenset()
    return TaskData(task, train, test, val, skip)


def new_model(cfg: RecipeConfig, tok: CharTokenizer, seed: int) -> torch.nn.Module:
    """A randomly initialised base of ``cfg.model``'s backend and sizes (vocab from ``tok``)."""
    torch.manual_seed(seed)
    m = cfg.model
    if m.backend == "llama":
        from miles_core.models.llama import random_llama

        return random_llama(tok.vocab_size, m.d_model, m.n_layers, m.n_heads, None, m.d_ff, m.max_len, seed,
                            pad_id=tok.pad_id, eos_id=tok.eos_id)
    return TinyDenoiser(TinyConfig(tok.vocab_size, m.d_model, m.n_layers, m.n_heads, m.d_ff, m.max_len))


def eval_config(cfg: RecipeConfig, num_problems: int | None = None, sampler: SamplerConfig | None = None,
                split: str = "test") -> EvalConfig:
    e = cfg.eval
    s = sampler
    return EvalConfig(num_problems=num_problems or e.num_problems, completion_len=cfg.task.completion_len,
                      steps=s.steps if s else e.steps, block_size=(s.block_size if s else e.block_size) or cfg.task.completion_len,
                      temperature=s.temperature if s else e.temperature,
                      remasking=s.remasking if s else e.remasking, sampler=s.kind if s else "static",
                      threshold=s.threshold if s and s.kind == "nsd" else None, n_samples=e.n_samples,
                      ks=(1,) if e.n_samples == 1 else (1, e.n_samples), seed=e.seed, split=split,
                      prompt_template=cfg.task.prompt_template)


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
    reward = get_reward(TASK_CHECK[cfg.task.name])
    return evaluate(model, tok, [p.prompt for p in probs], [p.answer for p in probs], ec, reward,
                    batch_size=cfg.eval.batch_size, progress=progress, sampler=sampler)


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


class Learner:
    """Base (frozen) + LoRA policy, optimizer, warm-up schedule, RNGs and policy version.

    ``state()``/``load_state()`` capture everything needed to resume bit-exactly."""

    def __init__(self, cfg: RecipeConfig, base_dir: str | Path, seed: int = 0, adapter_dir: str | Path | None = None,
                 total_updates: int | None = None):
        self.cfg, self.base_dir, self._base_identity = cfg, base_dir, None
        base, self.tok = load_base(cfg, base_dir)
        for p in base.parameters():
            p.requires_grad_(False)
        if adapter_dir is not None:
            self.model = load_adapter(base, adapter_dir, trainable=True)
        else:
            torch.manual_seed(seed)
            self.model = add_lora_from(base, cfg.lora)
        self.model.to(resolve_device(cfg.model.device))  # before the optimizer, which keeps its state beside the params
        a = cfg.adpo
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=a.lr, weight_decay=0.0)
        # adpo.lr_schedule decays over the run: total_updates (default train.iterations) policy updates,
        # each num_minibatches * epochs optimizer steps
        updates = cfg.train.iterations if total_updates is None else total_updates
        steps = updates * a.num_minibatches * a.epochs
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor(a.warmup, a.lr_schedule, steps))
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.version = 0
        self.reward_fn = get_reward(cfg.train.reward)
        self.groups_seen = 0
        self.guard = CollapseGuard(cfg.guard, self._policy_state()) if cfg.guard.enabled else None
        self.guard_event = ""  # why the last update was skipped or rolled back ("" when it ran)

    def _policy_state(self) -> dict:
        """What a rollback restores: adapter, optimizer and schedule (not the RNGs), as copies that
        later steps cannot change; ``state()`` adds the RNGs, version and guard to it."""
        return {"adapter": {k: v.detach().clone() for k, v in self.model.state_dict().items() if "lora_" in k},
                "opt": copy.deepcopy(self.opt.state_dict()), "sched": self.sched.state_dict()}

    def draw_prompts(self, data: TaskData, n: int) -> list[Problem]:
        """Fresh RL prompts from the verifier's supply (never the test bucket; see TaskData.draw_rl)."""
        return data.draw_rl(self.rng, n)

    def rollout(self, problems: list[Problem], sampler: SamplerConfig | None = None,
                threshold: float | None = None) -> TrajectoryBatch:
        s = sampler or self.cfg.sampler
        batch = rollout(self.model, self.tok, [p.prompt for p in problems], [p.answer for p in problems], s,
                        self.cfg.task.completion_len, self.cfg.train.group_size, self.gen, self.version,
                        group_offset=self.groups_seen, threshold=threshold)
        self.groups_seen += len(problems)
        score_rewards(batch, self.reward_fn)
        return assign_advantages(batch, self.cfg.adpo.std_normalize)

    def update(self, batch: TrajectoryBatch, temperature: float | None = None) -> dict[str, float]:
        """One ADPO update on ``batch``, unless the collapse guard sees in it that the policy collapsed:
        then the batch is skipped and (first sign of it; for a reward drop, the ``guard.confirm``-th
        unhealthy batch in a row) the last healthy policy is restored and published as a new
        version; ``stats["rolled_back"]``/``["guard_skipped"]`` say so and ``self.guard_event`` says why. Raises CollapseError when rolling back no longer helps."""
        self.guard_event = ""
        if self.guard is not None:
            h = batch_health(batch)
            reason = self.guard.collapse_reason(h)
            if reason is not None:
                self.guard_event = reason
                # sampled by the collapsed line (already rolled back), or a reward drop not yet confirmed
                if not self.guard.should_roll_back(h) or not self.guard.confirmed(h):
                    return {"rows": 0.0, "guard_skipped": 1.0, "policy_version": float(self.version),
                            "guard_rollbacks": float(self.guard.rollbacks)}
                self.version += 1
                self._restore(self.guard.rolled_back(self.version, reason))
                logging.getLogger("miles").warning("collapse guard: %s; restored policy version %d as version %d",
                                                   reason, self.guard.good[0], self.version)
                return {"rows": 0.0, "rolled_back": 1.0, "policy_version": float(self.version),
                        "guard_rollbacks": float(self.guard.rollbacks)}
            self.guard.accept(h)
        t = self.cfg.sampler.temperature if temperature is None else temperature
        stats = adpo_update(self.model, self.opt, batch, self.cfg.adpo, self.tok, t, self.gen, self.sched)
        self.version += 1
        if self.guard is not None:
            self.guard.offer(self.version, self._policy_state)
            stats["guard_rollbacks"] = float(self.guard.rollbacks)
        stats["policy_version"] = float(self.version)
        return stats

    def _restore(self, st: dict) -> None:
        """Inverse of ``_policy_state`` (also the first half of ``load_state``). The optimizer state
        is copied in, so later in-place steps never write into a snapshot the guard still holds."""
        missing = self.model.load_state_dict(st["adapter"], strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"checkpoint has unexpected adapter keys: {missing.unexpected_keys[:3]}")
        self.opt.load_state_dict(copy.deepcopy(st["opt"]))
        self.sched.load_state_dict(st["sched"])

    def save_adapter(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        if self._base_identity is None:  # hashed once per learner: the async learner publishes every update
            self._base_identity = base_identity(self.base_dir)
        return save_adapter(self.model, directory, dtype, base=self._base_identity)

    def state(self) -> dict:
        return {**self._policy_state(), "gen": self.gen.get_state(), "rng": self.rng.getstate(),
                "version": self.version, "groups_seen": self.groups_seen, "torch_rng": torch.get_rng_state(),
                "guard": self.guard.state() if self.guard else None}

    def load_state(self, st: dict) -> None:
        self._restore(st)
        self.gen.set_state(st["gen"])
        self.rng.setstate(st["rng"])
        self.version = int(st["version"])
        self.groups_seen = int(st["groups_seen"])
        torch.set_rng_state(st["torch_rng"])
        if self.guard is not None and st.get("guard") is not None:  # older checkpoints: a fresh guard
            self.guard.load_state(st["guard"])

