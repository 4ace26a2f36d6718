"""Save/load a module as ``config.json`` + ``model.safetensors``: one implementation shared by
every built-in backend, so checkpoint checks and error messages are the same everywhere.

Tensor files Miles writes get their sha256 in ``miles_sha256.json`` beside them, checked when they
are read back (:func:`load_tensors`): a truncated or altered file is an error naming the file and
both digests, not safetensors' "invalid header length" naming nothing. A folder without the record
(a published checkpoint, an adapter from elsewhere) is read unchecked, still naming the file on error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from miles_core.storage.adapters import sha256_file

M = TypeVar("M", bound=nn.Module)
DIGESTS = "miles_sha256.json"


def save_tensors(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, readable as the folder's other files are: safetensors creates
    its file owner-only (0600) whatever the umask, so a folder a user shares or serves from another
    account would hold one file nobody else can read."""
    save_file(state, str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def record_digest(path: str | Path) -> None:
    """Add ``path``'s sha256 to its folder's ``miles_sha256.json``."""
    path = Path(path)
    book = path.parent / DIGESTS
    digests = json.loads(book.read_text()) if book.exists() else {}
    digests[path.name] = sha256_file(path)
    book.write_text(json.dumps(digests, indent=1, sort_keys=True))


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file``, checked against the recorded sha256 when the folder has one."""
    path = Path(path)
    book = path.parent / DIGESTS
    want = json.loads(book.read_text()).get(path.name) if book.exists() else None
    if want is not None and (got := sha256_file(path)) != want:
        raise ValueError(f"{path}: sha256 {got[:16]}… does not match the {want[:16]}… recorded in {book.name} "
                         "when it was written (the file is corrupted or was changed)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def save_module(module: nn.Module, config: dict[str, Any], directory: str | Path) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    save_tensors({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}, d / "model.safetensors")
    record_digest(d / "model.safetensors")


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
    model.load_state_dict(load_tensors(d / "model.safetensors"))
    return model
