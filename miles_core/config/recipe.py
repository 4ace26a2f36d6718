"""The whole recipe: its sections, the rules that span them, and the loader (YAML path, built-in
name, mapping or defaults, then ``key.sub=value`` overrides).

Every field is checked at load: an unknown key or a bad value fails before any work, with a
message naming the field and the allowed values (see tests/test_config.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.config.estimators import EstimatorSections, build_estimator_sections
from miles_core.config.legacy import migrate, moved_key, warn
from miles_core.config.schema import ConfigError, Need, Section, bounded, build, flatten, set_dotted
from miles_core.config.sections import (AsyncSettings, EvalSettings, GuardSettings, LoraSettings, ModelConfig,
                                        OptimConfig, RenoiseConfig, SamplerConfig, SandboxSettings, SFTConfig,
                                        TaskConfig, TrainConfig, UpdateConfig)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _plain(value: Any) -> Any:
    """Nested dicts (the estimators' sections included) as plain dicts and lists, for YAML and JSON."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class RecipeConfig(Section):
    name: str = "arith"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    renoise: RenoiseConfig = field(default_factory=RenoiseConfig)   # the sampler of renoising families
    lora: LoraSettings = field(default_factory=LoraSettings)
    optim: OptimConfig = field(default_factory=OptimConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    estimators: EstimatorSections = field(default_factory=lambda: build_estimator_sections({}))
    train: TrainConfig = field(default_factory=TrainConfig)
    async_rl: AsyncSettings = field(default_factory=AsyncSettings)
    guard: GuardSettings = field(default_factory=GuardSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    torch_threads: int = bounded(0, 0, 1024)               # 0: leave torch's default

    def check(self, need: Need) -> None:
        need(self.renoise.output == "argmax" or self.estimators["adpo"].renoise_output, "renoise.output",
             "'sample' needs estimators.adpo.renoise_output=true: the output row is what scores the sampled output")
        per = self.train.prompts_per_iter * self.train.group_size
        need(self.async_rl.global_batch % per == 0, "async_rl.global_batch",
             f"{self.async_rl.global_batch} is not a whole number of sampler batches of {per} completions "
             "(train.prompts_per_iter x train.group_size)")

    def own(self) -> Any:
        """The settings of the estimator this recipe trains with (``estimators[update.estimator]``)."""
        return self.estimators[self.update.estimator]

    def batches_per_update(self) -> int:
        """B: sampler batches one update consumes (``async_rl.global_batch`` in completions)."""
        return max(1, self.async_rl.global_batch // (self.train.prompts_per_iter * self.train.group_size))

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, for MLflow params."""
        return flatten(self.to_dict())


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


def _read(source: str | Path | dict | None) -> tuple[dict[str, Any], str]:
    """The recipe mapping and where it came from (for messages)."""
    import yaml

    if isinstance(source, dict):
        return json.loads(json.dumps(source)), "recipe"
    if not source:
        return {}, "recipe"
    path = Path(source)
    if not path.exists():
        builtin = RECIPES / f"{source}.yaml"
        if not builtin.exists():
            names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
            raise ConfigError(f"recipe {str(source)!r} is neither a file nor a built-in recipe; built-ins: {', '.join(names)}")
        path = builtin
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data, str(path)


def load_recipe(source: str | Path | dict | None = None, overrides: list[str] | None = None) -> RecipeConfig:
    """Recipe from a YAML path, a built-in name (``recipes/NAME.yaml``), a dict or defaults, with
    ``overrides`` applied in order. Keys of the old single ``adpo`` section still load, each with a
    FutureWarning naming the key(s) that now hold it (config/legacy.py)."""
    data, where = _read(source)
    data = migrate(data, where)
    for ov in overrides or []:
        keys, value = parse_override(ov)
        if keys[0] == "adpo" and len(keys) == 2:
            new = moved_key(keys[1])
            warn({keys[1]: new}, f"override {ov!r}")
        else:
            new = (".".join(keys),)
        for dotted in new:
            try:
                set_dotted(data, dotted, value)
            except ConfigError as e:
                raise ConfigError(f"override {ov!r}: {e}") from None
    return build(RecipeConfig, data)
