"""Save/load a module as ``config.json`` + ``model.safetensors``: one implementation shared by
every built-in backend, so checkpoint checks and error messages are the same everywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

from safetensors.torch import load_file, save_file
from torch import nn

M = TypeVar("M", bound=nn.Module)


def save_module(module: nn.Module, config: dict[str, Any], directory: str | Path) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}, str(d / "model.safetensors"))


def load_module(directory: str | Path, model_type: str, build: Callable[[dict[str, Any]], M]) -> M:
    """Check the folder holds a ``model_type`` checkpoint, build the module from its config, load weights."""
    d = Path(directory)
    for name in ("config.json", "model.safetensors"):
        if not (d / name).exists():
            raise FileNotFoundError(f"checkpoint {d} is missing {name}")
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("model_type") != model_type:
        raise ValueError(f"{d}/config.json: model_type {cfg.get('model_type')!r} is not {model_type!r}")
    model = build(cfg)
    model.load_state_dict(load_file(str(d / "model.safetensors")))
    return model
