"""Typed, frozen recipe configuration, loaded from YAML with ``key.sub=value`` overrides.

``schema`` is the machinery (bounds, typed build, each section's checks); ``sections`` the
recipe's sections; ``estimators`` each estimator's own settings; ``recipe`` the whole recipe and
its loader; ``legacy`` the keys of the old single ``adpo`` section. Everything a caller needs is
named here.
"""

from miles_core.config.estimators import (BUILTIN_ESTIMATORS, SETTINGS, AdpoSettings, CoupledSettings,
                                          EbpoSettings, EspoSettings, EstimatorSections, MeanFieldSettings,
                                          SpgSettings, Wd1Settings, build_estimator_sections, register_settings,
                                          unregister_settings)
from miles_core.config.recipe import RecipeConfig, load_recipe, parse_override
from miles_core.config.legacy import migrate
from miles_core.config.schema import (ConfigError, Section, bounded, build, check_bounds, did_you_mean, flatten,
                                      set_dotted)
from miles_core.config.sections import (AsyncSettings, EvalSettings, GuardSettings, LoraSettings, ModelConfig,
                                        OptimConfig, RenoiseConfig, SamplerConfig, SandboxSettings, SFTConfig,
                                        TaskConfig, TrainConfig, UpdateConfig)

__all__ = ["BUILTIN_ESTIMATORS", "SETTINGS", "AdpoSettings", "AsyncSettings", "ConfigError", "CoupledSettings",
           "EbpoSettings", "EspoSettings", "EstimatorSections", "EvalSettings", "GuardSettings", "LoraSettings",
           "MeanFieldSettings", "ModelConfig", "OptimConfig", "RecipeConfig", "RenoiseConfig", "SamplerConfig",
           "SandboxSettings", "Section", "SFTConfig", "SpgSettings", "TaskConfig", "TrainConfig", "UpdateConfig",
           "Wd1Settings", "bounded", "build", "build_estimator_sections", "check_bounds", "did_you_mean", "flatten",
           "load_recipe", "migrate", "parse_override", "register_settings", "set_dotted", "unregister_settings"]
