"""The denoiser interface every backend implements, and checkpoint loading by model_type.

A denoiser maps a partially masked sequence to per-position logits; samplers, losses and the
SFT objective only ever call it through this interface, so the tiny built-in transformer and a
transformers Llama backbone are interchangeable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Union, runtime_checkable

import torch
from torch import Tensor, nn

from miles_core.config import ConfigError
from miles_core.models.family import LoadOptions
from miles_core.models.registry import family_for_checkpoint
from miles_core.tokenizer import PROMPT_PREFILL, CharTokenizer, prompt_question

if TYPE_CHECKING:
    from miles_core.config import RecipeConfig
    from miles_core.models.hf_tokenizer import HFTokenizer

# Either tokenizer has the same interface (encode/decode/encode_completion, special ids, save).
AnyTokenizer = Union[CharTokenizer, "HFTokenizer"]


@runtime_checkable
class Denoiser(Protocol):
    """logits = denoiser(input_ids [B, T] long, attention_mask [B, T] bool) -> [B, T, V] float."""

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...


def resolve_device(name: str) -> torch.device:
    """``model.device`` as a torch.device (``auto``: cuda when torch sees one, else cpu).

    A GPU asked for by name on a machine without one is an error naming the field, not a silent
    fall-back to a CPU run a hundred times slower. ``cpu`` never touches CUDA, so a process that
    forks workers later (the warm launcher) stays fork-safe."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={name!r}, but torch {torch.__version__} sees no CUDA device; "
                           "use model.device=cpu (or auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RuntimeError(f"model.device={name!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def local_model_dir(path: str | Path) -> Path:
    """``model.path`` as a local folder. A fsspec URI (``s3://bucket/models/llada``) is copied once
    into a cache (``MILES_MODEL_CACHE``, default ``~/.cache/miles/models``) keyed by the URI, and
    reused while its completion marker is there. The Hugging Face Hub is never contacted at run time:
    ``hf://`` is refused, download a model once and point model.path at the folder."""
    import hashlib
    import os
    import shutil

    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if text.startswith(("hf://", "hub://")):
        raise ConfigError(f"model.path={text!r}: Miles never downloads from the Hugging Face Hub at run time; "
                          "download the folder once (e.g. huggingface-cli download) and give its local path or an "
                          "s3:// copy")
    from miles_core.storage.uri import resolve

    fs, root = resolve(text)
    cache = Path(os.environ.get("MILES_MODEL_CACHE", Path.home() / ".cache" / "miles" / "models"))
    dest = cache / hashlib.sha256(text.encode()).hexdigest()[:16]
    if (dest / ".miles-complete").exists():
        return dest
    if not fs.exists(root + "/config.json"):
        raise FileNotFoundError(f"model.path={text!r}: no config.json there")
    tmp = Path(f"{dest}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in fs.find(root):
        rel = f[len(root):].lstrip("/")
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f, str(tmp / rel))
    (tmp / ".miles-complete").write_text(text)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def load_checkpoint(directory: str | Path, mask_token: str | None = None, family: str = "auto",
                    trust_remote_code: bool = False, dtype: str = "float32") -> tuple[nn.Module, AnyTokenizer]:
    """Load a base denoiser and its tokenizer from a folder through its family (models/registry.py:
    a Miles tiny checkpoint, a Hugging Face Llama run bidirectionally, a published diffusion family
    such as llada, dream, sdar, bidir_qwen3, or DiffusionGemma), by ``family`` or (``auto``) by
    config.json's model_type.

    ``mask_token`` only matters for a Llama whose tokenizer registers no mask token. ``remote_code``
    (an explicit opt-in with ``trust_remote_code``) runs the folder's own modeling code. ``dtype``
    (``model.dtype``): the weights of a Llama or a family (tiny checkpoints load as saved)."""
    d = local_model_dir(directory)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"checkpoint folder {d} has no config.json")
    fam = family_for_checkpoint(json.loads(cfg_path.read_text()), family, trust_remote_code, str(cfg_path))
    return fam.load(d, LoadOptions(mask_token=mask_token, dtype=dtype, trust_remote_code=trust_remote_code))


def load_base(cfg: "RecipeConfig", directory: str | Path) -> tuple[nn.Module, AnyTokenizer]:
    """:func:`load_checkpoint` with the recipe's model settings (mask token, family, remote-code
    opt-in) and its prompt template: the one way training, sampling, evaluation and serving load
    a base, so all of them encode prompts alike."""
    model, tok = load_checkpoint(directory, mask_token=cfg.model.mask_token or None, family=cfg.model.family,
                                 trust_remote_code=cfg.model.trust_remote_code, dtype=cfg.model.dtype)
    set_prompt_format(tok, cfg, directory)
    return model, tok


def set_prompt_format(tok: AnyTokenizer, cfg: "RecipeConfig", directory: str | Path) -> None:
    """The recipe's prompt template (and the task's prefill) on a loaded tokenizer."""
    if cfg.task.prompt_template != "plain":
        if not hasattr(tok, "hf") or not getattr(tok.hf, "chat_template", None):
            raise ConfigError(f"task.prompt_template={cfg.task.prompt_template!r}: the tokenizer of {directory} "
                              "has no chat template")
    if hasattr(tok, "prompt_prefill"):
        tok.prompt_template = cfg.task.prompt_template
        tok.prompt_prefill = prompt_prefill(cfg.task.name) if cfg.task.prompt_template == "chat" else ""
        tok.prompt_question = prompt_question(cfg.task.name) if cfg.task.prompt_template == "chat" else str


def prompt_prefill(task: str) -> str:
    """What a chat prompt of ``task`` ends with after the generation prompt (d1: ``<reasoning>``)."""
    return PROMPT_PREFILL.get(task, "")


def base_identity(directory: str | Path) -> dict[str, str]:
    """What an adapter belongs to: the base's name (its config's ``_name_or_path`` when that is a
    name, else the folder's), its hub id where the config records one, its folder, and the SHA-256
    of its weight files, so an adapter is never silently applied to another base and peft's
    ``AutoPeftModel…`` finds the base. Hashing reads every weight once (~1 GB/s); callers cache it."""
    import hashlib

    d = local_model_dir(directory)
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    recorded = str(cfg.get("_name_or_path") or "")
    local = not recorded or Path(recorded).exists() or recorded.startswith((".", "/"))
    name = d.name if local else recorded
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    out = {"name": name, "path": str(d.resolve()), "sha256": h.hexdigest()}
    if not local and recorded.count("/") == 1:  # "org/model": a hub id
        out["hub_id"] = recorded
    return out


def max_positions(model: nn.Module) -> int:
    """Positions a loaded denoiser can take (prompt + completion): the tiny model's ``max_len``,
    a transformers config's ``max_position_embeddings`` (its text config for a multimodal one);
    what serving and lm-eval check a request against before it reaches the model."""
    c = getattr(model.config, "text_config", model.config)
    return int(getattr(c, "max_len", None) or c.max_position_embeddings)


def save_checkpoint(model: nn.Module, tokenizer: AnyTokenizer, directory: str | Path) -> None:
    """Write model weights, config and tokenizer so ``load_checkpoint`` restores them exactly
    (a Llama-Diffusion model is written as a standard Hugging Face folder)."""
    model.save_pretrained(directory)  # type: ignore[operator]
    tokenizer.save(directory)
