"""LoRA through peft: only adapter tensors train, the base stays frozen, and the reference
policy for KL is the same model with the adapter disabled (no second copy of the weights)."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from miles_core.models.checkpoint import load_tensors, record_digest, save_tensors
from miles_core.models.registry import family_of
from miles_core.models.window import capabilities

if TYPE_CHECKING:
    from miles_core.config import LoraSettings

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the tensors of a peft adapter folder
BASE_FILE = "miles_base.json"                  # what the adapter belongs to: the base's name and weight hash


def lora_targets(model: nn.Module) -> tuple[str, ...] | str:
    """The LoRA targets the base's family picks (models/registry.py): module names, or one
    full-match regex where names are ambiguous (DiffusionGemma's decoder, beside a tied encoder)."""
    return family_of(model).lora_targets(model)


def add_lora(model: nn.Module, r: int = 16, alpha: int = 32, dropout: float = 0.0,
             targets: tuple[str, ...] | None = None) -> PeftModel:
    """Wrap a base denoiser with a fresh LoRA adapter (B initialised to zero: output unchanged).

    ``targets=None`` picks the family's attention/MLP projections (:func:`lora_targets`); a
    family's regex (DiffusionGemma's decoder only) goes to peft as it is.
    """
    if targets is None and isinstance(regex := lora_targets(model), str):
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                target_modules=regex, bias="none"))
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
    """Attach a saved peft adapter folder (adapter_config.json + adapter_model.safetensors) to a
    base Miles loaded. Reads both layouts: the published one :func:`save_adapter` writes (module
    paths of the class a user loads from the base folder) and the older one, keyed by Miles'
    wrapper (``base_model.model.lm.…``), which peft attaches to the wrapper directly."""
    d = Path(adapter_dir)
    if not (d / "adapter_config.json").exists():
        raise FileNotFoundError(f"{adapter_dir} is not a peft adapter folder (no adapter_config.json)")
    state = load_tensors(d / ADAPTER_WEIGHTS)
    to_outside, to_inside = module_paths(base)
    if to_outside is None or _wrapper_layout(state):
        return PeftModel.from_pretrained(base, str(d), is_trainable=trainable)
    native = _rekey(state, to_inside, str(d))
    cfg = LoraConfig.from_pretrained(str(d))
    cfg.target_modules = sorted(set(_paths(native)))
    cfg.task_type, cfg.inference_mode = None, not trainable
    # the adapter goes onto the base loaded here (its identity is checked by sha256 where it matters:
    # models/export.py), so the config names that base, as peft would, without peft's rename warning
    cfg.base_model_name_or_path = base.__dict__.get("name_or_path") or None
    model = get_peft_model(base, cfg)
    result = set_peft_model_state_dict(model, native)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{d}: the adapter does not fit this base: unexpected {result.unexpected_keys[:4]}, "
                         f"missing {missing[:4]}")
    if not trainable:
        for p in model.parameters():
            p.requires_grad_(False)
    return model


_LORA_KEY = re.compile(r"^base_model\.model\.(.+)\.(lora_[AB]\.weight|lora_embedding_[AB])$")
Paths = Callable[[str], "str | None"]


def module_paths(base: nn.Module) -> tuple[Paths | None, Paths | None]:
    """(Miles' module path -> the published class's, and back) for a base Miles wraps; (None,
    None) where Miles runs the published class itself (tiny, DiffusionGemma). A family's wrapper
    (models/hf.py, llama.py) holds the native transformers model as ``lm``, and a family with
    renamed tensors (LLaDA's ``model.transformer.blocks.N.…``) maps names as its checkpoints do."""
    caps = capabilities(base)
    if not caps.wraps_lm:
        return None, None
    to_published, to_native = caps.to_published, caps.to_native

    def outside(path: str) -> str | None:
        if not path.startswith("lm."):
            return None
        if to_published is None:
            return path[3:]
        name = to_published(path[3:] + ".weight")
        return None if name is None else name.rsplit(".", 1)[0]

    def inside(path: str) -> str | None:
        if to_native is None:
            return "lm." + path
        name = to_native(path + ".weight")
        return None if name is None else "lm." + name.rsplit(".", 1)[0]
    return outside, inside


def _paths(state: dict[str, torch.Tensor]) -> list[str]:
    out = []
    for k in state:
        m = _LORA_KEY.match(k)
        if m is None:
            raise ValueError(f"adapter tensor {k!r} is not a LoRA tensor of peft's layout")
        out.append(m.group(1))
    return out


def _wrapper_layout(state: dict[str, torch.Tensor]) -> bool:
    """Keyed by Miles' wrapper (``base_model.model.lm.…``): the layout Miles wrote before."""
    return any(k.startswith("base_model.model.lm.") for k in state)


def _rekey(state: dict[str, torch.Tensor], move: Paths, where: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        m = _LORA_KEY.match(k)
        path = move(m.group(1)) if m else None
        if path is None:
            raise ValueError(f"{where}: adapter tensor {k!r} has no module in the other layout")
        out[f"base_model.model.{path}.{m.group(2)}"] = v
    return out


def native_adapter_state(base: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter's tensors as :func:`save_adapter` wrote them (the published class's keys) ->
    peft's keys on ``base`` as Miles wraps it; keys already in Miles' layout pass unchanged."""
    _, to_inside = module_paths(base)
    if to_inside is None or _wrapper_layout(state):
        return state
    return _rekey(state, to_inside, "load_adapter")


# model -> [(peft's saved key, parameter name, the parameter)], resolved once per model (adapter_tensors)
_BOUND: "weakref.WeakKeyDictionary[nn.Module, list[tuple[str, str, torch.Tensor]]]" = weakref.WeakKeyDictionary()


def _storage(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Where a tensor's values live and its shape; a DTensor (FSDP2) by its local shard's storage."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.data_ptr(), tuple(t.shape)


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
    by_storage = {_storage(p): name for name, p in live.items()}
    entries = []
    for key, t in peft_state.items():
        name = by_storage.get(_storage(t))
        if name is None:
            _BOUND.pop(model, None)
            return peft_state
        entries.append((key, name, live[name]))
    _BOUND[model] = entries
    return {key: p for key, _, p in entries}


def save_adapter(model: PeftModel, directory: str | Path, dtype: torch.dtype | None = None,
                 base: dict[str, str] | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter as the peft folder a user attaches to the published model.

    The same two files ``PeftModel.save_pretrained`` writes (adapter_config.json +
    adapter_model.safetensors), without the README model card it also renders (a Jinja template:
    ~60% of its time; the async learner publishes a version every update). Keys and
    ``target_modules`` are those of the class a user loads from the base folder (the wrapper's
    ``lm.`` and Miles' native names become the published module paths, :func:`module_paths`), so
    ``PeftModel.from_pretrained(AutoModelFor…(base), directory)`` attaches every tensor;
    ``task_type`` is set where an Auto class fits (``CAUSAL_LM`` for the Llama/Qwen families), so
    ``AutoPeftModelForCausalLM.from_pretrained(directory)`` loads the base from
    ``base_model_name_or_path`` (the base's hub id when its config records one, else its folder).
    ``dtype`` (e.g. ``torch.bfloat16``) casts the tensors as written: half the bytes to ship to
    samplers, which load them into their float32 LoRA layers; the behaviour log-probs they record
    are those of the rounded policy, and the learner's importance weight corrects for the difference.
    ``base`` (models.base.base_identity) is also written to ``miles_base.json`` (name, path and the
    hash of the base's weights), which Miles checks before applying the adapter. ``tensors``: the
    adapter's tensors under ``adapter_tensors``' keys when the model's own are shards (FSDP2).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    inner = model.base_model.model
    to_outside, _ = module_paths(inner)
    tensors = adapter_tensors(model) if tensors is None else tensors
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in tensors.items()}
    if to_outside is not None:  # the keys of the class a user loads from the base folder
        state = _rekey(state, to_outside, "save_adapter")
    save_tensors(state, d / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    record_digest(d / ADAPTER_WEIGHTS)
    if base:  # beside the weights, not in their header: safetensors orders header metadata arbitrarily
        (d / BASE_FILE).write_text(json.dumps(base, sort_keys=True))
    cfg = copy.deepcopy(model.peft_config["default"])
    cfg.inference_mode = True  # as save_pretrained stores it; load_adapter(trainable=True) overrides
    if to_outside is not None:
        cfg.target_modules = sorted(set(_paths(state)))  # exact module paths: LLaDA's ff_out is also its head
        cfg.task_type = "CAUSAL_LM" if capabilities(model).native in ("llama", "qwen2", "qwen3") else None
    if base:
        cfg.base_model_name_or_path = base.get("hub_id") or base.get("path") or base["name"]
    cfg.save_pretrained(str(d))
    return d


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def reference_policy(model: nn.Module) -> Iterator[nn.Module]:
    """Context in which ``model`` computes the reference (adapter-off) policy."""
    if isinstance(model, PeftModel):
        with model.disable_adapter():
            yield model
    else:
        yield model
