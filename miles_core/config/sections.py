"""The recipe's sections: model, task, SFT, samplers, LoRA, optimiser, update engine, training
loop, asynchronous runs, collapse guard, evaluation and sandbox. Each field's comment is what the
generated reference page (docs/reference/recipe.md) shows; its bounds sit beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from miles_core.config.estimators import SETTINGS
from miles_core.config.schema import Need, Section, bounded, did_you_mean


@dataclass(frozen=True)
class ModelConfig(Section):
    # tiny | llama: a random-init model of the sizes below; hf: a local checkpoint (model.path) of
    # model.family, in its published layout (models/families.py)
    backend: Literal["tiny", "llama", "hf"] = "tiny"
    family: Literal["auto", "llada", "dream", "sdar", "bidir_qwen3", "modernbert", "bidir_llama", "tiny",
                    "diffusion_gemma", "remote_code"] = "auto"
    # remote_code only: run the checkpoint's own modeling code (auto_map); off unless asked for
    trust_remote_code: bool = False
    d_model: int = bounded(128, 8)
    n_layers: int = bounded(4, 1, 256)
    n_heads: int = bounded(4, 1, 256)
    d_ff: int = bounded(512, 1)
    max_len: int = bounded(64, 8)
    # llama only: a local Hugging Face folder (config.json, safetensors, tokenizer) to start from;
    # empty: a random-init Llama of the sizes above with a character tokenizer (toy recipes).
    path: str = ""
    # llama only: token to use as [MASK] when the tokenizer registers none (e.g. '<|mdm_mask|>');
    # empty: the tokenizer's mask token, else '[MASK]' is added.
    mask_token: str = ""
    # where the denoiser's weights live and its forward passes run: cpu, cuda, cuda:N, or auto (cuda
    # when torch sees one, else cpu). The sampler's state and noise and the learner's scoring live
    # there too; only tokens, step maps, log-probs and NFE come back to the host.
    device: str = "cpu"
    # the frozen base's weights (llama and the families): bfloat16 halves their memory and traffic;
    # LoRA adapters stay float32 (peft casts them up), and log-probs are computed in float32
    dtype: Literal["float32", "bfloat16"] = "float32"

    def check(self, need: Need) -> None:
        need(self.d_model % self.n_heads == 0, "d_model", "must be divisible by n_heads")
        need(self.backend in ("llama", "hf") or not self.path, "path", "only the 'llama' and 'hf' backends load a checkpoint folder")
        need(self.backend != "hf" or bool(self.path), "path", "backend 'hf' needs model.path (a local checkpoint folder)")
        need(self.family == "remote_code" or not self.trust_remote_code, "trust_remote_code",
             "only used with model.family=remote_code")
        need(self.backend == "llama" or not self.mask_token, "mask_token", "only used by the 'llama' backend")
        need(re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device) is not None, "device",
             f"{self.device!r} is not one of cpu, cuda, cuda:N, auto")


@dataclass(frozen=True)
class TaskConfig(Section):
    # arith, countdown, code: procedural (countdown reads d1's files when test_path is set); the
    # field's benchmarks read files (data/filetask.py): path = train split, test_path = eval split.
    name: Literal["arith", "countdown", "code", "gsm8k", "math", "math500", "sudoku", "humaneval", "mbpp"] = "arith"
    path: str = ""          # train file (SFT demonstrations and RL prompts): a local path or fsspec URI
    test_path: str = ""     # evaluation file (what results are reported on); never sampled for RL
    min_ops: int = bounded(2, 1, 16)
    max_ops: int = bounded(3, 1, 16)
    max_digits: int = bounded(2, 1, 9)
    mul_max_digits: int = bounded(1, 1, 9)
    num_train: int = bounded(1000, 1)      # labelled demonstrations available to SFT (scarce on purpose)
    num_test: int = bounded(500, 1)        # held-out problems for evaluation
    num_val: int = bounded(200, 0)         # held-out validation problems (SFT plateau / model selection), disjoint from test
    completion_len: int = bounded(32, 4)
    # plain: the prompt's tokens as they are; chat: wrapped in the tokenizer's own chat template as
    # one user turn with the assistant header appended (instruct models: LLaDA-8B-Instruct, Dream-
    # Instruct, SDAR-Chat). Recorded with every evaluation (EvalConfig.prompt_template).
    prompt_template: Literal["plain", "chat"] = "plain"
    num_examples: int = bounded(6, 1, 64)      # code: visible outputs f(0..n-1) in the prompt
    const_max: int = bounded(49, 0, 1000000)        # code: additive constants range over [-const_max, const_max]
    numbers: int = bounded(3, 2, 8)           # countdown: given numbers per problem
    max_value: int = bounded(12, 1, 1000000)        # countdown: numbers range over 1..max_value

    def check(self, need: Need) -> None:
        need(1 <= self.min_ops <= self.max_ops, "min_ops", "need 1 <= min_ops <= max_ops")
        need(self.name != "code" or 3 <= self.num_examples <= 10, "num_examples", "need 3 <= num_examples <= 10")
        need(self.name != "code" or 0 <= self.const_max <= 99, "const_max", "need 0 <= const_max <= 99")


@dataclass(frozen=True)
class SFTConfig(Section):
    steps: int = bounded(3000, 1)
    batch_size: int = bounded(64, 1)
    lr: float = bounded(1e-3, 1e-12, 10.0)
    weight_decay: float = bounded(0.01, 0.0, 10.0)
    warmup: int = bounded(100, 0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up: decay to 0 at sft.steps
    eval_every: int = bounded(500, 1)
    seed: int = bounded(0, 0)


@dataclass(frozen=True)
class SamplerConfig(Section):
    kind: Literal["static", "nsd"] = "static"
    steps: int = bounded(16, 1)                     # static: total denoising steps for the completion
    block_size: int = bounded(0, 0)                 # 0: the whole completion is one block
    temperature: float = bounded(1.0, 0.0, 100.0)
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    threshold: float = bounded(0.9, 1e-09, 1.0)              # nsd: commit every position with confidence >= threshold
    # nsd: > 0, the threshold the run's first policy samples with, moving linearly to threshold by half
    # the run's updates (train.iterations): strict while the policy is unsure; 0: threshold throughout
    threshold_start: float = bounded(0.0, 0.0, 1.0)
    max_per_step: int = bounded(8, 1)               # nsd: cap on positions committed in one step
    min_per_step: int = bounded(1, 1)               # nsd: always commit at least this many
    cache: Literal["none", "prefix", "dual"] = "none"  # KV cache (miles_core/models/window.py): prompt + finished blocks, + suffix
    eos_stop: bool = False              # a row whose finished blocks hold EOS skips its later blocks (all EOS)

    def check(self, need: Need) -> None:
        need(1 <= self.min_per_step <= self.max_per_step, "min_per_step", "need 1 <= min_per_step <= max_per_step")

    def threshold_at(self, version: int, updates: int) -> float | None:
        """NSD's threshold for policy version ``version`` of a run of ``updates`` updates (the
        ``threshold_start`` schedule); None: ``threshold`` throughout."""
        if self.kind != "nsd" or self.threshold_start <= 0:
            return None
        frac = min(1.0, 2 * version / max(updates - 1, 1))
        return self.threshold_start + (self.threshold - self.threshold_start) * frac

    def hash(self, completion_len: int) -> str:
        fields = dataclasses.asdict(self)
        if not self.threshold_start:  # unscheduled: the hash it had before the schedule existed
            del fields["threshold_start"]
        blob = json.dumps({**fields, "completion_len": completion_len}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RenoiseConfig(Section):
    """The renoising sampler (samplers/renoise.py, DiffusionGemma): generate's own defaults
    (``DiffusionGemmaGenerationConfig._get_default_generation_params``, transformers 5.24)."""

    max_steps: int = bounded(48, 1)                   # max_denoising_steps
    entropy_bound: float = bounded(0.1, 1e-09)        # accept lowest-entropy positions while sum - max <= this
    t_min: float = bounded(0.4, 0.0)                  # temperature at the last step
    t_max: float = bounded(0.8, 1e-09)                # temperature at the first step
    stability_threshold: int = bounded(1, 0)          # stop: argmax unchanged for this many steps ...
    confidence_threshold: float = bounded(0.005, 1e-09)  # ... and mean entropy below this
    # the canvas RL chains return: generate's argmax of the last step, or that step's sample (not
    # generate's: every output token is then a sampled action, which estimators.adpo.renoise_output's row scores);
    # evaluation always decodes with the argmax
    output: Literal["argmax", "sample"] = "argmax"

    def check(self, need: Need) -> None:
        need(self.t_min < self.t_max, "t_min", f"need t_min < t_max, got {self.t_min} and {self.t_max}")

    def generate_kwargs(self) -> dict[str, Any]:
        """The same settings as ``model.generate`` keyword arguments (generate returns the argmax)."""
        if self.output != "argmax":
            raise ValueError(f"renoise.output={self.output!r}: model.generate returns the argmax canvas only")
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        return dict(max_denoising_steps=self.max_steps, sampler_config=EntropyBoundSamplerConfig(self.entropy_bound),
                    t_min=self.t_min, t_max=self.t_max, stability_threshold=self.stability_threshold,
                    confidence_threshold=self.confidence_threshold)

    def hash(self, canvas_length: int) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "canvas_length": canvas_length, "kind": "renoise"},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LoraSettings(Section):
    r: int = bounded(16, 1, 4096)
    alpha: int = bounded(32, 1)
    dropout: float = bounded(0.0, 0.0, 0.99)
    targets: str = ""          # comma-separated module names, e.g. "q_proj,v_proj"; "" = the backend's attention+MLP projections


@dataclass(frozen=True)
class OptimConfig(Section):
    """The learner's AdamW on the LoRA adapter: its learning rate and schedule."""

    lr: float = bounded(1e-3, 1e-12, 10.0)
    warmup: int = bounded(5, 0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up: decay to 0 over the run's updates


@dataclass(frozen=True)
class UpdateConfig(Section):
    """The update engine (algo/update.py) and the loss every estimator's rows feed: which estimator
    builds the rows (its own settings are ``estimators.NAME``), how the loss is clipped, weighted,
    regularised and normalised, and how the rows are split into minibatches, epochs and chunks."""

    # a name registered in miles_core/algo/estimators/ (adpo, meanfield, coupled, wd1, spg, espo, ebpo):
    # its module says what a row is, its loss and its advantage transform
    estimator: str = "adpo"
    clip_eps: float = bounded(0.2, 1e-09, 10.0)
    is_cap: float = bounded(2.0, 1.0)                 # C in w = min(pi_prox / mu, C)
    kl_coef: float = bounded(0.0, 0.0)                # KL to the reference (adapter disabled)
    entropy_floor: float = bounded(0.0, 0.0)          # penalise mean entropy below this (NSD guard)
    entropy_coef: float = bounded(0.0, 0.0)
    std_normalize: bool = False         # group advantages: mean-centred, optionally /std
    skip_zero_variance: bool = True
    loss_norm: Literal["informative", "batch"] = "informative"  # loss / tokens of: rows with A != 0 | the whole batch
    num_minibatches: int = bounded(1, 1)
    epochs: int = bounded(1, 1)
    row_chunk: int = bounded(256, 1)                # rows per forward/backward (bounds peak memory)
    chunk_tokens: int = bounded(0, 0)               # > 0: a chunk's memory budget in positions (algo/update.py), not row_chunk
    grad_checkpointing: bool = False    # recompute each layer in backward, keeping only its input (models/activations.py)
    max_grad_norm: float = bounded(1.0, 1e-09)

    def check(self, need: Need) -> None:
        known = set(SETTINGS)
        need(self.estimator in known, "estimator",
             f"{self.estimator!r} is not a registered estimator{did_you_mean(self.estimator, known)}; "
             f"registered: {', '.join(map(repr, sorted(known)))}")


@dataclass(frozen=True)
class TrainConfig(Section):
    iterations: int = bounded(40, 1)                # RL updates (0 would train nothing: `miles eval` evaluates a checkpoint)
    prompts_per_iter: int = bounded(16, 1)
    group_size: int = bounded(8, 2)
    eval_every: int = bounded(10, 0)
    seed: int = bounded(0, 0)
    reward: str = "math_exact"
    rl_exclude_demos: bool = False      # RL never draws a prompt that is one of the SFT demonstrations


@dataclass(frozen=True)
class AsyncSettings(Section):
    """Decoupled samplers and learner (miles_core/asyncrl). Staleness S is ``max_staleness``:
    a sampler starts batch slot k only while k < (S + v + 1) x B, v the learner's version and B
    the sampler batches of one update (AReaL's admission rule), so what it samples is still fresh
    enough to use when the learner gets to it."""

    max_staleness: int = bounded(4, 0)              # S: a batch older than S versions is dropped, never trained on
    num_samplers: int = bounded(1, 1, 4096)
    # data-parallel learner ranks a local run starts under torchrun (at scale: torchrun's --nproc-per-node x --nnodes)
    learner_ranks: int = bounded(1, 1, 4096)
    batches_per_sampler: int = bounded(10, 1)       # sample budget: each sampler commits this many batches
    # completions one update consumes, assembled from whole sampler batches (0: one sampler batch,
    # train.prompts_per_iter x train.group_size); sets the version rate, whatever the fleet size
    global_batch: int = bounded(0, 0, 1 << 20)
    checkpoint_every: int = bounded(1, 1)           # learner checkpoint to the store every N updates (and on stop)
    poll_interval: float = bounded(0.05, 1e-06, 3600.0)         # seconds between store polls while waiting
    # each empty poll multiplies the wait by poll_backoff, up to poll_max_interval (1.0: no back-off).
    # At thousands of samplers the polls are the store's load (benchmarks/scale/scale_model.py).
    poll_backoff: float = bounded(1.0, 1.0, 10.0)
    poll_max_interval: float = bounded(1.0, 1e-06, 3600.0)
    sampler_threads: int = bounded(1, 1, 1024)            # torch threads per sampler process
    sampler_nice: int = bounded(0, 0, 19)               # OS niceness of sampler processes (>0: the learner gets the CPU first on a shared host)
    pin_samplers: bool = False          # pin sampler i to CPU i mod (CPUs this process may use); the learner floats
    shared_budget: bool = False         # samplers claim slots of one num_samplers x batches_per_sampler budget (a fast one takes more)
    learner_samples: bool = False       # with shared_budget: the learner samples a batch itself instead of waiting idle
    sync_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # adapter tensors as published to samplers
    learner_threads: int = bounded(1, 1, 1024)            # torch threads of the learner process
    fsdp: bool = False                  # learner ranks shard base and adapter (FSDP2) instead of each holding it whole
    # how a global batch is dealt to the learner ranks: equal blocks, or blocks in proportion to each
    # rank's measured speed so a slow GPU does not set the pace (learner/shares.py::RankSpeeds)
    deal: Literal["even", "speed"] = "even"
    # in-flight policy refresh: a sampler fetches a newer adapter in the background while it samples
    # and swaps it in at the next step boundary, every refresh_every-th denoising step (0: a rollout
    # keeps the adapter it started with); each step records its version (asyncrl/refresh.py)
    refresh_every: int = bounded(0, 0, 1 << 20)
    # freed heap a worker keeps mapped for reuse (glibc mallopt; miles_core/allocator.py); 0: glibc's default
    retain_heap_mb: int = bounded(1024, 0, 2047)
    retry_budget_s: float = bounded(60.0, 0.0)        # storage errors are retried with backoff for this long

    def check(self, need: Need) -> None:
        need(self.shared_budget or not self.learner_samples, "learner_samples",
             "needs shared_budget=true (the learner claims slots of the shared sample budget)")
        need(not (self.fsdp and self.deal == "speed"), "deal",
             "'speed' cannot be combined with fsdp=true (FSDP pads every rank to the busiest one's passes, "
             "so a smaller share would not finish sooner)")
        need(not (self.fsdp and self.learner_samples), "fsdp",
             "cannot be combined with learner_samples=true (rank 0 alone would sample through a model "
             "whose every forward is a collective of all ranks)")


@dataclass(frozen=True)
class GuardSettings(Section):
    """Collapse guard (miles_core/algo/guard.py): roll the policy back when a batch shows it collapsed."""

    enabled: bool = True
    max_empty_frac: float = bounded(0.5, 1e-09, 1.0)         # collapse: this share of empty completions, after a running share below half of it
    reward_drop: float = bounded(0.1, 0.0, 0.999)            # collapse: batch mean reward below this x the running mean of healthy batches ...
    min_reward: float = bounded(0.2, 0.0)             # ... when that running mean is at least this (below, a drop is noise)
    min_rows: int = bounded(64, 1)                  # smaller batches are too noisy to call a collapse: always accepted
    ema: float = bounded(0.1, 1e-09, 1.0)                    # weight of a new healthy batch in the running means
    snapshot_every: int = bounded(10, 1)            # candidate rollback target every N policy versions
    max_rollbacks: int = bounded(3, 0)              # a collapse after this many rollbacks in a row (no healthy batch between) -> CollapseError
    confirm: int = bounded(2, 1)                    # a reward drop rolls back on the confirm-th unhealthy batch in a row (earlier ones skipped)


@dataclass(frozen=True)
class EvalSettings(Section):
    # A named preset (eval/presets.py: d1_128, d1, d1_512, dare) replaces completion length, steps,
    # block size, temperature and remasking with the values the field's tables used, recorded.
    preset: Literal["", "d1_128", "d1", "d1_512", "dare"] = ""
    num_problems: int = bounded(500, 1)
    steps: int = bounded(16, 1)
    block_size: int = bounded(0, 0)
    temperature: float = bounded(0.0, 0.0, 100.0)
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    n_samples: int = bounded(1, 1)
    seed: int = bounded(1234, 0)
    batch_size: int = bounded(250, 1)
    # `champion` moves to a new registered version only on a paired sign test won at p < this
    # (same evaluation fingerprint and problems; tracking/registry.py). A level of 0 could never be
    # won and one above 0.5 would promote on noise: the bounds are the levels the registry accepts.
    champion_alpha: float = bounded(0.05, 1e-09, 0.5)


@dataclass(frozen=True)
class SandboxSettings(Section):
    """How code completions are executed (miles_core/rewards/isolation.py says what each holds).

    bwrap: a new bubblewrap sandbox (own user/mount/PID/network namespaces, seccomp) per run;
    bwrap_shared: one such sandbox per pool worker, each run forked inside it (same boundary, the
    worker's namespaces shared by its runs one at a time; several times the throughput);
    none: no kernel boundary (rlimits and an audit hook only), an explicit opt-out, tagged in MLflow.
    """

    isolation: Literal["bwrap", "bwrap_shared", "none"] = "bwrap"
