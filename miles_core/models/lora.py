"""LoRA through peft: only adapter tensors train, the base stays frozen, and the reference
policy for KL is the same model with the adapter disabled (no second copy of the weights)."""

from __future__ import annotations

import contextlib
import copy
import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn

if TYPE_CHECKING:
    from miles_core.config import LoraSettings

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the tensors of a peft adapter folder
BASE_FILE = "miles_base.json"                  # what the adapter belongs to: the base's name and weight hash
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")
# Attention and MLP projections per backend, keyed by the base's ``config.model_type``.
TARGETS_BY_MODEL_TYPE: dict[str, tuple[str, ...]] = {
    "miles-tiny": DEFAULT_TARGETS,
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "modernbert": ("Wqkv", "Wo", "Wi"),
}


def lora_targets(model: nn.Module) -> tuple[str, ...]:
    """The LoRA target module names for this base (``DEFAULT_TARGETS`` for unknown model types)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return TARGETS_BY_MODEL_TYPE.get(str(model_type), DEFAULT_TARGETS)


def add_lora(model: nn.Module, r: int = 16, alpha: int = 32, dropout: float = 0.0,
             targets: tuple[str, ...] | None = None) -> PeftModel:
    """Wrap a base denoiser with a fresh LoRA adapter (B initialised to zero: output unchanged).

    ``targets=None`` picks the backend's attention/MLP projections (:func:`lora_targets`); for
    DiffusionGemma, its decoder's only (a regex: the tied encoder has the same module names).
    """
    if targets is None and getattr(getattr(model, "config", None), "model_type", None) == "diffusion_gemma":
        from miles_core.models.diffusion_gemma import DECODER_LORA_TARGETS

        return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                target_modules=DECODER_LORA_TARGETS, bias="none"))
    targets = lora_targets(model) if targets is None else targets
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"lora.targets: {missing} are not modules of this model; it has e.g. "
                         f"{sorted(lora_targets(model))}")
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none")
    return get_peft_model(model, cfg)


def add_lora_from(model: nn.Module, settings: "LoraSettings", dropout: float | None = None) -> PeftModel:
    """``add_lora`` with a recipe's ``lora`` section (``targets`` "" = the backend's default set)."""
    targets = tuple(t.strip() for t in settings.targets.split(",") if t.strip()) or None
    return add_lora(model, settings.r, settings.alpha, settings.dropout if dropout is None else dropout, targets)


def load_adapter(base: nn.Module, adapter_dir: str | Path, trainable: bool = False) -> PeftModel:
    """Attach a saved peft adapter folder (adapter_config.json + adapter_model.safetensors)."""
    if not (Path(adapter_dir) / "adapter_config.json").exists():
        raise FileNotFoundError(f"{adapter_dir} is not a peft adapter folder (no adapter_config.json)")
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)


# model -> [(peft's saved key, parameter name, the parameter)], resolved once per model (adapter_tensors)
_BOUND: "weakref.WeakKeyDictionary[nn.Module, list[tuple[str, str, torch.Tensor]]]" = weakref.WeakKeyDictionary()


def adapter_tensors(model: PeftModel) -> dict[str, torch.Tensor]:
    """``get_peft_model_state_dict(model)``'s keys bound to the model's live parameters.

    peft resolves those keys by walking every module's state dict: 3.6 ms per call here, a third
    of what the async learner spent publishing each version (cProfile). The binding is
    resolved once; the optimizer steps in place, so the bound parameters stay the live ones. A
    parameter replaced since (another object under its name) makes it resolve again, and a key
    peft reads from anything but a parameter (a buffer, a copy) leaves peft to answer every time.
    """
    live = dict(model.named_parameters())
    bound = _BOUND.get(model)
    if bound is not None and all(live.get(name) is p for _, name, p in bound):
        return {key: p for key, _, p in bound}
    peft_state = get_peft_model_state_dict(model)
    by_storage = {(p.data_ptr(), tuple(p.shape)): name for name, p in live.items()}
    entries = []
    for key, t in peft_state.items():
        name = by_storage.get((t.data_ptr(), tuple(t.shape)))
        if name is None:
            _BOUND.pop(model, None)
            return peft_state
        entries.append((key, name, live[name]))
    _BOUND[model] = entries
    return {key: p for key, _, p in entries}


def save_adapter(model: PeftModel, directory: str | Path, dtype: torch.dtype | None = None,
                 base: dict[str, str] | None = None) -> Path:
    """Write the adapter as a standard peft folder (adapter_config.json + adapter_model.safetensors).

    The same two files ``PeftModel.save_pretrained`` writes, without the README model card it also
    renders (a Jinja template: ~60% of its time). The async learner publishes a version every update,
    so that card was a tenth of its wall clock. ``load_adapter``/``PeftModel.from_pretrained`` read it.
    ``dtype`` (e.g. ``torch.bfloat16``) casts the tensors as written: half the bytes to ship to
    samplers, which load them into their float32 LoRA layers; the behaviour log-probs they record
    are those of the rounded policy, and the learner's importance weight corrects for the difference.
    ``base`` (models.base.base_identity): the adapter records what it belongs to, as peft's
    ``base_model_name_or_path`` and in ``miles_base.json`` (name and the hash of the base's weights).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in adapter_tensors(model).items()}
    save_file(state, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if base:  # beside the weights, not in their header: safetensors orders header metadata arbitrarily
        (d / BASE_FILE).write_text(json.dumps({"name": base["name"], "sha256": base["sha256"]}, sort_keys=True))
    cfg = copy.deepcopy(model.peft_config["default"])
    cfg.inference_mode = True  # as save_pretrained stores it; load_adapter(trainable=True) overrides
    if base:
        cfg.base_model_name_or_path = base["name"]
    cfg.save_pretrained(str(d))
    return d


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
