"""Published diffusion-LM families (models/families.py, models/hf.py): tiny random-init checkpoints in
each family's published layout load through the user's path, match an independent forward written
from the published tensors and the papers' math, keep their attention pattern, logit shift and
batch invariance, and a checkpoint that does not map completely is an error naming the tensors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from miles_core.algo.update import as_draws
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from miles_core.config import ConfigError
from miles_core.models.base import load_checkpoint
from miles_core.models.hf import HFDiffusion, init_tiny, load_family, read_tensors

pytestmark = pytest.mark.slow

FAMILIES = ("llada", "dream", "sdar", "bidir_qwen3", "modernbert")
WRITTEN_OUT = ("llada", "dream", "sdar", "bidir_qwen3")  # families the independent reference forward covers


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: init_tiny(f, root / f, seed=1) for f in FAMILIES}


def test_published_layouts(ckpts: dict[str, Path]) -> None:
    llada = json.loads((ckpts["llada"] / "config.json").read_text())
    assert llada["model_type"] == "llada" and llada["architectures"] == ["LLaDAModelLM"]
    assert {"d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "embedding_size", "weight_tying",
            "mask_token_id"} <= set(llada)
    keys = set(read_tensors(ckpts["llada"]))
    assert {"model.transformer.wte.weight", "model.transformer.blocks.0.ff_proj.weight",
            "model.transformer.blocks.1.attn_out.weight", "model.transformer.ln_f.weight",
            "model.transformer.ff_out.weight"} <= keys
    assert not any(k.startswith("model.layers.") for k in keys)
    assert json.loads((ckpts["dream"] / "config.json").read_text())["model_type"] == "Dream"
    assert "model.layers.0.self_attn.q_proj.bias" in read_tensors(ckpts["dream"])
    sdar = json.loads((ckpts["sdar"] / "config.json").read_text())
    assert (sdar["model_type"], sdar["block_size"], sdar["mask_token_id"]) == ("sdar", 4, 151669)
    assert "model.layers.0.self_attn.q_norm.weight" in read_tensors(ckpts["sdar"])


@pytest.mark.parametrize("family,ids", [("llada", {"mask": 126336, "eos": 126081}),
                                        ("dream", {"mask": 151666, "eos": 151643}),
                                        ("sdar", {"mask": 151669, "eos": 151643}),
                                        ("bidir_qwen3", {"mask": 151669, "eos": 151643}),
                                        ("modernbert", {"mask": 50284, "eos": 50282})])
def test_special_tokens_sit_at_their_published_ids(ckpts: dict[str, Path], family: str, ids: dict) -> None:
    model, tok = load_checkpoint(ckpts[family])
    assert isinstance(model, HFDiffusion) and model.spec.name == family
    assert (tok.mask_id, tok.eos_id) == (ids["mask"], ids["eos"])
    assert tok.decode(tok.encode("12+7*3")) == "12+7*3"
    if family == "llada":
        assert tok.hf.convert_tokens_to_ids("<|eot_id|>") == 126348
        chat = tok.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert chat.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding over the full head, rotate_half convention ([T, H, D])."""
    T, _, D = x.shape
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(d: Path, ids: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """A forward pass written from the published tensor names and each family's published math
    (LLaDA: ff_out(silu(ff_proj h) * up_proj h); Qwen2 q/k/v biases; Qwen3 q/k norms), independent
    of transformers. ``allowed``: [T, T] bool attention pattern. Returns [T, V]."""
    cfg, t = json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))
    if cfg["model_type"] == "llada":
        H, KV, L, eps, theta = cfg["n_heads"], cfg["n_kv_heads"], cfg["n_layers"], cfg["rms_norm_eps"], cfg["rope_theta"]
        p = "model.transformer."
        emb, head, norm = t[p + "wte.weight"], t[p + "ff_out.weight"], t[p + "ln_f.weight"]
        names = lambda i: {k: f"{p}blocks.{i}.{v}" for k, v in dict(  # noqa: E731
            n1="attn_norm", q="q_proj", k="k_proj", v="v_proj", o="attn_out", n2="ff_norm", g="ff_proj",
            u="up_proj", dn="ff_out").items()}
    else:
        H, KV, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
        eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        emb, head, norm = t["model.embed_tokens.weight"], t["lm_head.weight"], t["model.norm.weight"]
        names = lambda i: {k: f"model.layers.{i}.{v}" for k, v in dict(  # noqa: E731
            n1="input_layernorm", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
            o="self_attn.o_proj", n2="post_attention_layernorm", g="mlp.gate_proj", u="mlp.up_proj",
            dn="mlp.down_proj", qn="self_attn.q_norm", kn="self_attn.k_norm").items()}
    lin = lambda x, n: x @ t[n + ".weight"].T + (t[n + ".bias"] if n + ".bias" in t else 0)  # noqa: E731
    x = emb[torch.tensor(ids)]
    T = len(ids)
    for i in range(L):
        n = names(i)
        h = _rms(x, t[n["n1"] + ".weight"], eps)
        q, k, v = lin(h, n["q"]).view(T, H, -1), lin(h, n["k"]).view(T, KV, -1), lin(h, n["v"]).view(T, KV, -1)
        if "qn" in n and n["qn"] + ".weight" in t:
            q, k = _rms(q, t[n["qn"] + ".weight"], eps), _rms(k, t[n["kn"] + ".weight"], eps)
        q, k = _rope(q, theta), _rope(k, theta)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
        a = torch.einsum("hts,shd->thd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v).reshape(T, -1)
        x = x + lin(a, n["o"])
        h = _rms(x, t[n["n2"] + ".weight"], eps)
        x = x + lin(F.silu(lin(h, n["g"])) * lin(h, n["u"]), n["dn"])
    logits = _rms(x, norm, eps) @ head.T
    if cfg["model_type"] == "Dream":  # generation_utils._sample: logits = cat([logits[:, :1], logits[:, :-1]])
        logits = torch.cat([logits[:1], logits[:-1]], 0)
    return logits


def sdar_mask(T: int, block: int) -> torch.Tensor:
    """JetAstra/SDAR generate.py: tril(ones(nb, nb)) repeated block_length times on both axes."""
    nb = (T + block - 1) // block
    return torch.tril(torch.ones(nb, nb)).repeat_interleave(block, 0).repeat_interleave(block, 1)[:T, :T].bool()


@pytest.mark.parametrize("family", WRITTEN_OUT)
def test_parity_with_a_forward_from_the_published_tensors(ckpts: dict[str, Path], family: str) -> None:
    model, tok = load_family(ckpts[family])
    ids = tok.encode("3+4*5=") + [tok.mask_id] * 5
    allowed = sdar_mask(len(ids), 4) if family == "sdar" else torch.ones(len(ids), len(ids), dtype=torch.bool)
    with torch.no_grad():
        got = model(torch.tensor([ids]))[0]
    want = reference_logits(ckpts[family], ids, allowed)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("family,cls", [("bidir_qwen3", "Qwen3ForCausalLM"), ("modernbert", "ModernBertForMaskedLM")])
def test_parity_with_the_native_class(ckpts: dict[str, Path], family: str, cls: str) -> None:
    """bidir_qwen3's and modernbert's tensors are the native classes' own: transformers'
    class, loaded from the same folder by from_pretrained (bidirectional), gives the same logits."""
    import transformers

    model, tok = load_family(ckpts[family])
    native = getattr(transformers, cls).from_pretrained(str(ckpts[family]), local_files_only=True).eval()
    ids = torch.tensor([tok.encode("9-2=") + [tok.mask_id] * 3])
    kw = {"is_causal": False} if family == "bidir_qwen3" else {}
    with torch.no_grad():
        assert torch.allclose(model(ids), native(input_ids=ids, **kw).logits, atol=1e-5)


def test_block_causal_attention(ckpts: dict[str, Path]) -> None:
    model, tok = load_family(ckpts["sdar"])
    ids = torch.tensor([tok.encode("12+34=") + [tok.mask_id] * 6])                 # 12 positions, 3 blocks
    with torch.no_grad():
        base = model(ids)
        later = ids.clone()
        later[0, 9] = tok.encode("7")[0]                                           # block 2 changes
        out = model(later)
        assert torch.allclose(out[0, :8], base[0, :8], atol=1e-6)                  # blocks 0-1 unchanged
        assert not torch.allclose(out[0, 8], base[0, 8], atol=1e-4)                # same block: it sees it
        first = ids.clone()
        first[0, 3] = tok.encode("9")[0]                                           # last of block 0
        assert not torch.allclose(model(first)[0, 0], base[0, 0], atol=1e-4)       # inside a block: both ways


def test_full_attention_sees_later_positions(ckpts: dict[str, Path]) -> None:
    for fam in ("llada", "bidir_qwen3", "modernbert"):
        model, tok = load_family(ckpts[fam])
        ids = torch.tensor([tok.encode("12+34=") + [tok.mask_id] * 4])
        later = ids.clone()
        later[0, -1] = tok.encode("5")[0]
        with torch.no_grad():
            assert not torch.allclose(model(ids)[0, 0], model(later)[0, 0], atol=1e-4), fam


def test_dream_shifts_logits_by_one(ckpts: dict[str, Path]) -> None:
    model, tok = load_family(ckpts["dream"])
    ids = torch.tensor([tok.encode("5*6=") + [tok.mask_id] * 3])
    with torch.no_grad():
        shifted = model(ids)
        raw = model.lm(input_ids=ids, is_causal=False).logits
    assert torch.equal(shifted[0, 1:], raw[0, :-1]) and torch.equal(shifted[0, 0], raw[0, 0])


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariance_with_mixed_prompt_lengths(ckpts: dict[str, Path], family: str) -> None:
    model, tok = load_family(ckpts[family])
    rows = [tok.encode(p) + [tok.mask_id] * 4 for p in ("1+2=", "123+456*7=", "9=")]
    T = max(map(len, rows))
    ids = torch.tensor([[tok.pad_id] * (T - len(r)) + r for r in rows])            # left padding
    mask = torch.tensor([[False] * (T - len(r)) + [True] * len(r) for r in rows])
    with torch.no_grad():
        batched = model(ids, mask)
        for b, r in enumerate(rows):
            alone = model(torch.tensor([r]))[0]
            assert torch.allclose(batched[b, T - len(r):], alone, atol=1e-5), (family, b)


def test_save_writes_the_published_layout_back(ckpts: dict[str, Path], tmp_path: Path) -> None:
    model, tok = load_family(ckpts["llada"])
    model.save_pretrained(tmp_path)
    tok.save(tmp_path)
    assert set(read_tensors(tmp_path)) == set(read_tensors(ckpts["llada"]))
    again, _ = load_checkpoint(tmp_path)
    ids = torch.tensor([tok.encode("1+1=") + [tok.mask_id] * 2])
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def test_incomplete_checkpoints_name_the_tensor(ckpts: dict[str, Path], tmp_path: Path) -> None:
    up = "model.transformer.blocks.1.up_proj.weight"
    missing = _broken(ckpts["llada"], tmp_path / "missing", lambda t: t.pop(up))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_family(missing)
    extra = _broken(ckpts["llada"], tmp_path / "extra", lambda t: t.__setitem__("model.transformer.extra.weight",
                                                                                  torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unmapped tensors \['model.transformer.extra.weight'\]"):
        load_family(extra)
    renamed = _broken(ckpts["sdar"], tmp_path / "renamed", lambda t: t.__setitem__(
        "model.layers.0.self_attn.qnorm.weight", t.pop("model.layers.0.self_attn.q_norm.weight")))
    with pytest.raises(ValueError, match=r"unmapped tensors \['model.layers.0.self_attn.qnorm.weight'\].*"
                                         r"missing tensors \['model.layers.0.self_attn.q_norm.weight'\]"):
        load_family(renamed)
    shape = _broken(ckpts["dream"], tmp_path / "shape", lambda t: t.__setitem__(
        "model.norm.weight", torch.ones(7)))
    with pytest.raises(ValueError, match=r"wrong shapes \['model.norm.weight: \(7,\) in the file"):
        load_family(shape)


def test_unsupported_config_and_unknown_family_are_named(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "alibi"
    shutil.copytree(ckpts["llada"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "alibi": True}))
    with pytest.raises(ConfigError, match="alibi=True is not supported"):
        load_family(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not a known diffusion family"):
        load_family(bad)


def test_models_check_cli(ckpts: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    from miles.cli import main

    assert main(["models", "check", str(ckpts["sdar"])]) == 0
    out = capsys.readouterr().out
    assert "sdar" in out and "block-causal, block 4" in out and "151669" in out and "finite         true" in out


CONFIG_PY = '''
from transformers import PretrainedConfig


class ToyDLMConfig(PretrainedConfig):
    model_type = "toy-dlm"

    def __init__(self, vocab_size=128, hidden=16, mask_token_id=None, **kw):
        self.vocab_size, self.hidden, self.mask_token_id = vocab_size, hidden, mask_token_id
        super().__init__(**kw)
'''
MODELING_PY = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_toy import ToyDLMConfig


class ToyDLM(PreTrainedModel):
    """Bag-of-context denoiser: every position sees the mean of the attended embeddings."""
    config_class = ToyDLMConfig

    def __init__(self, config):
        super().__init__(config)
        self.emb = torch.nn.Embedding(config.vocab_size, config.hidden)
        self.out = torch.nn.Linear(2 * config.hidden, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kw):
        e = self.emb(input_ids)
        m = attention_mask[..., None].float()
        ctx = (e * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
        return MaskedLMOutput(logits=self.out(torch.cat([e, ctx.expand_as(e)], -1)))
'''


def test_remote_code_is_an_explicit_opt_in(tmp_path: Path) -> None:
    """A folder with its own modeling code (auto_map) loads only with trust_remote_code, through
    transformers' dynamic modules, offline; its logits are the code's own."""
    import importlib.util

    from miles_core.models.hf_tokenizer import HFTokenizer, char_tokenizer

    d = tmp_path / "toy"
    d.mkdir()
    (d / "configuration_toy.py").write_text(CONFIG_PY)
    (d / "modeling_toy.py").write_text(MODELING_PY)
    tok = HFTokenizer(char_tokenizer())
    tok.save(d)
    spec = importlib.util.spec_from_file_location("toy_pkg.configuration_toy", d / "configuration_toy.py")
    cfg_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg_mod)
    cfg = cfg_mod.ToyDLMConfig(vocab_size=tok.vocab_size, mask_token_id=tok.mask_id,
                               auto_map={"AutoConfig": "configuration_toy.ToyDLMConfig",
                                         "AutoModelForMaskedLM": "modeling_toy.ToyDLM"})
    cfg.save_pretrained(str(d))
    torch.manual_seed(0)
    weights = {"emb.weight": torch.randn(tok.vocab_size, 16), "out.weight": torch.randn(tok.vocab_size, 32),
               "out.bias": torch.randn(tok.vocab_size)}
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="set model.trust_remote_code=true"):
        load_checkpoint(d, family="remote_code")
    with pytest.raises(ConfigError, match="model_type 'toy-dlm' is not a known diffusion family"):
        load_checkpoint(d)
    model, tok2 = load_checkpoint(d, trust_remote_code=True)  # auto: unknown type + opt-in
    assert tok2.mask_id == tok.mask_id
    ids = torch.tensor([tok.encode("1+2=") + [tok.mask_id] * 2])
    e = weights["emb.weight"][ids[0]]
    want = torch.cat([e, e.mean(0, keepdim=True).expand_as(e)], -1) @ weights["out.weight"].T + weights["out.bias"]
    with torch.no_grad():
        assert torch.allclose(model(ids)[0], want, atol=1e-5)


def test_chat_template_wraps_prompts_everywhere_and_is_recorded(ckpts: dict[str, Path]) -> None:
    from miles_core.config import load_recipe
    from miles_core.models.base import load_base
    from miles_core.eval.evaluate import eval_config

    cfg = load_recipe("tiny", ["model.backend=hf", f"model.path={ckpts['llada']}", "task.prompt_template=chat"])
    _, tok = load_base(cfg, ckpts["llada"])
    ids = tok.encode_prompt("1+2")
    # arith's user turn asks the question (tokenizer.py::PROMPT_QUESTION): a bare "1+2" is not one
    text = ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 1+2? Answer with the number."
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids == tok.hf.encode(text, add_special_tokens=False)
    assert ids[0] == 126080 and 126348 in ids                      # BOS and EoT at their published ids
    assert eval_config(cfg).to_dict()["prompt_template"] == "chat"  # recorded with every evaluation
    plain = load_recipe("tiny", ["model.backend=hf", f"model.path={ckpts['llada']}"])
    assert load_base(plain, ckpts["llada"])[1].encode_prompt("1+2") == tok.encode("1+2")
    with pytest.raises(ConfigError, match="task.prompt_template='chat'.*has no chat template"):
        from miles_core.models.llama import init_checkpoint

        load_base(load_recipe("tiny", ["task.prompt_template=chat"]), init_checkpoint(ckpts["llada"].parent / "llama"))


def test_model_path_may_be_an_s3_uri_never_the_hub(ckpts: dict[str, Path], s3_endpoint: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """model.path on a real (moto) S3 endpoint is copied once into the cache and loads the same model;
    hf:// is refused."""
    import boto3

    from miles_core.models.base import local_model_dir

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "MILES_S3_ENDPOINT_URL": s3_endpoint, "MILES_MODEL_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for f in ckpts["sdar"].iterdir():
        s3.upload_file(str(f), "miles-flows", f"models/sdar/{f.name}")
    uri = "s3://miles-flows/models/sdar"
    model, tok = load_checkpoint(uri)
    local, _ = load_checkpoint(ckpts["sdar"])
    ids = torch.tensor([tok.encode("1+2=") + [tok.mask_id] * 2])
    with torch.no_grad():
        assert torch.equal(model(ids), local(ids))
    assert local_model_dir(uri) == local_model_dir(uri) and (local_model_dir(uri) / ".miles-complete").exists()
    with pytest.raises(ConfigError, match="never downloads from the Hugging Face Hub"):
        load_checkpoint("hf://GSAI-ML/LLaDA-8B-Instruct")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["block", "nsd"])
def test_samplers_record_steps_that_scoring_reproduces(ckpts: dict[str, Path], family: str, kind: str) -> None:
    """Block-wise static and NSD sampling on every family: every position committed once, and the
    learner's scoring of each recorded step reproduces the stored behaviour log-prob exactly."""
    from miles_core.algo.rows import score_rows
    from miles_core.algo.step_choice import build_rows
    from miles_core.config import SamplerConfig
    from miles_core.samplers.sampler import sample

    model, tok = load_family(ckpts[family])
    cfg = (SamplerConfig(kind="static", steps=4, block_size=4, temperature=1.0) if kind == "block" else
           SamplerConfig(kind="nsd", threshold=0.5, max_per_step=3, temperature=1.0))
    prompts = [tok.encode(p) for p in ("1+2", "34*5", "6")]
    batch = sample(model, tok, prompts, cfg, 8, torch.Generator().manual_seed(0))
    assert (batch.step_map >= 0).all() and torch.isfinite(batch.logp).all()
    assert not any(t in tok.forbidden_ids for t in batch.completion_ids.flatten().tolist())
    rows = build_rows(batch, 1.0, as_draws(torch.Generator(), len(batch)))
    logp, _, commit = score_rows(model, batch, rows.traj, rows.step, tok, 1.0)
    assert commit.sum() == batch.completion_ids.numel()
    assert torch.allclose(logp[commit], batch.logp[rows.traj][commit], atol=1e-5)


@pytest.mark.parametrize("family", ["tiny", "bidir_llama"])
def test_init_and_check_cover_the_built_in_families_too(family: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    from miles_core.models.__main__ import main

    assert main(["init", "--family", family, str(tmp_path / family)]) == 0
    assert main(["check", str(tmp_path / family)]) == 0
    out = capsys.readouterr().out
    assert f"family         {family}" in out and "finite         true" in out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fixtures_see_a_swapped_norm_a_dropped_bias_and_the_pad_row(ckpts: dict[str, Path], family: str,
                                                                      tmp_path: Path) -> None:
    """The tiny checkpoints draw norms, biases and the pad row at random (models/hf.py init_tiny),
    so a loader that swapped two norms, dropped a bias or zeroed the pad row would change logits."""
    model, tok = load_family(ckpts[family])
    pad_id = int(model.lm.config.pad_token_id)
    ids = torch.tensor([[pad_id] + tok.encode("3+4=") + [tok.mask_id] * 3])
    with torch.no_grad():
        want = model(ids)
    tensors = read_tensors(ckpts[family])
    norms = sorted(k for k, v in tensors.items() if v.dim() == 1 and "norm" in k)
    biases = sorted(k for k, v in tensors.items() if v.dim() == 1 and k.endswith(".bias") and "norm" not in k)
    pad = next(k for k, v in tensors.items() if v.dim() == 2 and v.shape[0] == model.lm.get_input_embeddings().weight.shape[0]
               and ("embed" in k or "wte" in k or "tok_embeddings" in k))
    a, b = next((x, y) for x in norms for y in norms if x < y and tensors[x].shape == tensors[y].shape)
    edits = {"swapped norms": {a: tensors[b], b: tensors[a]}, "zero pad row": {pad: tensors[pad].clone().index_fill_(0, torch.tensor([pad_id]), 0.0)}}
    if biases:
        edits["dropped bias"] = {biases[0]: torch.zeros_like(tensors[biases[0]])}
    assert family != "dream" or "dropped bias" in edits  # Dream's q/k/v carry biases
    for what, edit in edits.items():
        d = tmp_path / what.replace(" ", "_")
        shutil.copytree(ckpts[family], d)
        for f in d.glob("*.safetensors"):
            f.unlink()
        save_file({**tensors, **edit}, str(d / "model.safetensors"))
        with torch.no_grad():
            got = load_family(d)[0](ids)
        assert (got - want).abs().max() > 1e-3, (family, what)
