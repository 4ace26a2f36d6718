"""Typed, frozen recipe configuration, loaded from YAML with ``key.sub=value`` overrides.

Every field is checked at load: an unknown key or a bad value fails before any work, with a
message naming the field and the allowed values (see tests/test_config.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the field."""


# The estimators Miles ships: miles_core/algo/estimators loads exactly these modules, each of which
# registers under its own module name. Stated here, below the algorithms, so a recipe's
# adpo.estimator is checked at load without importing torch or the estimator code.
BUILTIN_ESTIMATORS: tuple[str, ...] = ("adpo", "coupled", "ebpo", "espo", "meanfield", "spg", "wd1")
# Registered names -> the ADPOConfig fields each reads, filled as estimators register (built-in
# ones and any a program registers itself before loading its recipe).
ESTIMATORS: dict[str, tuple[str, ...]] = {}


def did_you_mean(word: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``word``, else ''."""
    close = difflib.get_close_matches(str(word), sorted(set(choices)), n=1, cutoff=0.6)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def bounded(default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """A numeric field with inclusive bounds, declared beside it; :func:`build` checks them by name."""
    return field(default=default, metadata={"bounds": (lo, hi)})


def check_bounds(obj: Any, path: str = "") -> None:
    """Every bounded field of ``obj`` within its bounds, or a ConfigError naming field, value and bounds."""
    for f in dataclasses.fields(obj):
        lo, hi = f.metadata.get("bounds", (None, None))
        v = getattr(obj, f.name)
        if v is None or (lo is None and hi is None):
            continue
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            raise ConfigError(f"{path}{f.name}: {v!r} is out of bounds {rng}")


@dataclass(frozen=True)
class ModelConfig:
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


@dataclass(frozen=True)
class TaskConfig:
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


@dataclass(frozen=True)
class SFTConfig:
    steps: int = bounded(3000, 1)
    batch_size: int = bounded(64, 1)
    lr: float = bounded(1e-3, 1e-12, 10.0)
    weight_decay: float = bounded(0.01, 0.0, 10.0)
    warmup: int = bounded(100, 0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up: decay to 0 at sft.steps
    eval_every: int = bounded(500, 1)
    seed: int = bounded(0, 0)


@dataclass(frozen=True)
class SamplerConfig:
    kind: Literal["static", "nsd"] = "static"
    steps: int = bounded(16, 1)                     # static: total denoising steps for the completion
    block_size: int = bounded(0, 0)                 # 0: the whole completion is one block
    temperature: float = bounded(1.0, 0.0, 100.0)
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    threshold: float = bounded(0.9, 1e-09, 1.0)              # nsd: commit every position with confidence >= threshold
    max_per_step: int = bounded(8, 1)               # nsd: cap on positions committed in one step
    min_per_step: int = bounded(1, 1)               # nsd: always commit at least this many
    cache: Literal["none", "prefix", "dual"] = "none"  # KV cache (miles_core/models/window.py): prompt + finished blocks, + suffix
    eos_stop: bool = False              # a row whose finished blocks hold EOS skips its later blocks (all EOS)

    def hash(self, completion_len: int) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "completion_len": completion_len}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RenoiseConfig:
    """The renoising sampler (samplers/renoise.py, DiffusionGemma): generate's own defaults
    (``DiffusionGemmaGenerationConfig._get_default_generation_params``, transformers 5.24)."""

    max_steps: int = bounded(48, 1)                   # max_denoising_steps
    entropy_bound: float = bounded(0.1, 1e-09)        # accept lowest-entropy positions while sum - max <= this
    t_min: float = bounded(0.4, 0.0)                  # temperature at the last step
    t_max: float = bounded(0.8, 1e-09)                # temperature at the first step
    stability_threshold: int = bounded(1, 0)          # stop: argmax unchanged for this many steps ...
    confidence_threshold: float = bounded(0.005, 1e-09)  # ... and mean entropy below this
    # the canvas RL chains return: generate's argmax of the last step, or that step's sample (not
    # generate's: every output token is then a sampled action, which adpo.renoise_output's row scores);
    # evaluation always decodes with the argmax
    output: Literal["argmax", "sample"] = "argmax"

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
class LoraSettings:
    r: int = bounded(16, 1, 4096)
    alpha: int = bounded(32, 1)
    dropout: float = bounded(0.0, 0.0, 0.99)
    targets: str = ""          # comma-separated module names, e.g. "q_proj,v_proj"; "" = the backend's attention+MLP projections


@dataclass(frozen=True)
class ADPOConfig:
    # a name registered in miles_core/algo/estimators/ (adpo, meanfield, coupled, wd1, spg, espo, ebpo):
    # its module says what a row is, its loss, and which of the fields below marked with it it reads
    estimator: str = "adpo"
    lr: float = bounded(1e-3, 1e-12, 10.0)
    warmup: int = bounded(5, 0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up: decay to 0 over the run's updates
    clip_eps: float = bounded(0.2, 1e-09, 10.0)
    is_cap: float = bounded(2.0, 1.0)                 # C in w = min(pi_prox / mu, C)
    step_fraction: float = bounded(0.5, 1e-09, 1.0)          # rho: rows per trajectory = ceil(rho K), the update's forwards
    step_cover: bool = True             # the rows partition all K steps (every token scored); False: a random rho of the steps
    step_merge: int = bounded(1, 1)                   # s > 1: runs of s steps, a random rho of them (TraceRL shrinkage)
    step_sampling: Literal["uniform", "uncertainty"] = "uniform"  # step_cover=false: which steps are drawn (uncertainty: by 1 - mu, reweighted)
    step_floor: float = bounded(0.05, 1e-3, 1.0)      # uncertainty: the least probability any step is drawn with
    renoise_output: bool = False        # renoising chains: also score the output (last argmax) at the last step's T
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
    prompt_mask_prob: float = bounded(0.15, 0.0, 1.0)      # meanfield (d1): fraction of prompt tokens masked
    mask_samples: int = bounded(1, 1, 64)  # meanfield / wd1 / coupled: Monte-Carlo mask draws per trajectory, each a row of weight 1/n; spg: copies J; espo: coupled pairs; ebpo: timesteps N
    mask_block: int = bounded(0, 0)                 # spg, ebpo: block length of their block-wise masks (0: the completion is one block)
    eubo_beta: float = bounded(1.5, 1.0, 10.0)      # spg: beta of the upper bound (EUBO)
    spg_mix: float = bounded(0.5, 0.0, 1.0)         # spg: weight of the EUBO (vs the ELBO) for trajectories with A <= 0
    max_staleness: int = bounded(4, 0)              # async: S


@dataclass(frozen=True)
class TrainConfig:
    iterations: int = bounded(40, 1)                # RL updates (0 would train nothing: `miles eval` evaluates a checkpoint)
    prompts_per_iter: int = bounded(16, 1)
    group_size: int = bounded(8, 2)
    eval_every: int = bounded(10, 0)
    seed: int = bounded(0, 0)
    reward: str = "math_exact"
    rl_exclude_demos: bool = False      # RL never draws a prompt that is one of the SFT demonstrations


@dataclass(frozen=True)
class AsyncSettings:
    """Decoupled samplers and learner (miles_core/asyncrl). Staleness S is ``adpo.max_staleness``:
    a sampler starts batch slot k only while k < (S + v + 1) x B, v the learner's version and B
    the sampler batches of one update (AReaL's admission rule), so what it samples is still fresh
    enough to use when the learner gets to it."""

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
    # At thousands of samplers the polls are the store's load (benchmarks/scale_model.py).
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
    # freed heap a worker keeps mapped for reuse (glibc mallopt; miles_core/allocator.py); 0: glibc's default
    retain_heap_mb: int = bounded(1024, 0, 2047)
    retry_budget_s: float = bounded(60.0, 0.0)        # storage errors are retried with backoff for this long


@dataclass(frozen=True)
class GuardSettings:
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
class EvalSettings:
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
    # (same evaluation fingerprint and problems; tracking/registry.py).
    champion_alpha: float = bounded(0.05, 0.0, 1.0)


@dataclass(frozen=True)
class SandboxSettings:
    """How code completions are executed (miles_core/rewards/isolation.py says what each holds).

    bwrap: a new bubblewrap sandbox (own user/mount/PID/network namespaces, seccomp) per run;
    bwrap_shared: one such sandbox per pool worker, each run forked inside it (same boundary, the
    worker's namespaces shared by its runs one at a time; several times the throughput);
    none: no kernel boundary (rlimits and an audit hook only), an explicit opt-out, tagged in MLflow.
    """

    isolation: Literal["bwrap", "bwrap_shared", "none"] = "bwrap"


@dataclass(frozen=True)
class RecipeConfig:
    name: str = "arith"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    renoise: RenoiseConfig = field(default_factory=RenoiseConfig)   # the sampler of renoising families
    lora: LoraSettings = field(default_factory=LoraSettings)
    adpo: ADPOConfig = field(default_factory=ADPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    async_rl: AsyncSettings = field(default_factory=AsyncSettings)
    guard: GuardSettings = field(default_factory=GuardSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    torch_threads: int = bounded(0, 0, 1024)               # 0: leave torch's default

    def batches_per_update(self) -> int:
        """B: sampler batches one update consumes (``async_rl.global_batch`` in completions)."""
        return max(1, self.async_rl.global_batch // (self.train.prompts_per_iter * self.train.group_size))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, d: dict) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(f"{prefix}{k}.", v)
                else:
                    out[f"{prefix}{k}"] = v
        walk("", self.to_dict())
        return out


def _coerce(path: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not allowed{did_you_mean(value, map(str, allowed))}; "
                              f"allowed values: {', '.join(map(repr, allowed))}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, got {value!r}")
        return build(tp, value, f"{path}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{path}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def build(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Construct dataclass ``cls`` from a mapping, rejecting unknown keys by name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {full!r}{did_you_mean(key, names, path)}; "
                              f"allowed keys here: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(full, hints[key], value)
    obj = cls(**kwargs)
    check_bounds(obj, path)
    validate(obj, path)
    return obj


def validate(obj: Any, path: str = "") -> None:
    """Checks across fields, and choices that depend on another field (single-field ranges are the
    bounds declared beside each field, see :func:`bounded`)."""
    def need(cond: bool, field_name: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{path}{field_name}: {msg}")
    if isinstance(obj, ADPOConfig):
        known = {*BUILTIN_ESTIMATORS, *ESTIMATORS}
        need(obj.estimator in known, "estimator",
             f"{obj.estimator!r} is not a registered estimator{did_you_mean(obj.estimator, known)}; "
             f"registered: {', '.join(map(repr, sorted(known)))}")
    if isinstance(obj, ADPOConfig):
        need(obj.step_sampling == "uniform" or (not obj.step_cover and obj.step_merge == 1), "step_sampling",
             "'uncertainty' draws single steps: it needs adpo.step_cover=false and adpo.step_merge=1")
    if isinstance(obj, SamplerConfig):
        need(1 <= obj.min_per_step <= obj.max_per_step, "min_per_step", "need 1 <= min_per_step <= max_per_step")
    if isinstance(obj, RenoiseConfig):
        need(obj.t_min < obj.t_max, "t_min", f"need t_min < t_max, got {obj.t_min} and {obj.t_max}")
    if isinstance(obj, AsyncSettings):
        need(obj.shared_budget or not obj.learner_samples, "learner_samples",
             "needs shared_budget=true (the learner claims slots of the shared sample budget)")
        need(not (obj.fsdp and obj.learner_samples), "fsdp",
             "cannot be combined with learner_samples=true (rank 0 alone would sample through a model "
             "whose every forward is a collective of all ranks)")
    if isinstance(obj, RecipeConfig):
        need(obj.renoise.output == "argmax" or obj.adpo.renoise_output, "renoise.output",
             "'sample' needs adpo.renoise_output=true: the output row is what scores the sampled output")
        per = obj.train.prompts_per_iter * obj.train.group_size
        a = obj.async_rl
        need(a.global_batch % per == 0, "async_rl.global_batch",
             f"{a.global_batch} is not a whole number of sampler batches of {per} completions "
             "(train.prompts_per_iter x train.group_size)")
    if isinstance(obj, TaskConfig):
        need(1 <= obj.min_ops <= obj.max_ops, "min_ops", "need 1 <= min_ops <= max_ops")
        need(obj.name != "code" or 3 <= obj.num_examples <= 10, "num_examples", "need 3 <= num_examples <= 10")
        need(obj.name != "code" or 0 <= obj.const_max <= 99, "const_max", "need 0 <= const_max <= 99")
    if isinstance(obj, ModelConfig):
        need(obj.d_model % obj.n_heads == 0, "d_model", "must be divisible by n_heads")
        need(obj.backend in ("llama", "hf") or not obj.path, "path", "only the 'llama' and 'hf' backends load a checkpoint folder")
        need(obj.backend != "hf" or bool(obj.path), "path", "backend 'hf' needs model.path (a local checkpoint folder)")
        need(obj.family == "remote_code" or not obj.trust_remote_code, "trust_remote_code",
             "only used with model.family=remote_code")
        need(obj.backend == "llama" or not obj.mask_token, "mask_token", "only used by the 'llama' backend")
        need(re.fullmatch(r"cpu|auto|cuda(:\d+)?", obj.device) is not None, "device",
             f"{obj.device!r} is not one of cpu, cuda, cuda:N, auto")


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    import yaml

    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load_recipe(source: str | Path | dict | None = None, overrides: list[str] | None = None) -> RecipeConfig:
    """Recipe from a YAML path, a built-in name (``recipes/NAME.yaml``), a dict or defaults."""
    import yaml

    data: dict[str, Any] = {}
    if isinstance(source, dict):
        data = json.loads(json.dumps(source))
    elif source:
        path = Path(source)
        if not path.exists():
            builtin = Path(__file__).parent / "recipes" / f"{source}.yaml"
            if not builtin.exists():
                names = sorted(p.stem for p in (Path(__file__).parent / "recipes").glob("*.yaml"))
                raise ConfigError(f"recipe {str(source)!r} is neither a file nor a built-in recipe; built-ins: {', '.join(names)}")
            path = builtin
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    for ov in overrides or []:
        keys, value = parse_override(ov)
        cur = data
        for k in keys[:-1]:
            nxt = cur.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {ov!r}: {k!r} is not a section")
            cur = nxt
        cur[keys[-1]] = value
    return build(RecipeConfig, data)
