"""The registered model: an SFT base checkpoint plus a LoRA adapter, as an MLflow pyfunc that
turns text prompts into generated answers.

Why a pyfunc: whoever loads ``models:/NAME@champion`` (a serving endpoint, a notebook, the
``miles generate`` command) gets generation with the sampling settings the version was evaluated
with, recorded in ``model_config``, without knowing anything about Miles. It is logged as an
MLflow "model from code" (this file, ending in ``set_model``) with its own copy of ``miles_core`` as
a code path, so loading needs neither a checkout of Miles nor unpickling of Miles classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlflow.pyfunc
import pandas as pd
from mlflow.models.signature import ModelSignature
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

INPUT_COLUMN = "prompt"


def model_signature(temperature: float, seed: int) -> ModelSignature:
    """Input: one string column (a list of prompts, or a DataFrame with one column such as
    ``prompt``); output: one completion per prompt; optional ``temperature``/``seed``/``max_tokens`` params.

    The column is unnamed on purpose: MLflow then accepts a plain list of strings as well."""
    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("temperature", "double", float(temperature)),
                            ParamSpec("seed", "long", int(seed)),
                            ParamSpec("max_tokens", "long", 0)]),  # 0: the completion length it was evaluated at
    )


def prompts_from_input(model_input: Any) -> list[str]:
    """Accept a string, a list of strings, a pandas Series/DataFrame (``prompt`` column) or an array."""
    data = model_input
    if hasattr(data, "columns"):  # pandas DataFrame
        if INPUT_COLUMN in data.columns:
            data = data[INPUT_COLUMN]
        elif len(data.columns) == 1:
            data = data[data.columns[0]]
        else:
            raise ValueError(f"model input has columns {list(data.columns)}; expected a {INPUT_COLUMN!r} column")
    if isinstance(data, str):
        data = [data]
    if hasattr(data, "tolist"):
        data = data.tolist()
    if not isinstance(data, (list, tuple)):
        raise TypeError(f"model input must be prompts (list of str or a {INPUT_COLUMN!r} column), "
                        f"got {type(model_input).__name__}")
    flat = [row[0] if isinstance(row, (list, tuple)) and len(row) == 1 else row for row in data]
    for i, p in enumerate(flat):
        if not isinstance(p, str):
            raise TypeError(f"prompt {i} must be a string, got {type(p).__name__} ({p!r})")
    return list(flat)


class MilesGenerator(mlflow.pyfunc.PythonModel):
    """Artifacts: ``base`` (checkpoint folder) and optionally ``adapter`` (PEFT folder).
    ``model_config["recipe"]``: the resolved recipe (task format, eval sampling settings)."""

    def load_context(self, context: Any) -> None:
        from miles_core.config import load_recipe
        from miles_core.eval.evaluate import sampler_for
        from miles_core.models.base import load_base, max_positions
        from miles_core.models.lora import load_adapter
        from miles_core.eval.evaluate import eval_config

        recipe = (context.model_config or {}).get("recipe")
        if not isinstance(recipe, dict):
            raise ValueError("model_config has no 'recipe' mapping; this model was not logged by Miles")
        self.cfg = load_recipe(recipe)
        base, self.tok = load_base(self.cfg, context.artifacts["base"])
        adapter = context.artifacts.get("adapter")
        self.model = load_adapter(base, adapter) if adapter else base
        self.model.eval()
        ec = eval_config(self.cfg)
        self.sampler = sampler_for(ec)
        self.seed = ec.seed
        self.completion_len = ec.completion_len
        self.max_len = max_positions(base)

    def _canonical(self, prompt: str) -> str:
        # each task class says how its prompts are normalised (whitespace, countdown's sorted numbers)
        from miles_core.data.registry import canonical_prompt

        return canonical_prompt(self.cfg.task.name, prompt)

    # model_input is a DataFrame: MLflow converts any input to one against the explicit signature
    # (a ``prompt`` column) before predict, and takes this hint as "no schema from the hint", so the
    # signature keeps its sampling params and no "Add type hints" warning is printed at load
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        """One completion per prompt (greedy by default, as evaluated; ``temperature``/``seed`` params).
        The model's family picks the sampler (samplers/registry.py): a renoising one (DiffusionGemma)
        samples with the recipe's ``renoise`` schedule instead."""
        import torch

        from miles_core.config import ConfigError
        from miles_core.samplers.registry import sample_for

        params = dict(params or {})
        prompts = [self._canonical(p) for p in prompts_from_input(model_input)]
        length = int(params.get("max_tokens") or 0) or self.completion_len
        if length < 1:
            raise ValueError(f"param max_tokens must be >= 1, got {length}")
        limit = self.max_len - length
        ids = [self.tok.encode_prompt(p) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(ids[i]) > limit:
                raise ValueError(f"prompt {i} has {len(ids[i])} tokens; this model takes at most {limit} "
                                 f"(max_len {self.max_len} - max_tokens {length})")
        temperature = float(params.get("temperature", self.sampler.temperature))
        if temperature < 0:
            raise ValueError(f"param temperature must be >= 0, got {temperature}")
        # another length keeps the tokens per denoising step it was evaluated with
        steps = max(1, self.sampler.steps * length // self.completion_len)
        scfg = dataclasses.replace(self.sampler, temperature=temperature, steps=steps)
        gen = torch.Generator().manual_seed(int(params.get("seed", self.seed)))
        out: list[str] = []
        step = max(int(self.cfg.eval.batch_size), 1)
        for start in range(0, len(prompts), step):
            part = ids[start:start + step]
            try:
                batch = sample_for(self.model, self.tok, part, scfg, length, gen, renoise_cfg=self.cfg.renoise)
            except ConfigError as e:  # e.g. a length that is not a whole number of the sampler's blocks
                raise ValueError(f"param max_tokens={length}: {e}") from None
            out.extend(batch.completions)
        return out


mlflow.models.set_model(MilesGenerator())
