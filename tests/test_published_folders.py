"""Folders Miles writes carry what the family's published folder carries for loading: a
generation_config.json (Dream's ``from_pretrained`` always reads one), the config fields the
official forward reads (SDAR's ``fuse_cross_entropy``, its ``bos_token_id``), ``torch_dtype`` equal to
the stored dtype, and the ``auto_map`` code files of the folder a checkpoint was loaded from (or no
``auto_map`` where there is no code). Checked in a fresh process that does not import Miles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.models.__main__ import init
from miles_core.models.base import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.e2e

FAMILIES = ("llada", "dream", "sdar", "bidir_qwen3")
CODE = {"AutoConfig": "configuration_fam.FamConfig", "AutoModel": "modeling_fam.FamModel"}

# What the official loaders read before any modeling code runs, read here with transformers alone.
OUTSIDE = r"""
import json, sys
from pathlib import Path
from safetensors import safe_open
from transformers import GenerationConfig

out = {}
for d in map(Path, sys.argv[1:]):
    cfg = json.loads((d / "config.json").read_text())
    gen = GenerationConfig.from_pretrained(str(d))
    with safe_open(str(d / "model.safetensors"), framework="pt") as fh:
        names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
        dtypes = sorted({names.get(fh.get_slice(k).get_dtype(), "?") for k in fh.keys()})
    code = sorted({v.split(".")[0] + ".py" for v in cfg.get("auto_map", {}).values()})
    out[d.name] = {"gen_eos": gen.eos_token_id, "torch_dtype": cfg.get("torch_dtype"), "stored": dtypes,
                   "fuse_cross_entropy": cfg.get("fuse_cross_entropy"), "bos": cfg.get("bos_token_id"),
                   "code_present": [(d / f).exists() for f in code], "auto_map": bool(cfg.get("auto_map"))}
assert not any(m.split(".")[0] in ("miles", "miles_core") for m in sys.modules)
print(json.dumps(out))
"""


def _outside(folders: list[Path]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-I", "-c", OUTSIDE, *map(str, folders)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per family: the tiny folder init writes, and a checkpoint Miles saved from it in bfloat16."""
    root = tmp_path_factory.mktemp("published")
    out = {}
    for fam in FAMILIES:
        out[fam] = Path(init(fam, str(root / fam), seed=2))
        model, tok = load_checkpoint(out[fam], dtype="bfloat16")
        save_checkpoint(model, tok, root / f"{fam}-saved")
        out[f"{fam}-saved"] = root / f"{fam}-saved"
    return out


def test_every_folder_opens_as_the_published_one_does(folders: dict[str, Path]) -> None:
    got = _outside(list(folders.values()))
    for name, info in got.items():
        assert info["gen_eos"] is not None, name                  # generation_config.json, readable
        stored = "bfloat16" if name.endswith("-saved") else "float32"
        assert info["stored"] == [stored] and info["torch_dtype"] == stored, (name, info)
        assert not info["auto_map"], name                          # no code here: no auto_map naming any
    for name in ("sdar", "sdar-saved"):
        assert got[name]["fuse_cross_entropy"] is True and got[name]["bos"] == 151643


def test_a_saved_checkpoint_carries_the_code_its_config_names(folders: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "with-code"
    src.mkdir()
    for f in folders["dream"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "auto_map": CODE}))
    for f in ("configuration_fam.py", "modeling_fam.py"):
        (src / f).write_text(f"# {f}: the family's own code, shipped with its checkpoints\n")
    model, tok = load_checkpoint(src)
    save_checkpoint(model, tok, tmp_path / "saved")
    info = _outside([tmp_path / "saved"])["saved"]
    assert info["auto_map"] and info["code_present"] == [True, True]
    assert (tmp_path / "saved" / "modeling_fam.py").read_text() == (src / "modeling_fam.py").read_text()
