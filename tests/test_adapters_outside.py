"""What Miles trains works outside Miles: an adapter it saves attaches with plain peft to the
model a user loads from the base folder (``PeftModel.from_pretrained`` on the Auto class, and
``AutoPeftModelForCausalLM`` from the adapter folder alone), in a fresh process that does not
import Miles, and gives Miles' policy logits. For the families whose published class is remote
code (LLaDA, Dream, SDAR: it cannot ship with Miles), every adapter module is a module of the
published tensor names with the matching shape. Miles reads both its new and its old layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_core.models.__main__ import init
from miles_core.models.base import base_identity, load_checkpoint, save_checkpoint
from miles_core.models.hf import read_tensors
from miles_core.models.lora import ADAPTER_WEIGHTS, add_lora, load_adapter, save_adapter

pytestmark = pytest.mark.e2e

# family -> (the transformers class a user loads the base folder with, runs it bidirectionally)
OUTSIDE_CLASS = {"bidir_qwen3": ("AutoModelForCausalLM", True), "bidir_llama": ("AutoModelForCausalLM", True),
                 "modernbert": ("AutoModelForMaskedLM", False)}
REMOTE = ("llada", "dream", "sdar")

OUTSIDE = r"""
import json, sys, warnings
import torch, transformers
from peft import AutoPeftModelForCausalLM, PeftModel
base_dir, adapter_dir, cls, bidir, ids = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", json.loads(sys.argv[5])
kw = {"is_causal": False} if bidir else {}
x = torch.tensor([ids])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    base = getattr(transformers, cls).from_pretrained(base_dir, local_files_only=True).eval()
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    out = {"peft": model(input_ids=x, **kw).logits[0].tolist()}
    if cls == "AutoModelForCausalLM":
        auto = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, local_files_only=True).eval()
        out["auto"] = auto(input_ids=x, **kw).logits[0].tolist()
out["warnings"] = [str(w.message)[:200] for w in caught if "adapter" in str(w.message).lower()]
out["miles_imported"] = any(m.split(".")[0] in ("miles", "miles_core") for m in sys.modules)
print(json.dumps(out))
"""


def _trained(family: str, root: Path) -> tuple[Path, Path, list[int], torch.Tensor, torch.nn.Module]:
    """A tiny base in the family's published layout, saved again by Miles (as SFT saves the base an
    RL run starts from), a LoRA with every tensor drawn at random (not zero: an adapter that is not
    attached must show), saved as Miles saves it; Miles' logits."""
    first, tok = load_checkpoint(init(family, str(root / family / "init"), seed=3))
    base_dir = root / family / "base"
    save_checkpoint(first, tok, base_dir)
    base, tok = load_checkpoint(base_dir)
    model = add_lora(base, r=4, alpha=8)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = save_adapter(model, root / family / "adapter", base=base_identity(base_dir))
    ids = tok.encode("12+3=") + [tok.mask_id] * 4
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    return base_dir, adapter, ids, logits, model


@pytest.mark.parametrize("family", sorted(OUTSIDE_CLASS))
def test_plain_peft_attaches_the_adapter_in_a_fresh_process(family: str, tmp_path: Path) -> None:
    base_dir, adapter, ids, logits, _ = _trained(family, tmp_path)
    cls, bidir = OUTSIDE_CLASS[family]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-I", "-c", OUTSIDE, str(base_dir), str(adapter), cls, "1" if bidir else "0",
                          json.dumps(ids)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out["miles_imported"] and out["warnings"] == [], out["warnings"]
    for how in ("peft", "auto") if cls == "AutoModelForCausalLM" else ("peft",):
        got = torch.tensor(out[how])
        assert torch.allclose(got, logits, atol=1e-5), (how, (got - logits).abs().max())
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base_dir.resolve())
    assert cfg["task_type"] == ("CAUSAL_LM" if cls == "AutoModelForCausalLM" else None)


@pytest.mark.parametrize("family", REMOTE)
def test_remote_code_families_adapters_name_published_modules(family: str, tmp_path: Path) -> None:
    """The published class (remote code) builds its modules from the published tensor names, so
    each adapter module must be one of them, with the LoRA shapes its weight implies."""
    base_dir, adapter, _, _, _ = _trained(family, tmp_path)
    published = read_tensors(base_dir)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    state = load_file(str(adapter / ADAPTER_WEIGHTS))
    assert cfg["target_modules"] and all(f"{m}.weight" in published for m in cfg["target_modules"])
    r = cfg["r"]
    for key, t in state.items():
        path, kind = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        w = published[path + ".weight"]
        assert tuple(t.shape) == ((r, w.shape[1]) if kind.startswith("A") else (w.shape[0], r)), key
    if family == "llada":  # ff_out is both the MLP's down projection and the LM head: only the former
        assert "model.transformer.ff_out" not in cfg["target_modules"]
        assert any(".blocks.0.ff_out" in m for m in cfg["target_modules"])


@pytest.mark.parametrize("family", ["llada", "bidir_qwen3", "modernbert", "tiny"])
def test_miles_reads_its_adapters_in_both_layouts(family: str, tmp_path: Path) -> None:
    base_dir, adapter, ids, logits, model = _trained(family, tmp_path)
    x = torch.tensor([ids])
    for trainable in (False, True):
        again = load_adapter(load_checkpoint(base_dir)[0], adapter, trainable=trainable)
        assert torch.allclose(again(x)[0], logits, atol=1e-6)
        assert any(p.requires_grad for p in again.parameters()) == trainable
    if family == "tiny":
        return
    old = tmp_path / "old"  # the layout Miles wrote before: peft's keys of its wrapper, short targets
    old.mkdir()
    from peft import get_peft_model_state_dict

    save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}, str(old / ADAPTER_WEIGHTS))
    model.peft_config["default"].save_pretrained(str(old))
    assert any(k.startswith("base_model.model.lm.") for k in load_file(str(old / ADAPTER_WEIGHTS)))
    assert torch.allclose(load_adapter(load_checkpoint(base_dir)[0], old)(x)[0], logits, atol=1e-6)


# ---- miles export: the adapter merged into its base, a folder the outside class loads ------------


@pytest.mark.parametrize("family", ["bidir_qwen3", "modernbert", "llada", "tiny"])
def test_export_round_trip(family: str, tmp_path: Path) -> None:
    """Export, then load the folder with Miles (every family) and with the outside class in a fresh
    process (where transformers has one): the logits are the trained policy's."""
    from miles.cli import main

    base_dir, adapter, ids, logits, _ = _trained(family, tmp_path)
    out = tmp_path / "exported"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft's base-rename warning misled: none is raised
        assert main(["export", str(adapter), str(out)]) == 0  # the base from base_model_name_or_path
    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes  # safetensors alone writes 0600
    merged, _ = load_checkpoint(out)
    with torch.no_grad():
        assert torch.allclose(merged(torch.tensor([ids]))[0], logits, atol=1e-5)
    card = (out / "README.md").read_text()
    assert "merged" in card and base_identity(base_dir)["sha256"][:16] in card
    # the card's library is the one that loads the folder: transformers for the published families
    # (a config class or auto_map), Miles for its own toy family
    assert "library_name: transformers" in card
    assert not (out / ADAPTER_WEIGHTS).exists() and "lora_" not in json.dumps(list(read_or_empty(out)))
    if family in EXPORT_OUTSIDE:
        cls, bidir = EXPORT_OUTSIDE[family]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        res = subprocess.run([sys.executable, "-I", "-c", EXPORT_CHILD, str(out), cls, "1" if bidir else "0",
                              json.dumps(ids), "1" if family == "tiny" else "0"],
                             capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        child = json.loads(res.stdout.strip().splitlines()[-1])
        got = torch.tensor(child["logits"])
        assert torch.allclose(got, logits, atol=1e-5), (got - logits).abs().max()
        assert not child["miles_imported"]
        if family == "tiny":  # AutoTokenizer reads the folder's tokenizer and encodes as Miles does
            tok = load_checkpoint(out)[1]
            assert child["ids"] == [tok.encode(p) for p in PROMPTS] and child["decoded"] == PROMPTS[0]


# The tiny family's export opens with transformers' Auto classes through the remote code its folder
# carries (modeling_miles_tiny.py, named in config.json's auto_map), where Miles is not installed.
EXPORT_OUTSIDE = {**OUTSIDE_CLASS, "tiny": ("AutoModel", False)}
PROMPTS = ["12+3=", "7*(2-5)\n"]
EXPORT_CHILD = r"""
import json, sys, torch, transformers
m = getattr(transformers, sys.argv[2]).from_pretrained(sys.argv[1], local_files_only=True, trust_remote_code=True).eval()
kw = {'is_causal': False} if sys.argv[3] == '1' else {}
with torch.no_grad():
    out = {"logits": m(input_ids=torch.tensor([json.loads(sys.argv[4])]), **kw).logits[0].tolist()}
if sys.argv[5] == "1":
    tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True, trust_remote_code=True)
    out["ids"] = [tok(p)["input_ids"] for p in %r]
    out["decoded"] = tok.decode(out["ids"][0])
out["miles_imported"] = any(k.split(".")[0] in ("miles", "miles_core") for k in sys.modules)
print(json.dumps(out))
""" % PROMPTS


def read_or_empty(d: Path) -> list[str]:
    """Tensor names of a folder's safetensors (none for a Miles tiny folder written otherwise)."""
    try:
        return sorted(read_tensors(d))
    except FileNotFoundError:
        return []


def test_export_refuses_another_base_and_a_used_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from miles.cli import main

    _, adapter, _, _, _ = _trained("bidir_qwen3", tmp_path)
    other = Path(init("bidir_qwen3", str(tmp_path / "other"), seed=9))
    assert main(["export", str(adapter), str(tmp_path / "x"), "--base", str(other)]) == 2
    assert "was trained on base" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    assert main(["export", str(adapter), str(tmp_path / "used")]) == 2
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"


MERGE_OUTSIDE = r"""
import json, sys, warnings
import torch
from peft import PeftModel
from transformers import DiffusionGemmaForBlockDiffusion

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(sys.argv[1], local_files_only=True).eval()
    merged = PeftModel.from_pretrained(base, sys.argv[2]).merge_and_unload()
torch.save({k: v.clone() for k, v in merged.state_dict().items()}, sys.argv[3])  # the encoder shares the base
print(json.dumps({"warnings": [str(w.message)[:200] for w in caught if "adapter" in str(w.message).lower()],
                  "miles_imported": any(m.split(".")[0] in ("miles", "miles_core") for m in sys.modules)}))
"""


def test_diffusion_gemma_adapters_attach_to_transformers_own_class(tmp_path: Path) -> None:
    """DiffusionGemma runs as transformers' own class in Miles too: plain peft in a fresh process
    attaches every adapter tensor, and the merged weights are Miles' merged policy's."""
    base_dir, adapter, _, _, model = _trained("diffusion_gemma", tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-I", "-c", MERGE_OUTSIDE, str(base_dir), str(adapter),
                          str(tmp_path / "merged.pt")], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["warnings"] == [] and not out["miles_imported"]
    outside = torch.load(tmp_path / "merged.pt", weights_only=True)
    mine = {k: v for k, v in model.merge_and_unload().state_dict().items()}
    changed = [k for k in mine if not torch.equal(mine[k], load_checkpoint(base_dir)[0].state_dict()[k])]
    assert changed, "the adapter changed nothing: the comparison would prove nothing"
    for k, v in mine.items():
        assert torch.allclose(outside[k], v, atol=1e-6), k
