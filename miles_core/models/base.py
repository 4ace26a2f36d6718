"""The denoiser interface every backend implements, and checkpoint loading by model_type.

A denoiser maps a partially masked sequence to per-position logits; samplers, losses and the
SFT objective only ever call it through this interface, so the tiny built-in transformer and a
transformers Llama backbone are interchangeable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from miles_core.tokenizer import CharTokenizer


@runtime_checkable
class Denoiser(Protocol):
    """logits = denoiser(input_ids [B, T] long, attention_mask [B, T] bool) -> [B, T, V] float."""

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...


def load_checkpoint(directory: str | Path) -> tuple[nn.Module, CharTokenizer]:
    """Load a base denoiser and its tokenizer from a folder written by ``save_checkpoint``."""
    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"checkpoint folder {d} has no config.json")
    model_type = json.loads(cfg_path.read_text()).get("model_type")
    if model_type == "miles-tiny":
        from miles_core.models.tiny import TinyDenoiser

        return TinyDenoiser.from_pretrained(d), CharTokenizer.load(d)
    raise ValueError(f"{cfg_path}: unknown model_type {model_type!r}; allowed: 'miles-tiny'")


def save_checkpoint(model: nn.Module, tokenizer: CharTokenizer, directory: str | Path) -> None:
    """Write model weights, config and tokenizer so ``load_checkpoint`` restores them exactly."""
    model.save_pretrained(directory)  # type: ignore[operator]
    tokenizer.save(directory)
