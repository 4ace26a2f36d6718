"""``python -m miles_core.models``: write a tiny checkpoint in a family's published layout, or check one.

    python -m miles_core.models init --family llada OUT
    python -m miles_core.models check DIR [--family F]      (also: miles models check DIR)
"""

from __future__ import annotations

import argparse
import json

from miles_core.models.families import SPECS


def init(family: str, out: str, seed: int = 0) -> str:
    """A tiny random-init checkpoint of ``family`` in its published layout (bidir_llama: a plain
    Hugging Face Llama folder; tiny: Miles' own character model; diffusion_gemma: transformers' own
    DiffusionGemma class with the character tokenizer)."""
    if family == "bidir_llama":
        from miles_core.models.llama import init_checkpoint

        return str(init_checkpoint(out, seed=seed))
    if family == "tiny":
        import torch

        from miles_core.models.base import save_checkpoint
        from miles_core.models.tiny import TinyConfig, TinyDenoiser
        from miles_core.tokenizer import CharTokenizer

        torch.manual_seed(seed)
        tok = CharTokenizer()
        save_checkpoint(TinyDenoiser(TinyConfig(tok.vocab_size, 32, 1, 2, 64, 64)), tok, out)
        return out
    if family == "diffusion_gemma":  # canvas 24: the tiny recipe's completion length
        from miles_core.models.diffusion_gemma import write_tiny_checkpoint
        from miles_core.tokenizer import CharTokenizer

        return str(write_tiny_checkpoint(out, CharTokenizer(), canvas_length=24, seed=seed, hidden=32, heads=2))
    from miles_core.models.hf import init_tiny

    return str(init_tiny(family, out, seed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_core.models", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="write a tiny random-init checkpoint in a family's published layout")
    i.add_argument("out", help="output folder")
    i.add_argument("--family", required=True, choices=sorted([*SPECS, "bidir_llama", "tiny", "diffusion_gemma"]))
    i.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("check", help="load a checkpoint folder, print what it is, run one smoke forward")
    c.add_argument("dir")
    c.add_argument("--family", default="auto", choices=["auto", *sorted(SPECS), "bidir_llama", "tiny", "diffusion_gemma"])
    a = p.parse_args(argv)
    if a.command == "init":
        print(f"wrote {init(a.family, a.out, a.seed)}")
        return 0
    from miles_core.models.hf import check

    info = check(a.dir, a.family)
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k:<{width}}  {json.dumps(v) if isinstance(v, (list, bool)) else v}")
    return 0 if info["finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
