"""LoRA through peft: only adapter tensors train, the base stays frozen, and the reference
policy for KL is the same model with the adapter disabled (no second copy of the weights)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")
# Attention and MLP projections per backend, keyed by the base's ``config.model_type``.
TARGETS_BY_MODEL_TYPE: dict[str, tuple[str, ...]] = {
    "miles-tiny": DEFAULT_TARGETS,
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def lora_targets(model: nn.Module) -> tuple[str, ...]:
    """The LoRA target module names for this base (``DEFAULT_TARGETS`` for unknown model types)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return TARGETS_BY_MODEL_TYPE.get(str(model_type), DEFAULT_TARGETS)


def add_lora(model: nn.Module, r: int = 16, alpha: int = 32, dropout: float = 0.0,
             targets: tuple[str, ...] | None = None) -> PeftModel:
    """Wrap a base denoiser with a fresh LoRA adapter (B initialised to zero: output unchanged).

    ``targets=None`` picks the backend's attention/MLP projections (:func:`lora_targets`).
    """
    targets = lora_targets(model) if targets is None else targets
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none")
    return get_peft_model(model, cfg)


def load_adapter(base: nn.Module, adapter_dir: str | Path, trainable: bool = False) -> PeftModel:
    """Attach a saved peft adapter folder (adapter_config.json + adapter_model.safetensors)."""
    if not (Path(adapter_dir) / "adapter_config.json").exists():
        raise FileNotFoundError(f"{adapter_dir} is not a peft adapter folder (no adapter_config.json)")
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state(model: nn.Module) -> dict:
    """Only the LoRA tensors: what samplers need to hot-swap a new policy version."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


@contextlib.contextmanager
def reference_policy(model: nn.Module) -> Iterator[nn.Module]:
    """Context in which ``model`` computes the reference (adapter-off) policy."""
    if isinstance(model, PeftModel):
        with model.disable_adapter():
            yield model
    else:
        yield model
