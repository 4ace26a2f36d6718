"""Flow parameters as pydantic models, and the ``python -m flows.<name>`` command line built from them.

Why both plain typed flow arguments and these models: Prefect renders a flow's typed signature as
the deployment form in its UI and the ``miles`` CLI calls ``flow(**params)``, while these models
hold the checks that types alone cannot express (an override must be ``key=value``; an adapter
needs its base checkpoint). Each flow validates its arguments through its model first, so a bad
value fails before any work with a message naming the field. ``tests/test_flows.py`` checks that
every flow signature matches its model field for field.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import typing
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RUNS_DIR = "runs"


def ALIAS(*flags: str) -> dict[str, Any]:
    """Shorter command-line spellings of a field (``--store`` for ``store_uri``), listed first."""
    return {"cli": list(flags)}


# what a recipe field may name without a path (listed in the Prefect form's help text)
BUILTIN_RECIPES = tuple(sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "miles_core" / "recipes").glob("*.yaml")))

class FlowParams(BaseModel):
    """Shared by every flow: which recipe, where outputs go, which MLflow experiment."""

    model_config = ConfigDict(extra="forbid")

    recipe: str = Field("arith", description=f"built-in recipe name ({', '.join(BUILTIN_RECIPES)}) or a YAML file")
    overrides: list[str] = Field(default_factory=list, description="recipe overrides, key.sub=value")
    run_dir: str | None = Field(None, description="local folder for checkpoints/plots (default ./runs/<flow>-<recipe>-<time>)")
    experiment: str = Field("miles", min_length=1, description="MLflow experiment name")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (default MLFLOW_TRACKING_URI or ./mlruns sqlite)")
    progress: bool = Field(False, description="show progress bars")

    @field_validator("overrides")
    @classmethod
    def _overrides_are_pairs(cls, value: list[str]) -> list[str]:
        for ov in value:
            if "=" not in ov or not ov.split("=", 1)[0].strip():
                raise ValueError(f"override {ov!r} must look like key.sub=value")
        return value

    def recipe_overrides(self) -> list[str]:
        """The overrides the flow applies to its recipe (subclasses add their own fields' ones)."""
        return list(self.overrides)

    def run_path(self, flow: str) -> Path:
        """``run_dir`` resolved, or a fresh timestamped folder under ``./runs``."""
        if self.run_dir:
            return Path(self.run_dir).expanduser().resolve()
        stem = Path(self.recipe or "model").stem
        return (Path(RUNS_DIR) / f"{flow}-{stem}-{datetime.now():%Y%m%d-%H%M%S}").resolve()


class SFTParams(FlowParams):
    eval_problems: int | None = Field(None, ge=1, description="held-out problems per plateau evaluation (default eval.num_problems)")
    register_as: str | None = Field(None, description="also register the SFT checkpoint as this MLflow model")


class TrainParams(FlowParams):
    store_uri: str | None = Field(None, description="trajectory/adapter store: folder or s3://bucket/prefix (default RUN_DIR/store, RUN_DIR being run_dir)", json_schema_extra=ALIAS("--store"))
    base_checkpoint: str | None = Field(None, description="SFT checkpoint folder; trained first when absent")
    iterations: int | None = Field(None, ge=1, description="RL iterations, at least 1 (overrides train.iterations; `miles eval` evaluates without training)")
    register_as: str | None = Field("miles-arith", description="MLflow registered model for the final adapter (empty: do not register)")
    resume: bool = Field(False, description="continue the learner checkpoint found in run_dir")
    log_adapters: bool = Field(True, description="log every adapter version as an MLflow artifact")

    @model_validator(mode="after")
    def _resume_needs_run_dir(self) -> "TrainParams":
        if self.resume and not self.run_dir:
            raise ValueError("resume needs run_dir (the folder holding the learner checkpoint to continue)")
        return self

    def recipe_overrides(self) -> list[str]:
        return [*self.overrides, *([f"train.iterations={self.iterations}"] if self.iterations is not None else [])]


class AsyncTrainParams(FlowParams):
    store_uri: str | None = Field(None, description="the run's store shared by samplers and learner: folder or s3://bucket/prefix (default RUN_DIR/store, RUN_DIR being run_dir)", json_schema_extra=ALIAS("--store"))
    base_checkpoint: str | None = Field(None, description="SFT checkpoint folder; trained first when absent")
    num_samplers: int | None = Field(None, ge=1, description="sampler workers (overrides async_rl.num_samplers)", json_schema_extra=ALIAS("--samplers"))
    batches_per_sampler: int | None = Field(None, ge=1, description="sample budget per sampler (overrides async_rl.batches_per_sampler)", json_schema_extra=ALIAS("--batches"))
    learner_ranks: int | None = Field(None, ge=1, description="data-parallel learner ranks under torchrun (overrides async_rl.learner_ranks)", json_schema_extra=ALIAS("--ranks"))
    devices: int | None = Field(None, ge=2, description="split this many devices into samplers and learner ranks from measured seconds per completion, with the global batch that keeps them admitted (replaces num_samplers, learner_ranks and async_rl.global_batch)")
    launcher: Literal["processes", "deployments"] = Field(
        "processes", description="processes: local subprocesses; deployments: flow runs of miles-async-sampler / miles-async-learner on their work pools")
    register_as: str | None = Field("miles-arith", description="MLflow registered model for the final adapter (empty: do not register)")
    timeout_s: float = Field(3600.0, gt=0, description="seconds: fail if the samplers and learner have not finished by then", json_schema_extra=ALIAS("--timeout"))

    @model_validator(mode="after")
    def _devices_or_split(self) -> "AsyncTrainParams":
        if self.devices and (self.num_samplers or self.learner_ranks):
            raise ValueError("devices chooses num_samplers and learner_ranks itself: give devices, or the split, not both")
        return self

    def recipe_overrides(self) -> list[str]:
        extra = [f"async_rl.num_samplers={self.num_samplers}"] if self.num_samplers else []
        extra += [f"async_rl.batches_per_sampler={self.batches_per_sampler}"] if self.batches_per_sampler else []
        extra += [f"async_rl.learner_ranks={self.learner_ranks}"] if self.learner_ranks else []
        return [*self.overrides, *extra]


class SamplerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_uri: str = Field(..., min_length=1, description="the run's store URI (prepared by miles-async-train)")
    worker: str = Field("w0", pattern=r"^[A-Za-z0-9_.-]+$", description="sampler name, unique in the run")
    index: int = Field(0, ge=0, description="sampler index in [0, num_samplers)")


class LearnerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_uri: str = Field(..., min_length=1, description="the run's store URI (prepared by miles-async-train)")


class EvalParams(FlowParams):
    recipe: str | None = Field(None, description="recipe for task and eval settings (default: the model's own, else arith)")  # type: ignore[assignment]
    model_uri: str | None = Field(None, description="models:/NAME@champion, models:/NAME/3 or runs:/ID/model", json_schema_extra=ALIAS("--model"))
    adapter: str | None = Field(None, description="PEFT adapter folder or <store_uri>/adapters/vNNNNNN (needs base_checkpoint)")
    base_checkpoint: str | None = Field(None, description="SFT checkpoint folder (for adapter, or alone to evaluate the base)", json_schema_extra=ALIAS("--base"))
    num_problems: int | None = Field(None, ge=1, description="held-out problems (overrides eval.num_problems)")
    tasks: str | None = Field(None, pattern=r"^[a-z0-9_]+(,[a-z0-9_]+)*$", description="benchmarks to evaluate, comma-separated (gsm8k,math500,countdown,sudoku,humaneval,mbpp); their test files come from data_dir")
    data_dir: str | None = Field(None, description="folder (or fsspec URI) with one test file per task: TASK.jsonl, TASK.jsonl.gz, TASK.csv, TASK.parquet or TASK/test.*")
    preset: str | None = Field(None, description="named sampling settings (d1_128, d1, d1_512, dare), recorded with every number (eval.preset)")

    @model_validator(mode="before")
    @classmethod
    def _folder_as_model(cls, values: Any) -> Any:
        """``--model DIR``: a local model folder is the base checkpoint (URIs stay URIs)."""
        m = values.get("model_uri") if isinstance(values, dict) else None
        if m and not re.match(r"^[a-z]+:/", m) and Path(m).expanduser().is_dir() and not values.get("base_checkpoint"):
            values = {**values, "model_uri": None, "base_checkpoint": str(Path(m).expanduser())}
        return values

    def recipe_overrides(self) -> list[str]:
        return [*self.overrides, *([f"eval.preset={self.preset}"] if self.preset else [])]

    @model_validator(mode="after")
    def _one_source(self) -> "EvalParams":
        if self.model_uri and self.adapter:
            raise ValueError("give either model_uri or adapter, not both")
        if self.model_uri and self.base_checkpoint:
            raise ValueError("base_checkpoint goes with adapter (or alone, to evaluate the base), not with model_uri")
        if not self.model_uri and not self.base_checkpoint:
            raise ValueError("base_checkpoint is required unless model_uri is given")
        if self.tasks and not self.data_dir:
            raise ValueError("tasks needs data_dir, the folder holding each task's test file")
        return self


def documented(model: type[BaseModel]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Append an ``Args:`` section built from ``model``'s field descriptions to a flow's docstring,
    which Prefect shows as the help text of each field in the deployment form."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        args = "\n".join(f"    {name}: {f.description}" for name, f in model.model_fields.items() if f.description)
        fn.__doc__ = f"{(fn.__doc__ or '').rstrip()}\n\nArgs:\n{args}\n"
        return fn
    return deco


def validate(model: type[BaseModel], values: dict[str, Any]) -> Any:
    """Build ``model`` from a flow's arguments (``None`` for a list means its empty default)."""
    return model.model_validate({k: v for k, v in values.items() if not (v is None and k == "overrides")})


def check_signature(fn: Callable[..., Any], model: type[BaseModel]) -> None:
    """Raise if ``fn``'s parameters (names and defaults) drift from ``model``'s fields."""
    params = inspect.signature(fn).parameters
    fields = model.model_fields
    if set(params) != set(fields):
        raise TypeError(f"{fn.__name__}: parameters {sorted(params)} != {model.__name__} fields {sorted(fields)}")
    for name, f in fields.items():
        default = [] if f.default_factory is list else f.default
        got = params[name].default
        if f.is_required() and got is inspect.Parameter.empty:
            continue
        if not (got == default or (got is None and default == [])):
            raise TypeError(f"{fn.__name__}({name}=...) default {got!r} != {model.__name__}.{name} default {default!r}")


def _arg_type(annotation: Any) -> Callable[[str], Any]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return args[0] if args[0] in (int, float) else str


def flags(name: str, f: Any) -> list[str]:
    """A field's command-line options: its aliases first (:func:`ALIAS`), then ``--field-name``."""
    return [*((f.json_schema_extra or {}).get("cli", [])), "--" + name.replace("_", "-")]


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], positional: Sequence[str] = (),
                  defaults: bool = True) -> None:
    """One option per field of ``model``, from its type, default and description: the one place a
    flow parameter becomes a command-line option, for ``python -m flows.<name>`` and ``miles``.

    ``positional``: fields taken as positional arguments (``overrides`` as trailing ``key=value``
    words, else ``--set key=value``). ``defaults=False``: unset options are None, which
    :func:`call_values` drops, so the flow's own default applies.
    """
    for name, f in model.model_fields.items():
        default = (f.default if not f.is_required() and f.default_factory is None else None) if defaults else None
        if name == "overrides":
            if name in positional:
                parser.add_argument(name, nargs="*", default=[], metavar="key=value", help=f.description)
            else:
                parser.add_argument("--set", dest=name, action="append", default=[], metavar="KEY=VALUE",
                                    help=f.description)
        elif name in positional:
            parser.add_argument(name, default=default, nargs=None if f.is_required() or name == "recipe" else "?",
                                help=f.description)
        elif f.annotation is bool:
            parser.add_argument(*flags(name, f), dest=name, action=argparse.BooleanOptionalAction, default=default,
                                help=f.description)
        elif typing.get_origin(f.annotation) is Literal:
            parser.add_argument(*flags(name, f), dest=name, choices=typing.get_args(f.annotation), default=default,
                                help=f.description)
        else:
            parser.add_argument(*flags(name, f), dest=name, type=_arg_type(f.annotation), default=default,
                                help=f.description)


def call_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The parsed options that were given (None dropped). ``--register-as ''`` stays the empty
    string, which the flows read as "do not register": None would mean "the flow's default"."""
    return {k: getattr(args, k) for k in model.model_fields if getattr(args, k, None) is not None}


def flag_message(err: Exception, model: type[BaseModel]) -> str:
    """A ValidationError in one line, fields named the way the command line spells them."""
    try:
        parts = [f"{'.'.join(map(str, d['loc'])) or 'parameters'}: {d['msg']}" for d in err.errors()]  # type: ignore[attr-defined]
    except AttributeError:
        parts = [str(err).splitlines()[0]]
    msg = "; ".join(parts).replace("parameters: Value error, ", "").replace("Value error, ", "")
    for name, f in sorted(model.model_fields.items(), key=lambda kv: -len(kv[0])):
        if name in ("recipe", "overrides"):  # positional words on the command line: the name is right
            continue
        msg = re.sub(rf"(?<![\w-]){name}(?![\w-])", flags(name, f)[0], msg)
    return msg


def cli_main(flow: Callable[..., Any], model: type[BaseModel], argv: Sequence[str] | None = None) -> int:
    """``python -m flows.<name>``: one option per field (``--set key=value`` for overrides)."""
    module = f"flows.{Path(inspect.getfile(getattr(flow, 'fn', flow))).stem}"
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=(flow.__doc__ or "").split("\n")[0])
    add_arguments(parser, model)
    result = flow(**call_values(parser.parse_args(argv), model))
    json.dump(result, sys.stdout, indent=2, default=str)
    print()
    return 0
